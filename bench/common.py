"""Shared pieces of the benchmarks: prompts, timing, tables."""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
OUT_DIR = BENCH_DIR / "out"
TARGET = REPO / "models" / "shakespeare-target"
DRAFT = REPO / "models" / "shakespeare-draft"
DSPARK_DRAFT = REPO / "models" / "shakespeare-dspark"  # DSpark block draft for the same target


def load_prompts(n: int) -> list[str]:
    """Held-out prompts (Twelfth Night, not in the training split), cycled if n is larger."""
    rows = [json.loads(line)["prompt"] for line in (BENCH_DIR / "prompts.jsonl").read_text().splitlines()]
    return [rows[i % len(rows)] for i in range(n)]


@dataclass
class Row:
    system: str
    batch: int
    output_tokens: int
    seconds: float
    mean_acceptance_length: float | None = None
    draft_ms_per_step: float | None = None  # wall time in the draft service per engine step that drafted
    # ms per engine step in each of the engine's phases (schedule, propose, verify, commit) and the steps
    # counted ("steps"), over the steps that ran rows; None: not measured
    phases: dict[str, float] | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def machine(device: str = "cpu") -> str:
    where = f"{platform.machine()}, {torch.get_num_threads()} torch threads"
    if torch.device(device).type == "cuda":
        where = torch.cuda.get_device_name(torch.device(device))
    return f"{where}, torch {torch.__version__}"


def table(rows: list[Row], baseline: dict[int, Row]) -> str:
    """Markdown: one line per row, with its ratio to the baseline row of the same batch (and the
    draft's time per step when some row measured it)."""
    cost = any(r.draft_ms_per_step is not None for r in rows)
    lines = ["| system | batch | output tok/s | vs baseline | mean acceptance length |"
             + (" draft ms / step |" if cost else ""),
             "|---|---:|---:|---:|---:|" + ("---:|" if cost else "")]
    for r in rows:
        base = baseline.get(r.batch)
        ratio = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base else "-"
        acc = f"{r.mean_acceptance_length:.2f}" if r.mean_acceptance_length else "-"
        line = f"| {r.system} | {r.batch} | {r.tokens_per_s:.1f} | {ratio} | {acc} |"
        if cost:
            line += f" {r.draft_ms_per_step:.2f} |" if r.draft_ms_per_step is not None else " - |"
        lines.append(line)
    return "\n".join(lines)


def save(name: str, rows: list[Row], markdown: str, device: str = "cpu") -> None:
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / f"{name}.md").write_text(markdown + "\n")
    data = [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in rows]
    (OUT_DIR / f"{name}.json").write_text(json.dumps({"machine": machine(device), "rows": data}, indent=2))


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start
