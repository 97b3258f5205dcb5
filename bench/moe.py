"""Per-token cost of a mixture-of-experts target against a dense one with as many active parameters.

    .venv/bin/python bench/moe.py                  # batches 1 and 8, one torch thread, ~30 s
    .venv/bin/python bench/moe.py --batches 1 8 32 --steps 40 --threads 2

Three random float32 targets of the same attention and width (no download,
built in process): a Qwen3-MoE-shaped one (32 experts, top-4), a Mixtral-shaped
one (8 experts, top-2) and a dense Qwen3 whose MLP is as wide as the experts a
token visits (top_k x expert width), so all three multiply the same number of
weights per token; the MoE ones hold 8x / 4x more MLP weights in total. Each
runs decode steps (one token per row, no drafts) through the engine's
``TargetRunner`` (paged KV, packed batch), the models interleaved over
--rounds rounds so the machine's drift hits each alike. Figures: median ms
per step and per token, each MoE target's ratio to the dense one, and the MLP
weights a step reads relative to the dense MLP's, if the batch's tokens chose
experts uniformly at random (E * (1 - (1 - k/E)^B) distinct experts per layer):
a decode step reads weights, so at batch 8 the MoE targets are expected to
cost more per token than the dense one, though each token multiplies the same.
Results go to bench/out/moe.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import OUT_DIR, machine
from dspark_ray.engine.interfaces import SamplingRow, TargetStep, VerifyRow
from dspark_ray.engine.target_runner import TargetRunner
from dspark_ray.model import ModelConfig, MoeConfig
from dspark_ray.model.cpu_gemm import pack_weights
from dspark_ray.model.llama import CausalLM, fuse_projections

GREEDY = SamplingRow(0.0, 1.0, 0, 0)
PROMPT = 32


def build(architecture: str, intermediate: int, moe: MoeConfig | None, seed: int = 0) -> CausalLM:
    cfg = ModelConfig(architecture=architecture, vocab_size=8192, hidden_size=512, intermediate_size=intermediate,
                      num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64, max_position_embeddings=1024,
                      qk_norm=True, moe=moe)
    torch.manual_seed(seed)
    model = CausalLM(cfg)
    with torch.no_grad():  # decisive routers, so each token's experts differ as in a trained model
        for name, p in model.named_parameters():
            if name.endswith(".gate.weight"):
                p.normal_(0, 1 / cfg.hidden_size**0.5)
    return pack_weights(fuse_projections(model.eval().requires_grad_(False)))


def targets() -> dict[str, CausalLM]:
    qwen = MoeConfig(num_experts=32, top_k=4, intermediate_size=256, norm_topk_prob=True)
    mixtral = MoeConfig(num_experts=8, top_k=2, intermediate_size=512, norm_topk_prob=True)
    return {
        "dense (MLP 1024)": build("Qwen3ForCausalLM", 1024, None),
        "Qwen3-MoE 32e top-4 x 256": build("Qwen3MoeForCausalLM", 1024, qwen),
        "Mixtral 8e top-2 x 512": build("MixtralForCausalLM", 1024, mixtral),
    }


def parameters(model: CausalLM) -> tuple[float, float]:
    """(total, active per token) parameters in millions, embeddings and LM head included."""
    total = sum(p.numel() for p in model.parameters())
    active = total
    for layer in model.model.layers:
        moe = layer.ffn
        if hasattr(moe, "experts"):
            per_expert = sum(p.numel() for p in moe.experts[0].parameters())
            active -= per_expert * (len(moe.experts) - moe.top_k)
    return total / 1e6, active / 1e6


def mlp_reads(model: CausalLM, batch: int) -> float:
    """MLP weights one step reads per layer, relative to the dense MLP of as many active weights."""
    moe = next((layer.ffn for layer in model.model.layers if hasattr(layer.ffn, "experts")), None)
    if moe is None:
        return 1.0
    e, k = len(moe.experts), moe.top_k
    return e * (1 - (1 - k / e) ** batch) / k


def decode_steps(model: CausalLM, batch: int, steps: int) -> float:
    """Median seconds per decode step for ``batch`` rows that each hold a PROMPT-token context."""
    runner = TargetRunner(model, capacity=batch, max_context=PROMPT + steps + 8,
                          kv_pool_size=batch * (PROMPT + steps + 8) + 1, max_spec_tokens=0, prefix_block=None)
    gen = torch.Generator().manual_seed(batch)
    prompts = [tuple(torch.randint(1, 8192, (PROMPT,), generator=gen).tolist()) for _ in range(batch)]
    rows = [VerifyRow(s + 1, 0, 0, p, (), GREEDY) for s, p in enumerate(prompts)]
    result = runner.step(TargetStep(rows))
    starts = [PROMPT] * batch
    times = []
    for _ in range(steps):
        rows = [VerifyRow(s + 1, 0, starts[s], (result.emitted[s][-1],), (), GREEDY) for s in range(batch)]
        t0 = time.perf_counter()
        result = runner.step(TargetStep(rows))
        times.append(time.perf_counter() - t0)
        starts = [s + 1 for s in starts]
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    models = targets()
    for model in models.values():  # warm-up: first-call costs out of the figures
        decode_steps(model, 1, 2)
    seconds: dict[tuple[str, int], list[float]] = {(name, b): [] for name in models for b in args.batches}
    for _ in range(args.rounds):
        for b in args.batches:
            for name, model in models.items():
                seconds[name, b].append(decode_steps(model, b, args.steps))

    dense = next(iter(models))
    lines = [f"MoE vs dense decode step, {machine()}, {args.steps} steps x {args.rounds} rounds, median",
             "", "| target | params total / active (M) | batch | MLP weights read | ms per step | ms per token "
             "| vs dense |", "|---|---:|---:|---:|---:|---:|---:|"]
    for b in args.batches:
        base = statistics.median(seconds[dense, b])
        for name, model in models.items():
            step = statistics.median(seconds[name, b])
            total, active = parameters(model)
            lines.append(f"| {name} | {total:.1f} / {active:.1f} | {b} | {mlp_reads(model, b):.1f}x "
                         f"| {step * 1e3:.2f} | {step * 1e3 / b:.2f} | {step / base:.2f}x |")
    report = "\n".join(lines)
    print(report)
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / "moe.md").write_text(report + "\n")


if __name__ == "__main__":
    main()
