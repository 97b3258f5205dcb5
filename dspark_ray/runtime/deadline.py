"""StepDeadline: how long a worker may take to answer one per-step call (pure Python).

A fixed timeout long enough for the slowest legitimate step (a cold start, a
step full of prefill chunks) leaves a hung shard, a wedged collective or an
unreachable box undetected for minutes, while every request waits. So the
deadline follows the calls the worker answered lately: ``factor`` times the
slowest of the last ``window``, never below ``floor_s`` (small steps vary a
lot in relative terms) and never above ``ceiling_s`` (the configured
``worker_call_timeout_s``, which also holds until ``warmup`` calls have been
seen). A step's size is bounded by ``max_num_batched_tokens``, so the slowest
recent step is a fair measure of the slowest legitimate one once traffic has
run for a while. A call past its deadline is handled as a crash of the worker
(the target is rebuilt, the draft worker restarted), and the requests in
flight wait and resume.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class StepDeadline:
    ceiling_s: float
    floor_s: float = 5.0
    factor: float = 10.0
    window: int = 64
    warmup: int = 8
    _recent: deque = field(default_factory=deque, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.floor_s <= self.ceiling_s:
            raise ValueError(f"the step deadline's floor ({self.floor_s} s) must be in (0, ceiling = "
                             f"{self.ceiling_s} s]")
        if self.factor < 1:
            raise ValueError(f"the step deadline's factor must be at least 1, got {self.factor}")
        self._recent = deque(maxlen=self.window)

    def observe(self, seconds: float) -> None:
        """A call answered after ``seconds``."""
        self._recent.append(seconds)

    @property
    def measured(self) -> bool:
        """Enough calls were seen for the deadline to follow them (before that it is ``ceiling_s``)."""
        return len(self._recent) >= self.warmup

    def timeout_s(self) -> float:
        """The deadline of the next call."""
        if not self.measured:
            return self.ceiling_s
        return min(self.ceiling_s, max(self.floor_s, self.factor * max(self._recent)))
