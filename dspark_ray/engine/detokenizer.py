"""OutputText: a request's streamed text, with stop strings cut out.

Text is released as soon as it is complete, except the last
``len(longest stop string) - 1`` characters, which could still turn out to be
the start of a stop string. When a stop string appears, the text before it is
released and the stop string itself is not (OpenAI's behaviour), unless
``include_stop`` asks for it (vLLM's ``include_stop_str_in_output``).
"""

from __future__ import annotations

from dspark_ray.tokenizer import IncrementalDecoder, Tokenizer


class OutputText:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], skip_special_tokens: bool,
                 include_stop: bool = False) -> None:
        self._decoder = IncrementalDecoder(tokenizer, skip_special_tokens)
        self._stop = stop
        self._include_stop = include_stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # decoded so far, maybe past a stop string
        self.released = 0  # characters of text handed out

    def push(self, ids: list[int], check_stop: bool = True) -> tuple[str, str | None]:
        """Feed new token ids; returns (text to release, the stop string hit or None).

        ``check_stop=False`` (before min_tokens are out) looks for no stop string.
        """
        before = len(self.text)
        self.text += self._decoder.push(ids)
        if self._stop and check_stop:
            start = max(0, before - self._hold)
            hits = [(i, s) for s in self._stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                cut, stop = min(hits)
                return self._release(cut + len(stop) if self._include_stop else cut), stop
        return self._release(len(self.text) - self._hold), None

    def finish(self) -> str:
        """The request ended without a stop string: release everything held back."""
        self.text += self._decoder.finish()
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.released:
            return ""
        out = self.text[self.released:upto]
        self.released = upto
        return out
