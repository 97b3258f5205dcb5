"""dspark_ray against its peers, side by side: one workload through every system in turn.

    bash bench/setup_vllm.sh                                  # once, for the vLLM rows
    .venv/bin/python bench/compare.py                         # everything; also `dspark bench`
    .venv/bin/python bench/compare.py --systems dspark vllm --batches 1 8 --max-tokens 32

Systems (--systems; default all but vllm-ngram):

    dspark, dspark-nospec          dspark_ray in process (the offline LLM engine), speculation on / off
    serve-tp1, serve-tp1-nospec    dspark_ray through Ray Serve, target tensor-parallel 1, over HTTP
    serve-tp2, serve-tp2-nospec    the same with the target split over 2 shards (gloo on CPU)
    vllm, vllm-nospec, vllm-ngram  vLLM (bench/.vllm-venv): draft_model speculation on the same pair,
                                   the target alone, prompt-lookup (ngram) speculation
    transformers                   transformers generate and assisted generation, batch 1 only

The workload: held-out prompts (bench/prompts.jsonl), greedy, exactly
--max-tokens output tokens per request. At batch b the in-process engines get
b requests at once, --rounds times (--repeats-at-1 at batch 1) after one
warm-up round; the Serve app gets the same requests from the load generator
at a fixed concurrency of b (bench/loadgen.py). Figures (bench/metrics.py):
output tokens/s, TTFT, inter-token latency p50/p99, TPOT, mean acceptance
length, each row's speed relative to dspark_ray in process with speculation
at the same batch. Results go to bench/out/compare.{md,json}, rewritten
after each system so a stopped run keeps what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_DIR, DRAFT, TARGET, load_prompts, machine, save  # noqa: E402
from loadgen import LoadConfig, run_load  # noqa: E402
from metrics import RequestTrace, Summary, summarize  # noqa: E402

VLLM_PYTHON = BENCH_DIR / ".vllm-venv" / "bin" / "python"


class SystemUnavailable(RuntimeError):
    """A system could not be run (its venv is missing, its process failed); the rest of the run goes on."""


@dataclass(frozen=True)
class System:
    name: str  # the --systems key
    kind: str  # inprocess | serve | vllm | transformers
    spec: bool = True
    tp: int = 1
    vllm_method: str = "none"


SYSTEMS = {s.name: s for s in [
    System("dspark", "inprocess"),
    System("dspark-nospec", "inprocess", spec=False),
    System("serve-tp1", "serve", tp=1),
    System("serve-tp1-nospec", "serve", spec=False, tp=1),
    System("serve-tp2", "serve", tp=2),
    System("serve-tp2-nospec", "serve", spec=False, tp=2),
    System("vllm", "vllm", vllm_method="draft_model"),
    System("vllm-nospec", "vllm", spec=False),
    System("vllm-ngram", "vllm", vllm_method="ngram"),
    System("transformers", "transformers"),
]}
DEFAULT_SYSTEMS = [name for name in SYSTEMS if name != "vllm-ngram"]


def label(s: System, k: int) -> str:
    spec = f"spec k={k}" if s.spec else "no spec"
    if s.kind == "inprocess":
        return f"dspark_ray in-process, {spec}"
    if s.kind == "serve":
        return f"dspark_ray Serve TP={s.tp}, {spec}"
    if s.kind == "vllm":
        return f"vLLM, {s.vllm_method} k={k}" if s.spec else "vLLM, no spec"
    return "transformers"


@dataclass
class Result:
    system: str
    batch: int
    summary: Summary

    @property
    def tokens_per_s(self) -> float:
        return self.summary.tokens_per_s


def rounds_at(batch: int, args: argparse.Namespace) -> int:
    return args.repeats_at_1 if batch == 1 else args.rounds


# -- dspark_ray in process ------------------------------------------------------


def generate_traced(engine, prompts: list, params) -> list[RequestTrace]:
    """Like LLM.generate, with a timestamp on every engine step's output; ``params`` is one SamplingParams
    for every prompt or a list of one per prompt."""
    sent = time.perf_counter()
    each = params if isinstance(params, list) else [params] * len(prompts)
    traces = {engine.add_request(p, sp): RequestTrace(sent=sent) for p, sp in zip(prompts, each, strict=True)}
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            trace = traces[out.req_id]
            if out.new_token_ids:
                trace.deliver(now, len(out.new_token_ids))
            if out.finished:
                trace.output_tokens = out.num_output_tokens
                if out.finish_reason in ("error", "abort"):
                    trace.error = f"engine {out.finish_reason}"
                if out.spec is not None:
                    trace.drafts, trace.accepted_tokens = out.spec.drafts, out.spec.accepted_tokens
    return list(traces.values())


def run_inprocess(s: System, args: argparse.Namespace) -> list[Result]:
    from dspark_ray import LLM, SamplingParams

    llm = LLM(args.model, args.draft if s.spec else None, num_speculative_tokens=args.k, max_context=512,
              capacity=max(64, *args.batches), max_num_seqs=max(64, *args.batches), dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    results = []
    for b in args.batches:
        generate_traced(llm.engine, load_prompts(b), params)  # warm-up
        rounds = rounds_at(b, args)
        prompts, traces, seconds = load_prompts(b * rounds), [], 0.0
        for r in range(rounds):
            start = time.perf_counter()
            traces += generate_traced(llm.engine, prompts[r * b:(r + 1) * b], params)
            seconds += time.perf_counter() - start
        results.append(Result(label(s, args.k), b, summarize(traces, seconds)))
    return results


# -- dspark_ray through Ray Serve -------------------------------------------------


def start_serve(port: int) -> None:
    import ray
    from ray import serve

    if not ray.is_initialized():
        # address="local": our own cluster, never one another user started on this machine.
        ray.init(address="local", num_cpus=4, object_store_memory=200 * 2**20, include_dashboard=False,
                 log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})


def stop_serve() -> None:
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        from ray import serve

        serve.shutdown()
        ray.shutdown()


def run_serve(s: System, args: argparse.Namespace) -> list[Result]:
    from ray import serve

    from dspark_ray.serve.app import build_app

    start_serve(args.port)
    app = build_app({
        "model": args.model, "draft": args.draft if s.spec else None,
        "num_speculative_tokens": args.k if s.spec else 0, "tensor_parallel_size": s.tp,
        "capacity": max(64, *args.batches), "max_num_seqs": max(args.batches), "max_context": 512,
        "dtype": args.dtype, "torch_threads": max(1, args.threads // s.tp), "cpus_per_shard": 0.25,
    })
    serve.run(app, name="dspark", route_prefix="/")
    url = f"http://127.0.0.1:{args.port}/v1"
    results = []
    try:
        for b in args.batches:
            warm = LoadConfig(base_url=url, max_tokens=args.max_tokens, concurrency=b, requests=b, progress=False)
            asyncio.run(run_load(warm, load_prompts(b)))
            n = b * rounds_at(b, args)
            cfg = LoadConfig(base_url=url, max_tokens=args.max_tokens, concurrency=b, requests=n)
            load = asyncio.run(run_load(cfg, load_prompts(n)))
            for kind, message in load.error_examples.items():
                print(f"  {label(s, args.k)} batch {b}: {kind}: {message}", file=sys.stderr)
            results.append(Result(label(s, args.k), b, load.summary))
    finally:
        serve.delete("dspark")
    return results


# -- vLLM (its own venv, a subprocess) ---------------------------------------------


def run_vllm(s: System, args: argparse.Namespace) -> list[Result]:
    if not VLLM_PYTHON.is_file():
        raise SystemUnavailable(f"no {VLLM_PYTHON}; run `bash bench/setup_vllm.sh` first")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "vllm.json"
        cmd = [str(VLLM_PYTHON), str(BENCH_DIR / "vllm_runner.py"), "--json", str(out),
               "--model", args.model, "--draft", args.draft, "--method", s.vllm_method, "-k", str(args.k),
               "--batches", *map(str, args.batches), "--max-tokens", str(args.max_tokens),
               "--repeats-at-1", str(args.repeats_at_1), "--rounds", str(args.rounds),
               "--dtype", args.dtype, "--threads", str(args.threads)]
        log = Path(tmp) / "vllm.log"
        with log.open("w") as fh:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
        if rc != 0 or not out.is_file():
            tail = "\n".join(log.read_text().splitlines()[-15:])
            raise SystemUnavailable(f"{label(s, args.k)}: vllm_runner.py exited {rc}:\n{tail}")
        data = json.loads(out.read_text())
    name = f"{label(s, args.k)} ({data['vllm_version']})"
    return [Result(name, r["batch"], summarize([RequestTrace.from_dict(t) for t in r["traces"]], r["seconds"],
                                               tuple(r["spec_totals"]) if s.spec else None))
            for r in data["results"]]


# -- transformers (bench/spec.py) ---------------------------------------------------


def run_transformers(s: System, args: argparse.Namespace) -> list[Result]:
    from spec import run_transformers as spec_run_transformers

    if 1 not in args.batches:
        return []
    rows = spec_run_transformers(load_prompts(args.repeats_at_1), args.max_tokens, args.k)
    return [Result(row.system, 1, Summary(
        requests=args.repeats_at_1, completed=args.repeats_at_1, output_tokens=row.output_tokens,
        seconds=row.seconds, ttft_ms_p50=None, ttft_ms_p99=None, itl_ms_p50=None, itl_ms_p99=None,
        tpot_ms_mean=None, mean_acceptance_length=None, errors={})) for row in rows]


RUNNERS = {"inprocess": run_inprocess, "serve": run_serve, "vllm": run_vllm, "transformers": run_transformers}


# -- the table ------------------------------------------------------------------------


def baselines(results: list[Result], k: int) -> dict[int, Result]:
    """Per batch: dspark_ray in process with speculation, else the first dspark_ray row measured."""
    base: dict[int, Result] = {}
    for r in results:
        if r.system.startswith("dspark_ray") and r.batch not in base:
            base[r.batch] = r
    for r in results:
        if r.system == label(SYSTEMS["dspark"], k):
            base[r.batch] = r
    return base


def table(results: list[Result], k: int) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    base = baselines(results, k)
    lines = ["| system | batch | output tok/s | vs dspark_ray | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
             "| ITL p99 ms | TPOT ms | mean acceptance length | completed | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted(results, key=lambda r: r.batch):
        s, b = r.summary, base.get(r.batch)
        ratio = f"{s.tokens_per_s / b.tokens_per_s:.2f}x" if b and b.tokens_per_s else "-"
        acc = "-" if s.mean_acceptance_length is None else f"{s.mean_acceptance_length:.2f}"
        errors = ", ".join(f"{k_}: {n}" for k_, n in s.errors.items()) or "-"
        lines.append(f"| {r.system} | {r.batch} | {s.tokens_per_s:.1f} | {ratio} | {ms(s.ttft_ms_p50)} "
                     f"| {ms(s.ttft_ms_p99)} | {ms(s.itl_ms_p50)} | {ms(s.itl_ms_p99)} | {ms(s.tpot_ms_mean)} "
                     f"| {acc} | {s.completed}/{s.requests} | {errors} |")
    return "\n".join(lines)


def report(results: list[Result], notes: list[str], args: argparse.Namespace) -> str:
    head = (f"Machine: {machine()}, {os.cpu_count()} CPUs. Workload: {args.max_tokens} greedy output tokens "
            f"per request (ignore_eos) from held-out prompts, dtype {args.dtype}, k={args.k}, "
            f"{args.threads} threads per engine; batch 1 = {args.repeats_at_1} requests one after another, "
            f"batch b > 1 = b at once x {args.rounds}. Ratio: output tok/s over dspark_ray in-process with "
            "speculation at the same batch. ITL is per streamed chunk (a speculative step delivers several "
            "tokens); TPOT is per token.")
    notes_md = "".join(f"\n\nNot run: {n}" for n in notes)
    return f"{head}\n\n{table(results, args.k)}{notes_md}"


# -- main -------------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared with `dspark bench`)."""
    ap.add_argument("--systems", nargs="+", default=DEFAULT_SYSTEMS, choices=[*SYSTEMS, "all"], metavar="SYSTEM",
                    help=f"any of {', '.join(SYSTEMS)}, or all (default: all but vllm-ngram)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="batch sizes / concurrencies")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (fixed)")
    ap.add_argument("--repeats-at-1", type=int, default=8, help="requests run one after another at batch 1")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of b requests at batch b > 1")
    ap.add_argument("-k", type=int, default=4, help="speculative tokens per step, every system")
    ap.add_argument("--threads", type=int, default=2, help="torch/OpenMP threads per engine (split over TP shards)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--model", default=str(TARGET),
                    help="target checkpoint (the transformers rows always use the shipped pair)")
    ap.add_argument("--draft", default=str(DRAFT))
    ap.add_argument("--port", type=int, default=8123, help="HTTP port of the benchmark's own Serve app")
    ap.add_argument("--name", default="compare", help="results go to bench/out/NAME.{md,json}")


def run_cli(args: argparse.Namespace) -> int:
    systems = list(SYSTEMS) if "all" in args.systems else args.systems
    torch.set_num_threads(args.threads)
    results: list[Result] = []
    notes: list[str] = []
    try:
        for name in systems:
            s = SYSTEMS[name]
            print(f"== {label(s, args.k)}", file=sys.stderr, flush=True)
            try:
                results += RUNNERS[s.kind](s, args)
            except SystemUnavailable as exc:
                notes.append(str(exc))
                print(f"   not run: {exc}", file=sys.stderr, flush=True)
            gc.collect()
            save(args.name, results, report(results, notes, args))
    finally:
        stop_serve()
    print(report(results, notes, args))
    return 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run_cli(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
