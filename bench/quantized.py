"""dspark_ray on a quantized GGUF file against llama.cpp (single stream) and vLLM (batches), side by side.

    bash bench/setup_llamacpp.sh && bash bench/setup_vllm.sh   # once: the peers' venvs
    .venv/bin/python bench/quantized.py                         # everything: 128 tokens, 3 rounds
    .venv/bin/python bench/quantized.py --draft models/smollm2-135m-dspark   # adds dspark with its drafter
    .venv/bin/python bench/quantized.py --tokens 8 --rounds 1 --batches 8    # a smoke run
    .venv/bin/python bench/quantized.py --stages single --no-compile          # one stage, eager

The file: SmolLM2-135M-Instruct.Q4_1.gguf (``--model``), the embedded default model. The issue's
targets, each printed as a ratio beside its goal:

- single-stream decode without speculation >= 1.0x llama.cpp on the same file, at 1 and 2 threads
  (with the trained drafter: aim 2x);
- output tok/s at batch 8 and 32 >= vLLM's in bfloat16 on the same model;
- resident weight memory <= 1.1x the file's tensor bytes.

Stage ``single``: every system gets the same prompt token ids (the first ``--prompts`` prompts of
bench/chat_prompts.jsonl through the model's chat template, rendered here once), greedy, exactly
``--tokens`` new tokens (end-of-sequence ignored), one request at a time. Decode tok/s counts from
the first new token's arrival to the last's (prefill excluded: TTFT and prefill tok/s are reported
apart), summed over the prompts. Systems: dspark_ray's offline engine with ``--quantizations``
(auto: the file's blocks, float32 activations; int8: activations rounded to int8 per block, as
llama.cpp does; none: dequantized into float32, for reference) at each of ``--threads`` torch
threads, compiled (``compile_model``; ``--no-compile``: eager); with ``--draft`` the same with the
DSpark drafter for ``--draft-quantizations``; llama.cpp (llama-cpp-python in bench/.llamacpp-venv)
at each of ``--threads`` (n_threads and n_threads_batch), greedy by argmax of the logits after each
``eval``. The same tokens are compared once: each dspark system's and llama.cpp's greedy answers to
every prompt, the length of their common start.

Stage ``batch``: b prompts at once (the first b chat prompts), ``--tokens`` each, output tok/s =
all output tokens / wall time from submission to the last token, at each of ``--batches``: dspark_ray
with ``--batch-quantizations`` at ``--batch-threads`` torch threads against vLLM 0.32's offline ``LLM``
(bench/.vllm-venv; the file ``dspark export``ed in ``--vllm-dtype``, eager) with its OpenMP threads
bound as ``--vllm-binds`` say (all: one on each core 0..batch-threads-1, as bench/served.py's
``all``; auto: vLLM's own choice, which on a 2-core x86 box keeps one core for its engine core);
vLLM's better bind is the one compared.

dspark's worker runs with OMP_WAIT_POLICY=PASSIVE, as a served worker on two or more threads does
(``runtime.actors.MULTI_THREAD_ENV``): otherwise torch's OpenMP threads, spinning after the step's
small sampling ops, hold the cores the kernels' own pool wants (single stream at 2 threads, int8:
8.5 -> 6.8 ms a token).

NOTE: the method (bench/served.py's). Every system is a process of its own
(bench/quantized_worker.py, in its own venv), started and loaded once, then
driven over a pipe; while one runs, every other is stopped (SIGSTOP to its
process tree, SIGCONT after), so they never share the cores. After one
warm-up run each, the runs are interleaved: each round visits every
(system, threads) of a stage, grouped by thread count (or batch) so that the
systems compared run back to back; odd rounds go in reverse order, so a
steady drift of the machine weighs on both sides alike. A figure is the median
over ``--rounds`` rounds, a ratio the median of its per-round ratios. Prefix
caching is off everywhere, so every round does the same work.

The memory is read as each worker loads: its resident memory
(VmRSS from /proc/<pid>/status, summed over its process tree: vLLM runs its
engine core in a child) before the model is loaded (after its library is
imported), after loading and after the warm-ups, with its anonymous part
(RssAnon: a mapped GGUF file's pages are not); for dspark also the bytes of
the blocks and float tensors its model holds and of its KV pool; for llama.cpp
``llama_model_size``. All against the file's tensor bytes (gguf.GGUFReader).

Before anything starts the report measures the machine's limit for decode:
memory bandwidth (bench/common.py: ``torch.sum`` over 1 GiB, best of 3) at each
thread count, against the bytes of weights a decode step reads (the model as
dspark loads it); each single-stream figure is printed as a fraction of it.
The load average is noted around every stage; measure on a quiet machine.

Results: bench/out/NAME.{md,json} (``--name``, default quantized), rewritten
after every stage; the workers' logs in bench/out/NAME/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chat_workload
from common import BENCH_DIR, OUT_DIR, REPO, machine, memory_bandwidth
from quantized_worker import REPLY
from served import (
    SystemUnavailable,
    descendants,
    exported,
    frozen,
    process_memory,
    process_table,
    vllm_server_env,
)

from dspark_ray.ops.processes import stop_process
from dspark_ray.runtime.actors import MULTI_THREAD_ENV

WORKER = BENCH_DIR / "quantized_worker.py"
PYTHONS = {"dspark": Path(sys.executable), "llamacpp": BENCH_DIR / ".llamacpp-venv" / "bin" / "python",
           "vllm": BENCH_DIR / ".vllm-venv" / "bin" / "python"}
SETUP_HINT = {"llamacpp": "bash bench/setup_llamacpp.sh", "vllm": "bash bench/setup_vllm.sh"}
STAGES = ("single", "batch")
WARMUP_TOKENS = 16  # new tokens of each warm-up run (fewer if --tokens is smaller)
SHOWN_TOKENS = 24  # tokens of the first prompt's answers printed side by side
GOAL_SINGLE, GOAL_DRAFT, GOAL_BATCH, GOAL_MEMORY = 1.0, 2.0, 1.0, 1.1


# -- the systems ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class System:
    """One worker process: a backend in given settings. ``threads``: llama.cpp's, fixed at load (dspark
    takes its thread count per run; vLLM's come from ``bind``)."""

    backend: str  # dspark | llamacpp | vllm
    quantization: str | None = None  # dspark
    draft: bool = False  # dspark with the drafter
    threads: int | None = None  # llama.cpp
    bind: str | None = None  # vLLM: all | auto

    @property
    def label(self) -> str:
        if self.backend == "dspark":
            return f"dspark {self.quantization}" + (" + drafter" if self.draft else "")
        if self.backend == "llamacpp":
            return f"llama.cpp t{self.threads}"
        return f"vLLM bind {self.bind}"


def single_systems(args: argparse.Namespace) -> list[System]:
    ours = [System("dspark", q) for q in args.quantizations]
    drafted = [System("dspark", q, draft=True) for q in args.draft_quantizations] if args.draft else []
    return ours + drafted + [System("llamacpp", threads=t) for t in args.threads]


def batch_systems(args: argparse.Namespace) -> list[System]:
    return [System("dspark", q) for q in args.batch_quantizations] + [System("vllm", bind=b) for b in args.vllm_binds]


def single_cells(systems: list[System], threads: list[int]) -> list[tuple[System, int]]:
    """(system, threads) of one round, grouped by thread count: llama.cpp only at its own."""
    return [(s, t) for t in threads for s in systems if s.threads in (None, t)]


def batch_cells(systems: list[System], batches: list[int]) -> list[tuple[System, int]]:
    """(system, batch) of one round, grouped by batch."""
    return [(s, b) for b in batches for s in systems]


def round_order(cells: list, r: int) -> list:
    """Round ``r``'s order (0-based): as given in even rounds, reversed in odd ones."""
    return list(cells) if r % 2 == 0 else list(reversed(cells))


# -- results and their arithmetic -------------------------------------------------------------------


@dataclass
class SingleRun:
    """One system's single-stream run at one thread count in one round: every prompt once, in order."""

    system: str
    threads: int
    round: int  # 1-based
    prompt_tokens: list[int]
    ttft_s: list[float]
    decode_s: list[float]  # first new token's arrival to the last's
    decode_tokens: list[int]  # tokens that came after the first arrival
    token_ids: list[list[int]]
    drafts: int = 0  # drafter runs: blocks proposed and their tokens accepted, over the prompts
    accepted_tokens: int = 0

    @property
    def decode_tok_s(self) -> float:
        return sum(self.decode_tokens) / sum(self.decode_s)

    @property
    def ttft_ms(self) -> float:
        return statistics.median(self.ttft_s) * 1e3

    @property
    def prefill_tok_s(self) -> float:
        return sum(self.prompt_tokens) / sum(self.ttft_s)

    @property
    def acceptance_length(self) -> float | None:
        """Tokens a verification step commits, accepted drafts plus the target's own (drafter runs only)."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else None


@dataclass
class BatchRun:
    system: str
    batch: int
    round: int
    seconds: float
    output_tokens: int

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


@dataclass
class Memory:
    """One worker's resident memory (bytes, summed over its process tree) and what its model holds."""

    system: str
    processes: int
    rss_before: int  # library imported, model not loaded
    rss_loaded: int
    anon_before: int = 0  # RssAnon: the process's own pages (RSS less mapped files: a mapped GGUF file's)
    anon_loaded: int = 0
    rss_warm: int | None = None  # after the warm-up runs
    model_bytes: int | None = None  # dspark: its model's tensors; llama.cpp: llama_model_size
    draft_bytes: int = 0  # dspark with a drafter: the drafter's own tensors
    kv_bytes: int | None = None  # dspark: its KV pool
    load_s: float = 0.0

    @property
    def loaded(self) -> int:
        return self.rss_loaded - self.rss_before

    @property
    def anon_loaded_delta(self) -> int:
        return self.anon_loaded - self.anon_before

    def weights_ratio(self, file_bytes: int) -> float | None:
        return self.model_bytes / file_bytes if self.model_bytes else None

    def resident_ratio(self, file_bytes: int) -> float:
        """The memory loading added, less the KV pool where known, against the file's tensor bytes."""
        return (self.loaded - (self.kv_bytes or 0)) / file_bytes


def medians(values: dict[tuple, list[float]]) -> dict[tuple, float]:
    return {key: statistics.median(v) for key, v in values.items() if v}


def paired_ratio(ours: dict[int, float], theirs: dict[int, float]) -> float | None:
    """The median over the rounds both ran in (``{round: figure}``) of ours / theirs; None if none."""
    ratios = [ours[r] / theirs[r] for r in sorted(ours.keys() & theirs.keys()) if theirs[r] > 0]
    return statistics.median(ratios) if ratios else None


def by_round(runs: list, system: str, key: str, value: int, figure: str) -> dict[int, float]:
    return {r.round: getattr(r, figure) for r in runs if r.system == system and getattr(r, key) == value}


def common_start(a: list[int], b: list[int]) -> int:
    """How many tokens two answers share from their start."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@dataclass(frozen=True)
class Ratio:
    """One headline figure: ours against a peer (or a bound), and the goal it is held to."""

    what: str
    ours: str
    theirs: str
    ratio: float | None
    goal: float
    at_most: bool = False  # memory: the ratio must stay under the goal

    @property
    def met(self) -> bool | None:
        if self.ratio is None:
            return None
        return self.ratio <= self.goal if self.at_most else self.ratio >= self.goal


@dataclass
class Report:
    machine: str
    settings: dict
    name: str = "quantized"
    commands: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    load: list[tuple[str, list[float], list[float] | None]] = field(default_factory=list)  # stage, before, after
    bandwidth: dict[int, float] = field(default_factory=dict)  # threads -> bytes/s
    step_bytes: dict[str, int] = field(default_factory=dict)  # system -> weight bytes a decode step reads
    file_bytes: int = 0
    single: list[SingleRun] = field(default_factory=list)
    batch: list[BatchRun] = field(default_factory=list)
    memory: list[Memory] = field(default_factory=list)
    shown: dict[str, str] = field(default_factory=dict)  # system -> the first prompt's answer, as text

    # -- the arithmetic --

    def single_median(self, system: str, threads: int) -> float | None:
        runs = [r.decode_tok_s for r in self.single if r.system == system and r.threads == threads]
        return statistics.median(runs) if runs else None

    def vs_llamacpp(self, system: str, threads: int) -> float | None:
        return paired_ratio(by_round(self.single, system, "threads", threads, "decode_tok_s"),
                            by_round(self.single, f"llama.cpp t{threads}", "threads", threads, "decode_tok_s"))

    def best_vllm(self, batch: int) -> str | None:
        """The vLLM bind with the higher median output tok/s at ``batch``."""
        figures = {r.system: self.batch_median(r.system, batch) for r in self.batch
                   if r.system.startswith("vLLM") and r.batch == batch}
        return max(figures, key=figures.get) if figures else None

    def batch_median(self, system: str, batch: int) -> float | None:
        runs = [r.tok_s for r in self.batch if r.system == system and r.batch == batch]
        return statistics.median(runs) if runs else None

    def vs_vllm(self, system: str, batch: int) -> float | None:
        peer = self.best_vllm(batch)
        if peer is None:
            return None
        return paired_ratio(by_round(self.batch, system, "batch", batch, "tok_s"),
                            by_round(self.batch, peer, "batch", batch, "tok_s"))

    def headline(self) -> list[Ratio]:
        """The issue's targets, one line each, for every quantized dspark system and setting that ran
        (quantization none, the dequantized reference, only in the tables)."""
        lines = []
        ours = sorted({r.system for r in self.single if quantized(r.system)}, key=self._order)
        for t in sorted({r.threads for r in self.single}):
            for s in ours:
                if f"llama.cpp t{t}" in {r.system for r in self.single}:
                    goal = GOAL_DRAFT if "drafter" in s else GOAL_SINGLE
                    lines.append(Ratio(f"single-stream decode, {t} thread{'s' * (t > 1)}", s, "llama.cpp",
                                       self.vs_llamacpp(s, t), goal))
        for b in sorted({r.batch for r in self.batch}):
            peer = self.best_vllm(b)
            for s in sorted({r.system for r in self.batch if quantized(r.system)}, key=self._order):
                if peer:
                    lines.append(Ratio(f"output tok/s, batch {b}", s, peer, self.vs_vllm(s, b), GOAL_BATCH))
        for m in self.memory:
            if quantized(m.system) and "drafter" not in m.system and m.model_bytes:
                lines.append(Ratio("weight memory (model tensors)", m.system, "file's tensor bytes",
                                   m.weights_ratio(self.file_bytes), GOAL_MEMORY, at_most=True))
        return lines

    @staticmethod
    def _order(system: str) -> tuple:
        q = ("auto", "int8", "none")
        return ("drafter" in system, next((i for i, name in enumerate(q) if name in system), 9), system)

    # -- the tables --

    def headline_table(self) -> str:
        lines = ["| target | ours | against | ratio | goal | met |", "|---|---|---|---:|---:|---|"]
        for h in self.headline():
            met = "-" if h.met is None else ("yes" if h.met else "no")
            goal = f"<= {h.goal:.1f}x" if h.at_most else f">= {h.goal:.1f}x"
            lines.append(f"| {h.what} | {h.ours} | {h.theirs} | {fmt(h.ratio, 2, 'x')} | {goal} | {met} |")
        return "\n".join(lines)

    def single_table(self) -> str:
        keys = sorted({(r.threads, r.system) for r in self.single}, key=lambda k: (k[0], self._order(k[1])))
        lines = [("| system | threads | decode tok/s | rounds | vs llama.cpp | TTFT ms | prefill tok/s "
                  "| acceptance length | bandwidth ceiling tok/s | of the ceiling |"),
                 "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
        for t, s in keys:
            runs = sorted((r for r in self.single if r.system == s and r.threads == t), key=lambda r: r.round)
            decode = statistics.median(r.decode_tok_s for r in runs)
            ceiling = self.ceiling(s, t)
            accept = [a for r in runs if (a := r.acceptance_length) is not None]
            lines.append(
                f"| {s} | {t} | {decode:.1f} | {' '.join(f'{r.decode_tok_s:.1f}' for r in runs)} "
                f"| {fmt(None if s.startswith('llama') else self.vs_llamacpp(s, t), 2, 'x')} "
                f"| {statistics.median(r.ttft_ms for r in runs):.1f} "
                f"| {statistics.median(r.prefill_tok_s for r in runs):.0f} "
                f"| {fmt(statistics.median(accept) if accept else None, 2)} | {fmt(ceiling)} "
                f"| {fmt(decode / ceiling if ceiling else None, 2)} |")
        return "\n".join(lines)

    def ceiling(self, system: str, threads: int) -> float | None:
        """Tokens/s at one step a token with the step's weights streamed at ``threads``' bandwidth."""
        base = system.split(" t")[0] if system.startswith("llama") else system.replace(" + drafter", "")
        stored, bw = self.step_bytes.get(base), self.bandwidth.get(threads)
        return bw / stored if stored and bw else None

    def agreement_table(self) -> str:
        """Each system's greedy answers against llama.cpp's (its first run at the fewest threads)."""
        first = [r for r in self.single if r.round == 1]
        peers = [r for r in first if r.system.startswith("llama")]
        if not peers:
            return ""
        ref = min(peers, key=lambda r: r.threads)
        lines = [f"| system | threads | tokens in common with {ref.system}, per prompt (of the answer's) |",
                 "|---|---:|---|"]
        for r in sorted(first, key=lambda r: (r.threads, self._order(r.system))):
            if r is not ref:
                same = [f"{common_start(a, b)}/{len(b)}" for a, b in zip(r.token_ids, ref.token_ids, strict=True)]
                lines.append(f"| {r.system} | {r.threads} | {' '.join(same)} |")
        return "\n".join(lines)

    def batch_table(self) -> str:
        keys = sorted({(r.batch, r.system) for r in self.batch}, key=lambda k: (k[0], self._order(k[1])))
        lines = ["| system | batch | output tok/s | rounds | vs vLLM's better bind |", "|---|---:|---:|---|---:|"]
        for b, s in keys:
            runs = sorted((r for r in self.batch if r.system == s and r.batch == b), key=lambda r: r.round)
            vs = None if s.startswith("vLLM") else self.vs_vllm(s, b)
            best = " (better)" if s == self.best_vllm(b) else ""
            lines.append(f"| {s}{best} | {b} | {self.batch_median(s, b):.1f} "
                         f"| {' '.join(f'{r.tok_s:.1f}' for r in runs)} | {fmt(vs, 2, 'x')} |")
        return "\n".join(lines)

    def memory_table(self) -> str:
        mb = 1e6
        lines = [f"The file's tensor bytes: {self.file_bytes / mb:.1f} MB.", "",
                 ("| system | processes | RSS before load, MB | loading added, MB | of it anonymous, MB "
                  "| added after warm-up, MB | model tensors, MB | model / file | KV pool, MB | (added - KV) / file "
                  "| load s |"),
                 "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for m in self.memory:
            tensors = None if m.model_bytes is None else (m.model_bytes + m.draft_bytes) / mb
            warm = None if m.rss_warm is None else (m.rss_warm - m.rss_before) / mb
            lines.append(f"| {m.system} | {m.processes} | {m.rss_before / mb:.0f} | {m.loaded / mb:.0f} "
                         f"| {m.anon_loaded_delta / mb:.0f} | {fmt(warm, 0)} "
                         f"| {fmt(tensors)} | {fmt(m.weights_ratio(self.file_bytes), 3, 'x')} "
                         f"| {fmt(None if m.kv_bytes is None else m.kv_bytes / mb, 0)} "
                         f"| {m.resident_ratio(self.file_bytes):.2f}x | {m.load_s:.1f} |")
        return "\n".join(lines)

    def markdown(self) -> str:
        s = self.settings
        parts = [f"# dspark_ray on {Path(s['model']).name} against llama.cpp and vLLM", "",
                 f"Machine: {self.machine}.", "",
                 (f"Workload: {s['prompts']} chat prompts ({', '.join(str(n) for n in s['prompt_lengths'])} tokens), "
                  f"{s['tokens']} new tokens each, greedy, end-of-sequence ignored; {s['rounds']} interleaved rounds, "
                  f"medians (ratios: median of per-round ratios); dspark compile_model {s['compile_model']}."), "",
                 "## Targets", "", self.headline_table()]
        if self.single:
            parts += ["", "## Single stream (decode: first new token to last; prefill apart)", "", self.single_table()]
            bw = ", ".join(f"{t} thread{'s' * (t > 1)} {b / 1e9:.1f} GB/s" for t, b in sorted(self.bandwidth.items()))
            steps = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in self.step_bytes.items())
            parts += ["", (f"Bandwidth (torch.sum over 1 GiB, best of 3): {bw}. Weights a decode step reads: {steps}. "
                           "A drafter run's ceiling is per target step, which commits several tokens.")]
            if agreement := self.agreement_table():
                parts += ["", "### Greedy answers against llama.cpp's (round 1)", "", agreement]
            if self.shown:
                parts += ["", f"The first prompt's answers, first {SHOWN_TOKENS} tokens:", ""]
                parts += [f"- {k}: {json.dumps(v)}" for k, v in self.shown.items()]
        if self.batch:
            parts += ["", "## Batches (output tok/s: all output tokens / wall time)", "", self.batch_table()]
        if self.memory:
            parts += ["", "## Memory", "", self.memory_table()]
        parts += ["", "## Load average (1, 5, 15 min) around each stage", "", "| stage | before | after |", "|---|---|---|"]
        parts += [f"| {st} | {' '.join(f'{x:.2f}' for x in b)} | {' '.join(f'{x:.2f}' for x in a) if a else '-'} |"
                  for st, b, a in self.load]
        if self.notes:
            parts += ["", "## Notes", ""] + [f"- {n}" for n in self.notes]
        parts += ["", "## Commands", "", "```"] + self.commands + ["```"]
        return "\n".join(parts)

    def to_dict(self) -> dict:
        return {"machine": self.machine, "settings": self.settings, "commands": self.commands, "notes": self.notes,
                "load": [{"stage": st, "before": b, "after": a} for st, b, a in self.load],
                "bandwidth": self.bandwidth, "step_bytes": self.step_bytes, "file_bytes": self.file_bytes,
                "headline": [{**asdict(h), "met": h.met} for h in self.headline()],
                "single": [{**asdict(r), "decode_tok_s": r.decode_tok_s, "ttft_ms": r.ttft_ms,
                            "prefill_tok_s": r.prefill_tok_s} for r in self.single],
                "batch": [{**asdict(r), "tok_s": r.tok_s} for r in self.batch],
                "memory": [{**asdict(m), "weights_ratio": m.weights_ratio(self.file_bytes),
                            "resident_ratio": m.resident_ratio(self.file_bytes)} for m in self.memory],
                "shown": self.shown}

    def save(self, out_dir: Path = OUT_DIR) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{self.name}.md").write_text(self.markdown() + "\n")
        (out_dir / f"{self.name}.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def quantized(system: str) -> bool:
    """Whether a label is dspark's on the file's blocks (auto, int8), the systems the targets are for."""
    return system.startswith("dspark") and " none" not in system


def fmt(x: float | None, digits: int = 1, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


# -- the workers ------------------------------------------------------------------------------------


class Worker:
    """A system's process (bench/quantized_worker.py) and the pipe it is driven over."""

    def __init__(self, system: System, setup: dict, log: Path, env: dict[str, str] | None = None,
                 timeout_s: float = 1800) -> None:
        python = PYTHONS[system.backend]
        if not python.is_file():
            raise SystemUnavailable(f"{system.label}: no {python}; run {SETUP_HINT[system.backend]}")
        self.system, self.timeout_s, self.log_path = system, timeout_s, log
        self.command = [str(python), str(WORKER), json.dumps(setup)]
        self.env = env or {}
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log.open("a")
        self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, cwd=REPO, env={**os.environ, **self.env}, start_new_session=True)
        self.memory: Memory | None = None
        self.info: dict = {}  # what the worker said when it had loaded

    def shown_command(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return " ".join(filter(None, [env, *(shlex.quote(str(c)) for c in self.command)]))

    def reply(self) -> dict:
        """The next reply line; the other lines go to the log. Raises SystemUnavailable if the process ends
        or says nothing for ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = self.proc.stdout.readline() if ready else None
            if line is None or line == "":
                why = f"said nothing for {self.timeout_s:.0f} s" if line is None else "ended"
                raise SystemUnavailable(f"{self.system.label}: its worker {why}:\n{self.log_tail()}")
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
            self.log.write(line)
            self.log.flush()

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        answer = self.reply()
        if "error" in answer:
            raise SystemUnavailable(f"{self.system.label}: {cmd['op']} failed: {answer['error']}\n{self.log_tail()}")
        return answer

    def pids(self) -> set[int]:
        return descendants(self.proc.pid, process_table())

    def rss(self) -> tuple[int, int, int]:
        """(VmRSS, RssAnon, processes) summed over its process tree."""
        found = [m for p in self.pids() if (m := process_memory(p)) is not None]
        return sum(m[0] for m in found), sum(m[1] for m in found), len(found)

    def load(self) -> Memory:
        """Wait for the import, read the memory, load, read it again."""
        self.reply()
        before, anon_before, _ = self.rss()
        info = self.ask(op="load")
        after, anon_after, processes = self.rss()
        self.memory = Memory(self.system.label, processes, before, after, anon_before, anon_after,
                             model_bytes=info.get("model_bytes"), draft_bytes=info.get("draft_bytes", 0),
                             kv_bytes=info.get("kv_bytes"), load_s=info["load_s"])
        self.info = info
        return self.memory

    def log_tail(self, lines: int = 20) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        stop_process(self.proc)
        self.log.close()


@contextlib.contextmanager
def alone(worker: Worker, workers: list[Worker]) -> Iterator[None]:
    """Every other worker's process tree stopped while ``worker`` runs."""
    others = set().union(*(w.pids() for w in workers if w is not worker))
    with frozen(others):
        yield


# -- the stages -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """The prompts as token ids, and the sizes every system is set up for."""

    single: list[list[int]]
    batch: list[list[int]]  # the first max(batches) chat prompts
    tokens: int
    max_context: int

    @staticmethod
    def of(args: argparse.Namespace) -> Workload:
        from dspark_ray.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_path(args.model)
        items = chat_workload.load()
        n = max(args.prompts, *args.batches) if "batch" in args.stages else args.prompts
        ids = [chat_workload.render(tokenizer, items[i % len(items)].prompt) for i in range(n)]
        return Workload(ids[:args.prompts], ids, args.tokens, context_for(ids, args.tokens, args.k))


def context_for(prompts: list[list[int]], tokens: int, k: int) -> int:
    """The context every system is set up for: the longest prompt, its new tokens and a drafter's k more
    (a verification step may write k tokens past the last it keeps), in whole 64s."""
    need = max(len(p) for p in prompts) + tokens + k + 1
    return -(-need // 64) * 64


def setup_of(system: System, args: argparse.Namespace, w: Workload, capacity: int) -> dict:
    """The worker's setup (bench/quantized_worker.py) for ``system``."""
    base = {"backend": system.backend, "max_context": w.max_context}
    if system.backend == "dspark":
        return {**base, "model": args.model, "quantization": system.quantization, "compile_model": args.compile,
                "draft": args.draft if system.draft else None, "k": args.k, "capacity": capacity,
                "kv_pool_tokens": capacity * (w.max_context + args.k)}
    if system.backend == "llamacpp":
        return {**base, "model": args.model, "threads": system.threads, "n_batch": 512}
    return {**base, "model": str(exported(Path(args.model), args.vllm_dtype)), "dtype": args.vllm_dtype,
            "capacity": capacity}


def start_workers(systems: list[System], args: argparse.Namespace, w: Workload, report: Report,
                  capacity: dict[System, int], running: dict[System, Worker]) -> dict[System, Worker]:
    """Each system's worker, started and loaded one after the other (those already in ``running`` kept);
    a system that cannot run is noted and left out."""
    logs = OUT_DIR / args.name
    for s in systems:
        if s in running:
            continue
        try:
            env = None
            if s.backend == "vllm":
                env = vllm_server_env(args.batch_threads, s.bind)
            elif s.backend == "dspark":  # what a served worker on 2+ threads gets (runtime/actors.py)
                env = dict(MULTI_THREAD_ENV)
            worker = Worker(s, setup_of(s, args, w, capacity[s]), logs / f"{s.label.replace(' ', '_')}.log", env,
                            args.command_timeout)
        except SystemUnavailable as exc:
            note(report, f"{s.label} left out: {exc}")
            continue
        try:
            with alone(worker, list(running.values())):
                memory = worker.load()
        except SystemUnavailable as exc:
            note(report, f"{s.label} left out: {exc}")
            worker.stop()
            continue
        if s.backend == "dspark" and not s.draft:
            report.step_bytes[s.label] = worker.info["step_bytes"]
        if s.backend == "llamacpp":
            report.step_bytes["llama.cpp"] = worker.info["model_bytes"]
            report.settings.setdefault("llama_cpp_system_info", worker.info.get("system_info"))
        report.memory.append(memory)
        report.commands.append(worker.shown_command())
        print(f"   {s.label}: loaded in {memory.load_s:.1f} s, +{memory.loaded / 1e6:.0f} MB resident",
              file=sys.stderr, flush=True)
        running[s] = worker
    return running


def note(report: Report, text: str) -> None:
    print(f"   {text}", file=sys.stderr, flush=True)
    report.notes.append(text.splitlines()[0] if len(text) < 400 else text[:400] + " ...")


def run_single(worker: Worker, workers: list[Worker], w: Workload, threads: int, rnd: int,
               tokens: int | None = None) -> SingleRun:
    """Every single-stream prompt once, in order, with the others stopped."""
    answers = []
    with alone(worker, workers):
        for prompt in w.single:
            answers.append(worker.ask(op="single", prompt=prompt, tokens=tokens or w.tokens, threads=threads))
    spec = [a["spec"] for a in answers if a.get("spec")]
    return SingleRun(worker.system.label, threads, rnd, [len(p) for p in w.single], [a["ttft_s"] for a in answers],
                     [a["decode_s"] for a in answers], [len(a["token_ids"]) - a["first_tokens"] for a in answers],
                     [a["token_ids"] for a in answers], sum(s["drafts"] for s in spec),
                     sum(s["accepted_tokens"] for s in spec))


def run_batch(worker: Worker, workers: list[Worker], w: Workload, batch: int, threads: int, rnd: int,
              tokens: int | None = None) -> BatchRun:
    with alone(worker, workers):
        answer = worker.ask(op="batch", prompts=w.batch[:batch], tokens=tokens or w.tokens, threads=threads)
    return BatchRun(worker.system.label, batch, rnd, answer["seconds"], answer["output_tokens"])


def warm_up(cells: list[tuple[Worker, int]], run, workers: dict[System, Worker], w: Workload) -> None:
    """One short run of each cell, its result dropped; then the memory of each worker warmed up for the first
    time read once more."""
    warm = min(w.tokens, WARMUP_TOKENS)
    for worker, n in cells:
        run(worker, n, 0, warm)
    for worker in workers.values():
        if worker.memory is not None and worker.memory.rss_warm is None:
            worker.memory.rss_warm = worker.rss()[0]


def stage_single(args: argparse.Namespace, w: Workload, report: Report, running: dict[System, Worker]) -> None:
    systems = single_systems(args)
    capacity = {s: max(args.batches) if s in batch_systems(args) and "batch" in args.stages else 1 for s in systems}
    workers = start_workers(systems, args, w, report, capacity, running)
    cells = [(workers[s], t) for s, t in single_cells(systems, args.threads) if s in workers]
    everyone = list(workers.values())

    def run(worker: Worker, threads: int, rnd: int, tokens: int | None = None) -> SingleRun:
        return run_single(worker, everyone, w, threads, rnd, tokens)

    warm_up(cells, run, workers, w)
    for r in range(args.rounds):
        for worker, t in round_order(cells, r):
            result = run(worker, t, r + 1)
            report.single.append(result)
            print(f"   round {r + 1}: {result.system}, {t} threads: decode {result.decode_tok_s:.1f} tok/s, "
                  f"TTFT {result.ttft_ms:.0f} ms", file=sys.stderr, flush=True)
    show_answers(report, args.model)


def show_answers(report: Report, model: str) -> None:
    from dspark_ray.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(model)
    for r in report.single:
        if r.round == 1 and r.system not in report.shown:
            report.shown[r.system] = tokenizer.decode(r.token_ids[0][:SHOWN_TOKENS])


def stage_batch(args: argparse.Namespace, w: Workload, report: Report, running: dict[System, Worker]) -> None:
    systems = batch_systems(args)
    workers = start_workers(systems, args, w, report, {s: max(args.batches) for s in systems}, running)
    cells = [(workers[s], b) for s, b in batch_cells(systems, args.batches) if s in workers]
    everyone = list(workers.values())

    def run(worker: Worker, batch: int, rnd: int, tokens: int | None = None) -> BatchRun:
        return run_batch(worker, everyone, w, batch, args.batch_threads, rnd, tokens)

    warm_up(cells, run, workers, w)
    for r in range(args.rounds):
        for worker, b in round_order(cells, r):
            result = run(worker, b, r + 1)
            report.batch.append(result)
            print(f"   round {r + 1}: {result.system} batch {b}: {result.tok_s:.1f} tok/s", file=sys.stderr, flush=True)


def stop_unneeded(running: dict[System, Worker], keep: list[System]) -> None:
    for s in [s for s in running if s not in keep]:
        running.pop(s).stop()


def file_tensor_bytes(path: str) -> int:
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


# -- main -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=chat_workload.MODEL, help="the GGUF file (default %(default)s)")
    ap.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    ap.add_argument("--tokens", type=int, default=128, help="new tokens a request (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default %(default)s)")
    ap.add_argument("--prompts", type=int, default=3, help="single-stream prompts a round (default %(default)s)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="single stream: thread counts")
    ap.add_argument("--quantizations", nargs="+", choices=("auto", "int8", "none"), default=["auto", "int8", "none"],
                    help="dspark's, single stream")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="dspark eager (default: compile_model)")
    ap.add_argument("--draft", help="a DSpark drafter folder (e.g. models/smollm2-135m-dspark): adds dspark with it")
    ap.add_argument("--draft-quantizations", nargs="+", choices=("auto", "int8", "none"), default=["auto", "int8"])
    ap.add_argument("-k", type=int, default=4, help="the drafter's tokens a step (default %(default)s)")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--batch-quantizations", nargs="+", choices=("auto", "int8", "none"), default=["auto", "int8"])
    ap.add_argument("--batch-threads", type=int, default=2, help="dspark's torch threads and vLLM's in the batches")
    ap.add_argument("--vllm-binds", nargs="+", choices=("all", "auto"), default=["all", "auto"])
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--command-timeout", type=float, default=1800, help="seconds a worker may take for one command")
    ap.add_argument("--name", default="quantized", help="bench/out/NAME.{md,json} (default %(default)s)")
    args = ap.parse_args(argv)
    from dspark_ray.model.checkpoint import locate

    args.model = str(locate(args.model).resolve())
    if args.draft:
        args.draft = str(locate(args.draft).resolve())
    return args


def main(argv: list[str] | None = None) -> Report:
    args = parse_args(argv)
    w = Workload.of(args)
    report = Report(machine(), {"model": args.model, "tokens": args.tokens, "rounds": args.rounds,
                                "prompts": args.prompts, "prompt_lengths": [len(p) for p in w.single],
                                "max_context": w.max_context, "compile_model": args.compile, "draft": args.draft,
                                "k": args.k, "threads": args.threads, "batches": args.batches,
                                "batch_threads": args.batch_threads, "vllm_dtype": args.vllm_dtype},
                    name=args.name, commands=[shlex.join([sys.executable, *sys.argv])])
    report.file_bytes = file_tensor_bytes(args.model)
    before = list(os.getloadavg())
    report.bandwidth = {t: memory_bandwidth(threads=t) for t in sorted(set(args.threads))}
    report.load.append(("bandwidth", before, list(os.getloadavg())))
    running: dict[System, Worker] = {}
    try:
        for stage, body in (("single", stage_single), ("batch", stage_batch)):
            if stage not in args.stages:
                continue
            print(f"== {stage}", file=sys.stderr, flush=True)
            before = list(os.getloadavg())
            try:
                body(args, w, report, running)
            except SystemUnavailable as exc:
                note(report, f"stage {stage} stopped: {exc}")
            report.load.append((stage, before, list(os.getloadavg())))
            stop_unneeded(running, batch_systems(args) if stage == "single" and "batch" in args.stages else [])
            report.save()
    finally:
        stop_unneeded(running, [])
    report.save()
    print(report.markdown())
    return report


if __name__ == "__main__":
    main()
