"""Tool parsers: the tool calls a chat model writes as text, turned into OpenAI ``tool_calls``.

A model calls a tool by writing the call out in a format of its own. The
parser for that format splits the generated text into ordinary content and
calls, either as it streams (``feed`` ... ``finish``, one parser per message)
or all at once (``parse``).

NOTE: ``parse`` is ``feed(text)`` then ``finish()`` on a fresh parser, so a
whole output and the same output streamed cannot disagree; what the parsers
must get right is that the answer does not depend on where the stream was cut.

A call is reported only once its text is complete and valid, and then in one
delta carrying its id, name and whole arguments. Streaming the arguments
earlier would commit to a call that can still turn out malformed (a missing
brace, junk before the closing tag), and a malformed call is returned as the
raw text it was, which a half-streamed call could no longer become.

Content (the text outside calls) streams as soon as it cannot be the start of
a call. Once the output holds a call, content that is only whitespace (the
newlines between and around calls) is dropped, as vLLM does; an output
without calls is content, unchanged.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    """One complete call."""

    id: str  # "call_" + 24 hex digits, unique per call
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass
class ToolCallDelta:
    """One streamed piece of a call: OpenAI's ``chat.completion.chunk`` ``delta.tool_calls[i]``."""

    index: int  # which call of the message (0, 1, ...)
    id: str | None = None  # set on the call's first delta only
    name: str | None = None  # set on the call's first delta only
    arguments: str = ""  # a fragment of the arguments' JSON text


@dataclass
class ParsedDelta:
    """What one piece of generated text released: content to stream, and pieces of calls."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolParser:
    """Splits one generated message into content and tool calls; stateful, one instance per message."""

    def __init__(self) -> None:
        self._calls: list[ToolCall] = []

    def feed(self, text: str) -> ParsedDelta:
        """A new piece of generated text (cut anywhere); returns what it releases."""
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        """Generation ended: release what was held back (an unfinished call is judged as it stands)."""
        raise NotImplementedError

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The complete calls parsed so far (after ``finish``: all of them)."""
        return list(self._calls)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output: (content, calls); content is None when there are calls and nothing else."""
        parser = type(self)()
        content = parser.feed(text).content + parser.finish().content
        calls = parser.tool_calls
        return (content if content or not calls else None), calls

    def _report(self, call: ToolCall, out: ParsedDelta) -> None:
        out.tool_calls.append(ToolCallDelta(len(self._calls), call.id, call.name, call.arguments))
        self._calls.append(call)


class HermesToolParser(ToolParser):
    """Hermes 2 Pro, Qwen 2.5 and Qwen 3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

    A block ends at the first ``</tool_call>`` outside a JSON string, so
    arguments that quote the tag do not cut it short. Its body must be one
    JSON object with a string "name" and "arguments" (an object, or the JSON
    text of one); otherwise the block, tags and all, is content. A block left
    open when generation ends counts if its body is valid (a closing tag cut
    short after it is dropped with it).

    The text between calls comes in runs; a run is held while it is all
    whitespace and released once it has something else. A whitespace-only run
    is dropped when a call follows it or the output has calls, which is what
    makes streamed content equal ``parse``'s.
    """

    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""  # text not yet released: a partial START, or the body of an open block
        self._in_block = False
        self._scan = _JsonScan()  # whether the open block's body, up to _scanned, is inside a string
        self._scanned = 0
        self._run = ""  # the current run of text between calls, held while all whitespace
        self._live = False  # the current run has had something other than whitespace

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buf += text
        while self._advance(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._in_block:
            # Cut short in the block: a partial END after the body (the scan
            # stops there) is the model closing the call, not part of it.
            self._close_block(self._buf[:self._scanned], self.START + self._buf, out)
        else:
            self._text(self._buf, out)
        if not self._calls:
            out.content += self._run
        self._buf, self._run, self._in_block = "", "", False
        return out

    def _advance(self, out: ParsedDelta) -> bool:
        """Release what the buffer settles; False when the rest must wait for more text."""
        if not self._in_block:
            at = self._buf.find(self.START)
            if at < 0:
                cut = len(self._buf) - _partial_suffix(self._buf, self.START)
                self._text(self._buf[:cut], out)
                self._buf = self._buf[cut:]
                return False
            self._text(self._buf[:at], out)
            self._buf = self._buf[at + len(self.START):]
            self._in_block, self._scan, self._scanned = True, _JsonScan(), 0
            return True
        end = self._block_end()
        if end is None:
            return False
        self._close_block(self._buf[:end], self.START + self._buf[:end + len(self.END)], out)
        self._buf = self._buf[end + len(self.END):]
        self._in_block = False
        return True

    def _block_end(self) -> int | None:
        """Where the open block's END starts in the buffer, or None if it has not come yet."""
        body = self._buf
        while self._scanned < len(body):
            j = self._scanned
            if body[j] == "<" and not self._scan.in_string:
                if body.startswith(self.END, j):
                    return j
                if self.END.startswith(body[j:]):
                    return None  # maybe END, cut short: look again when more text comes
            self._scan.step(body[j])
            self._scanned += 1
        return None

    def _close_block(self, body: str, raw: str, out: ParsedDelta) -> None:
        """A block's body is done: report its call, or release its raw text as content."""
        call = _call_from_json(body)
        if call is None:
            self._text(raw, out)
            return
        self._report(call, out)
        self._run, self._live = "", False

    def _text(self, text: str, out: ParsedDelta) -> None:
        """Text outside calls: released, unless its run is so far all whitespace."""
        self._run += text
        if self._live or self._run.strip():
            out.content += self._run
            self._run, self._live = "", True


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 JSON tool calling: ``<|python_tag|>{"name": ..., "parameters": {...}}; {...}``.

    Whether the output is calls or content is decided at its first
    non-whitespace character: ``{`` or ``<|python_tag|>`` begins calls,
    anything else makes the whole output content. Calls are JSON objects with
    a string "name" and "parameters" (or "arguments"), separated by ``;`` and
    whitespace; each ends where its braces balance. The calls are the longest
    run of valid objects: from the first thing that is not one (a malformed
    object, prose after the calls) the rest of the output is content, raw, and
    with no valid call at all the content is the whole output, tag included.
    An output that opens with a JSON object which is not a call (a JSON-mode
    answer) is held until the object closes, then released as content.
    """

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._held = ""  # text since the last call (or the start), not yet released
        self._state = "start"  # start -> between <-> object; or content, for good
        self._scanned = 0  # how far into _held the state has looked
        self._obj = 0  # where the open object starts in _held
        self._scan = _JsonScan()

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self._state == "content":
            out.content = text
            return out
        self._held += text
        while self._advance(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        # Held text left between calls is separators, dropped; before any
        # call, or an unclosed object, it is raw content.
        out = ParsedDelta()
        if self._state == "object" or (self._state != "content" and not self._calls):
            out.content = self._held
        self._held, self._state = "", "content"
        return out

    def _advance(self, out: ParsedDelta) -> bool:
        """Move the state on over the held text; False when it must wait for more text."""
        held = self._held
        if self._state == "start":
            head = held.lstrip()
            skip = len(held) - len(head)
            if head.startswith(self.TAG):
                self._scanned, self._state = skip + len(self.TAG), "between"
                return True
            if head.startswith("{"):
                self._scanned, self._state = skip, "between"
                return True
            if self.TAG.startswith(head):
                return False
            return self._to_content(out)
        if self._state == "between":
            j = self._scanned
            while j < len(held) and (held[j].isspace() or held[j] == ";"):
                j += 1
            self._scanned = j
            if j == len(held):
                return False
            if held[j] != "{":
                return self._to_content(out)
            self._obj, self._scan, self._state = j, _JsonScan(), "object"
            return True
        if self._state == "object":
            while self._scanned < len(held):
                self._scan.step(held[self._scanned])
                self._scanned += 1
                if self._scan.depth == 0:
                    call = _call_from_json(held[self._obj:self._scanned])
                    if call is None:
                        return self._to_content(out)
                    self._report(call, out)
                    self._held, self._scanned, self._state = held[self._scanned:], 0, "between"
                    return True
        return False

    def _to_content(self, out: ParsedDelta) -> bool:
        out.content += self._held
        self._held, self._state = "", "content"
        return False


class _JsonScan:
    """Where JSON text stands, one character at a time: inside a string or not, and how deeply nested."""

    def __init__(self) -> None:
        self.in_string = False
        self.escaped = False
        self.depth = 0

    def step(self, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1


def _call_from_json(text: str) -> ToolCall | None:
    """The call a JSON object spells, or None if it is not one.

    A call is an object with a non-empty string "name" and arguments under
    "arguments" or "parameters" (none: ``{}``): an object, or a string holding
    the JSON text of one, as some models write them.
    """
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], json.dumps(args, ensure_ascii=False))


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def make_tool_parser(name: str) -> ToolParser:
    """A fresh parser for one message, by the name the server was configured with."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()
