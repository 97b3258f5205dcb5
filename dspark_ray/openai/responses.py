"""Responses: a request's choices rendered as OpenAI bodies and stream chunks.

``CompletionView`` and ``ChatView`` hold what a response needs besides the
choices (echoed prompt text, whether log-probabilities were asked for) and
turn a finished ``Choice`` into a ``choices[]`` entry, or one engine output
into a streamed chunk's entry. Text offsets of streamed completions
log-probabilities continue across chunks, so the streamed pieces read like
the whole response.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from dspark_ray.engine import RequestOutput
from dspark_ray.openai.choices import Choice
from dspark_ray.openai.protocol import chat_logprobs, completion_logprobs
from dspark_ray.openai.reasoning import ReasoningParser
from dspark_ray.openai.tool_parsers import ToolCall, ToolCallDelta, ToolParser


class CompletionView:
    """``text_completion`` choices: text (after the echoed prompt) and the logprobs object."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, token_text: Callable[[int], str], echo: list[str] | None, logprobs: bool) -> None:
        self.token_text = token_text
        self.echo = echo  # per prompt: its text, when the request echoes
        self.logprobs = logprobs
        self._offsets: dict[int, int] = {}  # per streamed choice: text offset of its next token

    def _entries(self, c: Choice, ids: list[int], logprobs: list, with_prompt: bool) -> tuple[list, list]:
        if with_prompt and self.echo is not None:
            return c.prompt_ids + ids, list(c.prompt_logprobs or [None] * len(c.prompt_ids)) + logprobs
        return ids, logprobs

    def choice(self, c: Choice) -> dict:
        text = (self.echo[c.prompt] if self.echo is not None else "") + c.text
        lp = None
        if self.logprobs:
            lp = completion_logprobs(*self._entries(c, c.token_ids, c.logprobs, True), self.token_text)
        return {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.last.finish_reason,
                "stop_reason": c.last.stop_reason}

    def head(self, c: Choice) -> dict | None:
        return None

    def chunk(self, c: Choice, out: RequestOutput, first: bool) -> dict | None:
        text = (self.echo[c.prompt] if first and self.echo is not None else "") + out.new_text
        lp = None
        if self.logprobs:
            ids, entries = self._entries(c, out.new_token_ids, out.logprobs or [], first)
            offset = self._offsets.get(c.index, 0)
            lp = completion_logprobs(ids, entries, self.token_text, offset)
            self._offsets[c.index] = offset + sum(len(t) for t in lp["tokens"])
            if not ids and not text and not out.finished:
                return None
        elif not text and not out.finished:
            return None
        return {"index": c.index, "text": text, "logprobs": lp, "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason if out.finished else None}


@dataclass(frozen=True)
class ToolMode:
    """How a chat request's output turns into tool calls.

    ``auto``: the model may call tools in its own format, read by ``parser``
    (a new ``ToolParser`` per choice); ``named``: the output is the named
    function's arguments (grammar-forced); ``required``: the output is a JSON
    array of ``{"name", "parameters"}`` objects (grammar-forced).
    """

    mode: str
    parser: Callable[[], ToolParser] | None = None
    name: str | None = None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def forced_calls(mode: ToolMode, text: str) -> list[ToolCall] | None:
    """The calls of a grammar-forced output.

    named: the output is the arguments (cut short if max_tokens ended it, as
    OpenAI returns them then). required: the JSON array's complete items; if
    max_tokens cut the array, the calls completed before the cut (the
    grammar made each of them valid); None if not even one was.
    """
    if mode.mode == "named":
        return [ToolCall(new_call_id(), mode.name, text)]
    decoder, items, i = json.JSONDecoder(), [], text.find("[") + 1
    while i > 0:
        try:
            item, i = decoder.raw_decode(text, _skip(text, i))
        except json.JSONDecodeError:
            break
        items.append(item)
        i = text.find(",", i) + 1
    calls = [ToolCall(new_call_id(), it["name"], json.dumps(it["parameters"], ensure_ascii=False))
             for it in items if isinstance(it, dict) and "name" in it and "parameters" in it]
    return calls or None


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _call_json(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _delta_json(d: ToolCallDelta) -> dict:
    out: dict = {"index": d.index}
    function: dict = {"arguments": d.arguments}
    if d.id is not None:
        out.update(id=d.id, type="function")
    if d.name is not None:
        function["name"] = d.name
    out["function"] = function
    return out


@dataclass
class _Stream:
    """One streamed choice's parsing state."""

    reasoning: ReasoningParser | None
    tools: ToolParser | None  # auto
    forced: str = ""  # required: the output so far (parsed when it ends)
    call_id: str | None = None  # named: the call's id once its head was sent
    calls: int = 0


class ChatView:
    """``chat.completion`` choices: an assistant message and the chat logprobs object.

    With a reasoning parser the thinking goes to ``reasoning_content``; with
    tools the content is read for tool calls (``ToolMode``), returned as
    ``tool_calls`` with ``finish_reason: "tool_calls"``, and streamed as
    OpenAI's tool-call deltas.
    """

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, token_text: Callable[[int], str], echo: str, logprobs: bool,
                 tools: ToolMode | None = None, reasoning: Callable[[], ReasoningParser] | None = None) -> None:
        self.token_text = token_text
        self.echo = echo  # the last message's content when it is the assistant's and echo is on, else ""
        self.logprobs = logprobs
        self.tools = tools
        self.reasoning = reasoning
        self._streams: dict[int, _Stream] = {}

    def choice(self, c: Choice) -> dict:
        text = self.echo + c.text
        message: dict = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            message["reasoning_content"], message["content"] = self.reasoning().parse(text)
        calls: list[ToolCall] = []
        if self.tools is not None and message["content"] is not None:
            if self.tools.mode == "auto":
                message["content"], calls = self.tools.parser().parse(message["content"])
            else:
                calls = forced_calls(self.tools, message["content"]) or []
                if calls:
                    message["content"] = None
        if calls:
            message["tool_calls"] = [_call_json(k) for k in calls]
        finish = c.last.finish_reason
        return {"index": c.index, "message": message,
                "logprobs": chat_logprobs(c.logprobs, self.token_text) if self.logprobs else None,
                "finish_reason": "tool_calls" if calls and finish == "stop" else finish,
                "stop_reason": c.last.stop_reason}

    def head(self, c: Choice) -> dict | None:
        return {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def chunk(self, c: Choice, out: RequestOutput, first: bool) -> dict | None:
        st = self._streams.get(c.index)
        if st is None:
            st = self._streams[c.index] = _Stream(
                self.reasoning() if self.reasoning else None,
                self.tools.parser() if self.tools is not None and self.tools.mode == "auto" else None)
        text = (self.echo if first else "") + out.new_text
        delta: dict = {}
        reasoning = ""
        if st.reasoning is not None:
            reasoning, text = st.reasoning.feed(text)
            if out.finished:
                more = st.reasoning.finish()
                reasoning, text = reasoning + more[0], text + more[1]
        if reasoning:
            delta["reasoning_content"] = reasoning
        calls: list[ToolCallDelta] = []
        if self.tools is not None:
            text, calls = self._tool_deltas(st, text, out.finished)
        if text:
            delta["content"] = text
        if calls:
            st.calls = max(st.calls, 1 + max(d.index for d in calls))
            delta["tool_calls"] = [_delta_json(d) for d in calls]
        entries = out.logprobs or [] if self.logprobs else []
        if not delta and not entries and not out.finished:
            return None
        finish = out.finish_reason
        return {"index": c.index, "delta": delta,
                "logprobs": chat_logprobs(entries, self.token_text) if self.logprobs else None,
                "finish_reason": "tool_calls" if st.calls and finish == "stop" else finish,
                "stop_reason": out.stop_reason if out.finished else None}

    def _tool_deltas(self, st: _Stream, text: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        """(content left to stream, tool-call deltas) for this piece of content."""
        mode = self.tools.mode
        if mode == "auto":
            parsed = st.tools.feed(text)
            content, calls = parsed.content, list(parsed.tool_calls)
            if finished:
                last = st.tools.finish()
                content, calls = content + last.content, calls + list(last.tool_calls)
            return content, calls
        if mode == "named":  # the content is the arguments, streamed as they come
            if st.call_id is None:
                st.call_id = new_call_id()
                return "", [ToolCallDelta(0, st.call_id, self.tools.name, text)]
            return "", [ToolCallDelta(0, arguments=text)] if text else []
        st.forced += text  # required: a JSON array, read when complete
        if not finished:
            return "", []
        calls = forced_calls(self.tools, st.forced)
        if calls is None:
            return st.forced, []
        return "", [ToolCallDelta(i, k.id, k.name, k.arguments) for i, k in enumerate(calls)]
