"""Training blocks: sequences packed from the states, every block of a batch in one draft forward.

NOTE: the objective (DFlash's, with DSpark's Markov head). A training sequence packs whole rows
(prompt + the target's answer) up to ``seq_tokens``; anchors ``p0`` are drawn among the answer
positions. The block at ``p0`` is ``[x_p0, mask, ..]`` at positions ``p0 ..``; it sees the
context K/V (from the target's tap states) of its own row before ``p0`` within the draft's
window, and its own block's queries up to itself (causal layers: a block of k drafts what the
first k of a longer block would, so the serving k is chosen after training). Query ``j``
predicts the token at ``p0 + j + 1``: the loss is KL(target || draft) against the target's
top-k next-token distribution at ``p0 + j`` (renormalised over the draft's vocabulary), the
Markov head teacher-forced with the true previous token (what it sees whenever the drafts before
were accepted), weighted by ``exp(-j / pos_decay)``: a later position only counts once the
earlier ones were accepted.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark_ray.drafter.states import States


@dataclass(frozen=True)
class BlockSpec:
    """What the training blocks look like (the draft's config decides all but the anchors)."""

    block: int  # queries per block
    window: int  # context positions before the query a block sees
    mask_token_id: int
    taps: tuple[int, ...]


@dataclass
class PackedBatch:
    """B sequences of L tokens, each the concatenation of whole rows (padding at the end)."""

    tokens: torch.Tensor  # [B, L] int64
    taps: torch.Tensor  # [B, L, n * hidden] bfloat16
    positions: torch.Tensor  # [B, L] int64: the position inside its row (RoPE)
    row: torch.Tensor  # [B, L] int64: which row of the sequence a token belongs to (-1: padding)
    answer: torch.Tensor  # [B, L] bool: a position with a next token of the same row's answer to predict
    topk_ids: torch.Tensor  # [B, L, K] int64: the target's top-k next tokens at each position
    topk_logp: torch.Tensor  # [B, L, K] float32: their log-probabilities (-inf where none)
    row_tokens: int  # tokens of real rows in the batch

    def to(self, device) -> PackedBatch:
        return PackedBatch(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in (
            self.tokens, self.taps, self.positions, self.row, self.answer, self.topk_ids, self.topk_logp)),
            self.row_tokens)


class RowStream:
    """The training rows in a seeded random order, epoch after epoch; ``state`` resumes it."""

    def __init__(self, rows: list[int], seed: int, epoch: int = 0, cursor: int = 0) -> None:
        self.rows, self.seed, self.epoch, self.cursor = rows, seed, epoch, cursor
        self.order = self._order()

    def _order(self) -> list[int]:
        order = list(self.rows)
        random.Random(self.seed * 1000 + self.epoch).shuffle(order)
        return order

    def next(self) -> int:
        if self.cursor == len(self.order):
            self.epoch, self.cursor = self.epoch + 1, 0
            self.order = self._order()
        self.cursor += 1
        return self.order[self.cursor - 1]

    @property
    def state(self) -> tuple[int, int]:
        return self.epoch, self.cursor


def pack(states: States, rows: list[list[int]], seq_tokens: int, columns: list[int]) -> PackedBatch:
    """One sequence per list of row indices (their tokens end to end; a row longer than the
    sequence keeps its last ``seq_tokens`` tokens)."""
    b, width = len(rows), len(columns)
    out = PackedBatch(torch.zeros(b, seq_tokens, dtype=torch.int64), torch.zeros(b, seq_tokens, width, dtype=torch.bfloat16),
                      torch.zeros(b, seq_tokens, dtype=torch.int64), torch.full((b, seq_tokens), -1, dtype=torch.int64),
                      torch.zeros(b, seq_tokens, dtype=torch.bool), None, None, 0)
    k = states.index["topk"]
    out.topk_ids = torch.zeros(b, seq_tokens, k, dtype=torch.int64)
    out.topk_logp = torch.full((b, seq_tokens, k), float("-inf"))
    cols = torch.tensor(columns)
    for s, seq in enumerate(rows):
        at = 0
        for n, i in enumerate(seq):
            r = states.rows[i]
            cut = max(0, r.length - seq_tokens)  # a row too long for a sequence keeps its end
            length = min(r.length - cut, seq_tokens - at)
            sl = slice(at, at + length)
            out.tokens[s, sl] = states.read(i, "tokens")[cut:cut + length].long()
            out.taps[s, sl] = states.read(i, "taps")[cut:cut + length][:, cols]
            out.positions[s, sl] = torch.arange(cut, cut + length)
            out.row[s, sl] = n
            pos = torch.arange(cut, cut + length)
            out.answer[s, sl] = (pos >= r.prompt_len) & (pos <= r.length - 2)
            out.topk_ids[s, sl] = states.read(i, "topk_ids")[cut:cut + length].long()
            out.topk_logp[s, sl] = states.read(i, "topk_logp")[cut:cut + length].float()
            at += length
            out.row_tokens += length
    return out


def fill_sequences(stream: RowStream, states: States, batch: int, seq_tokens: int) -> list[list[int]]:
    """Rows from the stream packed into ``batch`` sequences: each takes rows while they fit (always
    at least one); the row that does not fit opens the next sequence."""
    seqs, pending = [], None
    for _ in range(batch):
        seq, used = [], 0
        while True:
            i = pending if pending is not None else stream.next()
            pending = None
            n = states.rows[i].length
            if seq and used + n > seq_tokens:
                pending = i
                break
            seq.append(i)
            used += n
            if used >= seq_tokens:
                break
        seqs.append(seq)
    if pending is not None:  # the next step starts from it: the stream steps back one row
        stream.cursor -= 1 if stream.cursor > 0 else 0
    return seqs


def draw_anchors(batch: PackedBatch, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, n] anchors, [B, n] bool real): ``n`` distinct answer positions per sequence, ascending;
    a sequence with fewer repeats its first and marks the repeats unreal (no loss)."""
    anchors, real = [], []
    for ok in batch.answer:
        idx = ok.nonzero().flatten()
        if len(idx) == 0:
            idx = torch.zeros(1, dtype=torch.int64)
            keep = torch.zeros(n, dtype=torch.bool)
        else:
            keep = torch.arange(n) < len(idx)
        picked = idx[torch.randperm(len(idx), generator=gen)[:n]].sort().values
        anchors.append(torch.cat((picked, picked[:1].expand(n - len(picked)))))
        real.append(keep)
    return torch.stack(anchors), torch.stack(real)


class TrainBlocks:
    """Every block of a batch in one attention call: query ``(n, j)`` at ``p0_n + j`` sees the
    context of its own row before the anchor, inside the window, and its block up to itself."""

    def __init__(self, ctx_k, ctx_v, batch: PackedBatch, anchors: torch.Tensor, spec: BlockSpec) -> None:
        self.ctx_k, self.ctx_v = ctx_k, ctx_v
        b, n = anchors.shape
        device = anchors.device
        j = torch.arange(spec.block, device=device)
        qidx = (anchors[:, :, None] + j).flatten(1)  # [B, Q] sequence index each query sits at (p0 + j)
        p0 = anchors.repeat_interleave(spec.block, dim=1)  # [B, Q]
        c = torch.arange(batch.tokens.shape[1], device=device)
        same_row = batch.row[:, None, :] == batch.row.gather(1, p0)[:, :, None]  # [B, Q, L]
        ctx = same_row & (c[None, None, :] < p0[:, :, None]) & (c[None, None, :] > qidx[:, :, None] - spec.window)
        blk = torch.arange(n, device=device).repeat_interleave(spec.block)
        jj = j.repeat(n)
        own = (blk[:, None] == blk[None, :]) & (jj[None, :] <= jj[:, None])  # [Q, Q] causal within a block
        self.mask = torch.cat((ctx, own.expand(b, -1, -1)), dim=2)[:, None]  # [B, 1, Q, L + Q]
        self.index = qidx.clamp(max=batch.tokens.shape[1] - 1)
        self.positions = batch.positions.gather(1, p0) + jj[None, :]  # [B, Q] RoPE positions

    def __call__(self, layer: int, q, k, v):
        keys = torch.cat((self.ctx_k[layer].to(k.dtype), k), dim=1)
        values = torch.cat((self.ctx_v[layer].to(v.dtype), v), dim=1)
        rep = q.shape[2] // k.shape[2]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2).repeat_interleave(rep, dim=1),
            values.transpose(1, 2).repeat_interleave(rep, dim=1), attn_mask=self.mask)
        return out.transpose(1, 2)


@dataclass
class BlockOutput:
    logits: torch.Tensor  # [B, Q, N] draft logits over its vocabulary, Markov bias teacher-forced
    index: torch.Tensor  # [B, Q] the sequence index each query predicts from (p0 + j)
    valid: torch.Tensor  # [B, Q] bool: a real anchor and a next token of the same row's answer there
    features: torch.Tensor | None  # [B, Q, hidden + rank]: what the confidence head reads


def block_forward(draft, batch: PackedBatch, anchors: torch.Tensor, real: torch.Tensor, spec: BlockSpec,
                  features: bool = False) -> BlockOutput:
    """The draft's logits at every query of every block of ``batch`` (anchors ``[B, n]``)."""
    ctx_k, ctx_v = draft.context_kv(batch.taps, batch.positions)
    blocks = TrainBlocks(ctx_k, ctx_v, batch, anchors, spec)
    b, q = blocks.index.shape
    ids = torch.full((b, q), spec.mask_token_id, dtype=torch.int64, device=anchors.device)
    ids[:, ::spec.block] = batch.tokens.gather(1, anchors)
    x = F.embedding(ids, draft.embed)
    cos, sin = draft.rope(blocks.positions, x.dtype)
    for i, layer in enumerate(draft.layers):
        x = layer(i, x, cos, sin, blocks)
    hidden = draft.norm(x)
    prev = batch.tokens.gather(1, blocks.index)  # the token before each predicted one (the anchor for j = 0)
    embed = draft.markov_head.embed(prev)
    logits = draft.base_logits(hidden) + draft.markov_head.bias(embed) * draft.config.logit_scale
    p0 = anchors.repeat_interleave(spec.block, dim=1)
    qidx = (anchors[:, :, None] + torch.arange(spec.block, device=anchors.device)).flatten(1)
    inside = qidx < batch.tokens.shape[1]
    valid = (real.repeat_interleave(spec.block, dim=1) & inside & batch.answer.gather(1, blocks.index)
             & (batch.row.gather(1, blocks.index) == batch.row.gather(1, p0)))
    feats = torch.cat((hidden, embed.to(hidden.dtype)), dim=-1) if features else None
    return BlockOutput(logits.float(), blocks.index, valid, feats)


def teacher_targets(batch: PackedBatch, index: torch.Tensor, to_draft: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's distribution at each query, over the draft's vocabulary: (draft ids [B, Q, K],
    probabilities [B, Q, K] renormalised over the top-k ids the draft has, and the target's argmax
    in draft ids [B, Q], -1 where the draft cannot say it)."""
    k = batch.topk_ids.shape[-1]
    ids = batch.topk_ids.gather(1, index[..., None].expand(-1, -1, k))  # [B, Q, K] target ids
    logp = batch.topk_logp.gather(1, index[..., None].expand(-1, -1, k))
    draft_ids = ids if to_draft is None else to_draft[ids]
    keep = (draft_ids >= 0) & torch.isfinite(logp)
    p = torch.where(keep, logp.exp(), torch.zeros_like(logp))
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-20)
    best = torch.where(keep[..., 0], draft_ids[..., 0], torch.full_like(draft_ids[..., 0], -1))
    return draft_ids.clamp_min(0), p, best


def position_weights(block: int, decay: float, device=None) -> torch.Tensor:
    return torch.exp(-torch.arange(block, dtype=torch.float32, device=device) / decay)


@dataclass
class BlockLoss:
    loss: torch.Tensor  # scalar: the position-weighted mean KL
    kl_by_position: torch.Tensor  # [S] mean KL per block position (detached)
    agree_by_position: torch.Tensor  # [S] draft argmax == target argmax, per position (detached)
    counts: torch.Tensor  # [S] valid queries per position
    predictions: int  # valid queries (supervised tokens) in the batch


def block_loss(out: BlockOutput, batch: PackedBatch, spec: BlockSpec, decay: float,
               to_draft: torch.Tensor | None) -> BlockLoss:
    ids, p, best = teacher_targets(batch, out.index, to_draft)
    log_q = F.log_softmax(out.logits, dim=-1).gather(-1, ids)  # [B, Q, K]
    kl = (p * (torch.log(p.clamp_min(1e-20)) - log_q)).sum(-1)  # [B, Q]
    b = kl.shape[0]
    valid = out.valid.float()
    per_pos = (kl * valid).view(b, -1, spec.block).sum((0, 1))
    counts = valid.view(b, -1, spec.block).sum((0, 1))
    w = position_weights(spec.block, decay, kl.device)
    kl_pos = per_pos / counts.clamp_min(1)
    loss = (kl_pos * w).sum() / w.sum()
    with torch.no_grad():
        agree = ((out.logits.argmax(-1) == best).float() * valid).view(b, -1, spec.block).sum((0, 1))
    return BlockLoss(loss, kl_pos.detach(), (agree / counts.clamp_min(1)).detach(), counts.detach(),
                     int(valid.sum()))


def expected_length(agree: list[float], k: int | None = None) -> float:
    """Tokens per verification step of greedy speculation with k drafts, from each position's
    agreement given the earlier ones right: 1 + sum_j prod_{i <= j} a_i."""
    total, run = 1.0, 1.0
    for a in agree[:k]:
        run *= a
        total += run
    return total
