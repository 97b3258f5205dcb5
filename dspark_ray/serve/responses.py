"""Responses: a request's choices rendered as OpenAI bodies and stream chunks.

``CompletionView`` and ``ChatView`` hold what a response needs besides the
choices (echoed prompt text, whether log-probabilities were asked for) and
turn a finished ``Choice`` into a ``choices[]`` entry, or one engine output
into a streamed chunk's entry. Text offsets of streamed completions
log-probabilities continue across chunks, so the streamed pieces read like
the whole response.
"""

from __future__ import annotations

from collections.abc import Callable

from dspark_ray.engine import RequestOutput
from dspark_ray.serve.choices import Choice
from dspark_ray.serve.protocol import chat_logprobs, completion_logprobs


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


class ChatView:
    """``chat.completion`` choices: an assistant message and the chat logprobs object."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, token_text: Callable[[int], str], echo: str, logprobs: bool) -> None:
        self.token_text = token_text
        self.echo = echo  # the last message's content when it is the assistant's and echo is on, else ""
        self.logprobs = logprobs

    def choice(self, c: Choice) -> dict:
        return {"index": c.index, "message": {"role": "assistant", "content": self.echo + c.text},
                "logprobs": chat_logprobs(c.logprobs, self.token_text) if self.logprobs else None,
                "finish_reason": c.last.finish_reason, "stop_reason": c.last.stop_reason}

    def head(self, c: Choice) -> dict | None:
        return {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def chunk(self, c: Choice, out: RequestOutput, first: bool) -> dict | None:
        text = (self.echo if first else "") + out.new_text
        entries = out.logprobs or [] if self.logprobs else []
        if not text and not entries and not out.finished:
            return None
        return {"index": c.index, "delta": {"content": text} if text else {},
                "logprobs": chat_logprobs(entries, self.token_text) if self.logprobs else None,
                "finish_reason": out.finish_reason, "stop_reason": out.stop_reason if out.finished else None}
