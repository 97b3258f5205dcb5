"""Engine: the speculative-decoding step loop.

NOTE: the algorithm. Each request owns one slot from admission to its end;
every per-request buffer on the draft and target side is indexed by it. Per
step:

1. schedule   pick this step's rows (running + admitted), preempting by
              recompute if the target KV pool cannot hold the step;
2. lease      one slot-service call allocates slots for all admissions;
3. propose    one draft call: each speculating row rolls its draft cache back
              to what was accepted, catches up on unseen tokens and drafts k;
4. verify     one target call: each row feeds its unseen tokens plus drafts,
              the target scores k+1 positions, and the acceptance rule keeps
              the longest valid draft prefix plus one recovered or bonus token
              (greedy: the target's argmax, so output equals target-only
              greedy decoding; sampled: Leviathan et al.'s rejection sampling,
              so output follows the target distribution). A request's logits
              rules (penalties, logit_bias, min_tokens, min_p) shape the
              target's distribution at every scored position, and the draft's
              the same way; the rows carry the request's own output, so this
              state is per request, never per batch row. Log-probabilities
              reported to callers are read off the same pass, from the raw logits;
5. commit     append emitted tokens, apply stop conditions, record
              speculation statistics, advance target and draft lengths;
6. release    one slot-service call frees the slots of requests that ended
              (sent without waiting for its answer while other requests run,
              where the service can); their target KV is freed in the next
              target call.

When the target's one rank holds the (independent) draft proposer, steps 3
and 4 are one target call: the step carries its proposal rows
(``TargetStep.propose``), the target drafts them and verifies the drafts in
the same process, and the result names the drafts verified (rows with a
grammar keep two calls: their masks are computed here, from the drafts).

A DSpark block drafter (engine/dspark_proposer.py) builds its context from
the target's hidden states: the target returns them for the positions each
row committed (``VerifyResult.context``), the request keeps them
(``Request.context``) and its next proposal carries them to the draft
(``ProposeRow.context``), which lets go of them only once that proposal came
back. They are kept by request, never by batch row; a preempted request's
recompute sends them again from position 0, replacing what was kept. Served,
target rank 0 sends them to the draft worker itself (runtime/context_push.py):
the result then carries only which message held them
(``VerifyResult.context_push``), and the row's next proposal names it.

Speculation is only an accelerator: if the draft service fails, the step runs
without drafts and output is unchanged. If the target fails, no request is
lost either: the running ones are preempted by recompute (slot, draft cache
and output kept) and resume on the target that replaces it
(``reset_target``); randomness being a function of seed and position, they
produce exactly what they would have.

NOTE: pipelined steps. When the draft and the target run in other processes
(services with ``propose_async``/``step_async``: the Ray actors), the draft
would idle while the target verifies and the target while the draft
proposes. A pipelined engine keeps the batch in two halves and every ``step``
does both at once: it verifies the half drafted in the previous step while
it drafts the other half (scheduled, leased and sampled now), then commits
the verified half. A request is in at most one call at a time, so its
draft and target lengths are always those its last commit left; it
speculates and samples exactly as in the sequential engine (randomness is
a function of seed and position), so output is the same. A drafted request
is not preempted before its verification (its KV need is held for it), and
one that ends in between (abort) is dropped from the verification. (So a
DSpark request's context states, committed with its verification, go out
with its next proposal, a later step: never lost, never sent twice.) Both
calls are always collected before ``step`` returns, so between steps nothing
is in flight. New requests join the half being drafted; the halves are
balanced (neither takes more than half of the runnable requests), and with a
single request the steps simply alternate between drafting and verifying it.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dspark_ray.engine.adaptive import POPULATION_DECAY, Acceptance, SpecController, confident_drafts
from dspark_ray.engine.config import EngineConfig
from dspark_ray.engine.detokenizer import OutputText
from dspark_ray.engine.errors import InvalidRequest
from dspark_ray.engine.interfaces import (
    DraftService,
    GrammarRow,
    LogitsRules,
    Proposal,
    ProposeRow,
    SamplingRow,
    SlotService,
    TargetService,
    TargetStep,
    VerifyResult,
    VerifyRow,
)
from dspark_ray.engine.outputs import RequestOutput, SpecSummary, TokenLogprob
from dspark_ray.engine.request import ErrorCode, FinishReason, Request, Status
from dspark_ray.engine.sampling_params import SamplingParams
from dspark_ray.engine.scheduler import Scheduler, SchedulerConfig, StepPlan
from dspark_ray.engine.structured import GRAMMAR_ERROR, GrammarCompiler, GrammarError
from dspark_ray.slots import SlotLease, SlotsExhausted
from dspark_ray.tokenizer import Tokenizer

log = logging.getLogger(__name__)


# What a request that a failure ended reports (clients see it; the details are in the log).
TARGET_FAILED = ("target failed: the target model stopped while this request ran and could not be restarted "
                 "in time; retry the request")
ENGINE_FAILED = "engine failed: an internal error ended this request; retry the request"


@dataclass
class StepTimings:
    """Seconds spent in each phase of the last step."""

    schedule: float = 0.0
    propose: float = 0.0
    verify: float = 0.0
    commit: float = 0.0
    rows: int = 0


@dataclass
class _Drafted:
    """The half of the batch drafted in the last pipelined step, to verify in the next."""

    plan: StepPlan
    sampling: dict[str, SamplingRow]
    drafts: dict[str, tuple[list[int], torch.Tensor | None]]
    reserved: dict[str, int]  # req_id -> KV tokens its verification may add
    steady: bool  # every row decoding (its step times teach adaptive speculation)
    masks: dict[str, torch.Tensor] = field(default_factory=dict)  # structured outputs' masks, computed already


class TargetUnavailable(RuntimeError):
    """The target failed and has not been replaced yet (``Engine.reset_target``)."""


class DraftFailed(RuntimeError):
    """The proposer of a target that drafts its own steps failed (VerifyResult.draft_error): the step
    was verified without drafts."""


@dataclass
class EngineCounters:
    steps: int = 0
    draft_failures: int = 0
    target_failures: int = 0
    resumed_after_target_failure: int = 0  # requests that lost their KV to a target failure and resumed
    preemptions: int = 0  # requests whose target KV was freed to make room (recomputed later)
    prefill_chunks: int = 0  # partial prefill chunks run (long prompts split over steps)
    prefix_cache_query_tokens: int = 0  # prompt tokens of prefills that could use the prefix cache
    prefix_cache_hit_tokens: int = 0  # of them, found in the target's prefix cache (not computed)
    grammar_cut_drafts: int = 0  # draft tokens a structured output's grammar forbade (never verified)
    confidence_cut_drafts: int = 0  # draft tokens the draft's confidence head expected rejected (never verified)
    spec_k_steps: dict[int, int] = field(default_factory=dict)  # adaptive speculation: steps that chose each k
    finished: dict[str, int] = field(default_factory=dict)


class Engine:
    """Turns requests into tokens through a slot service, a draft and a target."""

    SLOT_RETRY_S = 0.05

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer,
        slots: SlotService,
        target: TargetService,
        draft: DraftService | None,
        owner: str = "engine",
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.slots, self.target, self.draft = slots, target, draft
        self.owner = owner
        self.max_spec_tokens = config.spec_tokens if draft is not None else 0
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            kv_pool_tokens=target.kv_capacity(),
            max_context=config.max_context,
            max_spec_tokens=self.max_spec_tokens,
        ))
        self.requests: dict[str, Request] = {}
        self._texts: dict[str, OutputText] = {}
        self._pending: list[RequestOutput] = []  # outputs produced between steps (aborts)
        self._release_target: list[int] = []
        self._release_leases: list[tuple[str, int]] = []
        self.timings = StepTimings()
        self.counters = EngineCounters()
        # After the slot service ran out, new admissions wait until this engine frees a
        # slot or SLOT_RETRY_S passes (another replica may free one), instead of asking every step.
        self._admissions_paused_until = 0.0
        # The application's drain switch as the last slot heartbeat reported it (the serving layer
        # then admits no new requests; the engine itself runs what it has).
        self.app_draining = False
        self.target_error: Exception | None = None  # set when a target step failed; see reset_target
        self.target_failed_at = 0.0  # time.monotonic() of the last target failure
        # Pipelined steps (module docstring) when both remote services can take a call and
        # return before it is done.
        self.pipelined = (config.pipeline and draft is not None and hasattr(draft, "propose_async")
                          and hasattr(target, "step_async"))
        self._drafted: _Drafted | None = None
        # A DSpark draft reads at most this many context positions before a block (None: all).
        self.context_window: int | None = getattr(draft, "context_window", None)
        self._grammar_compiler: GrammarCompiler | None = None
        self._deadlines = 0  # requests ever given a deadline (expire() has nothing to do without one)
        # Adaptive speculation (engine/adaptive.py): each step's k, from acceptance and step times.
        self.spec_controller = (SpecController(self.max_spec_tokens)
                                if config.adaptive_speculation and self.max_spec_tokens > 0 else None)
        if self.spec_controller is not None:
            self.counters.spec_k_steps = self.spec_controller.chosen
        # Every verification of the requests that adapt to the batch: a new one starts from what
        # this engine's traffic has been accepting lately, not from a guess.
        self.population = Acceptance(self.max_spec_tokens, decay=POPULATION_DECAY)

    # -- requests ------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        req_id: str | None = None,
        deadline: float | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Raises InvalidRequest, changing nothing.

        ``deadline`` (a ``time.monotonic()`` reading): a request still unfinished then is ended
        with an error (``ErrorCode.TIMEOUT``), its slot and KV freed, whether it waits, runs or
        waits for a rebuilt target (``expire``)."""
        params = params or SamplingParams()
        req_id = req_id or uuid.uuid4().hex
        if req_id in self.requests:
            raise InvalidRequest("request_id", f"{req_id!r} is already in flight")
        ids = self.check(prompt, params)
        k = self.max_spec_tokens if params.speculative else 0
        if params.num_speculative_tokens is not None:
            k = min(k, params.num_speculative_tokens)
        seed = params.seed if params.seed is not None else random.SystemRandom().getrandbits(63)
        req = Request(req_id=req_id, prompt_token_ids=ids, params=params, seed=seed, num_spec_tokens=k,
                      deadline=deadline)
        if deadline is not None:
            self._deadlines += 1
        # A k the request fixed itself is kept; a seeded sampled request adapts to its own acceptance
        # only, so its tokens do not depend on what else runs (adaptive.py): neither takes the step's
        # k (adaptive speculation's, or 0 above speculation_max_batch).
        req.batch_adapted = bool(k) and params.num_speculative_tokens is None and (params.greedy or params.seed is None)
        if self.spec_controller is not None and k and params.num_speculative_tokens is None:
            # A seeded sampled request starts from the fixed prior: nothing of other requests
            # may decide its k (its tokens depend on it).
            req.acceptance = Acceptance(k, self.population.rates()[:k] if req.batch_adapted else None)
        if params.structured is not None:
            req.grammar = self.grammar_compiler.matcher(self.grammar_compiler.check(params.structured))
        self.requests[req_id] = req
        self._texts[req_id] = OutputText(self.tokenizer, params.stop, params.skip_special_tokens,
                                         params.include_stop_str_in_output)
        self.scheduler.add(req)
        return req_id

    def check(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids (truncated as asked) if this engine can run the request.

        Changes nothing; raises InvalidRequest naming the field. ``add_request``
        calls it, and a caller submitting several requests at once can call it
        for all of them first, so that a bad one leaves none behind.
        """
        if params.n != 1:
            raise InvalidRequest("n", "an engine request is one sample: add params.samples() one by one")
        ids = self._prompt_ids(prompt, params.truncate_prompt_tokens)
        if len(ids) + params.max_tokens > self.config.max_context:
            raise InvalidRequest(
                "max_tokens",
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"of {self.config.max_context} tokens; lower max_tokens or shorten the prompt",
            )
        vocab = self.tokenizer.vocab_size
        if any(t >= vocab for t, _ in params.logit_bias):
            raise InvalidRequest("logit_bias", f"token ids must be in [0, {vocab})")
        if params.structured is not None:
            self.grammar_compiler.check(params.structured)
        return ids

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Structured outputs' compiler for this tokenizer (built on first use)."""
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler.of(self.tokenizer)
        return self._grammar_compiler

    def _prompt_ids(self, prompt: str | Sequence[int], truncate: int | None = None) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.tokenizer.vocab_size
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
                raise InvalidRequest("prompt", f"token ids must be integers in [0, {vocab})")
        if not ids:
            raise InvalidRequest("prompt", "the prompt is empty")
        if truncate is not None:
            ids = ids[-truncate:]  # the prompt's end is kept, as vLLM does
        if len(ids) >= self.config.max_context:
            raise InvalidRequest(
                "prompt",
                f"the prompt has {len(ids)} tokens; the context holds {self.config.max_context} "
                "including at least one output token",
            )
        return ids

    def abort(self, req_id: str, reason: FinishReason = FinishReason.ABORT, error: str | None = None,
              code: ErrorCode | None = None) -> bool:
        """End a request now (client gone, cancelled). Returns False if it is unknown or finished."""
        req = self.requests.get(req_id)
        if req is None or req.finished:
            return False
        self.scheduler.remove(req)
        req.error = error
        req.error_code = (code or ErrorCode.ENGINE_ERROR).value if reason is FinishReason.ERROR else None
        self._finish(req, reason)
        self._pending.append(self._output(req, [], ""))
        self._flush_releases()
        return True

    def sync_slots(self) -> int:
        """Heartbeat to the slot service with every lease this engine holds.

        After a slot-manager restart this re-registers the leases; a lease
        that someone else took meanwhile ends its request with an error (its
        slot is no longer its own). Returns the number of requests so ended.
        """
        leases = [SlotLease(r.req_id, r.slot, r.epoch, self.owner) for r in self.requests.values() if r.holds_slot]
        result = self.slots.sync(self.owner, leases)
        self.app_draining = result.draining
        for lease in result.conflicts:
            self.abort(lease.req_id, FinishReason.ERROR, error="its slot was lost while the slot manager restarted",
                       code=ErrorCode.SLOT_LOST)
        return len(result.conflicts)

    def fail_all(self, error: str, code: ErrorCode = ErrorCode.ENGINE_ERROR) -> None:
        """End every request in flight with an error (the target lost its KV, say); nothing leaks."""
        for req_id in list(self.requests):
            self.abort(req_id, FinishReason.ERROR, error=error, code=code)
        self._drafted = None

    def expire(self, now: float | None = None) -> int:
        """End the requests past their deadline (``add_request``); returns how many. ``step`` calls
        it; a server loop also calls it while no step runs (a target being rebuilt)."""
        if not self._deadlines:
            return 0
        now = time.monotonic() if now is None else now
        late = [r for r in self.requests.values() if r.deadline is not None and now >= r.deadline]
        for r in late:
            waited = now - r.arrival_time
            self.abort(r.req_id, FinishReason.ERROR, code=ErrorCode.TIMEOUT, error=(
                f"request timeout: not finished {waited:.1f} s after it arrived ({len(r.output_token_ids)} "
                "tokens generated); retry with a longer timeout_s, fewer max_tokens, or when the server is "
                "less busy"))
        return len(late)

    def reset_target(self, target: TargetService) -> None:
        """Swap in a rebuilt target (after a step failed); the requests that waited resume."""
        assert not self.scheduler.running, "requests still hold KV on the failed target"
        self.target = target
        # _release_target keeps every slot that had KV: the next step frees them on ``target``
        # (nothing, if it is a fresh one), so the resumed requests bind their slots anew.
        self.target_error = None
        self._drafted = None
        # A draft held by target rank 0 (draft_placement: target) was rebuilt with it, its window cache
        # empty: every request catches the draft up from its first token, so that its next proposal
        # drafts instead of finding the cache behind (a step without drafts would change a sampled
        # request's tokens). A draft worker of its own still has its cache; this costs it one catch-up.
        for r in self.requests.values():
            r.draft_len = 0

    def take_pending(self) -> list[RequestOutput]:
        """Outputs produced outside a step (aborts), without stepping."""
        outputs, self._pending = self._pending, []
        return outputs

    def has_unfinished(self) -> bool:
        """Requests in flight, or outputs (of aborts) not yet returned by ``step``."""
        return self.scheduler.has_work() or bool(self._pending)

    # -- the step ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request that progressed or ended."""
        if self.target_error is not None:
            raise TargetUnavailable(f"the target failed ({self.target_error!r}); reset_target must replace it")
        self.expire()
        if self.pipelined:
            return self._pipelined_step()
        outputs, self._pending = self._pending, []
        t0 = time.perf_counter()
        self._choose_k()
        plan = self._plan()
        t1 = time.perf_counter()
        if not plan.rows:
            self._flush_releases()
            return outputs
        steady = self._steady(plan.requests)
        sampling = {r.req_id: self._sampling(r) for r in plan.requests}  # built once, sent to draft and target
        if self._target_drafts(plan):
            result, proposal = self._run_drafting_target(plan, sampling)
            t2 = t1 + (result.propose_s if result is not None else 0.0)  # one call: the proposal's share is "propose"
        else:
            proposal = self._run_speculation(plan, sampling)
            t2 = time.perf_counter()
            result = self._run_target(plan, proposal, sampling)
        return self._close_step(plan, proposal, result, outputs, steady, t0, t1, t2)

    def _close_step(self, plan: StepPlan, drafts: dict, result: VerifyResult | None, outputs: list[RequestOutput],
                    steady: bool, t0: float, t1: float, t2: float) -> list[RequestOutput]:
        """Commit one target call's ``result`` for ``plan``, free what ended, time the step."""
        t3 = time.perf_counter()
        if result is not None:
            outputs += self._commit(plan, drafts, result)
        self._flush_releases()
        t4 = time.perf_counter()
        self.timings = StepTimings(t1 - t0, t2 - t1, t3 - t2, t4 - t3, len(plan.rows))
        self.counters.steps += 1
        if steady and result is not None:
            self._observe_step(len(plan.rows), t4 - t0)
        return outputs

    # -- adaptive speculation (engine/adaptive.py) ------------------------------

    def _choose_k(self) -> None:
        """The coming step's k, for the requests that adapt to the batch: 0 above
        ``speculation_max_batch``, else adaptive speculation's choice (None: each its own k)."""
        s = self.scheduler
        cap = self.config.speculation_max_batch
        if cap is None and self.spec_controller is None:
            return  # step_k stays None: every request drafts its own k
        batch = min(len(s.running) + len(s.waiting), self.config.max_num_seqs)
        if cap is not None and batch > cap:
            s.step_k = 0
            return
        if self.spec_controller is None:
            s.step_k = None
            return
        expected = [0.0] * (self.max_spec_tokens + 1)
        for r in s.running:
            a = r.acceptance
            if a is not None and r.batch_adapted:
                top = min(a.cap, r.num_spec_tokens)
                for k in range(len(expected)):
                    expected[k] += a.expected[min(k, top)]
        if self.pipelined:
            # A pipelined step commits one half of the batch; at k = 0 it runs the whole batch at
            # once (_whole_batch_step): per step, drafting is worth half its tokens.
            expected[1:] = [e / 2 for e in expected[1:]]
        s.step_k = self.spec_controller.choose(batch, expected) if any(expected) else None

    @staticmethod
    def _steady(rows: list[Request]) -> bool:
        """Every row decodes (no prompt or recompute being fed): a step whose time says what k costs."""
        return all(r.num_tokens - r.target_len <= 1 and r.output_token_ids for r in rows)

    def _observe_step(self, rows: int, seconds: float) -> None:
        if self.spec_controller is not None and self.scheduler.step_k is not None:
            self.spec_controller.observe(rows, self.scheduler.step_k, seconds)

    def _plan(self, drafted: _Drafted | None = None, busy: set[str] = frozenset(),
              max_rows: int | None = None) -> StepPlan:
        """Schedule this step's rows (besides ``drafted``, the other half in flight), free the KV
        of those preempted, lease slots for the admitted."""
        plan = self.scheduler.schedule(
            admit=time.monotonic() >= self._admissions_paused_until, busy=busy,
            reserved=sum(drafted.reserved.values()) if drafted else 0, max_rows=max_rows)
        self.counters.preemptions += len(plan.preempted)
        self._release_target.extend(r.slot for r in plan.preempted)
        self._lease_slots(plan)
        return plan

    def _lease_slots(self, plan: StepPlan) -> None:
        """One call for all admissions; under exhaustion, admit those that fit."""
        if not plan.admitted:
            return
        ids = [r.req_id for r in plan.admitted]
        try:
            leases = self.slots.allocate_many(ids, self.owner)
        except SlotsExhausted:
            leases = []
            for req_id in ids:
                try:
                    leases += self.slots.allocate_many([req_id], self.owner)
                except SlotsExhausted:
                    break
        for req, lease in zip(plan.admitted, leases):
            req.slot, req.epoch = lease.slot, lease.epoch
            req.target_len = req.draft_len = 0
        left = plan.admitted[len(leases):]
        if left:
            self._admissions_paused_until = time.monotonic() + self.SLOT_RETRY_S
            self.scheduler.return_unadmitted(left)
            plan.drop(left)

    def _sampling(self, req: Request) -> SamplingRow:
        p = req.params
        return SamplingRow(p.temperature, p.top_p, p.top_k, req.seed, p.min_p, self._rules(req))

    def _rules(self, req: Request) -> LogitsRules | None:
        """The request's logits rules with its history (see LogitsRules); None if it has none."""
        p = req.params
        if not p.has_rules:
            return None
        stop_ids = ()
        if p.min_tokens and len(req.output_token_ids) < p.min_tokens:
            eos = () if p.ignore_eos else tuple(sorted(self.tokenizer.eos_token_ids))
            stop_ids = eos + p.stop_token_ids
        prompt_ids = req.distinct_prompt_ids if p.repetition_penalty != 1.0 else ()
        return LogitsRules(p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias,
                           p.min_tokens, stop_ids, prompt_ids, tuple(req.output_token_ids))

    def _run_speculation(self, plan: StepPlan, sampling: dict[str, SamplingRow]
                         ) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """Draft tokens (and their q rows) per request id; empty when nothing speculates."""
        if self.draft is None:
            return {}
        return self._collect_proposal(self._send_proposal(plan, sampling, self.draft.propose))

    def _target_drafts(self, plan: StepPlan) -> bool:
        """The target drafts this step itself (TargetStep.propose): it holds the proposer and no row
        has a grammar (whose masks the engine computes from the drafts before verification)."""
        return (self.draft is not None and getattr(self.target, "drafts", False)
                and all(r.grammar is None for r in plan.requests))

    def _run_drafting_target(self, plan: StepPlan, sampling: dict[str, SamplingRow]
                             ) -> tuple[VerifyResult | None, dict[str, tuple[list[int], None]]]:
        """Propose and verify in one target call; the drafts verified per request id (as
        ``_run_speculation`` gives them, without q: it stayed in the target)."""
        proposing = self._propose_rows(plan, sampling)
        if proposing is None:
            return self._run_target(plan, {}, sampling), {}
        rows, sent, propose_rows = proposing
        batch = dataclasses.replace(self._target_batch(plan, {}, sampling, {}), propose=propose_rows)
        try:
            result = self.target.step(batch)
        except Exception as exc:
            self._target_failed(exc, batch.release_slots)
            return None, {}
        if result.drafts is None:
            return result, self._draft_failed(rows, DraftFailed(result.draft_error))
        for r, context in zip(rows, sent):
            if r.context is context:
                r.context = None
        return result, {r.req_id: (toks, None) for r, toks in zip(rows, result.drafts)}

    def _run_target(self, plan: StepPlan, drafts: dict, sampling: dict[str, SamplingRow],
                    masks: dict[str, torch.Tensor] | None = None) -> VerifyResult | None:
        batch = self._target_batch(plan, drafts, sampling, masks)
        try:
            return self.target.step(batch)
        except Exception as exc:
            self._target_failed(exc, batch.release_slots)
            return None

    def _target_batch(self, plan: StepPlan, drafts: dict, sampling: dict[str, SamplingRow],
                      masks: dict[str, torch.Tensor] | None = None) -> TargetStep:
        """The target call for ``plan``'s rows; takes the pending target releases along.
        ``masks``: the structured-output rows' masks if they were computed already."""
        allowed = self._grammar_masks(plan, drafts) if masks is None else masks
        rows, probs = [], None
        if any(q is not None for _, q in drafts.values()):
            some_q = next(q for _, q in drafts.values() if q is not None)
            probs = torch.zeros((len(plan.rows), *some_q.shape), dtype=some_q.dtype, device=some_q.device)
        for i, r in enumerate(plan.requests):
            toks, q = drafts.get(r.req_id, ([], None))
            # The prompt is scored when it is first fed (not again after a preemption's recompute).
            score_prompt = r.params.prompt_logprobs if r.target_len == 0 and r.prompt_logprobs is None else None
            rows.append(VerifyRow(r.slot, r.epoch, r.target_len, r.tokens_from(r.target_len), tuple(toks),
                                  sampling[r.req_id], r.params.logprobs, score_prompt, allowed.get(r.req_id),
                                  r.prefill_chunk, r.params.prefix_cache, r.params.cache_salt))
            if q is not None:
                probs[i] = q
        release, self._release_target = self._release_target, []
        return TargetStep(rows, probs, release)

    def _grammar_masks(self, plan: StepPlan, drafts: dict) -> dict[str, torch.Tensor]:
        """Structured-output rows: the grammar's bitmasks at each scored position (structured.py).

        A draft is cut at its first token the grammar forbids (``drafts`` is
        updated, so the commit counts what was verified). A request whose
        grammar allows no token at all ends here with an error, and leaves
        the plan."""
        masks = {}
        for r in [r for r in plan.requests if r.grammar is not None and not r.prefill_chunk]:
            toks, q = drafts.get(r.req_id, ([], None))
            try:
                masks[r.req_id], n = r.grammar.masks(toks)
            except GrammarError as exc:
                plan.drop([r])
                drafts.pop(r.req_id, None)
                self.scheduler.remove(r)
                r.error = f"{GRAMMAR_ERROR} {exc}"
                r.error_code = ErrorCode.STRUCTURED_OUTPUT.value
                self._finish(r, FinishReason.ERROR)
                self._pending.append(self._output(r, [], ""))
                continue
            if n < len(toks):
                drafts[r.req_id] = (toks[:n], q)
                if not (n and toks[n - 1] in self.tokenizer.eos_token_ids):  # not just the tokens past an EOS
                    self.counters.grammar_cut_drafts += len(toks) - n
        return masks

    def _target_failed(self, exc: Exception, release: list[int]) -> None:
        """The target's KV can no longer be trusted, but no request is lost: every running
        request is preempted by recompute (it keeps its slot, draft cache and output) and
        resumes once ``reset_target`` has put in a rebuilt target. Until then ``step`` raises
        TargetUnavailable. The exception (worker names, ranks, remote tracebacks) goes to
        the log with the ids of the requests that wait."""
        waiting = self.scheduler.preempt_all()
        log.error("target step failed; %d requests wait for a rebuilt target: %s", len(waiting),
                  [r.req_id for r in waiting], exc_info=exc)
        self.target_error = exc
        self.target_failed_at = time.monotonic()
        self.counters.target_failures += 1
        self.counters.resumed_after_target_failure += len(waiting)
        # Every slot's KV goes, on whichever target comes next (a release of what a fresh
        # target does not hold is harmless); a recomputed request binds its slot anew.
        self._release_target[:0] = release + [r.slot for r in waiting]
        self._drafted = None

    # -- pipelined steps (module docstring) -----------------------------------------

    def _pipelined_step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        t0 = time.perf_counter()
        drafted = self._take_drafted()
        busy = {r.req_id for r in drafted.plan.requests} if drafted else set()
        self._choose_k()
        if self.scheduler.step_k == 0:
            return self._whole_batch_step(drafted, busy, outputs, t0)
        plan = self._plan(drafted, busy, self._half_rows(len(busy)))
        t1 = time.perf_counter()
        if not plan.rows and drafted is None:
            self._flush_releases()
            return outputs
        sampling = {r.req_id: self._sampling(r) for r in plan.requests}
        reserved = {r.req_id: self.scheduler.need(r) for r in plan.requests}
        steady = self._steady(plan.requests) and (drafted is None or drafted.steady)
        # Both calls go out before either is waited for.
        proposing = self._send_proposal(plan, sampling, self.draft.propose_async)
        verifying = batch = None
        if drafted is not None:
            batch = self._target_batch(drafted.plan, drafted.drafts, drafted.sampling, drafted.masks)
            try:
                verifying = self.target.step_async(batch)
            except Exception as exc:  # noqa: BLE001 - the send itself failed
                verifying = exc
        # The draft's reply first: the structured-output masks of the rows it drafted (for their
        # verification next step) are computed while the target may still be verifying.
        drafts = self._collect_proposal(proposing)
        masks = self._grammar_masks(plan, drafts) if any(r.grammar is not None for r in plan.requests) else {}
        t2 = time.perf_counter()
        result = None
        if isinstance(verifying, Exception):
            error = verifying
        else:
            error = None
            if verifying is not None:
                try:
                    result = verifying.result()
                except Exception as exc:  # noqa: BLE001 - handled below
                    error = exc
        t3 = time.perf_counter()
        if error is not None:
            self._target_failed(error, batch.release_slots)
        else:
            if drafted is not None:
                outputs += self._commit(drafted.plan, drafted.drafts, result)
            live = [r for r in plan.requests if not r.finished]
            if live:
                plan.drop([r for r in plan.requests if r.finished])
                self._drafted = _Drafted(plan, sampling, drafts, {r.req_id: reserved[r.req_id] for r in live},
                                         self._steady(live),
                                         {k: v for k, v in masks.items() if k in {r.req_id for r in live}})
        self._flush_releases()
        t4 = time.perf_counter()
        # In a pipelined step propose and verify overlap: "propose" is the wait for the draft
        # (and the masks of what it drafted), "verify" only the wait for the target beyond it.
        self.timings = StepTimings(t1 - t0, t2 - t1, t3 - t2, t4 - t3, len(plan.rows) + len(busy))
        self.counters.steps += 1
        if steady and error is None and (plan.rows or drafted is not None):
            # (With one request the steps alternate: one drafts it, the next verifies it.)
            self._observe_step(len(plan.rows) + len(busy), t4 - t0)
        return outputs

    def _whole_batch_step(self, drafted: _Drafted | None, busy: set[str], outputs: list[RequestOutput],
                          t0: float) -> list[RequestOutput]:
        """Adaptive speculation chose k = 0: nothing to overlap, so one target call verifies the
        half drafted last step (if any) together with every other row this step takes, and the
        pipeline starts again from empty. (Rows that speculate whatever the step's k, a fixed
        num_speculative_tokens or a seeded sampled request, are drafted first, in this step.)"""
        plan = self._plan(drafted, busy, self.config.max_num_seqs - len(busy))
        t1 = time.perf_counter()
        if not plan.rows and drafted is None:
            self._flush_releases()
            return outputs
        steady = self._steady(plan.requests) and (drafted is None or drafted.steady)
        sampling = {r.req_id: self._sampling(r) for r in plan.requests}
        drafts = self._run_speculation(plan, sampling)
        masks = self._grammar_masks(plan, drafts) if any(r.grammar is not None for r in plan.requests) else {}
        t2 = time.perf_counter()
        if drafted is not None:
            plan.rows[:0] = drafted.plan.rows
            sampling.update(drafted.sampling)
            drafts.update(drafted.drafts)
            masks.update(drafted.masks)
        result = self._run_target(plan, drafts, sampling, masks)
        return self._close_step(plan, drafts, result, outputs, steady, t0, t1, t2)

    def _take_drafted(self) -> _Drafted | None:
        """Last step's drafted half, without the requests that ended since."""
        drafted, self._drafted = self._drafted, None
        if drafted is None:
            return None
        drafted.plan.drop([r for r in drafted.plan.requests if r.status is not Status.RUNNING])
        if not drafted.plan.rows:
            return None
        keep = {r.req_id for r in drafted.plan.requests}
        drafted.reserved = {k: v for k, v in drafted.reserved.items() if k in keep}
        return drafted

    def _half_rows(self, busy: int) -> int:
        """Rows the half drafted now may take: half of the runnable requests (at least one)."""
        runnable = len(self.scheduler.running) - busy + len(self.scheduler.waiting)
        total = min(busy + runnable, self.config.max_num_seqs)
        return max(0, min(-(-total // 2), self.config.max_num_seqs - busy)) if busy else max(1, -(-total // 2))

    def _send_proposal(self, plan: StepPlan, sampling: dict[str, SamplingRow], call):
        """The draft call for ``plan``'s speculating rows through ``call`` (``propose`` or
        ``propose_async``): None if none speculates, else (rows, the context states sent with
        them, its reply: pending call or error)."""
        proposing = self._propose_rows(plan, sampling)
        if proposing is None:
            return None
        rows, sent, propose_rows = proposing
        try:
            return rows, sent, call(propose_rows)
        except Exception as exc:  # noqa: BLE001 - e.g. DraftUnavailable: handled with the reply
            return rows, sent, exc

    def _propose_rows(self, plan: StepPlan, sampling: dict[str, SamplingRow]
                      ) -> tuple[list[Request], list, list[ProposeRow]] | None:
        """``plan``'s speculating rows, the context states going with them, and their ProposeRows;
        None if none speculates."""
        speculating = [row for row in plan.rows if row.k > 0]
        if not speculating:
            return None
        rows = [row.req for row in speculating]
        alone = len(rows) == len(self.scheduler.running) == 1 and not self.scheduler.waiting
        propose_rows = []
        for row in speculating:
            r = row.req
            propose_rows.append(ProposeRow(
                r.slot, r.epoch, r.draft_len, r.tokens_from(r.draft_len), row.k, sampling[r.req_id],
                None if r.grammar is None else GrammarRow(r.grammar.source, tuple(r.output_token_ids)),
                r.context, alone, r.context_push))
        return rows, [r.context for r in rows], propose_rows

    def _collect_proposal(self, proposing) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        if proposing is None:
            return {}
        rows, sent, reply = proposing
        try:
            if isinstance(reply, Exception):
                raise reply
            proposal: Proposal = reply if isinstance(reply, Proposal) else reply.result()
        except Exception as exc:  # noqa: BLE001 - speculation is optional
            return self._draft_failed(rows, exc)  # the context states are sent again next time
        for r, context in zip(rows, sent):
            if r.context is context:  # the draft has them now
                r.context = None
        probs, confidence = proposal.draft_probs, proposal.confidence
        if not self.config.confidence_verification:
            confidence = None
        drafts = {}
        for i, r in enumerate(rows):
            toks = proposal.draft_token_ids[i]
            if confidence is not None and r.acceptance is not None:
                # Adaptive speculation on this block's own estimate (adaptive.confident_drafts), like a
                # request's own cap (a seeded sampled request's too: the estimate is of its own block);
                # a request that fixed its k verifies what it asked for. Its acceptance is then
                # recorded over the positions verified, the doubtful ones cut: it leans high.
                n = confident_drafts(confidence[i][:len(toks)])
                self.counters.confidence_cut_drafts += len(toks) - n
                toks = toks[:n]
            drafts[r.req_id] = (toks, None if probs is None else probs[i])
        return drafts

    def _draft_failed(self, rows: list[Request], exc: Exception) -> dict:
        """These rows run without drafts this time; their draft caches are rebuilt from scratch."""
        log.error("draft proposer failed; running without speculation", exc_info=exc)
        self.counters.draft_failures += 1
        for r in rows:
            r.draft_len = 0  # its cache state is unknown now: catch up from scratch next time
        return {}

    def _commit(self, plan: StepPlan, drafts: dict, result: VerifyResult) -> list[RequestOutput]:
        outputs = []
        for i, (r, accepted, emitted) in enumerate(zip(plan.requests, result.num_accepted, result.emitted)):
            if result.context is not None and result.context[i] is not None and r.num_spec_tokens:
                new = result.context[i]
                r.context = new.last(self.context_window) if r.context is None else \
                    r.context.then(new, self.context_window)
            if result.context_push is not None and r.num_spec_tokens:
                r.context_push = result.context_push  # the draft worker reads that message first
            if result.cached_tokens is not None and result.cached_tokens[i]:
                r.cached_tokens += result.cached_tokens[i]
                self.counters.prefix_cache_hit_tokens += result.cached_tokens[i]
            if r.target_len == 0 and r.params.prefix_cache:
                self.counters.prefix_cache_query_tokens += len(r.prompt_token_ids)
            if r.prefill_chunk:  # a partial prefill: its KV is committed, nothing is emitted yet
                r.target_len += result.prefilled[i]  # the chunk, and what the prefix cache had beyond it
                r.prefill_chunk = 0
                self.counters.prefill_chunks += 1
                continue
            k = len(drafts.get(r.req_id, ((), None))[0])
            old_len = r.num_tokens
            r.target_len = old_len + accepted
            if k:
                r.draft_len = old_len + min(accepted, k - 1)
            r.spec.record(k, accepted)
            if r.acceptance is not None:
                if k:
                    r.acceptance.record(k, accepted)
                    if r.batch_adapted:
                        self.population.record(k, accepted)
                elif r.req_id in drafts:
                    # Asked for drafts, offered none (prompt lookup found no match, or the grammar
                    # forbade the first): for what drafting yields a step, the first position missed.
                    # (Counted as idle, a proposer that often has nothing would look as good as its
                    # matches, and adaptive k would keep paying for steps that verify little.)
                    r.acceptance.record(1, 0)
                    if r.batch_adapted:
                        self.population.record(1, 0)
                else:
                    r.acceptance.idle()
            if result.prompt_logprobs is not None and result.prompt_logprobs[i] is not None:
                r.prompt_logprobs = result.prompt_logprobs[i]
            logprobs = result.logprobs[i] if result.logprobs is not None else None
            if r.params.max_tokens == 0:  # the prompt was scored; nothing is generated
                outputs.append(self._end_unsampled(r))
            else:
                outputs.append(self._append_tokens(r, emitted, logprobs))
        return outputs

    def _end_unsampled(self, req: Request) -> RequestOutput:
        self.scheduler.remove(req)
        self._finish(req, FinishReason.LENGTH)
        return self._output(req, [], "", [] if req.params.logprobs is not None else None)

    def _append_tokens(self, req: Request, emitted: list[int], logprobs: list[TokenLogprob] | None = None
                       ) -> RequestOutput:
        """Append tokens one by one until a stop condition; returns this step's output.

        Stop strings are checked after every token, like the other conditions,
        so a request ends on the same token whether this step emitted one token
        or k + 1 (the tokens after a stop are dropped, not output).
        """
        params, text = req.params, self._texts[req.req_id]
        new, new_text = [], ""
        reason, detail, cut = None, None, False
        for tok in emitted:
            new.append(tok)
            req.output_token_ids.append(tok)
            if req.grammar is not None:
                try:
                    req.grammar.accept(tok)
                except GrammarError as exc:  # the target's masks make this impossible; end cleanly if not
                    req.error = f"{GRAMMAR_ERROR} {exc}"
                    req.error_code = ErrorCode.STRUCTURED_OUTPUT.value
                    reason = FinishReason.ERROR
                    break
            if params.stop:
                piece, stop = text.push([tok], check_stop=len(req.output_token_ids) >= params.min_tokens)
                new_text += piece
                if stop is not None:
                    reason, detail, cut = FinishReason.STOP, stop, True
                    break
            if not params.ignore_eos and tok in self.tokenizer.eos_token_ids:
                reason, detail = FinishReason.STOP, tok
            elif tok in params.stop_token_ids:
                reason, detail = FinishReason.STOP, tok
            elif req.grammar is not None and req.grammar.complete:
                reason = FinishReason.STOP  # the output matches and the grammar allows nothing more
            elif req.remaining_tokens() <= 0 or req.num_tokens >= self.config.max_context:
                reason = FinishReason.LENGTH
            if reason:
                break
        if not params.stop:
            new_text, _ = text.push(new)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if reason:
            if not cut:
                new_text += text.finish()
            self.scheduler.remove(req)
            self._finish(req, reason, detail)
        return self._output(req, new, new_text, None if logprobs is None else logprobs[:len(new)])

    # -- endings ---------------------------------------------------------------

    def _finish(self, req: Request, reason: FinishReason, detail: str | int | None = None) -> None:
        if req.holds_slot:
            self._release_target.append(req.slot)
            self._release_leases.append((req.req_id, req.epoch))
        req.finish(reason, detail)
        self.counters.finished[reason.value] = self.counters.finished.get(reason.value, 0) + 1
        del self.requests[req.req_id]
        del self._texts[req.req_id]

    def _flush_releases(self) -> None:
        if self._release_leases:
            leases, self._release_leases = self._release_leases, []
            # While requests remain, the releases go out without a wait on the step path, where the
            # slot service can (release_many_nowait: the slot manager's actor, whose answer took 2 ms
            # a step at 32 rows on the 2-core box); this replica's next call to it comes after them.
            # The last ones before the engine idles are waited for, so an idle engine's slots are free.
            nowait = getattr(self.slots, "release_many_nowait", None)
            if nowait is not None and self.scheduler.has_work():
                nowait(leases)
            else:
                self.slots.release_many(leases)
            self._admissions_paused_until = 0.0
        if self._release_target and not self.scheduler.has_work():
            slots, self._release_target = self._release_target, []
            try:
                self.target.release(slots)
            except Exception:  # noqa: BLE001 - a broken target is rebuilt empty; its KV is moot
                log.exception("target release failed")

    def _output(self, req: Request, new: list[int], new_text: str,
                logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        s = req.spec
        prompt_logprobs = None
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
        return RequestOutput(
            req_id=req.req_id,
            new_token_ids=new,
            new_text=new_text,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_output_tokens=len(req.output_token_ids),
            finished=req.finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            stop_reason=req.stop_reason,
            error=req.error,
            error_code=req.error_code,
            spec=SpecSummary(s.drafts, s.draft_tokens, s.accepted_tokens, list(s.accepted_per_position),
                             s.mean_acceptance_length, list(s.steps_by_k)) if req.finished else None,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=req.cached_tokens,
        )
