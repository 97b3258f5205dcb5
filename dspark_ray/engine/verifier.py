"""Verification: turn the target's logits over [pending, d1..dk] into emitted tokens.

Vocabulary (vLLM's, after Leviathan et al. 2023, arXiv 2211.17192):
accepted tokens are draft tokens the target keeps; at the first rejection a
recovered token is drawn from norm(max(0, p - q)); when all k drafts are
accepted a bonus token is drawn from the target's distribution after them.
Greedy rows accept while the draft equals the target's argmax, so greedy
output is exactly the target's own greedy output. The rule itself lives in
``dspark_kernels`` (Triton on CUDA, the reference elsewhere).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dspark_kernels import ops
from dspark_kernels.reference import first_argmax
from dspark_ray.engine.interfaces import SamplingRow
from dspark_ray.engine.randomness import DRAFT_STREAM, VERIFY_STREAM, derive_seed, uniform


def mask_vocab(
    logits: torch.Tensor,  # [..., V] float32
    limit: int | None,
) -> torch.Tensor:  # [..., V], ids >= limit at -inf
    """Rule out ids past ``limit``: rows a checkpoint pads its embeddings with, which no tokenizer id names."""
    if limit is not None:
        logits[..., limit:] = float("-inf")
    return logits


def sampling_probs(
    logits: torch.Tensor,  # [N, V] float32
    rows: Sequence[SamplingRow],  # N rows, none greedy
) -> torch.Tensor:  # [N, V] float32
    device = logits.device
    return ops.logits_to_probs(
        logits,
        torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=device),
        torch.tensor([r.top_k for r in rows], dtype=torch.int64, device=device),
        torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=device),
    )


def sample_draft_tokens(
    logits: torch.Tensor,  # [B, V] float32, the draft's next-token logits
    rows: Sequence[SamplingRow],
    positions: Sequence[int],  # per row: the position the sampled token will take
) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([B] int64, [B, V] float32 or None)
    """Greedy rows take the argmax; sampled rows draw from their processed q, by inverse CDF: the
    first token whose cumulative mass exceeds u times the row's total, u a function of the row's seed
    and position alone (randomness.uniform), so a row draws the same token whatever batch it is in.
    (One vectorised search for all rows: a torch.multinomial per row with a generator seeded for it
    had cost about as much as the draft's forward pass at 32 sampled rows.)"""
    tokens = first_argmax(logits)
    sampled = [i for i, r in enumerate(rows) if not r.greedy]
    if not sampled:
        return tokens, None
    device = logits.device
    probs = torch.zeros_like(logits, dtype=torch.float32)
    idx = torch.tensor(sampled, device=device)
    q = sampling_probs(logits[idx], [rows[i] for i in sampled])  # [S, V]
    probs[idx] = q
    u = torch.tensor([uniform(rows[i].seed, positions[i], DRAFT_STREAM) for i in sampled],
                     dtype=torch.float64, device=device)  # [S]
    cdf = q.double().cumsum(dim=-1)  # [S, V]
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=q.shape[-1] - 1)
    # Only a rounding at the very top of the range can land past the last token with mass.
    picked = torch.where(q.gather(1, picked[:, None])[:, 0] > 0, picked, q.argmax(dim=-1))  # [S]
    tokens[idx] = picked
    return tokens, probs


def verify(
    target_logits: torch.Tensor,  # [B, K+1, V] float32; row b valid at 0..num_draft[b]
    draft_token_ids: torch.Tensor,  # [B, K] int64, padded
    num_draft: torch.Tensor,  # [B] int64
    draft_probs: torch.Tensor | None,  # [B, K, V] float32, zeros on greedy rows
    rows: Sequence[SamplingRow],
    first_positions: Sequence[int],  # per row: the position of its first emitted token
) -> tuple[torch.Tensor, torch.Tensor]:  # ([B, K+1] int64 with -1 padding, [B] int64)
    B, K1, V = target_logits.shape
    K = K1 - 1
    device = target_logits.device
    is_greedy = torch.tensor([r.greedy for r in rows], dtype=torch.bool, device=device)
    sampled = [i for i, r in enumerate(rows) if not r.greedy]
    target_probs = None
    if sampled:
        idx = torch.tensor(sampled, device=device)
        target_probs = torch.zeros_like(target_logits)
        flat = target_logits[idx].reshape(-1, V)  # [S*(K+1), V]
        reps = [rows[i] for i in sampled for _ in range(K1)]
        target_probs[idx] = sampling_probs(flat, reps).view(len(sampled), K1, V)
        if draft_probs is None:
            draft_probs = torch.zeros((B, K, V), dtype=torch.float32, device=device)
    if sampled:
        # Greedy rows consume no randomness; a fixed seed keeps the global generator untouched.
        seeds = [0 if r.greedy else derive_seed(r.seed, pos, VERIFY_STREAM) for r, pos in zip(rows, first_positions)]
        uniforms, noise = ops.draw_random(seeds, B, K, V, device)
    else:  # all greedy: the rule reads neither
        uniforms = torch.zeros((B, K), dtype=torch.float32, device=device)
        noise = torch.ones((B, 1, V), dtype=torch.float32, device=device).expand(B, K + 1, V)
    return ops.rejection_sample(
        draft_token_ids, num_draft, draft_probs if sampled else None, target_logits,
        target_probs, is_greedy, uniforms, noise,
    )
