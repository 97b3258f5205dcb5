"""The confidence stage: the draft's confidence head, fitted on the trained draft (frozen).

Logistic regression of "the draft's greedy token is the target's" on the head's features (the
block position's final hidden state and the Markov embedding of the token before it), at every
query of random blocks in ``conf_rows`` training rows; held-out rows give its cross-entropy
against each position's rate alone and its calibration. Each label is the acceptance of position
j given that the drafts before it were accepted (the earlier tokens are the target's own), which
is what the head estimates; the engine cuts blocks with it under adaptive speculation.
"""

from __future__ import annotations

import json
import random
import time

import torch
import torch.nn.functional as F

from dspark_ray.drafter import blocks
from dspark_ray.drafter.config import RecipeConfig
from dspark_ray.drafter.states import States, autocast
from dspark_ray.drafter.train import chosen_shape, load_target, to_draft_map
from dspark_ray.drafter.vocab import DraftVocabulary
from dspark_ray.drafter.workdir import StageRecord, WorkDir, say

LR = 2e-2


@torch.no_grad()
def examples(draft, states: States, rows: list[int], spec: blocks.BlockSpec, config: RecipeConfig, seed: int):
    """(features [N, F], label [N], block position [N]) over ``rows``, each row a sequence."""
    gen = torch.Generator().manual_seed(seed)
    columns = states.tap_columns(spec.taps)
    to_draft = to_draft_map(draft, draft.config.vocab_size)
    feats, labels, pos = [], [], []
    for i in range(0, len(rows), config.batch):
        chunk = rows[i:i + config.batch]
        batch = blocks.pack(states, [[r] for r in chunk], max(states.rows[r].length for r in chunk), columns)
        batch = batch.to(config.device)
        anchors, real = blocks.draw_anchors(batch, config.anchors, gen)
        with autocast(config):
            out = blocks.block_forward(draft, batch, anchors.to(config.device), real.to(config.device), spec,
                                       features=True)
        _, _, best = blocks.teacher_targets(batch, out.index, to_draft)
        ok = out.valid
        feats.append(out.features[ok].float().cpu())
        labels.append((out.logits.argmax(-1) == best)[ok].float().cpu())
        pos.append(torch.arange(spec.block, device=ok.device).repeat(ok.shape[1] // spec.block)[None].expand_as(ok)[ok].cpu())
    return torch.cat(feats), torch.cat(labels), torch.cat(pos)


def run(config: RecipeConfig, work: WorkDir) -> StageRecord:
    from safetensors.torch import load_file, save_file

    from dspark_ray.model.dspark import load_dspark

    torch.manual_seed(config.seed + 20)
    states = States(work.states)
    shape = chosen_shape(config, work)
    chosen = DraftVocabulary.from_json(json.loads(work.vocab.read_text()))
    target = load_target(config)
    draft = load_dspark(config.out, target, dtype="float32", device=config.device)
    del target
    spec = blocks.BlockSpec(shape.block_size, shape.window, chosen.mask_token_id, config.taps(shape))
    t0 = time.perf_counter()
    train_rows = states.split("train")
    random.Random(config.seed + 21).shuffle(train_rows)
    x, y, pos = examples(draft, states, train_rows[:config.conf_rows], spec, config, config.seed + 22)
    hx, hy, hpos = examples(draft, states, states.split("heldout"), spec, config, config.seed + 23)
    rates = [round(float(y[pos == j].mean()), 3) if (pos == j).any() else None for j in range(spec.block)]
    say(f"confidence: {len(y)} examples, {len(hy)} held out; acceptance by position {rates}")
    head = torch.nn.Linear(x.shape[1], 1)
    opt = torch.optim.Adam(head.parameters(), lr=LR)
    for _ in range(config.conf_steps):
        loss = F.binary_cross_entropy_with_logits(head(x).squeeze(-1), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        p = torch.sigmoid(head(hx).squeeze(-1)) if len(hy) else torch.zeros(0)
        bce = float(F.binary_cross_entropy(p, hy)) if len(hy) else None
        per_pos = torch.tensor([float(y[pos == j].mean()) if (pos == j).any() else 0.5 for j in range(spec.block)])
        base = float(F.binary_cross_entropy(per_pos[hpos].clamp(1e-4, 1 - 1e-4), hy)) if len(hy) else None
        bands = ((0, .2), (.2, .4), (.4, .6), (.6, .8), (.8, 1.01))
        calibration = {f"{lo:.1f}-{min(hi, 1):.1f}": [int(((p >= lo) & (p < hi)).sum()),
                                                       round(float(hy[(p >= lo) & (p < hi)].mean()), 3)
                                                       if ((p >= lo) & (p < hi)).any() else None] for lo, hi in bands}
    path = config.out / "model.safetensors"
    tensors = load_file(str(path))
    tensors["confidence_head.proj.weight"] = head.weight.detach().float().contiguous()
    tensors["confidence_head.proj.bias"] = head.bias.detach().float().contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    details = {"examples": len(y), "heldout_examples": len(hy), "acceptance_by_position": rates,
               "heldout_bce": round(bce, 4) if bce is not None else None,
               "heldout_bce_position_rate_only": round(base, 4) if base is not None else None,
               "calibration": calibration, "steps": config.conf_steps, "lr": LR,
               "seconds": round(time.perf_counter() - t0, 1)}
    work.write_json(work.confidence, details)
    say(f"confidence: held-out bce {details['heldout_bce']} (position rate alone "
        f"{details['heldout_bce_position_rate_only']})")
    return StageRecord(0, details)
