"""Adaptive speculation against every static k and against none, in one process, side by side.

    .venv/bin/python bench/adaptive.py                       # batches 1 8 32 64, both prompt sets
    .venv/bin/python bench/adaptive.py --batches 1 --prompts heldout --repeats 5

One engine (the shipped pair, in process, greedy, ``ignore_eos``) runs every
configuration on the same prompts, interleaved round by round so that the
machine's drift hits them alike: no speculation (k=0), each static k from 1 to
the maximum (the request's ``num_speculative_tokens``), and adaptive
speculation (engine/adaptive.py; the engine's own default). Adaptive learns its
step-time table across rounds, as a server does over its life; the first round
is a warm-up and is not counted.

Two prompt sets: ``heldout`` (bench/prompts.jsonl: text like the pair's
training data, where the draft is often right) and ``random`` (random token
ids, as vLLM's benchmark client sends: the draft is rarely right). Each row
prints tokens per second (the best round) and the ratios to no speculation and
to the best static k, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from common import DRAFT, OUT_DIR, TARGET, load_prompts, machine
from dspark_ray.engine import EngineConfig, SamplingParams
from dspark_ray.engine.local import build_local_engine


def random_prompts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    from served import random_prompts as rp

    return rp(tokenizer, n, length, seed)


def run(engine, prompts, k: int | None, max_tokens: int) -> tuple[float, float]:
    """(tokens per second, mean accepted length) for one batch of ``prompts`` at ``k`` (None: adaptive)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=k)
    for p in prompts:
        engine.add_request(p, params)
    tokens, drafts, accepted = 0, 0, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finished and out.spec is not None:
                drafts += out.spec.drafts
                accepted += out.spec.accepted_tokens
    return tokens / (time.perf_counter() - start), 1 + accepted / drafts if drafts else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompts", nargs="+", default=["heldout", "random"], choices=["heldout", "random"])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=4, help="the most draft tokens (static ks run 1..k)")
    ap.add_argument("--repeats", type=int, default=3, help="counted rounds per configuration (best is kept)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the served workers run 1 each)")
    ap.add_argument("--name", default="adaptive", help="results go to bench/out/NAME.{md,json}")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = build_local_engine(EngineConfig(model=str(TARGET), draft=str(DRAFT), num_speculative_tokens=args.k,
                                             max_context=512, capacity=64, max_num_seqs=64))
    configs: list[int | None] = [0, *range(1, args.k + 1), None]
    label = {k: "adaptive" if k is None else f"k={k}" for k in configs}
    lines = [f"# Adaptive speculation vs static k ({machine()}, torch threads {args.threads}, "
             f"{args.max_tokens} tokens per request, best of {args.repeats} interleaved rounds)", "",
             "| prompts | batch | " + " | ".join(label[k] for k in configs) +
             " | adaptive / no spec | adaptive / best static |",
             "|---|---:|" + "---:|" * (len(configs) + 2)]
    results = []
    for source in args.prompts:
        for b in args.batches:
            prompts = (load_prompts(b) if source == "heldout"
                       else random_prompts(engine.tokenizer, b, 24, 0))
            best: dict = {k: (0.0, 1.0) for k in configs}
            for rnd in range(args.repeats + 1):
                for k in configs:
                    tps, acc = run(engine, prompts, k, args.max_tokens)
                    if rnd and tps > best[k][0]:
                        best[k] = (tps, acc)
            static = max(best[k][0] for k in configs if k)
            ad = best[None][0]
            row = (f"| {source} | {b} | " + " | ".join(f"{best[k][0]:.0f}" for k in configs) +
                   f" | {ad / best[0][0]:.2f}x | {ad / static:.2f}x |")
            print(row, flush=True)
            lines.append(row)
            results.append({"prompts": source, "batch": b, **{label[k]: best[k][0] for k in configs},
                            "acceptance_length": {label[k]: best[k][1] for k in configs},
                            "vs_no_spec": ad / best[0][0], "vs_best_static": ad / static})
    chosen = dict(sorted(engine.spec_controller.chosen.items()))
    lines += ["", f"Steps per chosen k over the whole run (adaptive rounds): {chosen}"]
    print(lines[-1])
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    (OUT_DIR / f"{args.name}.json").write_text(json.dumps({"machine": machine(), "rows": results,
                                                            "chosen": chosen}, indent=2))


if __name__ == "__main__":
    main()
