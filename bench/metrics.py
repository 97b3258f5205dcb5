"""Latency figures from per-request traces, computed one way for every system.

Standard library only: bench/vllm_runner.py imports this module inside the
vLLM virtual environment, where dspark_ray is not installed, so that vLLM's
numbers come out of the same arithmetic as dspark_ray's.

A ``RequestTrace`` records when a request was sent and when each delivery of
output arrived (a streamed chunk, an engine step's output), with the tokens
it carried. From a set of traces and the wall time of the run:

- output tokens/s: all output tokens / wall seconds (prefill included);
- TTFT: first delivery - send time;
- ITL (inter-token latency): the gap between successive deliveries, as vLLM's
  benchmark_serving measures it. A speculative step delivers several tokens
  at once, so ITL is the time per step and TPOT the time per token;
- TPOT: (last delivery - first delivery) / (output tokens - 1), per request;
- mean acceptance length: tokens emitted per verification step,
  1 + accepted draft tokens / drafts, summed over all requests (so a request
  with many steps weighs more). vLLM reports the same quantity.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass
class RequestTrace:
    """One request: what was sent when, and what came back when (seconds on one monotonic clock)."""

    sent: float
    arrivals: list[float] = field(default_factory=list)  # one per delivery of >= 1 token
    tokens: list[int] = field(default_factory=list)  # tokens in each delivery; 0 if unknown
    output_tokens: int = 0  # from usage where the server reports it, else sum(tokens)
    drafts: int = 0  # verification steps that had draft tokens
    accepted_tokens: int = 0  # draft tokens accepted over those steps
    error: str | None = None  # "400", "503", "timeout", "connection", ... ; None when it succeeded

    def deliver(self, now: float, n_tokens: int) -> None:
        self.arrivals.append(now)
        self.tokens.append(n_tokens)

    @classmethod
    def from_dict(cls, d: dict) -> RequestTrace:
        return cls(**d)


@dataclass
class Summary:
    """The figures of one run (one system, one concurrency). Latencies in milliseconds."""

    requests: int
    completed: int
    output_tokens: int
    seconds: float
    ttft_ms_p50: float | None
    ttft_ms_p99: float | None
    itl_ms_p50: float | None
    itl_ms_p99: float | None
    tpot_ms_mean: float | None
    mean_acceptance_length: float | None
    errors: dict[str, int]

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation, as numpy's default; None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def summarize(traces: list[RequestTrace], seconds: float, spec_totals: tuple[int, int] | None = None) -> Summary:
    """Figures over ``traces`` run in ``seconds`` of wall time.

    ``spec_totals`` = (drafts, accepted draft tokens) for systems that report
    speculation only in aggregate (vLLM); otherwise the traces' own counts.
    """
    ok = [t for t in traces if t.error is None]
    ttft = [t.arrivals[0] - t.sent for t in ok if t.arrivals]
    itl = [b - a for t in ok for a, b in zip(t.arrivals, t.arrivals[1:])]
    tpot = [(t.arrivals[-1] - t.arrivals[0]) / (t.output_tokens - 1) for t in ok
            if t.arrivals and t.output_tokens > 1]
    drafts, accepted = spec_totals or (sum(t.drafts for t in ok), sum(t.accepted_tokens for t in ok))
    return Summary(
        requests=len(traces),
        completed=len(ok),
        output_tokens=sum(t.output_tokens for t in ok),
        seconds=seconds,
        ttft_ms_p50=_ms(percentile(ttft, 50)),
        ttft_ms_p99=_ms(percentile(ttft, 99)),
        itl_ms_p50=_ms(percentile(itl, 50)),
        itl_ms_p99=_ms(percentile(itl, 99)),
        tpot_ms_mean=_ms(sum(tpot) / len(tpot)) if tpot else None,
        mean_acceptance_length=1 + accepted / drafts if drafts else None,
        errors=dict(Counter(t.error for t in traces if t.error is not None)),
    )
