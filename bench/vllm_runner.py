"""The benchmark workload through vLLM, run inside vLLM's own venv; results as JSON.

    bash bench/setup_vllm.sh                      # once: bench/.vllm-venv
    bench/.vllm-venv/bin/python bench/vllm_runner.py --json - --method draft_model -k 4 --batches 1 8
    bench/.vllm-venv/bin/python bench/vllm_runner.py --json out.json --method none --batches 1

bench/compare.py calls this as a subprocess: vLLM pins its own torch, so it
cannot share the project's venv. The workload is the one bench/compare.py
gives dspark_ray in process: held-out prompts, greedy, exactly --max-tokens
output tokens (ignore_eos and min_tokens), batch b = b requests submitted at
once, one warm-up round first. Requests go through vLLM's AsyncLLM with
streamed deltas, so each engine step's output gets a timestamp; the figures
come from bench/metrics.py like everyone else's. vLLM counts speculation only
in aggregate (its Prometheus counters), read before and after each run.

--method: none (target alone), draft_model (the shipped draft proposes k
tokens, verified by the target) or ngram (prompt lookup, no draft model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DRAFT, TARGET, load_prompts  # noqa: E402
from metrics import RequestTrace  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="write results here; - for stdout")
    ap.add_argument("--model", default=str(TARGET))
    ap.add_argument("--draft", default=str(DRAFT))
    ap.add_argument("--method", choices=["none", "draft_model", "ngram"], default="draft_model")
    ap.add_argument("-k", type=int, default=4, help="speculative tokens per step")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats-at-1", type=int, default=8, help="rounds at batch 1")
    ap.add_argument("--rounds", type=int, default=1, help="rounds at larger batches")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2, help="cores the engine's OpenMP threads bind to (0..n-1)")
    return ap.parse_args(argv)


def speculative_config(args: argparse.Namespace) -> dict | None:
    if args.method == "draft_model":
        return {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}
    if args.method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    return None


def spec_counts() -> tuple[int, int]:
    """(drafts, accepted draft tokens) so far, from vLLM's in-process Prometheus counters."""
    from vllm.v1.metrics.reader import Counter, get_metrics_snapshot

    values = {m.name: m.value for m in get_metrics_snapshot() if isinstance(m, Counter)}
    return int(values.get("vllm:spec_decode_num_drafts", 0)), int(values.get("vllm:spec_decode_num_accepted_tokens", 0))


async def traced(engine, prompt: str, params, request_id: str) -> RequestTrace:
    trace = RequestTrace(sent=time.perf_counter())
    async for out in engine.generate(prompt, params, request_id):
        new = len(out.outputs[0].token_ids)  # a delta: this step's tokens
        if new:
            trace.deliver(time.perf_counter(), new)
            trace.output_tokens += new
    return trace


async def run_round(engine, prompts: list[str], params, tag: str) -> list[RequestTrace]:
    return list(await asyncio.gather(*(traced(engine, p, params, f"{tag}-{i}") for i, p in enumerate(prompts))))


async def run(args: argparse.Namespace) -> dict:
    import vllm
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=args.model, dtype=args.dtype, enforce_eager=True, seed=0, max_num_seqs=max(args.batches),
        speculative_config=speculative_config(args), disable_log_stats=False))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, min_tokens=args.max_tokens,
                            ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    results = []
    try:
        for b in args.batches:
            rounds = args.repeats_at_1 if b == 1 else args.rounds
            await run_round(engine, load_prompts(b), params, f"warmup{b}")
            prompts = load_prompts(b * rounds)
            traces, seconds = [], 0.0
            drafts0, accepted0 = spec_counts()
            for r in range(rounds):
                start = time.perf_counter()
                traces += await run_round(engine, prompts[r * b:(r + 1) * b], params, f"b{b}r{r}")
                seconds += time.perf_counter() - start
            drafts, accepted = spec_counts()
            results.append({"batch": b, "seconds": seconds, "traces": [asdict(t) for t in traces],
                            "spec_totals": [drafts - drafts0, accepted - accepted0]})
            print(f"vllm_runner: batch {b} done in {seconds:.1f}s", file=sys.stderr, flush=True)
    finally:
        engine.shutdown()
        del engine  # now, not at interpreter exit, when its __del__ fails on torn-down globals
    return {"vllm_version": vllm.__version__, "method": args.method, "k": args.k,
            "speculative_config": speculative_config(args), "results": results}


def preload_intel_openmp() -> None:
    """Re-run this script with the venv's Intel OpenMP preloaded, as vLLM's CPU guide asks.

    Without it vLLM warns that speculative decoding on CPU "will cause
    significant performance loss"; the peer should run as its docs say.
    """
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    preload = os.environ.get("LD_PRELOAD", "")
    if lib.is_file() and str(lib) not in preload:
        env = {**os.environ, "LD_PRELOAD": ":".join(p for p in (str(lib), preload) if p)}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main() -> None:
    args = parse_args()
    preload_intel_openmp()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes a large share of RAM
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    data = asyncio.run(run(args))
    text = json.dumps(data)
    if args.json == "-":
        print(text)
    else:
        Path(args.json).write_text(text)


if __name__ == "__main__":  # vLLM starts its engine core with spawn, which re-imports this module
    main()
