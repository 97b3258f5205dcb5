"""The train stage (and the sweep): distil a DSpark block draft from the states, resumably.

The draft (``new_draft``): ``layers`` Qwen3 decoder layers of the target's widths, started as the
target's first or last layers (q/k norms at 1) or at random; ``fc`` random (normal 0.02); the
Markov head's output projection zero (no bias at first); its embeddings the target's (frozen) and
its LM head the target's, or with a reduced vocabulary the target's rows of that vocabulary
(trained only with ``train_head``). AdamW (betas 0.9, 0.95, no weight decay), linear warm-up then
cosine to ``min_lr_frac``, gradient clipping 1.0, bfloat16 autocast when asked.

Every ``eval_every`` steps a point of the acceptance curve: on held-out rows, each block
position's agreement with the target's argmax (the earlier positions given) and the expected
tokens per verification step it implies (``blocks.expected_length``), against the training tokens
seen so far. A checkpoint every ``save_every`` steps lets a stopped stage go on where it was.
With a time budget, the step count is fixed after the first steps' timing (and logged).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from dspark_ray.drafter import blocks
from dspark_ray.drafter.blocks import BlockSpec, RowStream
from dspark_ray.drafter.config import DraftShape, RecipeConfig
from dspark_ray.drafter.states import States, autocast
from dspark_ray.drafter.vocab import DraftVocabulary
from dspark_ray.drafter.workdir import StageRecord, WorkDir, say

TIMING_STEPS = 8  # steps timed before a budget fixes the step count


def draft_config(config: RecipeConfig, shape: DraftShape, chosen: DraftVocabulary) -> dict:
    """The draft's config.json (the layout vLLM loads as speculative method ``dspark``)."""
    t = config.target_config()
    taps = list(config.taps(shape))
    from dspark_ray.tokenizer import Tokenizer

    tok = Tokenizer.from_path(config.target)
    eos = sorted(tok.eos_token_ids)
    raw = {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3",
        "hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
        "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim,
        "vocab_size": t.vocab_size, "rms_norm_eps": t.rms_norm_eps, "rope_theta": t.rope_theta,
        "max_position_embeddings": t.max_position_embeddings, "hidden_act": "silu",
        "tie_word_embeddings": t.tie_word_embeddings, "bos_token_id": tok.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "num_hidden_layers": shape.layers, "attention_bias": False, "torch_dtype": "bfloat16",
        "block_size": shape.block_size, "mask_token_id": chosen.mask_token_id,
        "target_layer_ids": taps, "num_target_layers": t.num_layers, "target_hidden_size": t.hidden_size,
        "markov_rank": shape.markov_rank, "markov_head_type": "vanilla",
        "enable_confidence_head": True, "confidence_head_with_markov": True,
        "layer_types": ["sliding_attention"] * shape.layers, "sliding_window": shape.window, "is_causal": True,
        "dflash_config": {"mask_token_id": chosen.mask_token_id, "target_layer_ids": taps, "use_swa": True,
                          "swa_window_size": shape.window, "causal": True},
    }
    if chosen.ids is not None and shape.draft_vocab is not None:
        raw["draft_vocab_size"] = len(chosen.ids)
    return raw


def load_target(config: RecipeConfig):
    from dspark_ray.model import load

    # Float weights (a GGUF file's blocks dequantized): the teacher's long teacher-forced passes run on
    # the float matmuls, and the draft starts from the target's layers.
    return load(config.target, dtype="float32", device=config.device, pack=False,
                quantization="none").eval().requires_grad_(False)


def new_draft(config: RecipeConfig, shape: DraftShape, chosen: DraftVocabulary, target, seed: int):
    """The draft at initialisation (module docstring), float32, in training mode."""
    from dspark_ray.model.dspark import DSparkConfig, DSparkDraft

    cfg = DSparkConfig.from_dict(draft_config(config, shape, chosen))
    reduced = cfg.reduced_vocab
    lm = target.lm_weight.detach()
    if reduced:
        ids = torch.tensor(chosen.ids, device=lm.device)
        lm = torch.nn.Parameter(lm[ids].clone(), requires_grad=config.train_head)
    draft = DSparkDraft(cfg, target.model.embed_tokens.weight.detach(), lm).to(config.device)
    if reduced:
        draft.draft_to_target = ids
    n = target.config.num_layers
    first = {"first": 0, "last": n - shape.layers, "random": None}[shape.init]
    source = target.state_dict()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name == "lm_weight":
                continue
            src = None
            if first is not None and name.startswith("layers."):
                i, rest = name.split(".", 2)[1:]
                src = source.get(f"model.layers.{int(i) + first}.{rest}")
            if src is not None and src.shape == p.shape:
                p.copy_(src)
            elif p.dim() == 1:
                p.fill_(1.0)
            elif name == "markov_head.markov_w2.weight":
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    draft = draft.float().train()
    for name, p in draft.named_parameters():
        p.requires_grad_(name != "lm_weight" or config.train_head)
    return draft


def trainable(draft, config: RecipeConfig) -> list[torch.nn.Parameter]:
    return [p for name, p in draft.named_parameters()
            if (name != "lm_weight" or config.train_head) and not name.startswith("confidence_head.")]


def lr_at(step: int, total: int, peak: float, warmup: int, min_frac: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def to_draft_map(draft, vocab_size: int) -> torch.Tensor | None:
    """[V] int64: each target id's draft id, -1 outside a reduced vocabulary (None: the same ids)."""
    if draft.draft_to_target is None:
        return None
    out = torch.full((vocab_size,), -1, dtype=torch.int64, device=draft.draft_to_target.device)
    out[draft.draft_to_target] = torch.arange(len(draft.draft_to_target), device=out.device)
    return out


@torch.no_grad()
def evaluate(draft, states: States, rows: list[int], spec: BlockSpec, config: RecipeConfig, columns: list[int],
             to_draft) -> dict:
    """Held-out block agreement by position (every answer position an anchor, at most ``anchors``
    per row) and the expected tokens per step at each k."""
    was = draft.training
    draft.eval()
    gen = torch.Generator().manual_seed(config.seed + 77)
    hits, counts = torch.zeros(spec.block), torch.zeros(spec.block)
    kl = torch.zeros(spec.block)
    for i in range(0, len(rows), config.batch):
        seqs = [[r] for r in rows[i:i + config.batch]]
        batch = blocks.pack(states, seqs, max(states.rows[r].length for r in rows[i:i + config.batch]), columns)
        batch = batch.to(config.device)
        anchors, real = blocks.draw_anchors(batch, config.anchors, gen)
        with autocast(config):
            out = blocks.block_forward(draft, batch, anchors.to(config.device), real.to(config.device), spec)
        loss = blocks.block_loss(out, batch, spec, config.pos_decay, to_draft)
        hits += (loss.agree_by_position * loss.counts).cpu()
        kl += (loss.kl_by_position * loss.counts).cpu()
        counts += loss.counts.cpu()
    draft.train(was)
    agree = (hits / counts.clamp_min(1)).tolist()
    return {"agree_by_position": [round(a, 4) for a in agree],
            "kl_by_position": [round(float(x), 4) for x in kl / counts.clamp_min(1)],
            "expected_length": {k: round(blocks.expected_length(agree, k), 3) for k in range(1, spec.block + 1)}}


def train(config: RecipeConfig, work: WorkDir, shape: DraftShape, steps: int, folder: Path,
          budget_s: float | None = None, curve: bool = True) -> dict:
    """Train one draft shape for ``steps`` steps (fewer if ``budget_s`` runs out first), resuming
    from ``folder``'s checkpoint; returns the run's summary (also in folder/result.json)."""
    torch.manual_seed(config.seed + 11)
    label = "train" if folder == work.train else f"sweep {folder.name}"
    states = States(work.states)
    chosen = DraftVocabulary.from_json(json.loads(work.vocab.read_text()))
    if shape.draft_vocab is None:
        chosen = DraftVocabulary(chosen.mask_token_id, None, chosen.coverage)
    target = load_target(config)
    draft = new_draft(config, shape, chosen, target, config.seed + 10)
    del target
    spec = BlockSpec(shape.block_size, shape.window, chosen.mask_token_id, config.taps(shape))
    columns = states.tap_columns(spec.taps)
    to_draft = to_draft_map(draft, draft.config.vocab_size)
    params = trainable(draft, config)
    opt = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    train_rows = states.split("train")
    held = states.split("heldout")[:config.eval_rows]
    folder.mkdir(parents=True, exist_ok=True)
    ckpt_file = folder / "checkpoint.pt"
    # budget_total: the step count a time budget fixed (kept across a resume); else ``steps`` rules
    state = {"step": 0, "budget_total": None, "stream": (0, 0), "curve": [], "ema": None, "seconds": 0.0,
             "row_tokens": 0, "predictions": 0}
    if ckpt_file.is_file():
        saved = torch.load(ckpt_file, weights_only=False)
        draft.load_state_dict(saved["draft"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        say(f"{label}: resumed at step {state['step']}")
    stream = RowStream(train_rows, config.seed + 14, *state["stream"])
    gen = torch.Generator().manual_seed(config.seed + 13)
    total = state["budget_total"] or steps
    t0 = time.perf_counter() - state["seconds"]
    params_count = sum(p.numel() for p in params)
    say(f"{label}: {params_count} trainable parameters, taps {list(spec.taps)}, block {spec.block}, "
        f"window {spec.window}, vocab {draft.config.output_vocab_size}, {len(train_rows)} rows")
    if curve and not state["curve"]:
        state["curve"].append({"step": 0, "row_tokens": 0, "predictions": 0, "seconds": 0.0,
                               **evaluate(draft, states, held, spec, config, columns, to_draft)})
    log_every = max(1, min(10, total // 10))
    while state["step"] < total:
        step = state["step"]
        gen.manual_seed(config.seed * 7919 + step)  # the step's anchors depend on the step alone (resumable)
        seqs = blocks.fill_sequences(stream, states, config.batch, config.seq_tokens)
        batch = blocks.pack(states, seqs, config.seq_tokens, columns).to(config.device)
        anchors, real = blocks.draw_anchors(batch, config.anchors, gen)
        lr = lr_at(step, total, config.lr, min(config.warmup, max(1, total // 10)), config.min_lr_frac)
        for group in opt.param_groups:
            group["lr"] = lr
        with autocast(config):
            out = blocks.block_forward(draft, batch, anchors.to(config.device), real.to(config.device), spec)
        loss = blocks.block_loss(out, batch, spec, config.pos_decay, to_draft)
        opt.zero_grad(set_to_none=True)
        loss.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        value = loss.loss.item()
        state["ema"] = value if state["ema"] is None else 0.95 * state["ema"] + 0.05 * value
        state["step"] = step + 1
        state["row_tokens"] += batch.row_tokens
        state["predictions"] += loss.predictions
        state["stream"] = stream.state
        elapsed = time.perf_counter() - t0
        if budget_s is not None and state["budget_total"] is None and state["step"] == TIMING_STEPS:
            per_step = elapsed / TIMING_STEPS
            total = state["budget_total"] = max(TIMING_STEPS, min(steps, int(budget_s / per_step)))
            say(f"{label}: {per_step:.2f} s/step; the budget of {budget_s:.0f} s allows {total} steps")
        if step % log_every == 0 or state["step"] == total:
            say(f"{label}: step {step} kl {value:.4f} ema {state['ema']:.4f} agree/pos "
                f"{' '.join(f'{a:.2f}' for a in loss.agree_by_position.tolist())} lr {lr:.2e} "
                f"{elapsed / state['step']:.2f} s/step")
        if curve and (state["step"] % config.eval_every == 0 or state["step"] == total):
            point = evaluate(draft, states, held, spec, config, columns, to_draft)
            state["curve"].append({"step": state["step"], "row_tokens": state["row_tokens"],
                                   "predictions": state["predictions"], "seconds": round(elapsed, 1), **point})
            say(f"{label}: held out at step {state['step']}: {point['agree_by_position']} -> "
                f"{point['expected_length'][spec.block]} tokens/step")
        if state["step"] % config.save_every == 0 or state["step"] == total:
            state["seconds"] = time.perf_counter() - t0
            save_checkpoint(ckpt_file, draft, opt, state)
    state["seconds"] = time.perf_counter() - t0
    final = state["curve"][-1] if curve else evaluate(draft, states, held, spec, config, columns, to_draft)
    result = {"shape": {k: getattr(shape, k) for k in shape.__dataclass_fields__} | {"taps": list(spec.taps)},
              "steps": state["step"], "seconds": round(state["seconds"], 1), "row_tokens": state["row_tokens"],
              "predictions": state["predictions"], "final_kl_ema": round(state["ema"], 4),
              "trainable_parameters": params_count, "heldout": final, "curve": state["curve"]}
    work.write_json(folder / "result.json", result)
    return {"draft": draft, "chosen": chosen, "shape": shape, "result": result}


def save_checkpoint(path: Path, draft, opt, state: dict) -> None:
    payload = {"draft": draft.state_dict(), "opt": opt.state_dict(), "state": state}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)


def save_draft(config: RecipeConfig, draft, shape: DraftShape, chosen: DraftVocabulary, out: Path) -> None:
    """The draft as a checkpoint folder: config.json, model.safetensors (bfloat16; the confidence
    head float32; a reduced vocabulary's lm_head.weight and d2t), the target's tokenizer files if
    it is a folder that has them (a DSpark draft reads the target's ids either way)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, v in draft.state_dict().items():
        if k == "lm_weight":
            continue
        keep = torch.float32 if k.startswith("confidence_head.") else torch.bfloat16
        tensors[k] = v.detach().to("cpu", keep).contiguous()
    if draft.draft_to_target is not None:
        n = len(draft.draft_to_target)
        tensors["lm_head.weight"] = draft.lm_weight.detach().to("cpu", torch.bfloat16).contiguous()
        tensors["d2t"] = (draft.draft_to_target.cpu() - torch.arange(n)).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(draft_config(config, shape, chosen), indent=2) + "\n")
    from dspark_ray.model.checkpoint import locate

    source = locate(config.target)
    if source.is_dir():
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            if (source / name).is_file():
                (out / name).write_bytes((source / name).read_bytes())


def budget_left(config: RecipeConfig, work: WorkDir, reserve_s: float) -> float | None:
    if config.budget_minutes is None:
        return None
    return max(60.0, config.budget_minutes * 60 - work.seconds_spent() - reserve_s)


def run(config: RecipeConfig, work: WorkDir) -> StageRecord:
    shape = chosen_shape(config, work)
    reserve = reserve_seconds(config)
    trained = train(config, work, shape, config.steps, work.train, budget_left(config, work, reserve))
    save_draft(config, trained["draft"], shape, trained["chosen"], config.out)
    result = trained["result"]
    write_curve(work.curve, result["curve"], shape.block_size)
    say(f"train: {result['steps']} steps, {result['row_tokens']} row tokens in {result['seconds']:.0f} s; held out "
        f"{result['heldout']['agree_by_position']}; draft written to {config.out}")
    return StageRecord(result["row_tokens"], {k: v for k, v in result.items() if k != "curve"})


def chosen_shape(config: RecipeConfig, work: WorkDir) -> DraftShape:
    """The sweep's winner if the sweep ran, else the configured draft."""
    if work.sweep.is_file():
        from dspark_ray.drafter.config import shape_from_json

        return shape_from_json(json.loads(work.sweep.read_text())["chosen"])
    return config.draft


def reserve_seconds(config: RecipeConfig) -> float:
    """Wall time kept for the stages after training (confidence, measure, card), from their sizes:
    about a second per confidence row and per measured answer, plus start-ups."""
    return 120 + config.conf_rows * 0.5 + config.measure_prompts * 2 * config.measure_max_tokens / 60 \
        + config.speed_prompts * 2 * config.measure_max_tokens / 40


def write_curve(path: Path, curve: list[dict], block: int) -> None:
    head = ["step", "row_tokens", "predictions", "seconds", *[f"agree_{j + 1}" for j in range(block)],
            *[f"tokens_per_step_k{k}" for k in range(1, block + 1)]]
    lines = [",".join(head)]
    for p in curve:
        lines.append(",".join(str(x) for x in (p["step"], p["row_tokens"], p["predictions"], p["seconds"],
                                                *p["agree_by_position"],
                                                *[p["expected_length"][k] for k in range(1, block + 1)])))
    path.write_text("\n".join(lines) + "\n")


def run_sweep(config: RecipeConfig, work: WorkDir) -> StageRecord:
    """Each shape of ``config.sweep`` and the configured draft, ``sweep_steps`` steps each from the
    same data and seed; the one with the most expected tokens per step at its block size wins."""
    shapes = [config.draft, *config.sweep]
    rows, spent = [], 0.0
    for i, shape in enumerate(shapes):
        trained = train(config, work, shape, config.sweep_steps, work.root / "sweep" / f"shape-{i}", None, curve=False)
        r = trained["result"]
        spent += r["seconds"]
        rows.append({"shape": r["shape"], "seconds": r["seconds"], "agree_by_position": r["heldout"]["agree_by_position"],
                     "expected_length": r["heldout"]["expected_length"][shape.block_size]})
        say(f"sweep: {r['shape']} -> {rows[-1]['expected_length']} tokens/step in {r['seconds']:.0f} s")
    best = max(range(len(rows)), key=lambda i: rows[i]["expected_length"])
    chosen = {k: v for k, v in rows[best]["shape"].items()}
    work.write_json(work.sweep, {"steps": config.sweep_steps, "runs": rows, "chosen": chosen})
    return StageRecord(0, {"runs": rows, "chosen": chosen})
