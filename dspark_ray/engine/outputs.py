"""What the engine reports per request and step (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SpecSummary:
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]
    mean_acceptance_length: float


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
    spec: SpecSummary | None = None


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
