"""The three services an engine talks to, and the plain data they exchange.

The engine drives one step as: slot service (admissions and releases, one
call each) -> draft service (one ``propose`` call) -> target service (one
``step`` call); services that can run calls elsewhere also offer
``propose_async``/``step_async``, and then the engine overlaps one half of
the batch's draft with the other half's verification. In one process these are plain objects; the serving layer puts
each behind Ray actors with the same methods, so the engine does not change.

Randomness is stateless: every random draw for a request is derived from
``(seed, position)``, so the draft proposer and every tensor-parallel rank of
the target reproduce the same draws without sharing generator state, and a
preempted or rescheduled request samples exactly what it would have.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from dspark_ray.engine.outputs import TokenLogprob
from dspark_ray.slots import SlotLease, SyncResult

T = TypeVar("T", covariant=True)


@dataclass(frozen=True)
class LogitsRules:
    """A request's logits rules and the history they depend on, sent with each step's row.

    The history travels with the row (it is the request's own output so far),
    so no service keeps per-request penalty state: a preempted, rescheduled or
    restarted request gets exactly the same rules, on every tensor-parallel
    rank and in the draft. At the row's j-th scored position the history is
    ``output_ids`` plus the row's first j draft tokens (a position only counts
    if those drafts were accepted).
    """

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()  # ruled out while fewer than min_tokens tokens are out (EOS, stop ids)
    prompt_ids: tuple[int, ...] = ()  # distinct prompt ids; sent only with a repetition penalty
    output_ids: tuple[int, ...] = ()  # the request's output so far


@dataclass(frozen=True)
class SamplingRow:
    """The sampling settings a service needs for one row."""

    temperature: float
    top_p: float
    top_k: int
    seed: int
    min_p: float = 0.0
    rules: LogitsRules | None = None  # None: the logits are used as the model gives them

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GrammarRow:
    """A structured-output row's grammar and the output it has matched so far (the draft's
    matcher for the slot is synced to it; see ``dspark_ray.engine.structured``)."""

    grammar: str
    output_ids: tuple[int, ...]


@dataclass(frozen=True)
class ContextStates:
    """A DSpark draft's context: the target's residual stream after the draft's target layers
    (``dspark_ray.model.dspark``), concatenated, at consecutive committed positions ``start ..``."""

    start: int
    states: torch.Tensor  # [n, n_taps * hidden]

    def __len__(self) -> int:
        return self.states.shape[0]

    @property
    def end(self) -> int:
        return self.start + len(self)

    def then(self, later: ContextStates, keep: int | None = None) -> ContextStates:
        """These positions followed by ``later``'s, which win where both have one (the target
        recomputed them after a preemption); after a gap only ``later``'s. At most the last
        ``keep`` positions are kept (a block reads no further back)."""
        if later.start <= self.start or later.start > self.end:
            merged = later
        else:
            merged = ContextStates(self.start, torch.cat((self.states[:later.start - self.start], later.states)))
        return merged.last(keep)

    def last(self, keep: int | None) -> ContextStates:
        """Only the last ``keep`` positions (all if None)."""
        if keep is None or len(self) <= keep:
            return self
        return ContextStates(self.end - keep, self.states[len(self) - keep:])


@dataclass(frozen=True)
class ProposeRow:
    """Ask the draft for ``num_draft`` tokens after ``token_ids``.

    The draft first cuts its cache for ``slot`` back to ``start`` positions
    (dropping rejected provisional tokens), then feeds ``token_ids`` at
    positions ``start ..`` (catching up on what the target accepted), then
    drafts. A new ``epoch`` for the slot means its cache is empty. (A DSpark
    draft reads only the last token, its block's anchor at position
    ``start + len(token_ids) - 1``, and ``context``.)
    """

    slot: int
    epoch: int
    start: int
    token_ids: tuple[int, ...]
    num_draft: int
    sampling: SamplingRow
    grammar: GrammarRow | None = None  # structured output: drafts follow the grammar
    # A DSpark draft (engine/dspark_proposer.py): the target's context states of the committed
    # positions not sent to the draft before (VerifyResult.context, kept by the engine per
    # request until its next proposal); None: nothing new. An independent draft ignores it.
    context: ContextStates | None = None
    # The engine's only request (nothing else running or waiting): a draft worker may draft its
    # next proposal ahead while the target verifies (draft_proposer, ``draft_ahead``). With other
    # requests about, the machine's time is theirs.
    alone: bool = False
    # Served with a DSpark draft, target rank 0 sends the context states to the draft worker
    # itself (runtime/context_push.py): the (link, seq) of the last message that held this row's, which
    # the worker reads before drafting. None: nothing was sent that way.
    context_push: tuple[str, int] | None = None


@dataclass(frozen=True)
class Proposal:
    draft_token_ids: list[list[int]]  # per row, num_draft tokens
    # [B, K, V] float32: the distribution each draft token was sampled from
    # (rows that are greedy hold zeros); None when every row is greedy.
    draft_probs: torch.Tensor | None
    # Per row, per draft token: the draft's own estimate of P(the token is accepted | the drafts
    # before it were), from a DSpark draft's confidence head (engine/dspark_proposer.py). It reads
    # the position's hidden state and the token before it, never the token itself, so cutting a
    # row's drafts where it runs low decides nothing from the token being judged (lossless).
    # None without such a head.
    confidence: list[list[float]] | None = None


@dataclass(frozen=True)
class VerifyRow:
    """Feed ``token_ids + draft_token_ids`` at positions ``start ..`` and verify.

    ``start`` is the request's target KV length; ``token_ids`` are the tokens
    the target has not seen yet (the whole prompt at admission, the pending
    token afterwards). The target keeps KV for the accepted prefix only.
    """

    slot: int
    epoch: int
    start: int
    token_ids: tuple[int, ...]
    draft_token_ids: tuple[int, ...]
    sampling: SamplingRow
    logprobs: int | None = None  # report the emitted tokens' log-probabilities and this many top ones
    prompt_logprobs: int | None = None  # also for token_ids[1:] (and token_ids[0] is unscored)
    # Structured output: [J, W] int32 allowed-token bitmasks for the first J scored positions
    # (the pending token's and each draft's; J = len(draft_token_ids) + 1), applied to the
    # target's logits before anything else. None: unconstrained.
    allowed: torch.Tensor | None = None
    # A partial prefill: token_ids are all the tokens the target has not seen; it maps what its
    # prefix cache holds of them, then feeds at most ``chunk``, never the last token (the engine
    # reserved KV for all of them), keeps their KV and emits nothing (no drafts). 0: an ordinary row.
    chunk: int = 0
    # Prefix caching (dspark_ray/slots/prefix_cache.py): may the target map cached blocks for the
    # start of token_ids, and register this row's blocks; blocks are shared only under equal salts.
    prefix_cache: bool = True
    cache_salt: str | None = None


@dataclass(frozen=True)
class TargetStep:
    rows: list[VerifyRow]
    # [B, K, V] float32, as in Proposal; None when no row samples with drafts.
    draft_probs: torch.Tensor | None = None
    release_slots: list[int] = field(default_factory=list)  # free these slots' KV first
    # The target holds the draft proposer (``draft_placement: target``, one rank): draft these rows
    # first, in the target's process, and verify each row's drafts (and their q) in the VerifyRow with
    # its slot, sent with none; the result's ``drafts`` says what was verified. One call a step, and
    # the draft's probabilities never leave the target. None: the rows carry their drafts.
    propose: list[ProposeRow] | None = None


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: list[int]  # per row: draft tokens accepted
    emitted: list[list[int]]  # per row: accepted drafts, then the recovered or bonus token
    # Per row, when it asked: one entry per emitted token, from the target's raw logits.
    logprobs: list[list[TokenLogprob] | None] | None = None
    # Per row, when it asked: one per token_ids entry, None for the first.
    prompt_logprobs: list[list[TokenLogprob | None] | None] | None = None
    # Per row: tokens of token_ids the target found in its prefix cache (not computed).
    cached_tokens: list[int] | None = None
    # Per row: positions a partial prefill committed (cached and fed); 0 for other rows.
    prefilled: list[int] | None = None
    # A target with taps (a DSpark draft): per row, its tap states at the positions it committed
    # and computed this step (fed tokens and accepted drafts; not positions its prefix cache served).
    context: list[ContextStates | None] | None = None
    # Those states went to the draft worker directly instead (runtime/context_push.py): the (link,
    # seq) of the message that held them, for the rows' next proposals (ProposeRow.context_push).
    context_push: tuple[str, int] | None = None
    # A step that drafted its rows in the target (TargetStep.propose): per ProposeRow, the drafts
    # verified; None if the proposer failed (``draft_error`` says how: the step verified no drafts).
    drafts: list[list[int]] | None = None
    draft_error: str | None = None
    propose_s: float = 0.0  # of the call's seconds, those the proposal took


class SlotService(Protocol):
    def allocate_many(self, req_ids: Sequence[str], owner: str = "") -> list[SlotLease]: ...

    def release_many(self, req_ids_with_epochs: Iterable[tuple[str, int | None]]) -> list[bool]: ...

    # Optional: ``release_many_nowait(req_ids_with_epochs) -> None``, the releases sent without waiting
    # for the answer (the slot manager's actor); the engine uses it while other requests still run.

    def sync(self, owner: str, leases: list[SlotLease]) -> SyncResult:
        """Heartbeat: the leases ``owner`` holds (restores them after a restart, frees others)."""
        ...


class Pending(Protocol[T]):
    """A call that was sent and runs elsewhere; ``result`` waits for it (and raises what it raised)."""

    def result(self) -> T: ...


class DraftService(Protocol):
    def propose(self, rows: list[ProposeRow]) -> Proposal: ...

    # Optional: ``propose_async(rows) -> Pending[Proposal]``. A draft service and a target
    # service that both have it run in other processes, and the engine pipelines its steps
    # (Engine docstring): one half of the batch is drafted while the other half is verified.
    # Optional: ``context_window: int``, the most context positions before a block a DSpark draft
    # reads; the engine keeps no more of a request's ProposeRow.context than that.


class TargetService(Protocol):
    def step(self, batch: TargetStep) -> VerifyResult: ...

    # Optional: ``step_async(batch) -> Pending[VerifyResult]`` (see DraftService), and ``drafts: bool``,
    # True when the target holds the draft proposer and takes a step's ``propose`` rows (TargetStep).

    def release(self, slots: list[int]) -> None: ...

    def kv_capacity(self) -> int:
        """Tokens the KV pool can hold (the scheduler's budget)."""
        ...
