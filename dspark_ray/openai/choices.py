"""Choices: one OpenAI request fanned out into engine requests, and their outputs merged back.

A completions request with P prompts and n choices becomes P x n independent
engine requests, each with its own slot; choice ``p * n + i`` is prompt p's
i-th sample, the order OpenAI returns them in. A seeded request's choice i
runs with seed + i, so every choice is reproducible and choice 0 equals the
same request sent with n = 1.

Starting is all or nothing: every choice is submitted at once, and if one
cannot start (overload, a dead engine) the others are aborted before the
error is returned, so a refused request leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from dspark_ray.engine import InvalidRequest, RequestOutput, SamplingParams
from dspark_ray.engine.outputs import TokenLogprob
from dspark_ray.openai.protocol import PromptTokensDetails, Usage
from dspark_ray.runtime.engine_loop import EngineLoop


@dataclass
class Choice:
    """One engine request of a fanned-out OpenAI request, and what it produced so far."""

    index: int
    prompt: int  # which of the request's prompts
    prompt_ids: list[int]
    params: SamplingParams
    req_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    last: RequestOutput | None = None

    def take(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.last = out

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)


def fan_out(prompts: list[list[int]], params: SamplingParams, req_id: str) -> list[Choice]:
    """P prompts x params.n samples, in OpenAI's order (``SamplingParams.samples`` seeds them)."""
    samples = params.samples()
    total = len(prompts) * len(samples)
    return [Choice(p * len(samples) + i, p, ids, sample, req_id if total == 1 else f"{req_id}-{p * len(samples) + i}")
            for p, ids in enumerate(prompts) for i, sample in enumerate(samples)]


def check_fan_out(field: str, runs: int, most: int) -> int:
    """Choices per prompt run at once, on one replica: at most ``most``, its slots (each holds one)."""
    if runs > most:
        raise InvalidRequest(field, f"at most {most} (the slots one replica holds), got {runs}")
    return runs


def request_deadline(timeout_s: float | None, limit_s: float | None) -> float | None:
    """When a request's choices end if unfinished: its own ``timeout_s`` or the server's ``limit_s``,
    the shorter, from now (None: neither is set)."""
    limits = [t for t in (timeout_s, limit_s) if t is not None]
    return time.monotonic() + min(limits) if limits else None


def best_of(choices: list[Choice], keep: int) -> list[Choice]:
    """Per prompt, the ``keep`` choices of highest cumulative log-probability (best_of), renumbered."""
    if len({c.prompt for c in choices}) * keep == len(choices):
        return choices
    shown = []
    for p in sorted({c.prompt for c in choices}):
        ranked = sorted((c for c in choices if c.prompt == p), key=lambda c: -c.cumulative_logprob)[:keep]
        for i, c in enumerate(sorted(ranked, key=lambda c: c.index)):
            c.index = p * keep + i
            shown.append(c)
    return shown


def total_usage(choices: list[Choice]) -> Usage:
    """Each prompt counted once, every generated token counted."""
    prompt = sum({c.prompt: c.last.num_prompt_tokens for c in choices}.values())
    cached = sum({c.prompt: c.last.num_cached_tokens for c in choices}.values())
    completion = sum(c.last.num_output_tokens for c in choices)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=min(cached, prompt)))


class ChoiceStreams:
    """The engine streams of a request's choices, started together."""

    def __init__(self, loop: EngineLoop, choices: list[Choice], deadline: float | None = None) -> None:
        self.choices = choices
        self._streams = [loop.generate(c.prompt_ids, c.params, c.req_id, deadline) for c in choices]
        self._firsts: list[RequestOutput] = []

    async def start(self) -> None:
        """Submit every choice and wait for each one's first output; on any error abort all and raise."""
        results = await asyncio.gather(*(anext(s) for s in self._streams), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise errors[0]
        self._firsts = list(results)

    async def close(self) -> None:
        """Abort whatever is still running (idempotent)."""
        for s in self._streams:
            await s.aclose()

    async def _follow(self, i: int, queue: asyncio.Queue) -> None:
        try:
            await queue.put((i, self._firsts[i]))
            if not self._firsts[i].finished:
                async for out in self._streams[i]:
                    await queue.put((i, out))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))

    async def merged(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Every choice's outputs as they come (each also taken into its Choice); raises a stream's error."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._follow(i, queue)) for i in range(len(self.choices))]
        running = len(self.choices)
        try:
            while running:
                i, out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                self.choices[i].take(out)
                running -= out.finished
                yield self.choices[i], out
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.close()

    async def gather(self) -> list[Choice]:
        """Run every choice to its end."""
        async for _ in self.merged():
            pass
        return self.choices
