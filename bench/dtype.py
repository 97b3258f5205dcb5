"""The target in float32 against the target in bfloat16, in process, side by side.

    .venv/bin/python bench/dtype.py                          # shipped pair, batches 1 8 32, k=4, 1 torch thread
    .venv/bin/python bench/dtype.py --batches 8 --rounds 6 --threads 2

``dtype: auto`` runs the target in float32 on CPU: exact, and greedy output
does not depend on what else is in the batch beyond float32 rounding. On a
CPU that multiplies bfloat16 natively (AVX512-BF16, AMX) a bfloat16 target
reads half the bytes and takes the bfloat16 matrix units, and vLLM's CPU
backend runs the shipped (bfloat16) checkpoints in bfloat16 by default. This
script shows what that buys and what it changes: for each batch size, two
in-process engines (the same draft, ``draft_dtype`` auto, fixed k, greedy,
unpipelined) decode the same held-out prompts, interleaved round by round,
and it prints tok/s of each (median over the rounds), the ratio, the time
per step in the draft and in the target, and how many requests' greedy
outputs are identical between the two dtypes (bfloat16 rounding changes some
near-tie argmaxes; each engine alone is still lossless against its own
target).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import DRAFT, TARGET, load_prompts, machine
from dspark_ray.engine import EngineConfig, SamplingParams
from dspark_ray.engine.dtypes import draft_runtime_dtype
from dspark_ray.engine.local import build_local_engine

DTYPES = ("float32", "bfloat16")


def run(engine, prompts: list[str], params: SamplingParams) -> tuple[float, float, float, list[list[int]]]:
    """tok/s, draft ms per step, target ms per step, and every request's output ids (prompt order)."""
    ids = [engine.add_request(p, params) for p in prompts]
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    steps, propose, verify, tokens = 0, 0.0, 0.0, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.req_id] += out.new_token_ids
            tokens += len(out.new_token_ids)
        steps += 1
        propose += engine.timings.propose
        verify += engine.timings.verify
    seconds = time.perf_counter() - start
    return tokens / seconds, 1e3 * propose / steps, 1e3 * verify / steps, [outputs[i] for i in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds per batch size (medians)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a served worker has 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    engines = {}
    for dtype in DTYPES:
        config = EngineConfig(model=str(TARGET), draft=str(DRAFT), num_speculative_tokens=args.k, dtype=dtype,
                              adaptive_speculation=False, pipeline=False, max_context=512,
                              capacity=max(64, *args.batches), max_num_seqs=max(64, *args.batches),
                              enable_prefix_caching=False)
        engines[dtype] = build_local_engine(config)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0)
    print(f"Machine: {machine()}; shipped pair, draft in "
          f"{draft_runtime_dtype(config)}, k={args.k}, greedy, {args.max_tokens} tokens per request, "
          f"held-out prompts, {args.rounds} interleaved rounds (medians)\n")
    print("| batch | float32 tok/s | bfloat16 tok/s | bf16 / fp32 | draft ms/step fp32 / bf16 "
          "| target ms/step fp32 / bf16 | requests with identical greedy output |")
    print("|---:|---:|---:|---:|---|---|---:|")
    for b in args.batches:
        prompts = load_prompts(b)
        for engine in engines.values():  # warm-up
            run(engine, prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
        results: dict[str, list] = {d: [] for d in DTYPES}
        for r in range(args.rounds):
            for dtype in DTYPES if r % 2 == 0 else DTYPES[::-1]:
                results[dtype].append(run(engines[dtype], prompts, params))
        med = {d: [statistics.median(x[i] for x in results[d]) for i in range(3)] for d in DTYPES}
        same = sum(a == b for a, b in zip(results["float32"][0][3], results["bfloat16"][0][3]))
        fp, bf = med["float32"], med["bfloat16"]
        print(f"| {b} | {fp[0]:.1f} | {bf[0]:.1f} | {bf[0] / fp[0]:.2f}x | {fp[1]:.1f} / {bf[1]:.1f} "
              f"| {fp[2]:.1f} / {bf[2]:.1f} | {same} of {len(prompts)} |", flush=True)


if __name__ == "__main__":
    main()
