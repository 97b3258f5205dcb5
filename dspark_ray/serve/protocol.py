"""Request and response types: the OpenAI HTTP schema and the Ray-handle API.

OpenAI requests forbid unknown fields, so an unsupported option is a 400 that
names it rather than being silently ignored. dspark extensions (``top_k``,
``ignore_eos``, ``stop_token_ids``, ``seed``, ``speculative``,
``num_speculative_tokens``) are accepted as extra body fields; responses
carry speculation statistics in the extension field ``speculation``.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dspark_ray.engine import SamplingParams
from dspark_ray.engine.outputs import SpecSummary


class SamplingFields(BaseModel):
    """Sampling settings shared by every request type."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(None, ge=1, description="Tokens to generate (default 16).")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="dspark extension: 0 disables top-k.")
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = Field(None, description="Up to 16 stop strings.")
    stop_token_ids: list[int] | None = Field(None, description="dspark extension.")
    ignore_eos: bool = Field(False, description="dspark extension.")
    speculative: bool = Field(True, description="dspark extension: turn speculation off for this request.")
    num_speculative_tokens: int | None = Field(None, ge=0, le=16, description="dspark extension: this request's k.")

    def sampling_params(self, default_max_tokens: int = 16) -> SamplingParams:
        stop = self.stop if isinstance(self.stop, list) else ([self.stop] if self.stop else [])
        return SamplingParams(
            max_tokens=self.max_tokens or default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            speculative=self.speculative,
            num_speculative_tokens=self.num_speculative_tokens,
        )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _OpenAIRequest(SamplingFields):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="Only one choice per request is supported.")
    user: str | None = None
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="Not supported: must be 0.")
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="Not supported: must be 0.")
    repetition_penalty: float = Field(1.0, ge=1.0, le=1.0, description="vLLM extension; only 1.0 (neutral) so far.")


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[int] | list[str] = Field(..., description="A string, token ids, or a one-string list.")
    echo: Literal[False] = False
    logprobs: None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ValueError("prompt: batches of prompts are not supported; send one request per prompt")
        return self

    def prompt_input(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str | list[dict]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("messages: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: Literal[False] = False
    max_completion_tokens: int | None = Field(None, ge=1)

    def sampling_params(self, default_max_tokens: int = 16) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            return self.model_copy(update={"max_tokens": self.max_completion_tokens}).sampling_params()
        return super().sampling_params(default_max_tokens)


class Speculation(BaseModel):
    """Extension field: how speculation went for this request."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]
    mean_acceptance_length: float

    @classmethod
    def of(cls, s: SpecSummary | None) -> Speculation | None:
        return None if s is None else cls(**s.__dict__)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# -- Ray handle API -------------------------------------------------------------


class GenerateRequest(SamplingFields):
    """What another Ray app sends through ``handle.generate`` / ``handle.options(stream=True).generate``."""

    prompt: str | None = Field(None, description="Text; or give prompt_token_ids.")
    prompt_token_ids: list[int] | None = None
    request_id: str | None = None
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 (default here) is greedy.")

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")
        return self


class GenerateChunk(BaseModel):
    """One streamed piece of a generation; the last has ``finished`` set."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    usage: Usage | None = None
    speculation: Speculation | None = None
