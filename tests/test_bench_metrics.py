"""bench/metrics.py: the figures every benchmark row is computed with, on hand-made traces."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from metrics import RequestTrace, percentile, summarize  # noqa: E402


def trace(sent: float, arrivals: list[float], tokens: list[int], **kw) -> RequestTrace:
    return RequestTrace(sent=sent, arrivals=arrivals, tokens=tokens, output_tokens=sum(tokens), **kw)


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_latencies_throughput_and_acceptance():
    # Request a: sent at 0, first chunk at 0.1 (1 token), then a speculative step of 3 tokens at 0.3.
    # Request b: sent at 0, chunks of 1 token at 0.2, 0.25, 0.30, 0.35.
    a = trace(0.0, [0.1, 0.3], [1, 3], drafts=1, accepted_tokens=2)
    b = trace(0.0, [0.2, 0.25, 0.30, 0.35], [1, 1, 1, 1], drafts=3, accepted_tokens=0)
    s = summarize([a, b], seconds=0.5)
    assert (s.requests, s.completed, s.output_tokens) == (2, 2, 8)
    assert s.tokens_per_s == pytest.approx(16.0)
    assert s.ttft_ms_p50 == pytest.approx(150.0)
    assert s.itl_ms_p50 == pytest.approx(50.0)  # gaps 200, 50, 50, 50 ms: per chunk, not per token
    assert s.itl_ms_p99 == pytest.approx(50 + 150 * 0.97)
    assert s.tpot_ms_mean == pytest.approx((200 / 3 + 150 / 3) / 2)
    assert s.mean_acceptance_length == pytest.approx(1 + 2 / 4)  # summed over requests, as vLLM does
    assert s.errors == {}


def test_failed_requests_count_as_errors_and_not_in_the_figures():
    ok = trace(0.0, [0.1, 0.2], [1, 1])
    failed = [RequestTrace(sent=0.0, error="503"), RequestTrace(sent=0.0, error="503"),
              RequestTrace(sent=0.0, error="timeout")]
    s = summarize([ok, *failed], seconds=1.0)
    assert (s.requests, s.completed, s.output_tokens) == (4, 1, 2)
    assert s.errors == {"503": 2, "timeout": 1}
    assert s.ttft_ms_p50 == pytest.approx(100.0)


def test_aggregate_speculation_counts_override_the_traces():
    s = summarize([trace(0.0, [0.1], [1])], seconds=1.0, spec_totals=(10, 15))
    assert s.mean_acceptance_length == pytest.approx(2.5)
    assert summarize([trace(0.0, [0.1], [1])], seconds=1.0).mean_acceptance_length is None


def test_trace_round_trips_through_a_dict():
    t = trace(1.0, [1.5, 2.0], [2, 1], drafts=1, accepted_tokens=1)
    assert RequestTrace.from_dict(t.__dict__) == t
