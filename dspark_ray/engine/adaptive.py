"""Adaptive speculation: how many draft tokens each step verifies (pure Python).

NOTE: the policy. A draft token is worth drafting when what it adds in
expected output tokens pays for what it costs in time, and both sides move:
acceptance differs from one request (and one stretch of text) to the next,
and the cost of a draft pass and of verifying more positions grows with the
batch (on the 2-core CPU box, k=4 is the best static choice at batch 1 and
the worst at batch 32: README, Performance). So:

* every request keeps its own estimate of the conditional acceptance at each
  draft position (``Acceptance``: exponentially weighted, from its own
  verifications only), hence its expected tokens per step for any k, and a
  cap: the deepest position still accepted with probability ``CAP_PROB``
  along the chain (never below one token, so it keeps learning);
* every step the engine picks one k for the batch (``SpecController``): the
  one with the most expected tokens per second, from the expected tokens of
  the requests in the batch and the measured wall time of steps at this
  batch size and k (a table per batch-size bucket, filled by trying each k
  once and refreshed by trying the best k's neighbours now and then).
  k = 0 (no draft at all) is one of the choices: where verifying is not
  nearly free, not speculating is fastest.

A request's k is ``min(its num_speculative_tokens, its cap, the step's k)``.
Two kinds of request take no step k: one that fixed ``num_speculative_tokens``
itself (it always drafts exactly that), and a sampled request with a ``seed``
(its k follows its own cap only, so its output is a function of its seed and
its own history, whatever else runs; see ``Request.batch_adapted``). Output is
unchanged by any of this: greedy output is the target's argmax, and sampled
output follows the target distribution, for any k (the acceptance rule is
lossless per position).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

PRIOR_ACCEPTANCE = 0.7  # a fresh request's assumed conditional acceptance per position (see prior)
PRIOR_WEIGHT = 3.0  # ... worth this many observations
DECAY = 0.9  # per observation: what a request saw ~7 verifications ago counts half
POPULATION_DECAY = 0.995  # the engine-wide estimate: the last few hundred verifications
CAP_PROB = 0.2  # a request drafts position i only while P(positions 1..i all accepted) >= this


@dataclass
class Acceptance:
    """One request's conditional acceptance per draft position, exponentially weighted."""

    max_k: int
    prior: tuple[float, ...] | None = None  # conditional acceptance per position before any evidence
    decay: float = DECAY
    tried: list[float] = field(default_factory=list)  # weighted times position i was verified
    accepted: list[float] = field(default_factory=list)  # ... and accepted
    expected: list[float] = field(default_factory=list)  # expected tokens per step for k = 0..max_k
    cap: int = 0

    def __post_init__(self) -> None:
        if self.prior is None:
            self.prior = (PRIOR_ACCEPTANCE,) * self.max_k
        self.tried = [PRIOR_WEIGHT] * self.max_k
        self.accepted = [PRIOR_WEIGHT * p for p in self.prior]
        self._refresh()

    def record(self, proposed: int, accepted: int) -> None:
        """A verification of ``proposed`` draft tokens kept ``accepted``: positions 1..accepted+1 were
        reached (the one after the last accepted was rejected, if there is one)."""
        d = self.decay
        for i in range(min(accepted + 1, proposed, self.max_k)):
            self.tried[i] = d * self.tried[i] + 1.0
            self.accepted[i] = d * self.accepted[i] + (1.0 if i < accepted else 0.0)
        if proposed:
            self._refresh()

    def idle(self) -> None:
        """A step verified none of its drafts (the step's k was 0): what it saw fades toward the prior,
        so that a request an unlucky stretch talked out of speculating is tried again."""
        d = self.decay
        for i in range(self.max_k):
            self.tried[i] = d * self.tried[i] + (1.0 - d) * PRIOR_WEIGHT
            self.accepted[i] = d * self.accepted[i] + (1.0 - d) * PRIOR_WEIGHT * self.prior[i]
        self._refresh()

    def rates(self) -> tuple[float, ...]:
        return tuple(self.rate(i) for i in range(self.max_k))

    def rate(self, i: int) -> float:
        """P(position i accepted | positions before it accepted), 0-based."""
        return self.accepted[i] / self.tried[i]

    def _refresh(self) -> None:
        rates = [self.rate(i) for i in range(self.max_k)]
        chain, total = 1.0, 1.0
        self.expected = [1.0]
        for r in rates:
            chain *= r
            total += chain
            self.expected.append(total)
        self.cap = confident_drafts(rates)  # the same rule as a DSpark block's own estimate


def confident_drafts(confidence: list[float]) -> int:
    """How many of a block's drafts to verify, from the draft's own per-position acceptance
    estimates (a DSpark draft's confidence head): the same rule as ``Acceptance.cap``, on this
    block's estimate instead of the request's history. Position i is kept while the estimated
    P(drafts 1..i all accepted) >= ``CAP_PROB``; never fewer than one draft (none if there is none)."""
    chain, keep = 1.0, min(1, len(confidence))
    for i, c in enumerate(confidence):
        chain *= c
        if chain < CAP_PROB:
            break
        keep = i + 1
    return keep


def bucket(batch: int) -> int:
    """Batch sizes that cost about the same share a bucket: 1, 2, 3, 4, then half octaves."""
    return batch if batch <= 4 else 4 + round(2 * math.log2(batch / 4))


class _Cell:
    """The step times measured at one (batch bucket, k): the mean of the last few without their
    slowest quarter, rounded up (a step slowed by something else, a collection or another process,
    says nothing about k; a pipelined engine alternates two kinds of step, so one quantile would
    not do). Rounded up because the first step at a k is slow (the shapes are new to the kernels:
    measured at batch 8, 35.4 ms for k = 4 where the next ones took 24; with 3 probes and the
    quarter rounded down, that one counted, k = 4 looked 16% dearer than it is, and one such
    probe per k made the fitted cost per draft twice the real one: adaptive k settled on k = 1 at
    0.74x of the best static k at a steady batch of 8, bench/steady.py)."""

    KEEP = 16

    def __init__(self) -> None:
        self.times: deque[float] = deque(maxlen=self.KEEP)
        self.n = 0

    @property
    def seconds(self) -> float:
        ordered = sorted(self.times)
        kept = ordered[:max(1, len(ordered) - -(-len(ordered) // 4))]
        return sum(kept) / len(kept)

    def add(self, seconds: float) -> None:
        self.times.append(seconds)
        self.n += 1


class SpecController:
    """Picks each step's k (0..max_k) for the most expected tokens per second.

    ``choose`` is given the batch size and the expected tokens per step of the
    batch for every k; ``observe`` is told the wall time of each steady step
    (every row decoding: prefills cost what they cost whatever k is). Per
    batch-size bucket it keeps the step times measured at each k (the median
    of the last few, so a step slowed by something else does not count). A
    bucket seen for the first time tries every k (from max_k down)
    ``PROBE_STEPS`` times, or only those on the side of a measured bucket's
    best k where its own can lie (``_worth_probing``); then, now and then, it tries one other k again (each
    in turn) for ``REPROBE_STEPS`` steps, so the table follows the machine's
    load and the batch's text: ``REPROBE_EVERY`` decisions after the best k
    last changed, then twice as long each time it stays the same, up to
    ``REPROBE_MAX`` (a probe costs: a k = 0 stretch leaves the draft a catch-up).
    """

    PROBE_STEPS = 3
    REPROBE_EVERY = 24
    REPROBE_MAX = 192
    REPROBE_STEPS = 2

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k
        self.table: dict[int, list[_Cell]] = {}
        self._probes: dict[int, list[int]] = {}
        self._decisions: dict[int, int] = {}  # per bucket: decisions since the last re-probe
        self._interval: dict[int, int] = {}  # ... and until the next one
        self._best: dict[int, int] = {}  # ... the best k then
        self._turn: dict[int, int] = {}  # ... which other k the next re-probe tries
        self.last_k = max_k
        self.chosen: dict[int, int] = {}  # k -> steps that chose it (metrics)

    def _cells(self, b: int, expected: list[float] | None = None) -> list[_Cell]:
        cells = self.table.get(b)
        if cells is None:
            cells = self.table[b] = [_Cell() for _ in range(self.max_k + 1)]
            ks = self._worth_probing(b, expected)
            self._probes[b] = [k for k in ks for _ in range(self.PROBE_STEPS)]  # popped: the largest k first
        return cells

    def _worth_probing(self, b: int, expected: list[float] | None) -> range:
        """The k a new bucket tries: all, unless a measured bucket says where the best one lies.
        Verifying k drafts costs more, relative to a one-token step, the more rows a step has (README,
        Performance: 1.35x a one-token step at batch 1, 2.3x at 32), so at the same acceptance the
        best k of a smaller batch is at least that of a larger one: below the nearest fully probed
        bucket only k >= its best are tried, above it only k <= its best. (A closed batch ends
        through ever smaller buckets, its slowest requests last; trying k = 0 on each of them
        cost those requests steps: 40 steps instead of 34 at batch 32 with the DSpark draft.)"""
        every = range(self.max_k + 1)
        known = [(abs(o - b), o) for o, probes in self._probes.items() if o != b and not probes
                 and all(c.n for c in self.table[o])]
        if expected is None or not known:
            return every
        nearest = min(known)[1]
        best = self.best(nearest, expected)
        return range(best, self.max_k + 1) if nearest > b else range(best + 1)

    def choose(self, batch: int, expected: list[float]) -> int:
        """This step's k; ``expected[k]`` = the batch's expected output tokens per step at k."""
        if self.max_k == 0 or batch == 0:
            return self.max_k
        b = bucket(batch)
        self._cells(b, expected)
        probes = self._probes[b]
        if probes:
            k = probes.pop()
        else:
            k = self.best(b, expected)
            if self._best.get(b) != k:
                self._best[b], self._interval[b], self._decisions[b] = k, self.REPROBE_EVERY, 0
            self._decisions[b] += 1
            if self._decisions[b] >= self._interval[b]:
                others = [j for j in range(self.max_k + 1) if j != k]
                turn = self._turn[b] = self._turn.get(b, -1) + 1
                probes.extend([others[turn % len(others)]] * self.REPROBE_STEPS)
                self._decisions[b] = 0
                self._interval[b] = min(2 * self._interval[b], self.REPROBE_MAX)
        self.last_k = k
        self.chosen[k] = self.chosen.get(k, 0) + 1
        return k

    def best(self, b: int, expected: list[float]) -> int:
        """The k with the most expected tokens per second in bucket ``b``."""
        times = self.step_times(b)
        rates = [(expected[k] / t, k) for k, t in enumerate(times) if t is not None and t > 0]
        return max(rates)[1] if rates else self.max_k

    def step_times(self, b: int) -> list[float | None]:
        """Estimated step time per k in bucket ``b`` (None: not measured). k = 0 (no draft call) is
        its own; k >= 1 cost about a + c*k (one draft pass and one verified position per token),
        so those are a line fitted through every measured k, weighted by measurements: noise in
        one k's few steps is averaged with the others'."""
        cells = self.table[b]
        times: list[float | None] = [c.seconds if c.n else None for c in cells]
        points = [(k, c.seconds, len(c.times)) for k, c in enumerate(cells) if k and c.n]
        if len({k for k, _, _ in points}) >= 2:
            w = sum(n for _, _, n in points)
            mk = sum(k * n for k, _, n in points) / w
            mt = sum(t * n for _, t, n in points) / w
            var = sum(n * (k - mk) ** 2 for k, _, n in points)
            slope = max(0.0, sum(n * (k - mk) * (t - mt) for k, t, n in points) / var)
            for k in range(1, self.max_k + 1):
                times[k] = mt + slope * (k - mk)
        return times

    def table_ms(self) -> dict[int, dict[str, list]]:
        """Per batch bucket: the step time measured at each k (ms, None: not measured), the steps measured,
        and the fitted times it decides by (``step_times``): what ``GET /stats`` and bench/steady.py show."""
        return {b: {"measured": [round(1000 * c.seconds, 2) if c.n else None for c in cells],
                    "n": [c.n for c in cells],
                    "fitted": [None if t is None else round(1000 * t, 2) for t in self.step_times(b)]}
                for b, cells in sorted(self.table.items())}

    def observe(self, batch: int, k: int, seconds: float) -> None:
        """The wall time of a steady step of ``batch`` rows that chose ``k``."""
        if 0 <= k <= self.max_k and batch > 0:
            self._cells(bucket(batch))[k].add(seconds)
