"""DSparkProposer: DSpark's block drafter (dspark_ray/model/dspark.py) as the engine's draft service.

NOTE: one call, for rows whose last token ``x`` (the anchor) sits at position
``p0 = start + len(token_ids) - 1`` and whose target has committed positions
``0 .. p0 - 1``:

1. **Context.** Each slot's ``ContextRing`` is bound to the row's epoch (a new
   epoch: empty); the target's tap states of the positions committed since the
   row's last proposal (``ProposeRow.context``, which the engine keeps per
   request) become the draft layers' context K/V (``DSparkDraft.context_kv``, per
   position) and are written at their positions; the ring is cut back to ``p0``
   (it only ever holds committed positions, so nothing is rolled back in the
   ordinary case: a rejected draft never reaches it).
2. **Block.** ONE forward for all rows: ``[x, mask, ..]`` at ``p0 ..``
   attending to the ring's window before ``p0``; ``S`` queries, at most the
   draft's block (a row asking more drafts than the block holds gets the
   block: position ``j`` predicts ``p0 + j + 1``, and the block has no query
   past ``p0 + block_size``): for a draft with non-causal layers always the
   most any row may ask, so that no row's drafts depend on the others'
   (``_queries``).
3. **Markov head**, left to right with each row's sampling, as the target will
   verify it: the request's logits rules (penalties, logit bias, min_tokens,
   min_p) on each position given the drafts before it, then the argmax (greedy)
   or a draw from the processed q (temperature, top-k, top-p; keyed by seed
   and position), q kept in ``Proposal.draft_probs``. A draft with a reduced
   vocabulary (``draft_vocab_size``) drafts over the target's ids all the
   same: its logits are placed at their target ids, -inf elsewhere, before the
   rules and the draw (``DSparkDraft.to_target``), so its q is zero outside
   its vocabulary and verification stays exact.
4. **Confidence.** With a confidence head, each draft's estimated acceptance
   given the drafts before it (``Proposal.confidence``, from the position's
   hidden state and the token before it); under adaptive speculation the
   engine verifies a row's block only as far as it expects acceptance
   (``adaptive.confident_drafts``).

Structured-output rows draft without their grammar (as
``DraftProposer`` without grammars): the engine cuts each draft at its first
token the grammar forbids, which keeps verification exact.

A row whose ring lacks part of its window (the proposer was replaced, or a
draft call failed after the engine had let go of the states) still drafts:
the block sees the context it has. That costs acceptance, never correctness.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dspark_ray.engine.interfaces import ContextStates, Proposal, ProposeRow, SamplingRow
from dspark_ray.engine.logits_rules import apply_rules, needs_rules
from dspark_ray.engine.verifier import mask_vocab, sample_draft_tokens
from dspark_ray.model.dspark import DSparkConfig, DSparkDraft
from dspark_ray.slots.context_ring import ContextRing


def context_window(cfg: DSparkConfig, max_context: int) -> int:
    """Context positions a block reads before its anchor: the draft's widest sliding window, or
    the whole context when a layer attends to all of it (``max_context`` caps both)."""
    return min(cfg.window or max_context, max_context)


class RowSampler:
    """A block's draft sampling (a ``dspark.Sampler``): each row's logits rules given the drafts
    before the position, then ``sample_draft_tokens`` (what the target verifies against)."""

    def __init__(self, rows: Sequence[SamplingRow], first_positions: Sequence[int]) -> None:
        self.rows, self.first_positions = list(rows), list(first_positions)  # position of each row's draft 0
        self.rules = needs_rules(self.rows)
        self.drafts: list[list[int]] = [[] for _ in self.rows]  # sampled so far (read by the rules)

    def __call__(
        self,
        logits: torch.Tensor,  # [B, V] float32, the Markov bias applied
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([B] int64, [B, V] float32 q or None)
        if self.rules:
            logits = apply_rules(logits[:, None].clone(), self.rows, self.drafts, offset=step)[:, 0]
        tokens, q = sample_draft_tokens(logits, self.rows, [p + step for p in self.first_positions])
        if self.rules:
            for drafts, t in zip(self.drafts, tokens.tolist()):
                drafts.append(t)
        return tokens, q


class DSparkProposer:
    """The draft service over a ``DSparkDraft`` and a per-slot ``ContextRing``.

    Args:
        model: the loaded draft (its embedding and LM head are the target's).
        capacity: slots ``1..capacity`` (the ring has ``capacity + 1`` rows).
        max_context: the engine's context; the ring's window when a draft layer attends to the
            whole context (a sliding-window draft keeps only its widest window).
        max_spec_tokens: the engine's k (``Proposal.draft_probs`` is ``[B, k, V]``).
        vocab_limit: ids at or above it (embedding padding the tokenizer lacks) are never proposed.
    """

    def __init__(self, model: DSparkDraft, capacity: int, max_context: int, max_spec_tokens: int,
                 vocab_limit: int | None = None) -> None:
        self.model = model
        cfg = model.config
        self.block_size = cfg.block_size
        self.max_spec_tokens = max_spec_tokens
        self.vocab_limit = vocab_limit if vocab_limit is not None and vocab_limit < cfg.vocab_size else None
        self.padding = None  # [N] bool: draft ids whose target ids are padding (a reduced vocabulary)
        if self.vocab_limit is not None and model.draft_to_target is not None:
            self.padding = model.draft_to_target >= self.vocab_limit
        weight = model.fc.weight
        self.device = weight.device
        attn = model.layers[0].self_attn
        kv_heads = attn.k_proj.out_features // attn.head_dim
        self.context_window = context_window(cfg, max_context)
        self.causal = all(cfg.layer_causal)  # every layer's block queries see only those before them
        self.ring = ContextRing(cfg.backbone.num_layers, capacity, self.context_window, cfg.block_size, kv_heads,
                                attn.head_dim, dtype=weight.dtype, device=self.device)

    @torch.inference_mode()
    def propose(self, rows: list[ProposeRow]) -> Proposal:
        if not rows:
            return Proposal([], None)
        if any(not r.token_ids for r in rows):
            raise ValueError("every ProposeRow needs its last token (token_ids is empty)")
        slots = torch.tensor([r.slot for r in rows], dtype=torch.int64, device=self.device)
        anchors = [r.start + len(r.token_ids) - 1 for r in rows]  # p0 per row
        anchor_pos = torch.tensor(anchors, dtype=torch.int64, device=self.device)
        self.ring.bind(slots, torch.tensor([r.epoch for r in rows], device=self.device))
        self._write_context(rows, slots, anchors)
        self.ring.set_length(slots, anchor_pos)  # context is what lies before the anchor
        s = self._queries(rows)
        anchor_ids = torch.tensor([r.token_ids[-1] for r in rows], dtype=torch.int64, device=self.device)
        hidden = self.model.block_hidden(anchor_ids, anchor_pos, self.ring.view(slots, anchor_pos), s)
        base = self._mask_padding(self.model.base_logits(hidden))  # [B, S, N]
        sampler = RowSampler([r.sampling for r in rows], [p + 1 for p in anchors])
        tokens, _, q, markov = self.model.sample_block(base, anchor_ids, sampler)
        probs = None
        if q is not None:
            probs = torch.zeros((len(rows), self.max_spec_tokens, q.shape[-1]), dtype=torch.float32,
                                device=self.device)
            probs[:, :s] = q
        out = tokens.tolist()
        confidence = self.model.confidence(hidden, markov)  # [B, S] or None without the head
        if confidence is not None:
            confidence = [c[:r.num_draft] for c, r in zip(confidence.tolist(), rows)]
        return Proposal([out[b][:r.num_draft] for b, r in enumerate(rows)], probs, confidence)

    def _mask_padding(
        self,
        base: torch.Tensor,  # [B, S, N] float32 over the draft's vocabulary
    ) -> torch.Tensor:  # [B, S, N], ids the tokenizer lacks at -inf
        if self.model.draft_to_target is None:
            return mask_vocab(base, self.vocab_limit)
        if self.padding is not None:
            base[..., self.padding] = float("-inf")
        return base

    def _queries(self, rows: list[ProposeRow]) -> int:
        """The block's queries. A query sees the block's later queries in a non-causal layer, so
        there a row's drafts depend on how many queries the block has: always the most any row may
        ask (as vLLM, which always drafts num_speculative_tokens), never what the batch asks, or a
        row's drafts would depend on the other rows. With causal layers only, the most this batch
        asks gives the same drafts for less."""
        most = min(self.block_size, self.max_spec_tokens)
        return min(max(r.num_draft for r in rows), most) if self.causal else most

    def _write_context(self, rows: list[ProposeRow], slots: torch.Tensor, anchors: list[int]) -> None:
        """The new context states of the rows that have some, as context K/V in their slots' rings.

        Only the last ``context_window`` positions of each are projected (a block reads no
        further back); all positions of all rows go through ``context_kv`` as one sequence
        (it is per position), then each row's are written."""
        idx = [i for i, r in enumerate(rows) if r.context is not None and len(r.context)]
        if not idx:
            return
        ctx: list[ContextStates] = []
        for i in idx:
            c = rows[i].context.last(self.context_window)
            if c.end > anchors[i]:
                raise ValueError(f"slot {rows[i].slot}: context states reach position {c.end - 1}, at or past "
                                 f"the anchor at {anchors[i]}; only committed positions are context")
            ctx.append(c)
        states = torch.cat([c.states for c in ctx]).to(self.device)[None]  # [1, N, n_taps * hidden]
        flat_pos = torch.cat([torch.arange(c.start, c.end) for c in ctx]).to(self.device)[None]  # [1, N]
        k, v = self.model.context_kv(states, flat_pos)  # per layer [1, N, kv_heads, head_dim]
        lengths = torch.tensor([len(c) for c in ctx])
        offsets = torch.cumsum(lengths, 0) - lengths
        steps = torch.arange(int(lengths.max()))[None]  # [1, T]
        real = steps < lengths[:, None]  # [B', T]
        gather = torch.where(real, offsets[:, None] + steps, 0).to(self.device)  # [B', T] into the flat sequence
        positions = torch.where(real, torch.tensor([c.start for c in ctx])[:, None] + steps, -1).to(self.device)
        self.ring.write(slots[idx], positions, [x[0][gather] for x in k], [x[0][gather] for x in v])
