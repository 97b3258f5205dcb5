"""Two dspark_ray configurations served side by side, driven by vLLM's own benchmark client.

    .venv/bin/python bench/served_ab.py --yaml-b my-variant.yaml                  # deploy/dspark.yaml vs it
    .venv/bin/python bench/served_ab.py --yaml-b v.yaml --rounds 3 --concurrency 1 8 32 --name placement

An A/B of two configurations measured minutes apart compares the machine more
than them (on the shared 2-core development VMs its speed drifts by +-25%
within minutes), so both run at once: the first application of each YAML
becomes one application of a single ``serve run`` (A on --port, B on
--port + 1, B renamed ``<name>-b`` under route ``/b``), against a Ray head
this script starts, and ``vllm bench serve`` (bench/.vllm-venv, the same
workload as bench/served.py) alternates between them: for each round and
concurrency level one run against each, back to back, the first one
alternating between rounds. The headline is the median over the rounds of
B's tok/s over A's, per level.

The application not being measured is frozen for the run (its replicas and
workers, found by the ``DSPARK_BENCH_APP`` variable this script puts in each
application's environment, are sent SIGSTOP, then SIGCONT; --no-freeze keeps
them running). Idle, an application takes about 0.01 of a core, but a
configuration whose workers run two OpenMP threads loses far more than that
when those wakeups preempt one of its threads (bench/served.py measured
vLLM's server 20-25% faster alone than beside an idle dspark_ray). The Ray
cluster's own processes serve both and stay up, as they do in production.

bench/served.py compares dspark_ray with vLLM's server the same way; this
compares dspark_ray with itself. Used for ``draft_placement`` (README,
Performance).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from served import (  # noqa: E402 - this folder's modules
    DEFAULT_YAML, HOST, OUT_DIR, REPO, DsparkServed, SystemUnavailable, Workload, app_of, as_folder, client_command,
    frozen, get_json, lengths_text, load_yaml, processes_with_env, run_client, vllm_cli,
)


APP_MARK = "DSPARK_BENCH_APP"  # A or B, in the environment of each application's processes


def two_apps(yaml_a: Path, yaml_b: Path, port: int, folder: Path) -> Path:
    """One Serve config holding the first application of each YAML, A on ``port`` and B on ``port + 1``."""
    config = load_yaml(yaml_a)
    a = config["applications"][0]
    b = load_yaml(yaml_b)["applications"][0]
    for app, p, mark in ((a, port, "A"), (b, port + 1, "B")):
        args = app.setdefault("args", {})
        if args.get("http_port") is None:
            raise SystemUnavailable(f"{app['name']}: set args.http_port (the replica's own HTTP server) to A/B it")
        args.update(http_host=HOST, http_port=p)
        # Which application a process is of (its replicas through the runtime env, its workers through
        # worker_env_vars), so that the idle one can be frozen. Each application also claims CPUs in a
        # directory of its own (bind_cores, dspark_ray/runtime/cores.py): only one runs at a time, and it
        # should bind as it would alone, not find half the cores claimed by the frozen one.
        args["worker_env_vars"] = {**(args.get("worker_env_vars") or {}), APP_MARK: mark,
                                   "DSPARK_CORES_DIR": str(folder / f"cores-{mark}")}
        env = app.setdefault("runtime_env", {}).setdefault("env_vars", {})
        env[APP_MARK] = mark
    b["name"], b["route_prefix"] = f"{a['name']}-b", "/b"
    config["applications"] = [a, b]
    path = folder / "ab.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def wait_for(base_url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if get_json(f"{base_url}/v1/models") is not None:
            return
        time.sleep(1)
    raise SystemUnavailable(f"{base_url} did not answer within {timeout_s:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--yaml-a", type=Path, default=DEFAULT_YAML, help="configuration A (default %(default)s)")
    ap.add_argument("--yaml-b", type=Path, required=True, help="configuration B")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=8100, help="A's HTTP port; B's is the next one")
    ap.add_argument("--ray-cpus", type=int, default=4)
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--name", default="served-ab", help="results go to bench/out/<name>/")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of every request (default 0, greedy; 1.0 is the OpenAI API's default)")
    ap.add_argument("--freeze", action=argparse.BooleanOptionalAction, default=True,
                    help="stop the application not being measured for each run (SIGSTOP/SIGCONT; default: on)")
    ap.add_argument("--workload", choices=("random", "chat"), default="random",
                    help="random (default): 24-token random prompts, 64 tokens each; chat: bench/served.py's "
                         "chat workload (held-out chat prompts, each answer its natural length)")
    ap.add_argument("--range-ratio", type=float, default=0.0,
                    help="each prompt's and output's length uniform within len * (1 -+ r) (vLLM's "
                         "--random-range-ratio; default 0)")
    args = ap.parse_args()

    out = OUT_DIR / args.name
    out.mkdir(parents=True, exist_ok=True)
    cli = vllm_cli()
    if not 0 <= args.range_ratio < 1:
        ap.error("--range-ratio must be in [0, 1)")
    workload = Workload(temperature=args.temperature, range_ratio=args.range_ratio, kind=args.workload)
    app = app_of(args.yaml_a)
    model, tokenizer = app["name"], Path(as_folder(app["model"], app["dtype"]))  # a GGUF file's export
    urls = {"A": f"http://{HOST}:{args.port}", "B": f"http://{HOST}:{args.port + 1}"}

    def run(system: str, concurrency: int, tag: str) -> float:
        cmd = client_command(cli, urls[system], model, tokenizer, workload, concurrency,
                             workload.prompts(concurrency), out, f"{tag}.json")
        other = processes_with_env(APP_MARK, "B" if system == "A" else "A") if args.freeze else set()
        if args.freeze and not other:
            print(f"   (no process of the application other than {system} found to freeze)", flush=True)
        with frozen(other):
            return run_client(cmd, out / f"{tag}.json", out / f"{tag}.log")["output_throughput"]

    combined = two_apps(args.yaml_a, args.yaml_b, args.port, out)
    results: dict[tuple[int, str], list[float]] = {}
    with DsparkServed(combined, args.port, args.ray_cpus, out, args.startup_timeout):
        wait_for(urls["B"], args.startup_timeout)
        for system in urls:
            run(system, max(args.concurrency), f"{system}-warmup")
        for rnd in range(args.rounds):
            for c in args.concurrency:
                for system in ("A", "B") if rnd % 2 == 0 else ("B", "A"):
                    tok_s = run(system, c, f"{system}-c{c}-r{rnd + 1}")
                    results.setdefault((c, system), []).append(tok_s)
                    print(f"   round {rnd + 1} c={c} {system}: {tok_s:.1f} tok/s", flush=True)

    def shown(path: Path) -> str:
        path = path.resolve()
        return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)

    asked = ("the chat workload (bench/chat_prompts.jsonl, natural answer lengths)" if workload.kind == "chat" else
             f"{workload.input_len}-token random prompts, {workload.output_len} tokens"
             f"{lengths_text(workload.range_ratio)}")
    lines = [f"A: {shown(args.yaml_a)}   B: {shown(args.yaml_b)}   ({args.rounds} rounds, vLLM's client, {asked}, "
             f"{'greedy' if workload.temperature == 0 else f'temperature {workload.temperature:g}'})", "",
             "| concurrency | A tok/s (median) | B tok/s (median) | B / A (median of rounds) | per round |",
             "|---:|---:|---:|---:|---|"]
    for c in args.concurrency:
        a, b = results[(c, "A")], results[(c, "B")]
        per_round = [y / x for x, y in zip(a, b)]
        lines.append(f"| {c} | {statistics.median(a):.1f} | {statistics.median(b):.1f} | "
                     f"{statistics.median(per_round):.2f}x | {', '.join(f'{r:.2f}x' for r in per_round)} |")
    report = "\n".join(lines)
    (out / "report.md").write_text(report + "\n")
    print("\n" + report)
    print(f"\n(results: {(out / 'report.md').relative_to(REPO)})")


if __name__ == "__main__":
    main()
