"""Request: the engine's bookkeeping for one generation (no torch, no ray).

Token layout of a running request (``tokens = prompt + output``):

    positions  0 ............................ len(tokens)-1
    target KV  [0, target_len)                 target_len == len(tokens) - 1 after
                                               every step that emitted: the last
                                               token is "pending", fed in the next
                                               step; a chunked prefill advances it
                                               by prefill_chunk and emits nothing
    draft KV   [0, draft_len)                  the draft catches up from draft_len
"""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field
from typing import Any

from dspark_ray.engine.adaptive import Acceptance
from dspark_ray.engine.outputs import TokenLogprob
from dspark_ray.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # never admitted: holds no slot
    RUNNING = "running"  # holds a slot and target KV
    PREEMPTED = "preempted"  # holds its slot and draft cache, target KV freed
    FINISHED = "finished"


class ErrorCode(str, enum.Enum):
    """Why the engine ended a request with an error: the server's status code and advice follow it."""

    STRUCTURED_OUTPUT = "structured_output_failed"  # the request's grammar could not go on (its own doing)
    TIMEOUT = "request_timeout"  # past its deadline (Engine.add_request's timeout_s)
    TARGET_FAILED = "target_failed"  # the target failed and was not rebuilt in time
    SLOT_LOST = "slot_lost"  # its slot went to another request while the slot manager restarted
    ENGINE_ERROR = "engine_error"  # anything else on the server's side


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # the caller cancelled or disconnected
    ERROR = "error"  # the engine failed this request


@dataclass
class SpecStats:
    """Speculation counters, with vLLM's meanings."""

    drafts: int = 0  # verification steps that carried at least one draft token
    draft_tokens: int = 0  # draft tokens proposed
    accepted_tokens: int = 0  # draft tokens accepted
    accepted_per_position: list[int] = field(default_factory=list)
    steps_by_k: list[int] = field(default_factory=list)  # verification steps by their number of drafts (0..k)

    def record(self, proposed: int, accepted: int) -> None:
        if len(self.steps_by_k) <= proposed:
            self.steps_by_k.extend([0] * (proposed + 1 - len(self.steps_by_k)))
        self.steps_by_k[proposed] += 1
        if proposed == 0:
            return
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position.extend([0] * (proposed - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step: accepted drafts + 1."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass
class Request:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # params.seed, or one drawn at arrival: randomness is a function of (seed, position)
    num_spec_tokens: int  # this request's k (0 = speculation off)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    error_code: str | None = None  # what kind of error (ErrorCode), when finish_reason is error
    deadline: float | None = None  # time.monotonic() past which the request ends (ErrorCode.TIMEOUT)
    slot: int = 0
    epoch: int = -1
    target_len: int = 0  # committed target KV (positions 0..target_len-1)
    prefill_chunk: int = 0  # tokens of a partial prefill in flight this step (0: the row feeds all it has not)
    draft_len: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    # Adaptive speculation (engine/adaptive.py): this request's acceptance estimate (None: its k is
    # fixed), and whether the step's k (adaptive speculation's, or 0 above speculation_max_batch)
    # applies to it (False: a k it fixed itself, or a seeded sampled request, whose k follows its own
    # history only, so that it gives the same tokens whatever else runs).
    acceptance: Acceptance | None = None
    batch_adapted: bool = True
    cached_tokens: int = 0  # prompt tokens the target's prefix cache gave (not computed)
    first_token_time: float | None = None
    finish_time: float | None = None
    # Set once the target scored the prompt (params.prompt_logprobs), handed out with the next output.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    # Structured output: the matcher of the committed output (a structured.Grammar; this module
    # keeps no torch or llguidance import).
    grammar: Any = None
    # A DSpark draft: the target's context states (an interfaces.ContextStates) of the committed
    # positions the draft has not been sent yet; handed to the next proposal, dropped once it succeeded.
    context: Any = None
    # ... or the (link, seq) of the message in which target rank 0 sent them to the draft worker
    # itself (VerifyResult.context_push), named in the next proposal so that the worker reads it first.
    context_push: Any = None

    @functools.cached_property
    def distinct_prompt_ids(self) -> tuple[int, ...]:
        """The prompt's ids, each once, sorted (what a repetition penalty reads every step)."""
        return tuple(sorted(set(self.prompt_token_ids)))

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_from(self, start: int) -> tuple[int, ...]:
        """``tokens[start:]`` without building the whole list (it runs per row per step)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return tuple(self.output_token_ids[start - n:])
        return tuple(self.prompt_token_ids[start:]) + tuple(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def holds_slot(self) -> bool:
        return self.status in (Status.RUNNING, Status.PREEMPTED)

    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_token_ids)

    def finish(self, reason: FinishReason, detail: str | int | None = None) -> None:
        assert self.status is not Status.FINISHED, f"{self.req_id} finished twice"
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = detail
        self.finish_time = time.monotonic()
