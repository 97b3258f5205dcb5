"""One system of bench/quantized.py, loaded once in a process of its own and driven over a pipe.

    .venv/bin/python bench/quantized_worker.py '{"backend": "dspark", "model": "...", ...}'
    bench/.llamacpp-venv/bin/python bench/quantized_worker.py '{"backend": "llamacpp", ...}'
    bench/.vllm-venv/bin/python bench/quantized_worker.py '{"backend": "vllm", ...}'

Each peer runs in its own venv (llama.cpp and vLLM pin their own libraries), so this file imports
only the standard library at its top and each backend's library inside it. The setup (the one
argument, JSON) names the backend and its settings: ``Setup`` below.

The protocol, one JSON object a line. The worker imports its library and says
``{"event": "imported"}``; the driver reads the process's resident memory, then sends
``{"op": "load"}``; the worker loads the model and says ``{"event": "loaded", ...}`` (load time, and
for dspark the bytes its model holds); then every command gets one reply:

- ``{"op": "single", "prompt": [ids], "tokens": N, "threads": t}``: one request alone, greedy,
  exactly N new tokens (end-of-sequence ignored); replies ``{"ttft_s", "decode_s", "first_tokens",
  "token_ids"}``: prefill to the first token's arrival, then the first token's arrival to the
  last's (``first_tokens``: how many came with the first);
- ``{"op": "batch", "prompts": [[ids], ...], "tokens": N, "threads": t}``: the prompts at once,
  N new tokens each; replies ``{"seconds", "output_tokens"}``, wall time from submission to the
  last token;
- ``{"op": "quit"}``.

Replies are the stdout lines that start with ``REPLY``; whatever else the libraries print on stdout
(vLLM logs there) is the driver's to log. A failed command replies ``{"error": ...}`` and the worker
goes on.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

REPLY = "QUANTIZED_WORKER_REPLY "


def reply(obj: dict) -> None:
    sys.stdout.write(REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()


# -- dspark_ray in process --------------------------------------------------------------------------


class Dspark:
    """dspark_ray's offline engine: setup keys ``quantization``, ``compile_model``, ``draft`` (a folder or
    None), ``k``, ``max_context``, ``capacity`` (the largest batch), ``kv_pool_tokens``."""

    def __init__(self, setup: dict) -> None:
        import torch

        from dspark_ray import LLM, SamplingParams  # noqa: F401 - imported before the memory is read
        from dspark_ray.engine import local  # noqa: F401 - the loader's modules, too

        if setup["compile_model"]:
            import torch._inductor.compile_fx  # Inductor's own memory is no weight: read before it

        self.setup, self.torch, self.llm = setup, torch, None

    def load(self) -> dict:
        from common import model_weight_bytes

        from dspark_ray import LLM

        s = self.setup
        self.llm = LLM(s["model"], s["draft"], quantization=s["quantization"], compile_model=s["compile_model"],
                       num_speculative_tokens=s["k"], max_context=s["max_context"], capacity=s["capacity"],
                       max_num_seqs=s["capacity"], kv_pool_tokens=s["kv_pool_tokens"], enable_prefix_caching=False)
        target = self.llm.engine.target
        kv = sum(t.untyped_storage().nbytes() for t in [*target.k_pools, *target.v_pools])
        draft_model = getattr(self.llm.engine.draft, "model", None)
        ours = held_bytes(target.model)
        drafter = held_bytes(target.model, draft_model) - ours if draft_model is not None else 0
        return {"model_bytes": ours, "draft_bytes": drafter,
                "step_bytes": model_weight_bytes(target.model).stored, "kv_bytes": kv}

    def single(self, prompt: list[int], tokens: int, threads: int) -> dict:
        from dspark_ray import SamplingParams

        self.torch.set_num_threads(threads)
        engine = self.llm.engine
        sent = time.perf_counter()
        engine.add_request(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0))
        ids, first, last, first_tokens, spec = [], None, None, 0, None
        while engine.has_unfinished():
            for out in engine.step():
                if out.new_token_ids:
                    last = time.perf_counter()
                    if first is None:
                        first, first_tokens = last, len(out.new_token_ids)
                    ids += out.new_token_ids
                if out.finished and out.spec is not None:
                    spec = {"drafts": out.spec.drafts, "accepted_tokens": out.spec.accepted_tokens}
        return {"ttft_s": first - sent, "decode_s": last - first, "first_tokens": first_tokens, "token_ids": ids,
                "spec": spec}

    def batch(self, prompts: list[list[int]], tokens: int, threads: int) -> dict:
        from dspark_ray import SamplingParams

        self.torch.set_num_threads(threads)
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params)
        return {"seconds": time.perf_counter() - start, "output_tokens": sum(len(o.token_ids) for o in outs)}


def held_bytes(*models) -> int:
    """Bytes of every tensor the ``models`` hold (parameters and buffers: GGUF blocks kept are buffers), each
    storage once (a tied head, fused projections, a drafter's heads shared with its target)."""
    seen, total = set(), 0
    for t in [t for m in models for t in [*m.parameters(), *m.buffers()]]:
        storage = t.untyped_storage()
        if not t.is_meta and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


# -- llama.cpp (llama-cpp-python) -------------------------------------------------------------------


class LlamaCpp:
    """llama.cpp through llama-cpp-python's low-level calls: setup keys ``threads`` (n_threads and
    n_threads_batch), ``max_context`` (n_ctx), ``n_batch``. Greedy is the argmax of the last position's
    logits after each ``eval``, one token at a time; nothing checks for end-of-sequence, so every
    request runs its N tokens."""

    def __init__(self, setup: dict) -> None:
        import llama_cpp
        import numpy

        self.setup, self.llama_cpp, self.np, self.llm = setup, llama_cpp, numpy, None

    def load(self) -> dict:
        s = self.setup
        self.llm = self.llama_cpp.Llama(model_path=s["model"], n_ctx=s["max_context"], n_batch=s["n_batch"],
                                        n_threads=s["threads"], n_threads_batch=s["threads"], seed=0, verbose=False)
        return {"model_bytes": int(self.llama_cpp.llama_model_size(self.llm.model)),
                "llama_cpp": self.llama_cpp.__version__, "system_info": self.llama_cpp.llama_print_system_info().decode()}

    def _argmax(self) -> int:
        logits = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)  # the last position evaluated
        return int(self.np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),)).argmax())

    def single(self, prompt: list[int], tokens: int, threads: int) -> dict:
        if threads != self.setup["threads"]:
            raise ValueError(f"this llama.cpp worker runs {self.setup['threads']} threads, asked for {threads}")
        self.llm.reset()  # n_tokens = 0: eval then drops the whole KV cache (no prefix reuse across runs)
        sent = time.perf_counter()
        self.llm.eval(prompt)
        ids = [self._argmax()]
        first = time.perf_counter()
        for _ in range(tokens - 1):
            self.llm.eval(ids[-1:])
            ids.append(self._argmax())
        return {"ttft_s": first - sent, "decode_s": time.perf_counter() - first, "first_tokens": 1, "token_ids": ids,
                "spec": None}

    def batch(self, prompts: list[list[int]], tokens: int, threads: int) -> dict:
        raise ValueError("the llama.cpp worker runs single streams only")


# -- vLLM offline -----------------------------------------------------------------------------------


class Vllm:
    """vLLM's offline ``LLM`` on a Hugging Face folder: setup keys ``dtype``, ``max_context``
    (max_model_len), ``capacity`` (max_num_seqs). Its threads and their binding come from the
    environment (``VLLM_CPU_OMP_THREADS_BIND``, set by the driver); a command's ``threads`` is ignored."""

    def __init__(self, setup: dict) -> None:
        import vllm

        self.setup, self.vllm, self.llm = setup, vllm, None

    def load(self) -> dict:
        s = self.setup
        self.llm = self.vllm.LLM(model=s["model"], dtype=s["dtype"], enforce_eager=True, seed=0,
                                 max_model_len=s["max_context"], max_num_seqs=s["capacity"],
                                 enable_prefix_caching=False)
        return {"vllm": self.vllm.__version__}

    def batch(self, prompts: list[list[int]], tokens: int, threads: int) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return {"seconds": time.perf_counter() - start,
                "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}

    def single(self, prompt: list[int], tokens: int, threads: int) -> dict:
        raise ValueError("the vLLM worker runs batches only")


BACKENDS = {"dspark": Dspark, "llamacpp": LlamaCpp, "vllm": Vllm}


def serve(setup: dict, commands=sys.stdin) -> None:
    """Import, wait for ``load``, then answer commands until ``quit`` or the end of input."""
    worker = BACKENDS[setup["backend"]](setup)
    reply({"event": "imported"})
    for line in commands:
        cmd = json.loads(line)
        op = cmd.get("op")
        if op == "quit":
            break
        try:
            if op == "load":
                start = time.perf_counter()
                info = worker.load()
                reply({"event": "loaded", "load_s": time.perf_counter() - start, **info})
            elif op == "single":
                reply(worker.single(cmd["prompt"], cmd["tokens"], cmd["threads"]))
            elif op == "batch":
                reply(worker.batch(cmd["prompts"], cmd["tokens"], cmd["threads"]))
            else:
                reply({"error": f"unknown op {op!r}"})
        except Exception as exc:  # noqa: BLE001 - replied to the driver, which notes it and goes on
            traceback.print_exc()
            reply({"error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":  # vLLM's engine core may start with spawn, which re-imports this module
    serve(json.loads(sys.argv[1]))
