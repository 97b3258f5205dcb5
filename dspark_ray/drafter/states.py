"""The states stage: the target run teacher-forced over every prompt + answer, its states kept.

Per token of each row: the target's residual stream after every tap layer any draft shape of
the recipe reads (``taps`` in index.json; bfloat16), and at every answer position (the
positions a block predicts from) its top-``topk`` next-token log-probabilities (float16) and
ids. Training then never runs the target: a step's cost is the draft's alone, and a row is
read as often as the epochs ask. Also chosen here from the answers: the draft's mask token and
reduced vocabulary (vocab.json).

Shards of about ``SHARD_TOKENS`` tokens (planned in plan.json), safetensors, each written whole
(by ``workers`` processes of one thread each); index.json, written once all are there, makes
them readable: an interrupted stage keeps its finished shards and goes on.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from dspark_ray.drafter import vocab
from dspark_ray.drafter.config import RecipeConfig
from dspark_ray.drafter.workdir import StageRecord, WorkDir, say
from dspark_ray.drafter.workers import run_workers

SHARD_TOKENS = 65536
BATCH_TOKENS = 4096  # padded tokens per teacher forward
HEAD_CHUNK = 512  # answer positions per LM-head product (bounds the [n, V] logits' memory)


def autocast(config: RecipeConfig):
    """bfloat16 autocast on the recipe's device when the config asks for it, else nothing."""
    if not config.autocast:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(config.device).type, dtype=torch.bfloat16)


def all_taps(config: RecipeConfig) -> tuple[int, ...]:
    """Every tap layer the draft and the sweep's shapes read."""
    return tuple(sorted({t for shape in (config.draft, *config.sweep) for t in config.taps(shape)}))


def load_teacher(config: RecipeConfig):
    from dspark_ray.model import load

    # Float weights (a GGUF file's blocks dequantized): the teacher's long teacher-forced passes run on
    # the float matmuls, and the draft starts from the target's layers.
    return load(config.target, dtype="float32", device=config.device, pack=False,
                quantization="none").eval().requires_grad_(False)


def length_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices grouped by similar length, each group's padded size (rows x longest) within
    ``budget`` (a longer row alone)."""
    groups, group, longest = [], [], 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if group and (len(group) + 1) * max(longest, lengths[i]) > budget:
            groups.append(group)
            group, longest = [], 0
        group.append(i)
        longest = max(longest, lengths[i])
    return groups + ([group] if group else [])


@torch.no_grad()
def teacher_rows(teacher, rows: list[dict], taps: tuple[int, ...], topk: int, config: RecipeConfig) -> dict:
    """The states of ``rows`` (one padded forward per group of similar lengths), concatenated."""
    from dspark_ray.model.dspark import tap_hidden_states

    seqs = [r["prompt_ids"] + r["answer_ids"] for r in rows]
    total = sum(len(s) for s in seqs)
    width = len(taps) * teacher.config.hidden_size
    out = {"tokens": torch.empty(total, dtype=torch.int32), "taps": torch.empty(total, width, dtype=torch.bfloat16),
           "topk_ids": torch.zeros(total, topk, dtype=torch.int32),
           "topk_logp": torch.full((total, topk), float("-inf"), dtype=torch.float16)}
    starts = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)[:-1].tolist()
    for group in length_groups([len(s) for s in seqs], BATCH_TOKENS):
        longest = max(len(seqs[r]) for r in group)
        ids = torch.zeros(len(group), longest, dtype=torch.int64)
        for b, r in enumerate(group):
            ids[b, :len(seqs[r])] = torch.tensor(seqs[r])
        with autocast(config):
            hidden, states = tap_hidden_states(teacher, ids.to(config.device), taps)
        for b, r in enumerate(group):
            n, p, s = len(seqs[r]), len(rows[r]["prompt_ids"]), starts[r]
            out["tokens"][s:s + n] = ids[b, :n].int()
            out["taps"][s:s + n] = states[b, :n].to("cpu", torch.bfloat16)
            for lo in range(p, n - 1, HEAD_CHUNK):  # answer positions: each predicts the next token
                hi = min(lo + HEAD_CHUNK, n - 1)
                logp = F.log_softmax(F.linear(hidden[b, lo:hi].float(), teacher.lm_weight.float()), dim=-1)
                values, idx = logp.topk(topk, dim=-1)
                out["topk_ids"][s + lo:s + hi] = idx.int().cpu()
                out["topk_logp"][s + lo:s + hi] = values.half().cpu()
    out["rows"] = torch.tensor([[st, len(sq), len(r["prompt_ids"])] for st, sq, r in zip(starts, seqs, rows)],
                               dtype=torch.int64)
    return out


@dataclass
class StateRow:
    """One row of the states: where it lies and where its answer starts."""

    shard: int
    start: int  # offset in the shard
    length: int
    prompt_len: int
    split: str


class States:
    """Read access to the states stage's shards (memory-mapped by safetensors, row by row)."""

    def __init__(self, folder: Path) -> None:
        import json

        self.folder = folder
        self.index = json.loads((folder / "index.json").read_text())
        self.taps = tuple(self.index["taps"])
        self.hidden = self.index["hidden_size"]
        self.files = [safe_open(str(folder / s["file"]), framework="pt") for s in self.index["shards"]]
        self.rows: list[StateRow] = []
        for k, (shard, f) in enumerate(zip(self.index["shards"], self.files)):
            table = f.get_tensor("rows").tolist()
            self.rows += [StateRow(k, st, n, p, split) for (st, n, p), split in zip(table, shard["splits"])]

    def split(self, name: str) -> list[int]:
        return [i for i, r in enumerate(self.rows) if r.split == name]

    def tap_columns(self, taps: tuple[int, ...]) -> list[int]:
        """The columns of ``taps``' states in the stored concatenation."""
        missing = [t for t in taps if t not in self.taps]
        if missing:
            raise ValueError(f"the states hold taps {list(self.taps)}, not {missing}; rerun the states stage "
                             "with these taps in the recipe (--force states)")
        h = self.hidden
        return [c for t in taps for c in range(self.taps.index(t) * h, (self.taps.index(t) + 1) * h)]

    def read(self, i: int, name: str) -> torch.Tensor:
        r = self.rows[i]
        return self.files[r.shard].get_slice(name)[r.start:r.start + r.length]


def plan_shards(rows: list[dict]) -> list[list[dict]]:
    """Training rows first, then the held-out ones, cut into shards of about SHARD_TOKENS tokens."""
    ordered = [r for r in rows if r["split"] == "train"] + [r for r in rows if r["split"] == "heldout"]
    groups, current, size = [], [], 0
    for r in ordered:
        current.append(r)
        size += len(r["prompt_ids"]) + len(r["answer_ids"])
        if size >= SHARD_TOKENS:
            groups.append(current)
            current, size = [], 0
    return groups + ([current] if current else [])


def shard_name(k: int) -> str:
    return f"shard-{k:04d}.safetensors"


def write_shards(config: RecipeConfig, folder: Path, shards: list[tuple[int, list[dict]]]) -> None:
    """Teacher-force the rows of each (index, rows) shard and write it (whole, then renamed)."""
    torch.manual_seed(config.seed)
    teacher = load_teacher(config)
    taps = all_taps(config)
    for k, group in shards:
        t0 = time.perf_counter()
        tensors = teacher_rows(teacher, group, taps, config.topk, config)
        tmp = folder / (shard_name(k) + ".tmp")
        save_file(tensors, str(tmp))
        tmp.replace(folder / shard_name(k))
        n = tensors["tokens"].numel()
        say(f"states: shard {k}, {n} tokens in {time.perf_counter() - t0:.0f} s ({n / (time.perf_counter() - t0):.0f} tok/s)")


def run(config: RecipeConfig, work: WorkDir) -> StageRecord:
    import json

    from dspark_ray.tokenizer import Tokenizer

    rows = sorted(work.read_jsonl(work.answers), key=lambda r: r["id"])  # whatever order they were written in
    if not rows:
        raise RuntimeError(f"states: {work.answers} is empty or missing; run the answers stage first")
    tokenizer = Tokenizer.from_path(config.target)
    target_cfg = config.target_config()
    chosen = vocab.choose(tokenizer, rows, config.draft.draft_vocab, target_cfg.vocab_size, config.mask_token_id)
    work.write_json(work.vocab, chosen.to_json())
    say(f"states: mask token {chosen.mask_token_id}, draft vocabulary "
        f"{len(chosen.ids) if chosen.ids else target_cfg.vocab_size} covering {chosen.coverage}")
    taps = all_taps(config)
    groups = plan_shards(rows)
    work.states.mkdir(parents=True, exist_ok=True)
    meta = {"taps": list(taps), "hidden_size": target_cfg.hidden_size, "topk": config.topk,
            "shards": [{"file": shard_name(k), "rows": len(g), "tokens": sum(len(r["prompt_ids"]) + len(r["answer_ids"])
                                                                              for r in g),
                        "splits": [r["split"] for r in g]} for k, g in enumerate(groups)]}
    plan_file = work.states / "plan.json"
    if plan_file.is_file() and json.loads(plan_file.read_text()) != meta:
        raise RuntimeError(f"states: {plan_file} planned other shards (the answers or the taps changed); "
                           "rerun with --force states")
    work.write_json(plan_file, meta)
    todo = [(k, g) for k, g in enumerate(groups) if not (work.states / shard_name(k)).is_file()]
    t0 = time.perf_counter()
    workers = min(config.workers, len(todo))
    if workers > 1:
        run_workers("states", [{"config": config.to_json(), "folder": str(work.states), "shards": todo[i::workers]}
                               for i in range(workers)], work.root)
    elif todo:
        write_shards(config, work.states, todo)
    seconds = time.perf_counter() - t0
    work.write_json(work.states / "index.json", meta)  # every shard is there: the states are readable
    made = sum(meta["shards"][k]["tokens"] for k, _ in todo)
    tokens = sum(s["tokens"] for s in meta["shards"])
    return StageRecord(tokens, {"rows": len(rows), "shards": len(groups), "taps": list(taps), "topk": config.topk,
                                "mask_token_id": chosen.mask_token_id,
                                "draft_vocab": len(chosen.ids) if chosen.ids else None,
                                "vocab_coverage": chosen.coverage, "workers": max(1, workers),
                                "tokens_per_second": round(made / seconds, 1) if made else None})


def run_job(job: dict) -> None:
    """A worker process's share (``workers.run_workers``): its own teacher on one thread."""
    write_shards(RecipeConfig.from_json(job["config"]), Path(job["folder"]), job["shards"])
