"""HTTP load generator for OpenAI-compatible servers (dspark_ray's Serve app, vLLM's server).

    .venv/bin/serve run deploy/dspark.yaml &                # or any server on localhost
    .venv/bin/python bench/loadgen.py --concurrency 8 --requests 64 --max-tokens 64
    .venv/bin/python bench/loadgen.py --rate 2 --duration 60 --json bench/out/load.json
    dspark loadgen --concurrency 1 --requests 8

Streams /v1/completions with the async ``openai`` client, greedily, with a
fixed output length (``ignore_eos``), over held-out prompts. Two ways to load
the server:

- fixed concurrency (closed loop): N workers, each sends its next request as
  soon as its last one ends;
- arrival rate (open loop): requests start at Poisson-distributed times with
  the given mean rate, however many are still in flight.

Either way it stops sending after ``--requests`` requests or ``--duration``
seconds, whichever comes first, and waits for those in flight. It reports the
figures of bench/metrics.py plus errors counted by HTTP status (or
``timeout`` / ``connection`` / ``stream_error``). Only localhost is a target
unless ``--allow-remote`` is given: a benchmark is load, not a probe.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import openai
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_prompts  # noqa: E402
from metrics import RequestTrace, Summary, summarize  # noqa: E402

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


class RemoteTargetRefused(ValueError):
    """The base URL is not this machine and --allow-remote was not given."""


class NoUsageReported(RuntimeError):
    """The server ignored stream_options.include_usage, so output tokens cannot be counted."""


@dataclass(frozen=True)
class LoadConfig:
    """One load run. Give exactly one of ``concurrency`` and ``rate``."""

    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None  # None: the first model the server lists
    max_tokens: int = 64
    concurrency: int | None = None
    rate: float | None = None  # requests per second, open loop
    requests: int = 64
    duration_s: float | None = None
    timeout_s: float = 600.0
    api_key: str = "EMPTY"
    extra_body: dict = field(default_factory=lambda: {"ignore_eos": True})
    seed: int = 0
    allow_remote: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) and rate (open loop, requests/s)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be positive requests/s, got {self.rate}")
        if self.requests < 1:
            raise ValueError(f"requests must be at least 1, got {self.requests}")
        host = urlparse(self.base_url).hostname
        if host not in LOCAL_HOSTS and not self.allow_remote:
            raise RemoteTargetRefused(
                f"{self.base_url} is not localhost; pass allow_remote=True (--allow-remote) to load another machine")


@dataclass
class LoadResult:
    summary: Summary
    traces: list[RequestTrace]
    error_examples: dict[str, str]  # first message seen for each error kind

    def to_dict(self) -> dict:
        return {"summary": self.summary.to_dict(), "error_examples": self.error_examples}


def _error_kind(exc: openai.APIError) -> str:
    if isinstance(exc, openai.APIStatusError):
        return str(exc.status_code)
    if isinstance(exc, openai.APITimeoutError):
        return "timeout"
    if isinstance(exc, openai.APIConnectionError):
        return "connection"
    return "stream_error"  # an error event inside a 200 stream


def _speculation(chunk) -> dict | None:
    """dspark_ray's extension field on the last chunk (absent on other servers)."""
    spec = (chunk.model_extra or {}).get("speculation")
    return spec if isinstance(spec, dict) else None


async def send_one(client: openai.AsyncOpenAI, cfg: LoadConfig, model: str, prompt: str,
                   errors: dict[str, str]) -> RequestTrace:
    """Stream one completion; the trace has an arrival per chunk that carried text."""
    trace = RequestTrace(sent=time.perf_counter())
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=cfg.max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body=cfg.extra_body)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                trace.deliver(time.perf_counter(), 0)  # tokens per chunk are not in the stream
            if chunk.usage is not None:
                trace.output_tokens = chunk.usage.completion_tokens
            if spec := _speculation(chunk):
                trace.drafts, trace.accepted_tokens = spec["drafts"], spec["accepted_tokens"]
    except openai.APIError as exc:
        trace.error = _error_kind(exc)
        errors.setdefault(trace.error, str(exc))
    if trace.error is None and trace.output_tokens == 0:
        raise NoUsageReported(f"{cfg.base_url} sent no usage for a stream with include_usage; cannot count tokens")
    return trace


async def _closed_loop(cfg: LoadConfig, send, deadline: float) -> list[RequestTrace]:
    left = iter(range(cfg.requests))

    async def worker() -> list[RequestTrace]:
        out = []
        for i in left:
            if time.perf_counter() >= deadline:
                break
            out.append(await send(i))
        return out

    per_worker = await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
    return [t for traces in per_worker for t in traces]


async def _open_loop(cfg: LoadConfig, send, deadline: float) -> list[RequestTrace]:
    rng = random.Random(cfg.seed)
    tasks = []
    for i in range(cfg.requests):
        if time.perf_counter() >= deadline:
            break
        tasks.append(asyncio.create_task(send(i)))
        await asyncio.sleep(rng.expovariate(cfg.rate))
    return list(await asyncio.gather(*tasks))


async def run_load(cfg: LoadConfig, prompts: list[str] | None = None) -> LoadResult:
    """Run ``cfg`` against the server; prompts cycle if there are fewer than requests."""
    prompts = prompts or load_prompts(cfg.requests)
    errors: dict[str, str] = {}
    async with openai.AsyncOpenAI(base_url=cfg.base_url, api_key=cfg.api_key, max_retries=0,
                                  timeout=cfg.timeout_s) as client:
        model = cfg.model or (await client.models.list()).data[0].id
        with tqdm(total=cfg.requests, desc=f"load {cfg.base_url}", disable=not cfg.progress,
                  file=sys.stderr) as bar:

            async def send(i: int) -> RequestTrace:
                trace = await send_one(client, cfg, model, prompts[i % len(prompts)], errors)
                bar.update(1)
                return trace

            start = time.perf_counter()
            deadline = start + cfg.duration_s if cfg.duration_s else float("inf")
            loop = _closed_loop if cfg.concurrency is not None else _open_loop
            traces = await loop(cfg, send, deadline)
            seconds = time.perf_counter() - start
    return LoadResult(summarize(traces, seconds), traces, errors)


def format_summary(s: Summary) -> str:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    acc = "-" if s.mean_acceptance_length is None else f"{s.mean_acceptance_length:.2f}"
    return "\n".join([
        f"requests           {s.completed}/{s.requests} completed in {s.seconds:.1f}s",
        f"output tokens/s    {s.tokens_per_s:.1f} ({s.output_tokens} tokens)",
        f"TTFT ms            p50 {f(s.ttft_ms_p50)}  p99 {f(s.ttft_ms_p99)}",
        f"ITL ms (per chunk) p50 {f(s.itl_ms_p50)}  p99 {f(s.itl_ms_p99)}",
        f"TPOT ms (mean)     {f(s.tpot_ms_mean)}",
        f"mean accept. len.  {acc}",
        f"errors             {s.errors or 'none'}",
    ])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The load generator's options (shared with `dspark loadgen`)."""
    ap.add_argument("--base-url", default=LoadConfig.base_url)
    ap.add_argument("--model", default=None, help="default: the first model the server lists")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, help="closed loop: requests in flight (default 8)")
    mode.add_argument("--rate", type=float, help="open loop: mean Poisson arrival rate, requests/s")
    ap.add_argument("--requests", type=int, default=64, help="requests to send at most")
    ap.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (fixed: ignore_eos)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--api-key", default="EMPTY")
    ap.add_argument("--extra-body", type=json.loads, default={"ignore_eos": True},
                    help='JSON merged into each request body (default {"ignore_eos": true})')
    ap.add_argument("--seed", type=int, default=0, help="seeds the Poisson arrival times")
    ap.add_argument("--allow-remote", action="store_true", help="allow a base URL that is not localhost")
    ap.add_argument("--json", type=Path, default=None, help="also write the summary and traces here")
    ap.add_argument("--no-progress", action="store_true")


def run_cli(args: argparse.Namespace) -> int:
    try:
        cfg = LoadConfig(
            base_url=args.base_url, model=args.model, max_tokens=args.max_tokens,
            concurrency=args.concurrency if args.concurrency or args.rate else 8, rate=args.rate,
            requests=args.requests, duration_s=args.duration, timeout_s=args.timeout, api_key=args.api_key,
            extra_body=args.extra_body, seed=args.seed, allow_remote=args.allow_remote,
            progress=not args.no_progress)
    except ValueError as exc:  # RemoteTargetRefused included
        print(f"loadgen: {exc}", file=sys.stderr)
        return 2
    result = asyncio.run(run_load(cfg))
    print(format_summary(result.summary))
    for kind, message in result.error_examples.items():
        print(f"  {kind}: {message}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = {**result.to_dict(), "config": {k: v for k, v in cfg.__dict__.items()},
                "traces": [t.__dict__ for t in result.traces]}
        args.json.write_text(json.dumps(data, indent=2))
    return 1 if result.summary.completed == 0 else 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run_cli(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
