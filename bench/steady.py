"""Speculation at a steady load, in one process: every static k and adaptive k against none.

    .venv/bin/python bench/steady.py                       # independent draft, batch 1 8 32 64
    .venv/bin/python bench/steady.py --draft models/shakespeare-dspark --batches 8 32
    .venv/bin/python bench/steady.py --rounds 3
    python bench/steady.py --device cuda --range-ratio 0.5          # on a GPU box (bfloat16, the checkpoint's)

bench/spec.py and bench/adaptive.py run closed batches: B requests start
together and the batch ends with its slowest one. With speculation requests
advance at different speeds (each at its own acceptance), so a closed batch
ends through a tail of ever fewer rows, its worst-accepted requests last,
while without speculation every row ends at the same step: at batch 32 the
DSpark draft took 34 steps with k=4 where its requests' own mean was 3.4
tokens a step (18-20 steps). A server's batch does not end: a finished
request's place is taken by the next one (vLLM's benchmark client keeps its
concurrency the same way). Here each engine keeps ``batch`` requests in flight,
adding the next held-out prompt whenever one ends, and the tokens emitted
between the ``batch``-th and the ``(1 + cycles) * batch``-th completion count:
the steady state, no ramp-up and no tail. Systems are interleaved round by
round (the machine's speed drifts); each cell is the median round.

NOTE: lockstep. With every request asking for the same number of tokens,
no speculation keeps the batch in lockstep: the first ``batch`` requests
start together, so they end together and their successors start together,
and each wave's prompts are prefilled in one step of ``batch`` prompts. With
speculation requests drift apart and their prompts arrive a few at a time,
beside decoding rows. On the 2-core box at batch 64 (one run) a prompt cost
the target about 1.1 ms in a lockstep wave and 3.6 ms arriving beside a
k=3 verification, and the draft another 1.9 ms: a cost no speculating
engine can avoid, and one that no speculation avoids only because the
benchmark's lengths are equal. A server's traffic does not arrive in waves.
``--range-ratio r`` draws each request's length uniformly from
``max_tokens * (1 - r) .. max_tokens * (1 + r)`` (vLLM's client has the same
option for its random dataset), the same lengths in the same order for every
system, so no system runs in lockstep.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DRAFT, TARGET, load_prompts  # noqa: E402

from dspark_ray import LLM, SamplingParams  # noqa: E402


def output_lengths(max_tokens: int, range_ratio: float, n: int, seed: int = 0) -> list[int]:
    """``n`` request lengths: all ``max_tokens``, or drawn uniformly from ``max_tokens * (1 -+ range_ratio)``."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    lo, hi = max(1, round(max_tokens * (1 - range_ratio))), round(max_tokens * (1 + range_ratio))
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def steady_tokens_per_s(llm: LLM, batch: int, cycles: int, max_tokens: int, range_ratio: float = 0.0) -> float:
    """Tokens a second with ``batch`` requests always in flight (see the module docstring); the i-th
    request asks for ``output_lengths(max_tokens, range_ratio, n)[i % n]`` tokens, n = batch * (cycles + 2)."""
    engine = llm.engine
    prompts = load_prompts(batch * (cycles + 2))
    lengths = output_lengths(max_tokens, range_ratio, len(prompts))

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=lengths[i % len(lengths)], ignore_eos=True)

    for i, p in enumerate(prompts[:batch]):
        engine.add_request(p, params(i))
    nxt, done, tokens, start = batch, 0, 0, None
    while done < (1 + cycles) * batch:
        for out in engine.step():
            if start is not None:
                tokens += len(out.new_token_ids)
            if out.finished:
                done += 1
                if done == batch:
                    start = time.perf_counter()
                engine.add_request(prompts[nxt % len(prompts)], params(nxt))
                nxt += 1
    seconds = time.perf_counter() - start
    for req_id in list(engine.requests):  # the requests still in flight: not counted, ended
        engine.abort(req_id)
    while engine.has_unfinished():
        engine.step()
    return tokens / seconds


def adaptive_state(llm: LLM, batch: int) -> str:
    """What adaptive speculation believes at ``batch``'s bucket: its step time per k (ms; each measured
    cell with its step count, and the fitted line it decides by) and the steps each k was chosen so far."""
    from dspark_ray.engine.adaptive import bucket

    engine = llm.engine
    controller = engine.spec_controller
    if controller is None or bucket(batch) not in controller.table:
        return f"adaptive at batch {batch}: nothing measured"
    b = bucket(batch)
    row = controller.table_ms()[b]
    measured = " ".join(f"k={k}:{ms:.1f}ms/{n}" if n else f"k={k}:-"
                        for k, (ms, n) in enumerate(zip(row["measured"], row["n"])))
    fitted = " ".join("-" if t is None else f"{t:.1f}" for t in row["fitted"])
    return (f"adaptive at batch {batch} (bucket {b}): measured {measured}; fitted ms {fitted}; "
            f"steps by k so far {dict(sorted(controller.chosen.items()))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=str(DRAFT))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("-k", type=int, default=4, help="the most draft tokens (static k runs 1..k)")
    ap.add_argument("--cycles", type=int, default=3, help="batches of completions counted per run")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.0,
                    help="request lengths uniform in max-tokens * (1 -+ this); 0: all equal (lockstep without "
                         "speculation: module docstring)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (dtype auto: float32 on CPU, the checkpoint's on CUDA)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    common = dict(max_context=512, capacity=max(args.batches) + 1, max_num_seqs=max(args.batches), device=args.device)
    systems = [("k=0", LLM(str(TARGET), None, **common))]
    systems += [(f"k={k}", LLM(str(TARGET), args.draft, num_speculative_tokens=k, adaptive_speculation=False,
                               **common)) for k in range(1, args.k + 1)]
    systems.append(("adaptive", LLM(str(TARGET), args.draft, num_speculative_tokens=args.k, **common)))
    names = [n for n, _ in systems]
    where = torch.cuda.get_device_name() if args.device != "cpu" else f"{args.threads} torch threads"
    lines = [f"Draft: {args.draft}; {where}; {args.max_tokens} greedy tokens per request"
             f"{f' (each uniform in +-{args.range_ratio:.0%})' if args.range_ratio else ''}; "
             f"median of {args.rounds} interleaved rounds, tok/s at a steady load.", "",
             "| batch | " + " | ".join(names) + " | adaptive / no spec | adaptive / best static |",
             "|---:|" + "---:|" * len(names) + "---:|---:|"]
    for b in args.batches:
        for _, llm in systems:  # warm-up: the batch's shapes, and adaptive's first measurements
            steady_tokens_per_s(llm, b, 1, args.max_tokens, args.range_ratio)
        runs = {n: [] for n in names}
        for r in range(args.rounds):
            order = systems if r % 2 == 0 else systems[::-1]
            for n, llm in order:
                runs[n].append(steady_tokens_per_s(llm, b, args.cycles, args.max_tokens, args.range_ratio))
        med = {n: sorted(v)[len(v) // 2] for n, v in runs.items()}
        print(f"batch {b}, every round: " + "; ".join(f"{n} " + " ".join(f"{x:.1f}" for x in v)
                                                     for n, v in runs.items()), flush=True)
        print(adaptive_state(systems[-1][1], b), flush=True)
        best = max(med[n] for n in names[1:-1])
        lines.append(f"| {b} | " + " | ".join(f"{med[n]:.1f}" for n in names)
                     + f" | {med['adaptive'] / med['k=0']:.2f}x | {med['adaptive'] / best:.2f}x |")
        print(lines[-1], flush=True)
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
