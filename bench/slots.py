"""Slot allocate+release throughput: in-process registry vs the SlotManager actor, batches of 1 and 64.

    OMP_NUM_THREADS=1 .venv/bin/python bench/slots.py [--seconds 2] [--capacity 256]

One pair is one request admitted and finished: ``allocate_many`` then
``release_many`` (with the lease's epoch), each a blocking call. Through the
actor every batch is two round trips, as in an engine step. Aims (issue 3):
200,000 pairs/s in-process, 20,000 pairs/s through the actor at batch 64.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable

import ray

from dspark_ray.slots import SlotLease, SlotRegistry, start_slot_manager

BATCHES = (1, 64)
AIMS = {("in-process", 1): 200_000, ("actor", 64): 20_000}

Allocate = Callable[[list[str]], list[SlotLease]]
Release = Callable[[list[tuple[str, int | None]]], list[bool]]


def pairs_per_second(allocate: Allocate, release: Release, batch: int, seconds: float) -> float:
    """Allocate and release batches of fresh ids for ``seconds``; returns pairs per second."""
    ids = (f"req-{i}" for i in itertools.count())
    pairs = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(10):
            leases = allocate([next(ids) for _ in range(batch)])
            release([(lease.req_id, lease.epoch) for lease in leases])
        pairs += 10 * batch
    return pairs / elapsed


def in_process(capacity: int, seconds: float) -> dict[int, float]:
    registry = SlotRegistry(capacity)
    return {b: pairs_per_second(registry.allocate_many, registry.release_many, b, seconds) for b in BATCHES}


def through_actor(capacity: int, seconds: float) -> dict[int, float]:
    manager = start_slot_manager(capacity, app_name="bench")

    def allocate(req_ids: list[str]) -> list[SlotLease]:
        return ray.get(manager.allocate_many.remote(req_ids, "bench"))

    def release(items: list[tuple[str, int | None]]) -> list[bool]:
        return ray.get(manager.release_many.remote(items))

    pairs_per_second(allocate, release, 1, min(seconds, 0.5))  # warm up the worker
    return {b: pairs_per_second(allocate, release, b, seconds) for b in BATCHES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="measuring time per figure")
    parser.add_argument("--capacity", type=int, default=256, help="slots in the registry")
    args = parser.parse_args()

    rows = {"in-process": in_process(args.capacity, args.seconds)}
    ray.init(num_cpus=2, object_store_memory=100 * 1024 * 1024, include_dashboard=False, log_to_driver=False)
    try:
        rows["actor"] = through_actor(args.capacity, args.seconds)
    finally:
        ray.shutdown()

    print(f"\nallocate+release pairs/s (capacity {args.capacity}, {args.seconds:g} s per figure)")
    print(f"{'':<12}" + "".join(f"{f'batch {b}':>14}" for b in BATCHES))
    for name, figures in rows.items():
        print(f"{name:<12}" + "".join(f"{figures[b]:>14,.0f}" for b in BATCHES))
    for (name, batch), aim in AIMS.items():
        verdict = "met" if rows[name][batch] >= aim else "MISSED"
        print(f"aim {name} batch {batch}: {aim:,} pairs/s -> {verdict}")


if __name__ == "__main__":
    main()
