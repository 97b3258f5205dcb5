"""Serving metrics: what the engine loop and the target shards export through Ray.

Every process's ``ray.util.metrics`` are served in Prometheus format by its
node's metrics agent, and Prometheus finds the agents through Ray's
service-discovery file. A metric named ``dspark_x`` here is scraped as
``ray_dspark_x``; counters gain ``_total``, histograms ``_bucket``, ``_sum``
and ``_count``. Every metric carries ``model`` (the target checkpoint's
folder name) and ``replica`` (the Serve replica id) tags.

Ray 2.60 aggregates histograms in each worker and rebuilds them in the agent
from bucket midpoints, so a histogram's ``_sum`` is only approximate. Times
that dashboards add up or divide (phase shares, the collective fraction)
therefore also have an exact counter: ``dspark_step_phase_time_seconds`` next
to the ``dspark_step_phase_seconds`` histogram, and so on.

Two layers, as elsewhere in the project: ``StepObserver`` is plain Python (no
ray, no torch) and turns what the engine loop sees after a step into a
``StepReport``; ``ServingMetrics`` records reports in Ray's metrics.
``ShardMetrics`` is the per-rank counterpart, recorded by each ``TargetShard``.

Meanings (vLLM's, so that dashboards read the same):

- drafts: verification steps of a request that carried at least one draft
  token; draft tokens: tokens proposed; accepted tokens: of those, accepted.
  Mean acceptance length = 1 + accepted / drafts.
- accepted tokens per position ``i``: drafts whose first ``i + 1`` tokens were
  all accepted, so ``accepted_per_pos[i] / drafts`` is the acceptance rate at
  position ``i``. Counted every step, not only when a request finishes.
- time to first token: from the loop accepting the request (submit) to the
  first output carrying a token. Inter-token latency: the gap between two
  token-carrying outputs of a request, shared out over the tokens the later
  one carried (a step that emits 3 tokens 30 ms after the last counts three
  10 ms gaps: what a streaming client sees per token). End-to-end: submit to
  the finishing output, whatever the finish reason.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

from dspark_ray.engine.outputs import SpecCounts

log = logging.getLogger(__name__)

PHASES = ("schedule", "propose", "verify", "commit")
# Seconds. Latency buckets follow vLLM's, with finer low ends for per-token gaps.
TTFT_BOUNDARIES = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80]
ITL_BOUNDARIES = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5]
E2E_BOUNDARIES = [0.1, 0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960]
STEP_BOUNDARIES = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5]
COLLECTIVE_BOUNDARIES = [0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                         0.1, 0.25, 0.5, 1]
BATCH_BOUNDARIES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
# Engine counters exported as Ray counters of the same name (``dspark_<name>``), with their help text.
ENGINE_COUNTERS = {
    "prefill_chunks": "Partial prefill chunks run (prompts longer than a step's token budget, split over steps).",
    "prefix_cache_query_tokens": "Prompt tokens of prefills that could use the target's prefix cache.",
    "prefix_cache_hit_tokens": "Of them, tokens found in the prefix cache (mapped, not computed).",
    "grammar_cut_drafts": "Draft tokens a structured output's grammar forbade (cut before verification).",
    "confidence_cut_drafts": "Draft tokens a DSpark draft's confidence head expected rejected (cut before "
                             "verification).",
}

# Counters of the engine's target service (``engine.target``; 0 where it has none), exported the same way.
TARGET_COUNTERS = {
    "context_relayed": "DSpark draft: positions of the target's context states relayed through the replica "
                       "(context_path: replica, or while target rank 0's direct link to the draft worker is down).",
}


@dataclass(frozen=True)
class _SpecSnapshot:
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()

    @classmethod
    def of(cls, stats: Any) -> _SpecSnapshot:
        """From the engine's ``SpecStats`` (live request) or ``SpecSummary`` (finished one)."""
        return cls(stats.drafts, stats.draft_tokens, stats.accepted_tokens, tuple(stats.accepted_per_position))


@dataclass
class StepReport:
    """What one pass of the engine loop adds to the metrics."""

    running: int
    waiting: int
    kv_in_use: int  # target KV pool tokens held by running requests
    kv_capacity: int
    batch_size: int = 0  # rows in the step; 0 when no step ran (only abort outputs were returned)
    phase_seconds: dict[str, float] = field(default_factory=dict)  # empty when no step ran
    finished: list[str] = field(default_factory=list)  # one finish reason per request that ended
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    draft_failures: int = 0
    prefilling: int = 0  # running requests whose prompt (or recompute) is not fed yet
    counts: dict[str, int] = field(default_factory=dict)  # ENGINE_COUNTERS and TARGET_COUNTERS added by this pass
    spec: SpecCounts = field(default_factory=SpecCounts)  # what the step added
    spec_k: int | None = None  # the k adaptive speculation chose for this step (None: no step, or fixed k)


@dataclass
class _Tracked:
    submitted: float | None  # None: the request did not come through the loop (no latencies)
    last_token: float | None = None
    spec: _SpecSnapshot = _SpecSnapshot()


class StepObserver:
    """Turns the engine's state and a step's outputs into a ``StepReport`` (engine thread only).

    Reads ``engine.scheduler``, ``engine.requests``, ``engine.counters``,
    ``engine.timings`` and ``engine.target.kv_capacity()``; changes nothing.
    """

    def __init__(self, engine: Any, clock=time.monotonic) -> None:
        self.engine = engine
        self.clock = clock
        self._tracked: dict[str, _Tracked] = {}
        self._steps = engine.counters.steps
        self._preemptions = engine.counters.preemptions
        self._draft_failures = engine.counters.draft_failures
        self._counts = {name: getattr(engine.counters, name) for name in ENGINE_COUNTERS}
        self._target_counts = {name: getattr(engine.target, name, 0) for name in TARGET_COUNTERS}

    def submitted(self, req_id: str, at: float) -> None:
        """The loop accepted ``req_id`` at ``at`` (a ``clock`` reading, taken when the caller submitted)."""
        self._tracked[req_id] = _Tracked(submitted=at)

    def observe(self, outputs: list, waiting: int) -> StepReport:
        """The report of one loop pass: ``outputs`` is what ``engine.step()`` returned."""
        engine, now = self.engine, self.clock()
        report = StepReport(
            running=len(engine.scheduler.running), waiting=waiting,
            kv_in_use=engine.scheduler.kv_in_use(), kv_capacity=engine.target.kv_capacity(),
        )
        counters = engine.counters
        if counters.steps != self._steps:
            t = engine.timings
            report.batch_size = t.rows
            report.phase_seconds = {p: getattr(t, p) for p in PHASES}
            if getattr(engine, "spec_controller", None) is not None:
                report.spec_k = engine.scheduler.step_k
        report.preemptions = counters.preemptions - self._preemptions
        report.draft_failures = counters.draft_failures - self._draft_failures
        self._steps = counters.steps
        self._preemptions, self._draft_failures = counters.preemptions, counters.draft_failures
        for name, before in self._counts.items():
            total = getattr(counters, name)
            report.counts[name] = total - before
            self._counts[name] = total
        for name, before in self._target_counts.items():  # the target may have been replaced (reset_target)
            total = getattr(engine.target, name, 0)
            report.counts[name] = max(0, total - before)
            self._target_counts[name] = total
        report.prefilling = engine.scheduler.prefilling()
        for out in outputs:
            self._observe_output(out, now, report)
        return report

    def _observe_output(self, out: Any, now: float, report: StepReport) -> None:
        tracked = self._tracked.get(out.req_id) or _Tracked(submitted=None)
        n = len(out.new_token_ids)
        if n:
            report.generation_tokens += n
            if tracked.last_token is None:
                report.prompt_tokens += out.num_prompt_tokens
                if tracked.submitted is not None:
                    report.ttft.append(now - tracked.submitted)
            else:
                report.itl += [(now - tracked.last_token) / n] * n
            tracked.last_token = now
        stats = out.spec if out.finished else getattr(self.engine.requests.get(out.req_id), "spec", None)
        if stats is not None:
            snapshot = _SpecSnapshot.of(stats)
            report.spec.add(snapshot)
            report.spec.add(tracked.spec, -1)
            tracked.spec = snapshot
        if out.finished:
            report.finished.append(out.finish_reason or "unknown")
            if tracked.submitted is not None:
                report.e2e.append(now - tracked.submitted)
            self._tracked.pop(out.req_id, None)
        else:
            self._tracked[out.req_id] = tracked


class ServingMetrics:
    """One replica's serving metrics: call ``submitted`` per request and ``after_step`` per loop pass.

    The engine thread only builds the step's report (plain Python); a
    recorder thread hands it to Ray's metrics (a few microseconds per value,
    hundreds of values per large step), so recording stays off the step's
    critical path. Metrics are an observer, never a cause of failure: an
    error while recording is logged (once per kind) and serving goes on.
    """

    def __init__(self, engine: Any, model: str, replica: str) -> None:
        self.observer = StepObserver(engine)
        self._failures: set[str] = set()
        self.model = model
        self._spec_lock = threading.Lock()
        self._spec_totals = SpecCounts()  # this replica's speculation counters since start (GET /metrics)
        # Called on the engine thread with the new totals after each step that drafted: the replica's HTTP
        # server publishes them to the replicas sharing its port (dspark_ray/openai/balance.py).
        self.spec_sink: Callable[[SpecCounts], None] | None = None
        self._reports: queue.SimpleQueue[StepReport | None] = queue.SimpleQueue()
        self._recorder = threading.Thread(target=self._record_forever, name="dspark-metrics", daemon=True)
        keys = ("model", "replica")

        def make(cls, name: str, doc: str, extra: tuple[str, ...] = (), **kwargs):
            metric = cls(name, doc, tag_keys=keys + extra, **kwargs)
            metric.set_default_tags({"model": model, "replica": replica})
            return metric

        self.running = make(Gauge, "dspark_requests_running", "Requests holding a slot and running.")
        self.waiting = make(Gauge, "dspark_requests_waiting", "Requests queued for admission (no slot yet).")
        self.finished = make(Counter, "dspark_requests_finished", "Requests ended, by finish reason "
                             "(stop | length | abort | error).", ("reason",))
        self.ttft = make(Histogram, "dspark_time_to_first_token_seconds", "Submit to the first output token.",
                         boundaries=TTFT_BOUNDARIES)
        self.itl = make(Histogram, "dspark_inter_token_latency_seconds",
                        "Gap between output tokens of a request, per token.", boundaries=ITL_BOUNDARIES)
        self.e2e = make(Histogram, "dspark_e2e_request_latency_seconds", "Submit to the request's end.",
                        boundaries=E2E_BOUNDARIES)
        self.prompt_tokens = make(Counter, "dspark_prompt_tokens", "Prompt tokens of requests that started.")
        self.generation_tokens = make(Counter, "dspark_generation_tokens", "Output tokens sent to clients.")
        self.batch_size = make(Histogram, "dspark_batch_size", "Requests (rows) per engine step.",
                               boundaries=BATCH_BOUNDARIES)
        self.kv_in_use = make(Gauge, "dspark_kv_pool_tokens_in_use", "Target KV pool tokens held by requests.")
        self.kv_capacity = make(Gauge, "dspark_kv_pool_tokens_capacity", "Target KV pool size in tokens.")
        self.preemptions = make(Counter, "dspark_preemptions", "Requests preempted (target KV freed, recomputed).")
        self.draft_failures = make(Counter, "dspark_draft_failures", "Steps run without drafts: the proposer failed.")
        self.engine_counters = {name: make(Counter, f"dspark_{name}", doc)
                                for name, doc in {**ENGINE_COUNTERS, **TARGET_COUNTERS}.items()}
        self.prefilling = make(Gauge, "dspark_requests_prefilling", "Running requests mid-prefill (holding a slot, "
                               "their prompt or recompute not fed yet).")
        self.step_phase = make(Histogram, "dspark_step_phase_seconds", "Engine step time by phase "
                               "(schedule | propose | verify | commit).", ("phase",), boundaries=STEP_BOUNDARIES)
        self.step_phase_time = make(Counter, "dspark_step_phase_time_seconds", "Engine time spent per phase "
                                    "(exact; the histogram's sum is approximate).", ("phase",))
        self.drafts = make(Counter, "dspark_spec_decode_num_drafts", "Verification steps that carried drafts.")
        self.draft_tokens = make(Counter, "dspark_spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted_tokens = make(Counter, "dspark_spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = make(Counter, "dspark_spec_decode_num_accepted_tokens_per_pos",
                                     "Drafts accepted at least up to position (0-based).", ("position",))
        self.spec_k_steps = make(Counter, "dspark_spec_k_steps", "Engine steps by the k adaptive speculation "
                                 "chose (the most draft tokens a request verified in that step).", ("k",))
        self._recorder.start()

    @classmethod
    def for_engine(cls, engine: Any) -> ServingMetrics:
        """Tagged with the target checkpoint's folder name and the engine's owner (the replica id)."""
        return cls(engine, model=Path(engine.config.model).name, replica=engine.owner or "local")

    def submitted(self, req_id: str, at: float) -> None:
        self._guard("submit", self.observer.submitted, req_id, at)

    def after_step(self, outputs: list, waiting: int) -> None:
        """Observe one loop pass (engine thread); it is recorded by the recorder thread.

        The speculation totals ``GET /metrics`` serves are added here, on the engine thread (a few
        integer adds), so that they count a request's last step by the time the engine thread looks
        at its next one, however far behind Ray's recorder thread runs."""
        self._guard("step", self._observe, outputs, waiting)

    def _observe(self, outputs: list, waiting: int) -> None:
        report = self.observer.observe(outputs, waiting)
        self._add_spec_totals(report.spec)
        self._reports.put(report)

    def close(self) -> None:
        """Record what is queued, then stop the recorder thread."""
        self._reports.put(None)
        self._recorder.join(timeout=5)

    def _record_forever(self) -> None:
        while (report := self._reports.get()) is not None:
            self._guard("record", self.record, report)

    def record(self, r: StepReport) -> None:
        """Hand one report to Ray's metrics (the recorder thread calls this)."""
        self.running.set(r.running)
        self.waiting.set(r.waiting)
        self.kv_in_use.set(r.kv_in_use)
        self.kv_capacity.set(r.kv_capacity)
        self.prefilling.set(r.prefilling)
        for name, n in r.counts.items():
            if n > 0:
                self.engine_counters[name].inc(n)
        if r.batch_size:
            self.batch_size.observe(r.batch_size)
            if r.spec_k is not None:
                self.spec_k_steps.inc(tags={"k": str(r.spec_k)})
            for phase, seconds in r.phase_seconds.items():
                self.step_phase.observe(seconds, tags={"phase": phase})
                if seconds > 0:
                    self.step_phase_time.inc(seconds, tags={"phase": phase})
        for reason in r.finished:
            self.finished.inc(tags={"reason": reason})
        for hist, values in ((self.ttft, r.ttft), (self.itl, r.itl), (self.e2e, r.e2e)):
            for v in values:
                hist.observe(v)
        for counter, n in ((self.prompt_tokens, r.prompt_tokens), (self.generation_tokens, r.generation_tokens),
                           (self.preemptions, r.preemptions), (self.draft_failures, r.draft_failures),
                           (self.drafts, r.spec.drafts), (self.draft_tokens, r.spec.draft_tokens),
                           (self.accepted_tokens, r.spec.accepted_tokens)):
            if n > 0:
                counter.inc(n)
        for pos, n in enumerate(r.spec.accepted_per_position):
            if n > 0:
                self.accepted_per_pos.inc(n, tags={"position": str(pos)})

    def _add_spec_totals(self, d: SpecCounts) -> None:
        with self._spec_lock:
            self._spec_totals.add(d)
        if self.spec_sink is not None and d.drafts:
            self.spec_sink(self.spec_totals())

    def spec_totals(self) -> SpecCounts:
        """A copy of this replica's speculation counters since start."""
        with self._spec_lock:
            return self._spec_totals.copy()

    def _guard(self, what: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - metrics must not stop serving; logged once per kind
            if what not in self._failures:
                self._failures.add(what)
                log.exception("recording serving metrics (%s) failed; serving continues", what)


class ShardMetrics:
    """One target rank's step time and the part of it spent in collectives (all-reduce)."""

    def __init__(self, model: str, replica: str, rank: int) -> None:
        tags = {"model": model, "replica": replica, "rank": str(rank)}
        keys = tuple(tags)
        self.step = Histogram("dspark_target_step_seconds", "Target forward + verify on this rank, per step.",
                              boundaries=STEP_BOUNDARIES, tag_keys=keys)
        self.collective = Histogram(
            "dspark_target_collective_seconds",
            "Time in tensor-parallel all-reduces on this rank, per step (includes waiting for slower ranks).",
            boundaries=COLLECTIVE_BOUNDARIES, tag_keys=keys)
        self.step_time = Counter("dspark_target_step_time_seconds", "Target step time on this rank (exact).",
                                 tag_keys=keys)
        self.collective_time = Counter("dspark_target_collective_time_seconds",
                                       "All-reduce time on this rank (exact).", tag_keys=keys)
        for metric in (self.step, self.collective, self.step_time, self.collective_time):
            metric.set_default_tags(tags)

    def observe(self, step_s: float, collective_s: float) -> None:
        self.step.observe(step_s)
        self.collective.observe(collective_s)
        if step_s > 0:
            self.step_time.inc(step_s)
        if collective_s > 0:
            self.collective_time.inc(collective_s)
