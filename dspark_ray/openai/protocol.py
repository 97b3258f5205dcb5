"""Request and response types of the OpenAI HTTP schema, and the sampling fields every request shares.

Fields mean what they mean to OpenAI and to vLLM's OpenAI server, vLLM's
sampling extensions included (``top_k``, ``min_p``, ``min_tokens``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``include_stop_str_in_output``,
``truncate_prompt_tokens``). Unknown fields are forbidden, so an unsupported
option is a 400 that names it rather than being silently ignored; a field
accepted only at its neutral value (``suffix``,
``spaces_between_special_tokens``...) says so in its 400.

Structured outputs: OpenAI's ``response_format`` (``json_object`` and
``json_schema``) and vLLM's ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar`` and ``structured_outputs``, at most one
per request, for chat, completions and the handle API (``dspark_ray.serve.protocol``,
whose ``GenerateRequest`` takes the same ``SamplingFields``) alike. Tool calling
(chat): ``tools``, ``tool_choice`` (``none``, ``auto``, ``required`` or a
named function), ``tool`` and ``developer`` messages, assistant messages with
``tool_calls``. dspark extensions:
``speculative`` and ``num_speculative_tokens``; responses carry speculation
statistics in the extension field ``speculation``.

Log-probabilities are at most ``MAX_LOGPROBS`` (20) per position.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from dspark_ray.engine import InvalidRequest, SamplingParams
from dspark_ray.engine.outputs import RequestOutput, SpecSummary, TokenLogprob
from dspark_ray.engine.sampling_params import MAX_LOGPROBS
from dspark_ray.engine.structured import StructuredOutput


class SamplingFields(BaseModel):
    """Sampling settings shared by every request type."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(None, ge=1, description="Tokens to generate (default 16).")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="vLLM extension: 0 or -1 disables top-k.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM extension: drop tokens below min_p x the top one.")
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = Field(None, description="Up to 16 stop strings.")
    stop_token_ids: list[int] | None = Field(None, description="vLLM extension: token ids that end the output.")
    ignore_eos: bool = Field(False, description="vLLM extension: keep going past EOS.")
    min_tokens: int = Field(0, ge=0, description="vLLM extension: no EOS or stop before this many tokens.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted from tokens already output.")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted per occurrence in the output.")
    repetition_penalty: float = Field(1.0, gt=0.0, description="vLLM extension: > 1 discourages prompt and "
                                                               "output tokens; 1 is neutral.")
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) -> bias in [-100, 100].")
    skip_special_tokens: bool = Field(True, description="vLLM extension: leave special tokens out of the text.")
    spaces_between_special_tokens: Literal[True] = Field(
        True, description="vLLM extension; only true (the default) is supported.")
    include_stop_str_in_output: bool = Field(False, description="vLLM extension: keep the stop string.")
    truncate_prompt_tokens: int | None = Field(None, ge=1, description="vLLM extension: keep the prompt's last N.")
    speculative: bool = Field(True, description="dspark extension: turn speculation off for this request.")
    num_speculative_tokens: int | None = Field(None, ge=0, le=16, description="dspark extension: this request's k.")
    timeout_s: float | None = Field(None, gt=0, le=86400, description="dspark extension: end this request if it "
                                    "has not finished this many seconds after it arrived (504 request_timeout, "
                                    "or an error event when streaming); the server's request_timeout_s applies "
                                    "when shorter.")
    cache_salt: str | None = Field(None, min_length=1, max_length=256, description="vLLM extension: prefix-cache "
                                   "blocks are shared only between requests with the same salt.")
    prefix_cache: bool = Field(True, description="dspark extension: false keeps this request out of the "
                                                 "prefix cache (it neither reuses nor adds blocks).")
    response_format: ResponseFormat | None = Field(None, description="{'type': 'text' | 'json_object' | "
                                                                     "'json_schema', 'json_schema': {...}}.")
    guided_json: dict | str | None = Field(None, description="vLLM extension: a JSON schema the output follows.")
    guided_regex: str | None = Field(None, description="vLLM extension: a regular expression the output matches.")
    guided_choice: list[str] | None = Field(None, description="vLLM extension: the output is one of these.")
    guided_grammar: str | None = Field(None, description="vLLM extension: a Lark (or GBNF) grammar.")
    structured_outputs: StructuredOutputsField | None = Field(None, description="vLLM extension: one of json, "
                                                                                "regex, choice, grammar, json_object.")

    def structured_output(self) -> StructuredOutput | None:
        """The one structured-output constraint asked for, if any (InvalidRequest names the field)."""
        found = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(StructuredOutput("json_object", field="response_format"))
        elif rf is not None and rf.type == "json_schema":
            schema = rf.json_schema.schema_
            found.append(StructuredOutput.json_schema(closed_objects(schema) if rf.json_schema.strict else schema,
                                                      field="response_format"))
        if self.guided_json is not None:
            found.append(StructuredOutput.json_schema(self.guided_json, field="guided_json"))
        if self.guided_regex is not None:
            found.append(StructuredOutput("regex", self.guided_regex, field="guided_regex"))
        if self.guided_choice is not None:
            found.append(StructuredOutput.choice(self.guided_choice, field="guided_choice"))
        if self.guided_grammar is not None:
            found.append(grammar_output(self.guided_grammar, "guided_grammar"))
        if self.structured_outputs is not None:
            found += self.structured_outputs.outputs()
        if len(found) > 1:
            raise InvalidRequest(found[1].field, f"only one structured-output constraint per request; "
                                                 f"{found[0].field} already sets one")
        return found[0] if found else None

    def sampling_params(self, default_max_tokens: int = 16, **extra) -> SamplingParams:
        """The engine's SamplingParams; ``extra`` sets fields such as logprobs (raises InvalidRequest)."""
        stop = self.stop if isinstance(self.stop, list) else ([self.stop] if self.stop else [])
        return SamplingParams(**{
            "max_tokens": self.max_tokens if self.max_tokens is not None else default_max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": max(0, self.top_k),
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": tuple(stop),
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": _bias(self.logit_bias),
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "speculative": self.speculative,
            "num_speculative_tokens": self.num_speculative_tokens,
            "structured": self.structured_output(),
            "prefix_cache": self.prefix_cache,
            "cache_salt": self.cache_salt,
            **extra,
        })


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field("response", description="Accepted and unused, as OpenAI names it.")
    description: str | None = None
    schema_: dict | bool = Field(default_factory=dict, alias="schema", description="The JSON schema.")
    strict: bool | None = Field(None, description="The output always follows the schema; with strict, "
                                                  "objects take only their declared properties (as OpenAI's).")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format: type json_schema needs a json_schema object")
        return self


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs`` request field (one of its constraints)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def outputs(self) -> list[StructuredOutput]:
        field = "structured_outputs"
        out = []
        if self.json_ is not None:
            out.append(StructuredOutput.json_schema(self.json_, field=field))
        if self.regex is not None:
            out.append(StructuredOutput("regex", self.regex, field=field))
        if self.choice is not None:
            out.append(StructuredOutput.choice(self.choice, field=field))
        if self.grammar is not None:
            out.append(grammar_output(self.grammar, field))
        if self.json_object:
            out.append(StructuredOutput("json_object", field=field))
        return out


def closed_objects(schema):
    """A copy of a JSON schema where every object schema without ``additionalProperties`` gets
    ``additionalProperties: false``."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (closed_objects(v) if k in _SUBSCHEMAS else
               {n: closed_objects(s) for n, s in v.items()} if k in _SCHEMA_MAPS and isinstance(v, dict) else v)
           for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = {"items", "anyOf", "oneOf", "allOf", "not", "prefixItems", "additionalItems", "if", "then", "else"}
_SCHEMA_MAPS = {"properties", "$defs", "definitions", "patternProperties"}


def grammar_output(text: str, field: str) -> StructuredOutput:
    """A Lark grammar, or a GBNF one (``::=`` rules, llama.cpp's format) converted to Lark."""
    if "::=" in text:
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            text = any_to_lark(text)
        except Exception as exc:  # noqa: BLE001 - the converter raises plain exceptions
            raise InvalidRequest(field, f"cannot read the GBNF grammar: {exc}") from None
    return StructuredOutput("lark", text, field)


def _bias(bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        try:
            out[int(key)] = value
        except ValueError:
            raise InvalidRequest("logit_bias", f"keys must be token ids, got {key!r}") from None
    return out


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM extension: usage in every chunk.")


class _OpenAIRequest(SamplingFields):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, description="Choices per prompt, each an independent request (at most the slot "
                                        "capacity); a seeded request's choice i uses seed + i.")
    user: str | None = None


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="A string, a list of strings, token ids, or a list of token-id lists.")
    max_tokens: int | None = Field(None, ge=0, description="Tokens to generate (default 16); 0 with echo scores "
                                                           "the prompt without generating.")
    echo: bool = Field(False, description="Return the prompt before the completion (with its logprobs if asked).")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Log-probabilities of each token and "
                                                                          "this many most likely alternatives.")
    best_of: int | None = Field(None, ge=1, description="Generate this many per prompt, return the n with the "
                                                        "highest cumulative log-probability (not with stream).")
    suffix: str | None = Field(None, description="Not supported: only null or empty.")

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.prompt == []:
            raise ValueError("prompt: the list of prompts is empty")
        if self.suffix:
            raise ValueError("suffix: not supported (insertion needs a fill-in-the-middle model)")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: must be >= 1 (0 only with echo, to score the prompt)")
        if self.best_of is not None:
            if self.best_of < self.n:
                raise ValueError(f"best_of: must be >= n ({self.n})")
            if self.stream and self.best_of > self.n:
                raise ValueError("best_of: cannot be above n when streaming")
        return self

    def prompt_inputs(self) -> list[str | list[int]]:
        """Every prompt in the request: one string or token-id list each."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def params(self, default_max_tokens: int = 16, n: int = 1) -> SamplingParams:
        """The engine's params; ``n``: samples run per prompt (best_of when it is larger)."""
        lp = self.logprobs
        if self.best_of is not None and self.best_of > self.n and lp is None:
            lp = 0  # ranking needs each choice's cumulative log-probability
        return self.sampling_params(default_max_tokens, logprobs=lp, n=n,
                                    prompt_logprobs=self.logprobs if self.echo else None)


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str | dict = Field(description="JSON text of the arguments (OpenAI), or the object itself.")


class MessageToolCall(BaseModel):
    """A tool call in an assistant message of the conversation so far."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[MessageToolCall] | None = Field(None, description="Assistant messages: the calls it made.")
    content: str | list[dict] | None = Field(None, validate_default=True)  # after tool_calls: its check reads them
    name: str | None = None
    tool_call_id: str | None = Field(None, description="Tool messages: the call this answers.")
    reasoning_content: str | None = Field(None, description="Accepted on assistant messages and not rendered "
                                                            "(earlier turns' reasoning is not fed back).")

    @field_validator("tool_calls")
    @classmethod
    def _calls_are_the_assistants(cls, value, info: ValidationInfo):
        if value and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _content_given(cls, value, info: ValidationInfo):
        if value is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("content is required (it may be null only on an assistant message with tool_calls)")
        return value

    def rendered(self) -> dict:
        """The message as the chat template sees it. ``developer`` (OpenAI's newer name for the
        system role) is rendered as ``system``, which templates know."""
        out = {"role": "system" if self.role == "developer" else self.role,
               "content": None if self.content is None else self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("messages: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict | None = Field(None, description="A JSON schema of the arguments object.")
    strict: bool | None = None

    def parameters_schema(self) -> dict:
        """The arguments' schema as forced calls enforce it: objects that do not say otherwise
        take no properties beyond those declared (as OpenAI's strict mode has it), so a model
        cannot wander off into invented arguments and run out of tokens."""
        return closed_objects(self.parameters if self.parameters is not None else {"type": "object", "properties": {}})


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool | None = Field(False, description="Log-probabilities of each output token.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Alternatives per position "
                                                                               "(needs logprobs: true).")
    max_completion_tokens: int | None = Field(None, ge=1)
    echo: bool = Field(False, description="vLLM extension: prepend the last message's content when it is the "
                                          "assistant's.")
    tools: list[Tool] | None = Field(None, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (the default with tools), required (at least one call) or "
                          "{'type': 'function', 'function': {'name': ...}}; required and a named function "
                          "are enforced by grammar, so their arguments always follow the function's schema.")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (with required).")
    chat_template_kwargs: dict | None = Field(None, description="vLLM extension: extra chat template "
                                                                "variables, e.g. {'enable_thinking': false}.")

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool named {choice.function.name!r} in tools "
                             f"({', '.join(map(repr, names)) or 'none given'})")
        if choice == "required" and not names:
            raise ValueError("tool_choice: required needs tools")
        return self

    def tool_mode(self) -> str:
        """none | auto | required | named."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def tool_output(self) -> StructuredOutput | None:
        """The grammar of a forced call: the named function's arguments, or (required) a JSON
        array of one or more {"name", "parameters"} objects, one schema per tool."""
        mode = self.tool_mode()
        if mode == "named":
            tool = next(t for t in self.tools if t.function.name == self.tool_choice.function.name)
            return StructuredOutput.json_schema(tool.function.parameters_schema(), field="tools")
        if mode != "required":
            return None
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": t.function.name},
                                              "parameters": t.function.parameters_schema()},
             "required": ["name", "parameters"], "additionalProperties": False}
            for t in self.tools]}}
        if self.parallel_tool_calls is False:
            calls["maxItems"] = 1
        return StructuredOutput.json_schema(calls, field="tools")

    def params(self, default_max_tokens: int = 16, n: int = 1) -> SamplingParams:
        req = self
        if self.max_tokens is None and self.max_completion_tokens is not None:
            req = self.model_copy(update={"max_tokens": self.max_completion_tokens})
        forced = self.tool_output()
        extra = {}
        if forced is not None:
            if self.structured_output() is not None:
                raise InvalidRequest("tool_choice", "a forced tool call (required or a named function) cannot "
                                                    "be combined with response_format or guided decoding")
            extra["structured"] = forced
        return req.sampling_params(default_max_tokens, n=n,
                                   logprobs=(self.top_logprobs or 0) if self.logprobs else None, **extra)


class Speculation(BaseModel):
    """Extension field: how speculation went for this request."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]
    mean_acceptance_length: float
    steps_by_k: list[int] = Field(default_factory=list, description="Verification steps by the number of draft "
                                  "tokens they verified (index 0..k): what adaptive speculation chose for this "
                                  "request, step by step.")

    @classmethod
    def of(cls, s: SpecSummary | None) -> Speculation | None:
        return None if s is None else cls(**s.__dict__)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="Prompt tokens the prefix cache gave (not computed).")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, out: RequestOutput) -> Usage:
        """One engine request's usage so far (its cached prompt tokens at most its prompt)."""
        return cls(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                   total_tokens=out.num_prompt_tokens + out.num_output_tokens,
                   prompt_tokens_details=PromptTokensDetails(
                       cached_tokens=min(out.num_cached_tokens, out.num_prompt_tokens)))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# SamplingFields names types defined after it: complete it now, so that the request types built on it in
# other modules (the handle API's GenerateRequest, dspark_ray/serve/protocol.py) need not see them.
SamplingFields.model_rebuild()


# -- log-probabilities in OpenAI's shapes --------------------------------------------


def completion_logprobs(
    token_ids: list[int], entries: list[TokenLogprob | None], token_text, offset: int = 0
) -> dict:
    """The completions ``logprobs`` object: tokens, token_logprobs, top_logprobs, text_offset.

    ``entries``: one per token id, None for an unscored one (the first prompt
    token); ``token_text``: token id -> its text; ``offset``: the text offset
    of the first token (text offsets count the token texts before it).
    """
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, lp in zip(token_ids, entries, strict=True):
        text = token_text(token_id)
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        if lp is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(lp.logprob)
        top = {token_text(t): v for t, v in lp.top}
        top.setdefault(text, lp.logprob)  # the chosen token is always listed, as vLLM does
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def chat_logprobs(entries: list[TokenLogprob], token_text) -> dict:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def item(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(lp.token_id, lp.logprob), "top_logprobs": [item(t, v) for t, v in lp.top]}
                        for lp in entries]}
