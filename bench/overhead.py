"""Ray orchestration overhead: time per decode step through actors vs in-process.

    .venv/bin/python bench/overhead.py              # shipped pair, batches 1 and 16

The same engine drives (a) in-process services and (b) Ray actors (a slot
manager, a draft worker and 1 or 2 tensor-parallel target shards on this
machine). Each run decodes a fixed number of tokens per request after a
warm-up; the figure is wall time per engine step in the steady state.
"""

from __future__ import annotations

import argparse
import time

import ray
import torch

from common import DRAFT, TARGET, load_prompts, machine
from dspark_ray.engine import Engine, EngineConfig, SamplingParams
from dspark_ray.engine.local import build_local_engine
from dspark_ray.runtime.actors import start_replica_services
from dspark_ray.tokenizer import Tokenizer


def step_time(engine: Engine, batch: int, max_tokens: int) -> tuple[float, int]:
    """Seconds per step once every request is decoding, and the number of steps timed."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for p in load_prompts(batch):
        engine.add_request(p, params)
    engine.step()  # admission + prefill, not timed
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / max(steps, 1), steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    torch.set_num_threads(1)

    config = EngineConfig(model=str(TARGET), draft=str(DRAFT), num_speculative_tokens=args.k, max_context=512,
                          capacity=64, max_num_seqs=64)
    ray.init(num_cpus=4, object_store_memory=200 * 2**20, include_dashboard=False, log_to_driver=False,
             namespace="dspark-bench")
    local = build_local_engine(config)
    tokenizer = Tokenizer.from_path(config.model)
    remote = {}
    for tp in args.tp:
        services = start_replica_services(
            config, app_name=f"bench{tp}", replica=f"bench{tp}", tensor_parallel_size=tp,
            placement_strategy="PACK", cpus_per_shard=0.5, torch_threads=1, slot_timeout_s=30)
        remote[tp] = Engine(config, tokenizer, services.slots, services.target, services.draft, owner=f"bench{tp}")

    print(f"Machine: {machine()}; {args.max_tokens} tokens per request, k={args.k}\n")
    print("| batch | in-process ms/step | " + " | ".join(f"Ray TP={tp} ms/step | ratio" for tp in args.tp) + " |")
    print("|---:|---:|" + "---:|---:|" * len(args.tp))
    for b in args.batches:
        step_time(local, b, 8)  # warm-up
        base, _ = step_time(local, b, args.max_tokens)
        cells = []
        for tp, engine in remote.items():
            step_time(engine, b, 8)
            t, _ = step_time(engine, b, args.max_tokens)
            cells.append(f"{t * 1e3:.1f} | {t / base:.2f}x")
        print(f"| {b} | {base * 1e3:.1f} | " + " | ".join(cells) + " |", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
