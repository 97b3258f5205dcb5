"""What the engine reports per request and step (plain data)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


class _Counters(Protocol):
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: Sequence[int]


@dataclass
class SpecCounts:
    """Speculation counters in vLLM's meanings, summed over steps, requests or replicas.

    drafts: verification steps that carried draft tokens; draft tokens: tokens
    proposed; accepted tokens: of those, accepted; accepted per position ``i``:
    drafts whose first ``i + 1`` tokens were all accepted.
    """

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, other: _Counters, sign: int = 1) -> None:
        """Adds ``other``'s counters (``sign`` -1: takes them away), position by position."""
        self.drafts += sign * other.drafts
        self.draft_tokens += sign * other.draft_tokens
        self.accepted_tokens += sign * other.accepted_tokens
        for pos, n in enumerate(other.accepted_per_position):
            if pos == len(self.accepted_per_position):
                self.accepted_per_position.append(0)
            self.accepted_per_position[pos] += sign * n

    def copy(self) -> SpecCounts:
        return SpecCounts(self.drafts, self.draft_tokens, self.accepted_tokens, list(self.accepted_per_position))


@dataclass(frozen=True)
class SpecSummary:
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]
    mean_acceptance_length: float
    steps_by_k: list[int] = field(default_factory=list)  # verification steps by draft tokens verified (0..k)


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities under the target: the token's own and the top alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True)
class RequestOutput:
    """One request's progress after a step. ``new_*`` is what this step added."""

    req_id: str
    new_token_ids: list[int]
    new_text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    error: str | None = None
    error_code: str | None = None  # an ErrorCode value, when finish_reason is 'error'
    spec: SpecSummary | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them
    # The prompt's, on the request's first output when asked for: None for the first prompt token.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens the target's prefix cache gave so far (not computed)


@dataclass
class CompletionOutput:
    """A whole generation, as the offline API returns it."""

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # why, when finish_reason is 'error'
    spec: SpecSummary | None = None
    logprobs: list[TokenLogprob] | None = None  # one per output token, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (the first None)

    @property
    def cumulative_logprob(self) -> float | None:
        """Sum of the output tokens' log-probabilities (None unless logprobs were asked for)."""
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)
