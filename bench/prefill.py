"""Long prompts beside running streams: chunked prefill against whole-prompt prefill, side by side.

    .venv/bin/python bench/prefill.py                     # 8 streams, 400-token prompts arriving
    .venv/bin/python bench/prefill.py --streams 16 --prompt-tokens 480 --budgets 32 64 4096
    .venv/bin/python bench/prefill.py --systems dspark vllm   # and vLLM's engine, same workload

The in-process engine (the shipped pair, k=4, one torch thread unless
--threads) runs --streams greedy streams of --stream-tokens tokens; every
--every steps a long prompt (--prompt-tokens tokens, --prompt-output tokens
out) arrives, while the streams run. Each --budgets value is one run with
that ``max_num_batched_tokens``: a small budget feeds the long prompts in
chunks beside the streams (decode rows first), 4096 feeds each whole in one
step. The runs alternate, --rounds times, so the machine's drift hits each
alike.

With ``--systems ... vllm`` the same workload also runs through vLLM's own
engine loop (``LLM.llm_engine``: add_request / step, in bench/.vllm-venv,
the same pair with draft_model speculation, k=4, float32, eager, one OpenMP
thread), with its ``max_num_batched_tokens`` set to each budget (vLLM chunks
prefills itself), so the two schedulers are compared step by step.

Figures per budget: the streams' inter-token latency p50 / p99 / max (ms
between two deliveries of one stream; a delivery carries 1..k+1 tokens),
their throughput, the long prompts' time to first token (mean), and the
steps and chunks run. The aim (issue 16): the streams' p99 within 2x of
their p50 while prompts arrive. Results go to bench/out/prefill.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_DIR, DRAFT, TARGET, load_prompts, machine  # noqa: E402


@dataclass
class Row:
    budget: int
    rounds: int
    itl_p50_ms: float
    itl_p99_ms: float
    itl_max_ms: float
    stream_tok_s: float
    long_ttft_ms: float
    steps: int
    prefill_chunks: int


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def one_run(engine, args, seed: int, params=None) -> tuple[list[float], float, int, list[float], int, int]:
    """(stream ITLs in ms, stream tokens/s, stream tokens, long TTFTs in ms, steps, chunks).
    ``params(max_tokens)``: the engine's sampling parameters (greedy, ignore_eos); dspark_ray's by default."""
    if params is None:
        from dspark_ray.engine import SamplingParams

        def params(n: int):
            return SamplingParams(max_tokens=n, ignore_eos=True)

    rng = random.Random(seed)
    tok = engine.tokenizer
    corpus = tok.encode(" ".join(load_prompts(64)), add_special_tokens=False)
    streams = {engine.add_request(p, params(args.stream_tokens)): []
               for p in load_prompts(args.streams)}
    live = set(streams)
    longs: dict[str, list[float]] = {}
    steps0, chunks0 = engine.counters.steps, engine.counters.prefill_chunks
    start = time.perf_counter()
    stream_tokens, step = 0, 0
    while engine.has_unfinished():
        if step % args.every == args.every - 1 and live:  # prompts arrive while the streams run
            at = rng.randrange(0, len(corpus) - args.prompt_tokens)
            rid = engine.add_request(corpus[at:at + args.prompt_tokens], params(args.prompt_output))
            longs[rid] = [time.perf_counter()]
        outs = engine.step()
        now = time.perf_counter()
        step += 1
        for out in outs:
            if out.req_id in streams and out.new_token_ids:
                streams[out.req_id].append(now)
                stream_tokens += len(out.new_token_ids)
            if out.req_id in streams and out.finished:
                live.discard(out.req_id)
            elif out.req_id in longs and out.new_token_ids and len(longs[out.req_id]) == 1:
                longs[out.req_id].append(now)
    seconds = max(t[-1] for t in streams.values()) - start  # the streams' lifetime
    itl = [1e3 * (b - a) for times in streams.values() for a, b in zip(times, times[1:])]
    ttft = [1e3 * (t[1] - t[0]) for t in longs.values() if len(t) == 2]
    return (itl, stream_tokens / seconds, stream_tokens, ttft, engine.counters.steps - steps0,
            engine.counters.prefill_chunks - chunks0)


VLLM_PYTHON = BENCH_DIR / ".vllm-venv" / "bin" / "python"


def vllm_child(args) -> None:
    """In bench/.vllm-venv: the workload through vLLM's engine loop, one engine per budget; JSON rows."""
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    rows = []
    for budget in args.budgets:
        llm = LLM(model=str(args.model), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
                  max_num_batched_tokens=budget, max_num_seqs=64, enable_chunked_prefill=True,
                  speculative_config={"method": "draft_model", "model": str(args.draft),
                                      "num_speculative_tokens": args.k})
        engine = llm.llm_engine
        adapter = _VllmEngine(engine, SamplingParams, RequestOutputKind)
        params = lambda n: argparse.Namespace(max_tokens=n)  # noqa: E731 - what the adapter reads
        one_run(adapter, argparse.Namespace(**{**vars(args), "streams": 2, "stream_tokens": 8}), 0, params)  # warm-up
        acc = {"itl": [], "tok": 0, "sec": 0.0, "ttft": [], "steps": 0, "chunks": 0}
        for r in range(args.rounds):
            itl, tok_s, tokens, ttft, steps, _ = one_run(adapter, args, seed=r, params=params)
            acc["itl"] += itl
            acc["tok"] += tokens
            acc["sec"] += tokens / tok_s
            acc["ttft"] += ttft
            acc["steps"] += steps
        rows.append(asdict(_row(budget, acc, args.rounds)))
        del llm, engine, adapter
    print("RESULT " + json.dumps(rows), flush=True)


class _VllmEngine:
    """vLLM's LLMEngine behind the few engine calls ``one_run`` makes (add_request, step, counters)."""

    def __init__(self, engine, sampling_params, output_kind) -> None:
        from tokenizers import Tokenizer

        self.engine, self.SamplingParams, self.kind = engine, sampling_params, output_kind
        self.tokenizer = _Tok(Tokenizer.from_file(str(TARGET / "tokenizer.json")))
        self.counters = argparse.Namespace(steps=0, prefill_chunks=0)
        self._next = 0

    def add_request(self, prompt, params) -> str:
        self._next += 1
        rid = f"r{self._next}"
        vp = self.SamplingParams(temperature=0.0, max_tokens=params.max_tokens, min_tokens=params.max_tokens,
                                 ignore_eos=True, output_kind=self.kind.DELTA)
        self.engine.add_request(rid, {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt, vp)
        return rid

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list:
        self.counters.steps += 1
        return [argparse.Namespace(req_id=o.request_id, new_token_ids=list(o.outputs[0].token_ids),
                                   finished=o.finished) for o in self.engine.step()]


class _Tok:
    def __init__(self, tok) -> None:
        self.tok = tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids


def _row(budget: int, a: dict, rounds: int) -> Row:
    return Row(budget, rounds, round(percentile(a["itl"], 50), 1), round(percentile(a["itl"], 99), 1),
               round(max(a["itl"]), 1), round(a["tok"] / a["sec"], 1),
               round(sum(a["ttft"]) / max(1, len(a["ttft"])), 1), a["steps"], a["chunks"])


def run_vllm(args) -> list[Row] | str:
    if not VLLM_PYTHON.exists():
        return "bench/.vllm-venv is missing (bash bench/setup_vllm.sh)"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"}
    iomp = BENCH_DIR / ".vllm-venv" / "lib" / "libiomp5.so"  # as vLLM's CPU guide asks (bench/vllm_runner.py)
    if iomp.is_file():
        env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
    cmd = [str(VLLM_PYTHON), __file__, "--vllm-child", "--budgets", *map(str, args.budgets),
           "--streams", str(args.streams), "--stream-tokens", str(args.stream_tokens),
           "--prompt-tokens", str(args.prompt_tokens), "--prompt-output", str(args.prompt_output),
           "--every", str(args.every), "--rounds", str(args.rounds), "-k", str(args.k),
           "--threads", str(args.threads), "--model", str(args.model), "--draft", str(args.draft)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3000)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        return f"vLLM failed (rc {proc.returncode}): {proc.stderr[-800:]}"
    return [Row(**r) for r in json.loads(line[len("RESULT "):])]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", nargs="+", choices=["dspark", "vllm"], default=["dspark"])
    ap.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, default=TARGET)
    ap.add_argument("--draft", type=Path, default=DRAFT)
    ap.add_argument("--budgets", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=160)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--prompt-output", type=int, default=4)
    ap.add_argument("--every", type=int, default=8, help="a long prompt arrives every this many steps")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--name", default="prefill")
    args = ap.parse_args(argv)
    if args.vllm_child:
        return vllm_child(args)
    torch.set_num_threads(args.threads)
    systems: dict[str, list[Row]] = {}
    notes = []
    if "dspark" in args.systems:
        systems["dspark"] = run_dspark(args)
    if "vllm" in args.systems:
        got = run_vllm(args)
        if isinstance(got, str):
            notes.append(f"vllm: {got}")
        else:
            systems["vllm"] = got
    lines = ["| system | max_num_batched_tokens | stream ITL p50 ms | p99 ms | p99 / p50 | max ms | stream tok/s | "
             "long-prompt TTFT ms | steps | prefill chunks |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for system, rows in systems.items():
        for row in rows:
            lines.append(f"| {system} | {row.budget} | {row.itl_p50_ms} | {row.itl_p99_ms} | "
                         f"{row.itl_p99_ms / row.itl_p50_ms:.2f} | {row.itl_max_ms} | {row.stream_tok_s} | "
                         f"{row.long_ttft_ms} | {row.steps} | {row.prefill_chunks if system == 'dspark' else ''} |")
    print("\n".join(lines + notes))
    out = BENCH_DIR / "out"
    out.mkdir(exist_ok=True)
    cmd = "python bench/prefill.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (out / f"{args.name}.md").write_text("\n".join([
        f"# Long prompts beside running streams ({time.strftime('%Y-%m-%d %H:%M')})", "",
        f"`{cmd}` on {machine()}: {args.streams} streams of {args.stream_tokens} tokens, a "
        f"{args.prompt_tokens}-token prompt every {args.every} steps, k={args.k}, {args.rounds} rounds.", "",
        *lines, *notes, ""]))
    (out / f"{args.name}.json").write_text(json.dumps({"machine": machine(), "args": vars(args) | {"model": str(
        args.model), "draft": str(args.draft)}, "rows": {k: [asdict(r) for r in v] for k, v in systems.items()},
        "notes": notes}, indent=2))
    print(f"wrote bench/out/{args.name}.md")


def run_dspark(args) -> list[Row]:
    from dspark_ray.engine.config import EngineConfig
    from dspark_ray.engine.local import build_local_engine

    engines = {}
    for budget in args.budgets:
        cfg = EngineConfig(model=str(args.model), draft=str(args.draft), num_speculative_tokens=args.k, capacity=64,
                           max_num_seqs=64, max_context=1024, kv_pool_tokens=64 * 1024,
                           max_num_batched_tokens=budget)
        engines[budget] = build_local_engine(cfg)
        one_run(engines[budget], argparse.Namespace(**{**vars(args), "streams": 2, "stream_tokens": 8}), 0)  # warm-up
    acc = {b: {"itl": [], "tok": 0, "sec": 0.0, "ttft": [], "steps": 0, "chunks": 0} for b in args.budgets}
    for r in range(args.rounds):
        for budget in args.budgets:
            itl, tok_s, tokens, ttft, steps, chunks = one_run(engines[budget], args, seed=r)
            a = acc[budget]
            a["itl"] += itl
            a["tok"] += tokens
            a["sec"] += tokens / tok_s
            a["ttft"] += ttft
            a["steps"] += steps
            a["chunks"] += chunks
    return [_row(b, a, args.rounds) for b, a in acc.items()]


if __name__ == "__main__":
    main()
