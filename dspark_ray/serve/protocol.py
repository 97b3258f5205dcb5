"""The handle API's types: what another Ray application sends (``GenerateRequest``) and gets back
(``GenerateChunk``) through ``serve.get_app_handle("dspark")``, plain data with no HTTP involved.

A request takes the same sampling fields as the OpenAI routes
(``dspark_ray.openai.protocol.SamplingFields``: structured outputs, penalties,
``speculative`` ...), with a prompt as text or token ids; chunks carry the
same ``Usage`` and ``speculation`` extension as the OpenAI responses.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

from dspark_ray.engine import SamplingParams
from dspark_ray.engine.outputs import TokenLogprob
from dspark_ray.engine.sampling_params import MAX_LOGPROBS
from dspark_ray.openai.protocol import SamplingFields, Speculation, Usage


class GenerateRequest(SamplingFields):
    """What another Ray app sends through ``handle.generate`` / ``handle.options(stream=True).generate``."""

    prompt: str | None = Field(None, description="Text; or give prompt_token_ids.")
    prompt_token_ids: list[int] | None = None
    request_id: str | None = None
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 (default here) is greedy.")
    max_tokens: int | None = Field(None, ge=0, description="Tokens to generate (default 16); 0 with "
                                                           "prompt_logprobs scores the prompt.")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Per output token: its "
                                                                          "log-probability and this many top ones.")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="The same for the prompt.")
    n: int = Field(1, ge=1, description="Independent samples (generate streams them, each chunk with its index); "
                                        "sample i of a seeded request uses seed + i.")

    def params(self) -> SamplingParams:
        return self.sampling_params(logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs, n=self.n)

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")
        return self


class Logprob(BaseModel):
    """One position's log-probabilities under the target model."""

    token_id: int
    logprob: float
    rank: int = Field(description="1 = the most likely token.")
    top: list[tuple[int, float]] = Field(default_factory=list, description="(token id, logprob), most likely first.")

    @classmethod
    def of(cls, lp: TokenLogprob | None) -> Logprob | None:
        return None if lp is None else cls(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank, top=list(lp.top))


class GenerateChunk(BaseModel):
    """One streamed piece of a generation; the last has ``finished`` set."""

    request_id: str
    index: int = Field(0, description="Which of the request's n samples this chunk belongs to.")
    text: str
    token_ids: list[int]
    logprobs: list[Logprob] | None = Field(None, description="One per token id, when asked for.")
    prompt_logprobs: list[Logprob | None] | None = Field(None, description="On the first chunk, when asked for; "
                                                                           "the first prompt token has none.")
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = Field(None, description="When finish_reason is error: structured_output_failed, "
                                   "request_timeout, target_failed, slot_lost or engine_error.")
    usage: Usage | None = None
    speculation: Speculation | None = None
