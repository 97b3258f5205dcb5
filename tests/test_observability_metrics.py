"""StepObserver (plain Python): what one engine-loop pass adds to the metrics, step by step.

A stand-in engine exposes the attributes the observer reads; the clock is
manual, so latencies are exact.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from dspark_ray.engine.engine import EngineCounters, StepTimings
from dspark_ray.engine.outputs import RequestOutput, SpecSummary
from dspark_ray.engine.request import SpecStats
from dspark_ray.runtime.metrics import ServingMetrics, StepObserver


@dataclass
class _Req:
    spec: SpecStats = field(default_factory=SpecStats)


class _Scheduler:
    def __init__(self) -> None:
        self.running: list = []
        self.kv = 0

    def kv_in_use(self) -> int:
        return self.kv

    def prefilling(self) -> int:
        return self.mid_prefill

    mid_prefill = 0


class _Target:
    def kv_capacity(self) -> int:
        return 1000


class FakeEngine:
    def __init__(self) -> None:
        self.scheduler, self.target = _Scheduler(), _Target()
        self.requests: dict[str, _Req] = {}
        self.counters, self.timings = EngineCounters(), StepTimings()

    def step(self, rows: int, timings=(0.001, 0.01, 0.02, 0.003)) -> None:
        self.counters.steps += 1
        self.timings = StepTimings(*timings, rows)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def out(req_id: str, tokens: list[int], finished: bool = False, reason: str | None = None,
        spec: SpecSummary | None = None) -> RequestOutput:
    return RequestOutput(req_id=req_id, new_token_ids=tokens, new_text="", num_prompt_tokens=7,
                         num_output_tokens=0, finished=finished, finish_reason=reason, spec=spec)


def test_a_request_through_three_steps():
    engine, clock = FakeEngine(), Clock()
    obs = StepObserver(engine, clock)
    obs.submitted("a", at=100.0)
    engine.requests["a"] = _Req()

    # Step 1 (prefill, no drafts): one token after 50 ms.
    clock.now = 100.05
    engine.step(rows=1)
    engine.scheduler.running, engine.scheduler.kv = ["a"], 7
    r = obs.observe([out("a", [5])], waiting=2)
    assert (r.running, r.waiting, r.kv_in_use, r.kv_capacity, r.batch_size) == (1, 2, 7, 1000, 1)
    assert r.phase_seconds == {"schedule": 0.001, "propose": 0.01, "verify": 0.02, "commit": 0.003}
    assert r.prompt_tokens == 7 and r.generation_tokens == 1
    assert len(r.ttft) == 1 and abs(r.ttft[0] - 0.05) < 1e-9
    assert r.itl == [] and r.spec.drafts == 0

    # Step 2: k=4 drafts, 2 accepted, 3 tokens emitted 30 ms later: three 10 ms gaps.
    clock.now = 100.08
    engine.step(rows=1)
    engine.requests["a"].spec.record(4, 2)
    r = obs.observe([out("a", [6, 7, 8])], waiting=0)
    assert r.generation_tokens == 3 and r.prompt_tokens == 0 and r.ttft == []
    assert [round(x, 9) for x in r.itl] == [0.01, 0.01, 0.01]
    assert (r.spec.drafts, r.spec.draft_tokens, r.spec.accepted_tokens) == (1, 4, 2)
    assert r.spec.accepted_per_position == [1, 1, 0, 0]

    # Step 3: 4 drafts, all accepted, finishes by length; the summary replaces the live stats.
    clock.now = 100.13
    engine.step(rows=1)
    stats = engine.requests.pop("a").spec
    stats.record(4, 4)
    summary = SpecSummary(stats.drafts, stats.draft_tokens, stats.accepted_tokens, list(stats.accepted_per_position),
                          stats.mean_acceptance_length)
    engine.scheduler.running, engine.scheduler.kv = [], 0
    r = obs.observe([out("a", [9, 10, 11, 12, 13], True, "length", summary)], waiting=0)
    assert (r.spec.drafts, r.spec.draft_tokens, r.spec.accepted_tokens) == (1, 4, 4)
    assert r.spec.accepted_per_position == [1, 1, 1, 1]
    assert r.finished == ["length"] and abs(r.e2e[0] - 0.13) < 1e-9
    assert r.running == 0 and r.kv_in_use == 0 and len(r.itl) == 5
    assert obs._tracked == {}


def test_a_pass_without_a_step_reports_gauges_and_aborts_only():
    engine, clock = FakeEngine(), Clock()
    obs = StepObserver(engine, clock)
    obs.submitted("b", at=99.0)
    r = obs.observe([out("b", [], True, "abort", SpecSummary(0, 0, 0, [], 1.0))], waiting=0)
    assert r.batch_size == 0 and r.phase_seconds == {}
    assert r.finished == ["abort"] and r.e2e == [1.0] and r.ttft == [] and r.generation_tokens == 0


def test_counter_deltas_and_untracked_requests():
    engine, clock = FakeEngine(), Clock()
    engine.counters.preemptions, engine.counters.draft_failures = 3, 1
    obs = StepObserver(engine, clock)  # what happened before it started is not reported
    engine.counters.preemptions += 2
    engine.step(rows=2)
    engine.requests["x"] = _Req()
    r = obs.observe([out("x", [1, 2])], waiting=0)  # not submitted through the loop: no latencies
    assert r.preemptions == 2 and r.draft_failures == 0 and r.batch_size == 2
    assert r.generation_tokens == 2 and r.prompt_tokens == 7 and r.ttft == [] and r.itl == []


def test_reports_are_recorded_off_the_engine_thread():
    engine = FakeEngine()
    metrics = ServingMetrics(engine, model="m", replica="r")
    recorded = []
    metrics.record = lambda report: recorded.append((report, threading.current_thread().name))
    engine.step(rows=1)
    metrics.after_step([out("a", [1, 2, 3])], waiting=0)
    metrics.close()
    ((report, thread),) = recorded
    assert report.generation_tokens == 3 and thread == "dspark-metrics"


def test_recording_never_raises_into_the_loop(caplog):
    engine = FakeEngine()
    metrics = ServingMetrics(engine, model="m", replica="r")
    metrics.after_step([], waiting=0)  # recorded for real (Ray's metrics work without a cluster)
    del engine.scheduler  # a broken engine: the observer cannot read it
    metrics.after_step([], waiting=0)
    metrics.after_step([], waiting=0)
    metrics.record = lambda report: 1 / 0
    engine.scheduler = _Scheduler()
    metrics.after_step([], waiting=0)
    metrics.close()
    messages = [r.message for r in caplog.records]
    assert sum("serving metrics (step) failed" in m for m in messages) == 1
    assert sum("serving metrics (record) failed" in m for m in messages) == 1


def test_engine_counters_and_mid_prefill_requests():
    """Prefill chunks, prefix-cache queries and hits: per-pass deltas of the engine's counters."""
    engine, clock = FakeEngine(), Clock()
    obs = StepObserver(engine, clock)
    engine.counters.prefill_chunks, engine.counters.prefix_cache_hit_tokens = 3, 32
    engine.counters.prefix_cache_query_tokens = 50
    engine.scheduler.mid_prefill = 2
    engine.step(rows=2)
    r = obs.observe([], waiting=0)
    assert r.counts == {"prefill_chunks": 3, "prefix_cache_query_tokens": 50, "prefix_cache_hit_tokens": 32,
                        "grammar_cut_drafts": 0, "confidence_cut_drafts": 0,
                        "context_relayed": 0} and r.prefilling == 2  # (a target without the counter: 0)
    engine.counters.prefill_chunks = 4
    engine.scheduler.mid_prefill = 0
    r = obs.observe([], waiting=0)
    assert r.counts["prefill_chunks"] == 1 and r.counts["prefix_cache_hit_tokens"] == 0 and r.prefilling == 0
