"""Scheduler: which requests run this step (pure Python: no torch, no ray).

First come, first served. A step's batch is the running requests (rotated
when there are more than ``max_num_seqs``, so none starves) plus admissions
from the waiting queue while there is room in the batch, the token budget and
the target KV pool.

Chunked prefill: a step feeds at most ``max_num_batched_tokens`` target
tokens. Decode rows (one unseen token plus their drafts) are planned first;
what is left of the budget goes to prefills, and a prompt (or a preempted
request's recompute) that does not fit is fed in chunks over several steps:
a partial chunk (``Request.prefill_chunk``) commits its KV and emits nothing;
the chunk that reaches the last token emits the first one. The request keeps
its slot (it is running) between chunks. Requests that score their prompt
(``prompt_logprobs``) are not chunked. A first row always runs, so a budget
smaller than one decode row still makes progress. When the pool cannot hold the step, the most recently
admitted running request is preempted by recompute: its target KV is freed,
but it keeps its slot, its draft cache and every token it produced, and it
rejoins at the front of the waiting queue. A request left out of a step
keeps everything.

KV accounting bounds the target's pool: a request holds ``target_len``
tokens between steps and needs ``num_tokens - target_len + k`` more while a
step runs (the unseen tokens plus k drafts; a partial prefill reserves all
its unseen tokens, see ``need``). Prefix-cache blocks shared by several
requests are counted for each, so the pool always holds at least what this
accounting says is free.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from dspark_ray.engine.request import Request, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int  # rows per step
    max_num_batched_tokens: int  # target tokens fed per step (prefills beyond it are chunked)
    kv_pool_tokens: int  # usable tokens in the target KV pool
    max_context: int
    max_spec_tokens: int

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_pool_tokens", "max_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_spec_tokens < 0:
            raise ValueError(f"max_spec_tokens must be >= 0, got {self.max_spec_tokens}")


@dataclass(frozen=True)
class ScheduledRow:
    """One row of a step's batch: a request and the draft tokens it verifies this step."""

    req: Request
    k: int  # draft tokens proposed and verified: 0 for a prefill (chunk) and a request's first step


@dataclass
class StepPlan:
    rows: list[ScheduledRow] = field(default_factory=list)  # this step's batch, in row order
    admitted: list[Request] = field(default_factory=list)  # new: need a slot before the step
    preempted: list[Request] = field(default_factory=list)  # their target KV must be freed

    @property
    def requests(self) -> list[Request]:
        """The rows' requests, in row order."""
        return [row.req for row in self.rows]

    def drop(self, reqs: Collection[Request]) -> None:
        """Take ``reqs`` out of the batch (they did not get a slot, or ended before the step ran)."""
        self.rows = [row for row in self.rows if row.req not in reqs]


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._rotation = 0
        self._busy: Collection[str] = ()  # the other half's rows while a pipelined plan is made
        # The step's k under adaptive speculation (engine/adaptive.py), set before ``schedule``;
        # None: no step-wide limit.
        self.step_k: int | None = None

    # -- queue changes ---------------------------------------------------------

    def add(self, req: Request) -> None:
        assert req.status is Status.WAITING
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Drop a request (finished or aborted) from whichever queue holds it."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def preempt_all(self) -> list[Request]:
        """Every running request back to the front of the queue, in order, its target KV forgotten
        (the target failed): each keeps its slot, draft cache and output, and resumes by recompute."""
        victims, self.running = self.running, []
        for req in reversed(victims):
            req.status = Status.PREEMPTED
            req.target_len = req.prefill_chunk = 0
            self.waiting.appendleft(req)
        return victims

    def return_unadmitted(self, reqs: list[Request]) -> None:
        """Put admissions the slot service could not serve back at the queue front."""
        for req in reversed(reqs):
            self.running.remove(req)
            req.status = Status.WAITING
            self.waiting.appendleft(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def prefilling(self) -> int:
        """Running requests mid-prefill: their prompt (or recompute) is not all fed yet."""
        return sum(1 for r in self.running if r.num_tokens - r.target_len > 1)

    def kv_in_use(self) -> int:
        return sum(r.target_len for r in self.running)

    # -- planning ------------------------------------------------------------

    def spec_tokens_for(self, req: Request) -> int:
        """This step's k: the request's own, never past max_tokens or the context.

        A request's first step carries no drafts: its first token goes out after
        one target pass over the prompt instead of waiting for the draft to read
        the prompt and propose too (time to first token); the draft catches up
        on the prompt in the next step. The rule depends only on the request's
        own progress (not on preemption or the batch), so a request speculates,
        and samples, the same way whatever else runs.
        """
        if not req.output_token_ids:
            return 0
        room = min(req.remaining_tokens() - 1, self.config.max_context - req.num_tokens - 1)
        k = req.num_spec_tokens
        if req.acceptance is not None:  # adaptive: its own cap
            k = min(k, req.acceptance.cap)
        if req.batch_adapted and self.step_k is not None:  # the step's k (Engine._choose_k) unless it opted out
            k = min(k, self.step_k)
        return max(0, min(k, room))

    def need(self, req: Request) -> int:
        """Extra KV tokens ``req`` may take while this step runs. A partial prefill reserves all it
        has not fed, not only its chunk: the target's prefix cache may map more of the prompt at
        once (blocks no live request holds, which this accounting counts as free)."""
        if req.prefill_chunk:
            return req.num_tokens - req.target_len
        return req.num_tokens - req.target_len + self.spec_tokens_for(req)

    def _fit(self, req: Request, room: int, first: bool) -> int | None:
        """The row ``req`` takes with ``room`` budget tokens left: 0 for all it has not fed (and its
        drafts), n > 0 for a partial prefill chunk of n tokens, None if it waits this step."""
        unseen = req.num_tokens - req.target_len
        if unseen + self.spec_tokens_for(req) <= room:
            return 0
        if unseen > 1 and room >= 1 and req.params.prompt_logprobs is None:
            return min(unseen - 1, room)  # the last token comes in the chunk that emits
        return 0 if first else None

    def schedule(self, admit: bool = True, busy: Collection[str] = (), reserved: int = 0,
                 max_rows: int | None = None) -> StepPlan:
        """Plan one step. ``admit=False`` takes no new request (no slot is free), only resumptions.

        For a pipelined engine (two halves of the batch in flight at once):
        ``busy`` are the ids of running requests planned in the other half, which this
        plan neither takes nor preempts; ``reserved`` the KV tokens they hold
        on top of ``target_len`` while in flight; ``max_rows`` caps this half.
        """
        plan = StepPlan()
        rows: list[Request] = []  # the batch so far, in row order
        cfg = self.config
        kv_free = cfg.kv_pool_tokens - self.kv_in_use() - reserved
        max_rows = cfg.max_num_seqs if max_rows is None else min(max_rows, cfg.max_num_seqs)
        self._busy = busy
        tokens, full = 0, False
        running = self._rotated_running()
        # Decode rows first, then prefills in progress (chunked prompts, recomputes).
        running = [r for r in running if r.num_tokens - r.target_len <= 1] + \
                  [r for r in running if r.num_tokens - r.target_len > 1]
        for req in running:
            if len(rows) >= max_rows:
                break
            if req.status is not Status.RUNNING or req.req_id in busy:  # preempted earlier in this step: it waits
                continue
            # Only a request with committed KV continues in the slot it holds (new and preempted
            # ones come through the waiting queue; a chunk in flight is the other half's, busy).
            assert req.target_len > 0, f"{req.req_id} runs with no committed KV"
            chunk = self._fit(req, cfg.max_num_batched_tokens - tokens, first=not rows)
            if chunk is None:  # the budget is spent: no prefill may take what decode rows could not
                full = True
                break
            req.prefill_chunk = chunk
            need = self.need(req)
            while need > kv_free and (freed := self._preempt_one(plan, rows, protect=req)) is not None:
                kv_free += freed  # the rows planned so far keep what they reserved
            if need > kv_free:
                req.prefill_chunk = 0
                break
            kv_free -= need
            tokens += req.prefill_chunk or need
            rows.append(req)
        while self.waiting and len(rows) < max_rows and not plan.preempted and not full:
            req = self.waiting[0]
            if req.status is Status.WAITING and not admit:
                break
            chunk = self._fit(req, cfg.max_num_batched_tokens - tokens, first=not rows)
            if chunk is None:
                break
            req.prefill_chunk = chunk
            need = self.need(req)
            if need > kv_free:
                req.prefill_chunk = 0
                break
            self.waiting.popleft()
            if req.status is Status.WAITING:
                plan.admitted.append(req)
            req.status = Status.RUNNING
            self.running.append(req)
            kv_free -= need
            tokens += req.prefill_chunk or need
            rows.append(req)
        plan.rows = [ScheduledRow(r, 0 if r.prefill_chunk else self.spec_tokens_for(r)) for r in rows]
        return plan

    def _rotated_running(self) -> list[Request]:
        n = len(self.running)
        if n <= self.config.max_num_seqs:
            return list(self.running)
        self._rotation = (self._rotation + self.config.max_num_seqs) % n
        return self.running[self._rotation:] + self.running[: self._rotation]

    def _preempt_one(self, plan: StepPlan, planned: list[Request], protect: Request) -> int | None:
        """Preempt the newest running request other than ``protect`` and those already ``planned``.

        Returns the KV tokens it frees, or None when there is no victim.
        """
        for victim in reversed(self.running):
            if victim is protect or victim in planned or victim.req_id in self._busy:
                continue
            freed = victim.target_len
            self.running.remove(victim)
            victim.status = Status.PREEMPTED
            victim.target_len = victim.prefill_chunk = 0
            self.waiting.appendleft(victim)
            plan.preempted.append(victim)
            return freed
        return None
