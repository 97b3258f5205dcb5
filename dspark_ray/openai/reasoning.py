"""Reasoning: a thinking model's ``<think>…</think>`` returned as ``reasoning_content``, apart from ``content``.

An output is: optional text before the start marker (content), the
reasoning, the end marker, then the answer (content, with the whitespace
right after the end marker dropped, as vLLM does). One reasoning block at
most: after the end marker everything is content, markers included.

Where reasoning begins has to be decidable while streaming, within the first
few characters, because text already sent as content cannot be taken back:

- ``starts_in_reasoning=False``: the output is reasoning only if it opens with
  the start marker, after nothing but whitespace (which stays content).
  Otherwise all of it is content, and a start or end marker later on is
  plain text.
- ``starts_in_reasoning=True``: the chat template already opened the
  reasoning in the prompt, so the output starts inside it. A start marker
  that the model writes again at the very beginning (after nothing but
  whitespace, which stays reasoning) is dropped.

Either way, reasoning that never ends (generation stopped while thinking) is
all reasoning.

The registered parsers:

- ``think``: output that opens with ``<think>``.
- ``qwen3``: Qwen3 hybrid models, by the same rule as ``think``. In thinking
  mode the model writes ``<think>`` itself; with ``enable_thinking=False`` the
  template closes an empty think block in the prompt and the output is all
  content, so an output that does not open with ``<think>`` is content, even
  if a ``</think>`` turns up in it (vLLM's Qwen3 parser likewise returns
  output without ``</think>`` as content). Models whose template opens
  ``<think>`` in the prompt and which write only ``</think>`` (Qwen3-*-
  Thinking-2507, QwQ) need ``deepseek_r1``.
- ``deepseek_r1``: DeepSeek-R1 and the like, ``starts_in_reasoning``;
  ``<think>`` in the output is optional.

NOTE: ``parse`` is ``feed(text)`` then ``finish()`` on a fresh parser, so a
whole output and the same output streamed cannot disagree.
"""

from __future__ import annotations

# States: where the next text goes.
_BEFORE = "before"  # at the start: is this the start marker, or content?
_OPENING = "opening"  # at the start, already reasoning: is the start marker written again?
_REASONING = "reasoning"
_AFTER = "after"  # just past the end marker: whitespace to drop
_CONTENT = "content"


class ReasoningParser:
    """Splits one generated message into reasoning and content; stateful, one instance per message."""

    def __init__(self, start: str = "<think>", end: str = "</think>", starts_in_reasoning: bool = False) -> None:
        if not start or not end:
            raise ValueError("reasoning markers must be non-empty strings, e.g. start='<think>', end='</think>'")
        self.start = start
        self.end = end
        self.starts_in_reasoning = starts_in_reasoning
        self._state = _OPENING if starts_in_reasoning else _BEFORE
        self._held = ""  # text not yet released: leading whitespace, a partial marker

    def feed(self, text: str) -> tuple[str, str]:
        """A new piece of generated text (cut anywhere); returns (reasoning delta, content delta)."""
        self._held += text
        reasoning, content = [], []
        while self._advance(reasoning, content):
            pass
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """Generation ended: release what was held back, as (reasoning, content)."""
        held, self._held = self._held, ""
        state, self._state = self._state, _CONTENT
        if state == _BEFORE:
            return "", held
        if state in (_OPENING, _REASONING):
            return held, ""
        return "", ""  # _AFTER held only whitespace to drop; _CONTENT holds nothing

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """A whole output: (reasoning, content), each None when empty."""
        parser = ReasoningParser(self.start, self.end, self.starts_in_reasoning)
        r1, c1 = parser.feed(text)
        r2, c2 = parser.finish()
        return (r1 + r2) or None, (c1 + c2) or None

    def _advance(self, reasoning: list[str], content: list[str]) -> bool:
        """Move the state on over the held text; False when the rest must wait for more text."""
        held = self._held
        if self._state in (_BEFORE, _OPENING):
            head = held.lstrip()
            lead = held[:len(held) - len(head)]
            before = content if self._state == _BEFORE else reasoning
            if head.startswith(self.start):
                before.append(lead)
                self._held, self._state = head[len(self.start):], _REASONING
                return True
            if self.start.startswith(head):
                return False  # only whitespace, or maybe the start marker cut short
            self._state = _CONTENT if self._state == _BEFORE else _REASONING
            return True
        if self._state == _REASONING:
            at = held.find(self.end)
            if at < 0:
                cut = len(held) - _partial_suffix(held, self.end)
                reasoning.append(held[:cut])
                self._held = held[cut:]
                return False
            reasoning.append(held[:at])
            self._held, self._state = held[at + len(self.end):], _AFTER
            return True
        if self._state == _AFTER:
            self._held = held.lstrip()
            if not self._held:
                return False
            self._state = _CONTENT
            return True
        content.append(held)
        self._held = ""
        return False


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


REASONING_PARSERS: dict[str, dict] = {
    "think": dict(start="<think>", end="</think>", starts_in_reasoning=False),
    "qwen3": dict(start="<think>", end="</think>", starts_in_reasoning=False),
    "deepseek_r1": dict(start="<think>", end="</think>", starts_in_reasoning=True),
}


def make_reasoning_parser(name: str) -> ReasoningParser:
    """A fresh parser for one message, by the name the server was configured with."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    return ReasoningParser(**REASONING_PARSERS[name])
