"""Scheduler (pure Python): a hypothesis state machine against a simulated target KV pool.

The machine adds requests, runs steps and aborts requests in random order.
Each step is checked against what the target would do with the plan: free
the preempted requests' KV, then append every row's unseen tokens plus its
drafts, or its partial prefill chunk — which must fit in the pool (the
scheduler's accounting is the target's) and in the step's token budget — then
keep the accepted prefix (a chunk keeps all and emits nothing). Decode rows
are never left out for a prefill while they fit. Invariants: every row is running
and distinct, no preempted request runs in the step that preempted it, at most
``max_num_seqs`` rows, at least one row whenever there is work (no stall), a
preempted or skipped request keeps its tokens and slot, and every request
finishes with exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dspark_ray.engine.request import Request, Status
from dspark_ray.engine.sampling_params import SamplingParams
from dspark_ray.engine.scheduler import Scheduler, SchedulerConfig

MAX_CONTEXT = 40
MAX_SPEC = 3


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler
        self.held: dict[str, int] = {}  # the simulated target: req_id -> KV positions held
        self.live: dict[str, Request] = {}
        self.done: list[Request] = []
        self.next_id = 0
        self.preemptions = 0

    @initialize(max_num_seqs=st.integers(1, 4), pool_extra=st.integers(0, 24), budget=st.integers(1, 64))
    def configure(self, max_num_seqs, pool_extra, budget):
        self.pool = MAX_CONTEXT + MAX_SPEC + pool_extra
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, budget, self.pool, MAX_CONTEXT, MAX_SPEC))

    @rule(prompt_len=st.integers(1, 30), max_tokens=st.integers(1, 20), k=st.integers(0, MAX_SPEC))
    def add(self, prompt_len, max_tokens, k):
        max_tokens = min(max_tokens, MAX_CONTEXT - prompt_len)
        if max_tokens < 1:
            return
        req = Request(f"r{self.next_id}", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                      seed=0, num_spec_tokens=k)
        self.next_id += 1
        self.live[req.req_id] = req
        self.sched.add(req)

    @precondition(lambda self: self.sched.has_work())
    @rule(data=st.data())
    def step(self, data):
        self._step(lambda k: data.draw(st.integers(0, k)))

    def _step(self, accepted_of) -> None:
        before = {r.req_id: (len(r.output_token_ids), r.status) for r in self.live.values()}
        plan = self.sched.schedule()
        rows = plan.requests
        k_of = {row.req.req_id: row.k for row in plan.rows}
        ids = [r.req_id for r in rows]
        assert rows, "work was waiting but the step scheduled nothing"
        assert len(ids) == len(set(ids)) <= self.sched.config.max_num_seqs
        assert all(r.status is Status.RUNNING and r in self.sched.running for r in rows)
        assert not set(ids) & {r.req_id for r in plan.preempted}, "a request ran in the step that preempted it"
        if plan.preempted:
            event(f"preempted with {len(rows)} rows")
        for r in plan.preempted:
            assert r.status is Status.PREEMPTED and r.target_len == 0 and r in self.sched.waiting
            self.held.pop(r.req_id, None)
            self.preemptions += 1
        for r in plan.admitted:
            assert before[r.req_id][1] is Status.WAITING
        fed = 0
        for r in rows:  # the target appends unseen + drafts for every row (a partial chunk: the chunk)
            k = k_of[r.req_id]
            assert 0 <= k <= min(r.num_spec_tokens, r.remaining_tokens() - 1)
            assert self.held.get(r.req_id, 0) == r.target_len
            if r.prefill_chunk:
                assert k == 0 and 1 <= r.prefill_chunk < r.num_tokens - r.target_len, "a chunk leaves the last token"
                self.held[r.req_id] = r.num_tokens - 1  # at most: a prefix cache may map all but the last
                fed += r.prefill_chunk
            else:
                self.held[r.req_id] = r.num_tokens + k
                fed += r.num_tokens - r.target_len + k
        assert fed <= self.sched.config.max_num_batched_tokens or len(rows) == 1, \
            f"{fed} tokens fed, the budget is {self.sched.config.max_num_batched_tokens}"
        if any(r.prefill_chunk for r in rows):
            event("chunked prefill")
        decoding = [r for r in self.sched.running if r.num_tokens - r.target_len == 1]
        if any(r.num_tokens - r.target_len > 1 for r in rows):  # a prefill (chunk) ran: no decode row waited
            assert all(r in rows for r in decoding), "a decode row waited while a prefill took the step"
        in_use = sum(self.held.values())
        assert in_use <= self.pool, f"the plan needs {in_use} KV tokens, the pool has {self.pool}"
        for r in rows:  # verification: keep the accepted prefix, emit accepted + 1
            if r.prefill_chunk:  # a partial chunk: KV kept, nothing emitted (the cache may have had more)
                r.target_len += r.prefill_chunk if accepted_of(1) else r.num_tokens - 1 - r.target_len
                self.held[r.req_id] = r.target_len
                r.prefill_chunk = 0
                continue
            k = k_of[r.req_id]
            accepted = accepted_of(k)
            old = r.num_tokens
            r.output_token_ids += [7] * (accepted + 1)
            r.target_len = self.held[r.req_id] = old + accepted
            if r.remaining_tokens() <= 0:
                self.sched.remove(r)
                self._finish(r)
        for r in self.live.values():  # skipped and preempted requests lost nothing
            assert len(r.output_token_ids) >= before.get(r.req_id, (0,))[0]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        req = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda r: r.req_id)))
        self.sched.remove(req)
        self._finish(req)

    def _finish(self, req: Request) -> None:
        assert req.remaining_tokens() >= 0, "emitted past max_tokens"
        self.held.pop(req.req_id, None)
        req.status = Status.FINISHED
        del self.live[req.req_id]
        self.done.append(req)

    @invariant()
    def queues_hold_exactly_the_live_requests(self):
        queued = [r.req_id for r in self.sched.waiting] + [r.req_id for r in self.sched.running]
        assert sorted(queued) == sorted(self.live), "a request is lost or queued twice"
        assert all(r.status in (Status.WAITING, Status.PREEMPTED) for r in self.sched.waiting)
        assert self.sched.kv_in_use() == sum(self.held.get(r.req_id, 0) for r in self.sched.running)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(500):  # drain: everything left must finish
            if not self.sched.has_work():
                break
            self._step(lambda k: k // 2)
        assert not self.sched.has_work() and not self.live


SchedulerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                              derandomize=True)
TestScheduler = SchedulerMachine.TestCase


def test_preempted_victim_is_not_rescheduled_in_the_same_step():
    """Hand-built: the victim preempted for one row must not be re-planned later in that step.

    Two rows fit, the third needs room: the newest request (20 KV tokens) is
    preempted, which frees more than the third row needs. The victim itself
    must wait, and the rows planned before the preemption keep their share.
    """
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, kv_pool_tokens=100,
                                      max_context=MAX_CONTEXT, max_spec_tokens=0))
    reqs = []
    for i, (prompt, out) in enumerate([(20, 5), (25, 6), (20, 5), (15, 6)]):
        r = Request(f"r{i}", list(range(prompt)), SamplingParams(max_tokens=15), seed=0, num_spec_tokens=0)
        r.output_token_ids = [1] * out
        r.status = Status.RUNNING
        r.target_len = r.num_tokens - 1
        sched.running.append(r)
        reqs.append(r)
    assert sched.kv_in_use() == 98
    plan = sched.schedule()
    assert [r.req_id for r in plan.preempted] == ["r3"]
    assert [r.req_id for r in plan.requests] == ["r0", "r1", "r2"]
    need = sum(r.num_tokens - r.target_len for r in plan.requests)
    assert sched.kv_in_use() + need <= 100
