"""StepTimeline: where the served path's time goes, phase by phase (plain Python).

Cumulative seconds and counts per phase, kept by the engine thread and read
by ``DSparkServer.stats()`` (``GET /stats``, the handle's ``stats``). A
benchmark takes a snapshot before and after a load and divides the
difference by the number of steps: ms per step for each phase. Each replica
answers ``GET /stats`` for itself (``replica`` names it); ``every_replica``
asks until each has answered, and ``summed`` adds their snapshots.

Phases (per engine step unless noted):

- ``step``           the whole ``Engine.step`` call
- ``schedule``       scheduling and slot leases (the slot manager is called only on admissions)
- ``propose``        the draft call as the engine sees it; in a pipelined step
                     (engine/engine.py), which verifies one half of the batch
                     while it drafts the other, only the wait for the draft
                     beyond the target call; in a step the target drafts itself
                     (one rank holding an independent draft: ``TargetStep.propose``),
                     the proposal's time inside that one call
- ``verify``         the target call as the engine sees it (less that proposal)
- ``commit``         appending tokens, stop checks, releases
- ``deliver``        handing the step's outputs to the waiting streams (asyncio queues)
- ``loop``           one pass of the engine loop: inbox, maintenance, step, deliver, metrics
- ``draft.compute``  time inside the draft worker's ``propose`` (or the target's proposal)
- ``draft.transport``  ``propose`` as seen by the engine minus the worker's own time
                     (not counted for a reply that was already waiting when the
                     engine came to read it)
- ``target.compute`` time inside the target shards' ``step`` (the slowest rank; less a proposal)
- ``target.collective``  of that, time in all-reduces (rank 0)
- ``target.transport``   ``verify`` minus the slowest rank's own time
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class PhaseTotal:
    seconds: float = 0.0
    count: int = 0


class StepTimeline:
    """Thread-safe accumulator of per-phase seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phases: dict[str, PhaseTotal] = {}

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            total = self._phases.setdefault(phase, PhaseTotal())
            total.seconds += seconds
            total.count += 1

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{phase: {"seconds": total, "count": n}}`` since start."""
        with self._lock:
            return {name: {"seconds": t.seconds, "count": t.count} for name, t in self._phases.items()}


def per_step_ms(before: dict, after: dict) -> dict[str, float]:
    """Milliseconds per engine step for every phase between two snapshots (``step`` counts the steps)."""
    steps = after.get("step", {}).get("count", 0) - before.get("step", {}).get("count", 0)
    if steps <= 0:
        return {}
    out = {}
    for name, total in after.items():
        seconds = total["seconds"] - before.get(name, {}).get("seconds", 0.0)
        out[name] = 1000.0 * seconds / steps
    return out


def summed(snapshots: list[dict]) -> dict[str, dict[str, float]]:
    """Snapshots (``{phase: {"seconds", "count"}}``, one per replica) added phase by phase."""
    total: dict[str, dict[str, float]] = {}
    for snap in snapshots:
        for phase, t in snap.items():
            acc = total.setdefault(phase, {"seconds": 0.0, "count": 0})
            acc["seconds"] += t.get("seconds", 0.0)
            acc["count"] += t.get("count", 0)
    return total


def every_replica(fetch: Callable[[], dict | None], replicas: int, attempts: int) -> dict[str, dict] | None:
    """``GET /stats`` of each of an application's ``replicas`` replicas, by its ``replica`` name.

    Replicas serving HTTP themselves share the port and a new connection reaches any one of them
    (SO_REUSEPORT), so ``fetch`` (one ``GET /stats`` on a new connection; None if it failed) is called
    until every replica has answered; None if a fetch fails or ``attempts`` run out first."""
    seen: dict[str, dict] = {}
    for _ in range(attempts):
        stats = fetch()
        if stats is None:
            return None
        seen[stats.get("replica", "")] = stats
        if len(seen) == replicas:
            return seen
    return None

