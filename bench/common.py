"""Shared pieces of the benchmarks: prompts, timing, tables."""

from __future__ import annotations

import json
import os
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


# -- the machine's limit for decode: bytes of weights a step reads against memory bandwidth ---------------


@dataclass(frozen=True)
class WeightBytes:
    """The weights one decode step at batch 1 reads: every linear's weight and every norm once, the LM head
    once, the input embedding one row. ``stored``: bytes as held in memory (GGUF blocks kept: the blocks);
    ``values``: how many weights."""

    values: int
    stored: int

    def in_dtype(self, element_bytes: int) -> int:
        """The bytes of the same weights held plainly at ``element_bytes`` a value (float32: 4)."""
        return self.values * element_bytes


def _values(module: torch.nn.Module, name: str, t: torch.Tensor) -> int:
    """The weights ``module``'s tensor ``name`` holds: its elements, but for GGUF blocks kept (a uint8
    ``weight`` beside a ``qtype``, dspark_ray/model/quantized.py) the weights its rows encode."""
    if name == "weight" and t.dtype == torch.uint8 and hasattr(module, "qtype"):
        cols = getattr(module, "in_features", None) or module.embedding_dim
        return t.shape[0] * cols
    return t.numel()


def model_weight_bytes(model: torch.nn.Module) -> WeightBytes:
    """The bytes a decode step of ``model`` reads (``WeightBytes``): its parameters and persistent buffers
    (GGUF blocks kept are buffers), each storage counted once (tied and fused weights share one), less an
    input embedding that is not also the LM head, of which a step reads one row."""
    seen_storage, seen, values, stored = set(), set(), 0, 0
    for module in model.modules():
        tensors = [*module.named_parameters(recurse=False),
                   *((n, b) for n, b in module.named_buffers(recurse=False)
                     if n not in module._non_persistent_buffers_set)]  # a cache such as inv_freq is no weight
        for name, t in tensors:
            if t.is_meta or id(t) in seen:
                continue
            seen.add(id(t))
            values += _values(module, name, t)
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen_storage:
                seen_storage.add(storage.data_ptr())
                stored += storage.nbytes()
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_weight", None)
    if embed is not None and head is not None and embed.weight.data_ptr() != head.data_ptr():
        w, rows = embed.weight, embed.weight.shape[0]
        unread = (rows - 1) / rows
        values -= round(_values(embed, "weight", w) * unread)
        stored -= round(w.untyped_storage().nbytes() * unread)
    return WeightBytes(values, stored)


def weight_bytes(app_config) -> WeightBytes:
    """What a decode step of the target of ``app_config`` (an AppConfig) reads, from the model loaded as
    its engine loads it (its dtype, one unsharded copy: tensor-parallel ranks read their shares of it)."""
    from dspark_ray.engine.dtypes import runtime_dtype
    from dspark_ray.model import load

    engine = app_config.engine_config()
    # The engine's quantization (GGUF blocks kept or not) where this dspark_ray has the setting.
    how = {"quantization": engine.quantization} if hasattr(engine, "quantization") else {}
    model = load(engine.model, dtype=runtime_dtype(engine.dtype, engine.device), device="cpu", pack=False, **how)
    return model_weight_bytes(model)


def memory_bandwidth(gib: float = 1.0, repeats: int = 3, threads: int | None = None) -> float:
    """This machine's memory read bandwidth in bytes/s: ``torch.sum`` over ``gib`` GiB of float32 on
    ``threads`` torch threads (default: every core), the best of ``repeats``."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - start)
        return x.numel() * 4 / best
    finally:
        torch.set_num_threads(before)
