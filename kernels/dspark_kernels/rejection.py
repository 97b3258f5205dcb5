"""Triton kernels: speculative acceptance (Leviathan et al. 2023, arXiv 2211.17192).

NOTE: verification runs in three launches, after a torch argmax of the
target logits (the greedy rule and greedy recovered / bonus tokens):

1. `_accept_kernel`, one program per row, walks the row's drafts in order and
   stops at the first rejection: greedy rows accept x_i while it equals the
   target argmax, random rows while u_i * q_i(x_i) < p_i(x_i) (the same test
   as u_i < min(1, p_i(x_i) / q_i(x_i)) for u in [0, 1)). It writes the
   accepted tokens, num_accepted, and for greedy rows the argmax at the first
   free position (recovered or bonus token).
2. `_emit_partial_kernel`, grid (rows, vocab splits), reads one position per
   random row, j = num_accepted: the residual max(0, p_j - q_j) if j is a
   rejection, p_j if j is the bonus position. Each program keeps the first
   argmax of dist / noise (the exponential race) over its vocab slice, for
   the residual and for p (the fallback when the residual is all zero).
3. `_emit_combine_kernel`, one program per random row, picks the first
   best slice and stores the recovered / bonus token.

Splitting the vocab lets small batches use the whole GPU: each random row
reads V values of p, q and noise at one position only.

Reference: `dspark_kernels.reference.rejection_sample`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark_kernels.reference import PLACEHOLDER_TOKEN_ID

# Target programs for the emit step: enough to fill a large GPU twice over.
_EMIT_PROGRAMS = 512
_BLOCK_V = 1024


@triton.jit
def _accept_kernel(
    out_ptr,  # [B, K + 1] int64, prefilled with -1
    num_accepted_ptr,  # [B] int64
    draft_ptr,  # [B, K] int64
    num_draft_ptr,  # [B] int64
    draft_probs_ptr,  # [B, K, V] float32 (unused unless HAS_PROBS)
    target_probs_ptr,  # [B, K + 1, V] float32 (unused unless HAS_PROBS)
    target_argmax_ptr,  # [B, K + 1] int64
    is_greedy_ptr,  # [B] bool
    uniforms_ptr,  # [B, K] float32
    K,
    V,
    HAS_PROBS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = tl.load(num_draft_ptr + row)
    greedy = tl.load(is_greedy_ptr + row) != 0
    accepted = n * 0
    rejected = tl.full((), False, tl.int1)
    for i in range(0, K):
        if (i < n) & (~rejected):
            token = tl.load(draft_ptr + row * K + i)
            in_range = (token >= 0) & (token < V)
            ok = in_range & (token == tl.load(target_argmax_ptr + row * (K + 1) + i))
            if HAS_PROBS:
                if ~greedy:
                    safe = tl.where(in_range, token, 0)
                    p = tl.load(target_probs_ptr + (row * (K + 1) + i) * V + safe)
                    q = tl.load(draft_probs_ptr + (row * K + i) * V + safe)
                    u = tl.load(uniforms_ptr + row * K + i)
                    ok = in_range & (u * q < p)
            if ok:
                tl.store(out_ptr + row * (K + 1) + i, token)
                accepted += 1
            else:
                rejected = tl.full((), True, tl.int1)
    tl.store(num_accepted_ptr + row, accepted)
    if greedy:
        token = tl.load(target_argmax_ptr + row * (K + 1) + accepted)
        tl.store(out_ptr + row * (K + 1) + accepted, token)


@triton.jit
def _emit_partial_kernel(
    residual_score_ptr,  # [B, SPLITS] float32 out
    residual_index_ptr,  # [B, SPLITS] int64 out
    target_score_ptr,  # [B, SPLITS] float32 out
    target_index_ptr,  # [B, SPLITS] int64 out
    num_accepted_ptr,  # [B] int64
    num_draft_ptr,  # [B] int64
    draft_probs_ptr,  # [B, K, V] float32 (unused unless HAS_DRAFT)
    target_probs_ptr,  # [B, K + 1, V] float32
    noise_ptr,  # [B, K + 1, V] float32, vocab dim dense
    is_greedy_ptr,  # [B] bool
    K,
    V,
    noise_row_stride,
    noise_pos_stride,
    SPLITS,
    SPLIT_SIZE,  # vocab entries per split, a multiple of BLOCK_V
    HAS_DRAFT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    if tl.load(is_greedy_ptr + row) == 0:
        j = tl.load(num_accepted_ptr + row)
        is_bonus = j >= tl.load(num_draft_ptr + row)
        # The bonus position reads no q: its distribution is p itself.
        q_limit = tl.where(is_bonus, 0, V)
        p_base = target_probs_ptr + (row * (K + 1) + j) * V
        q_base = draft_probs_ptr + (row * K + tl.minimum(j, K - 1)) * V
        noise_base = noise_ptr + row * noise_row_stride + j * noise_pos_stride
        best_res = tl.full((), -1.0, tl.float32)
        best_res_idx = tl.full((), 0, tl.int64)
        best_p = tl.full((), -1.0, tl.float32)
        best_p_idx = tl.full((), 0, tl.int64)
        first = split * SPLIT_SIZE
        for start in range(first, tl.minimum(first + SPLIT_SIZE, V), BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            mask = offs < V
            p = tl.load(p_base + offs, mask=mask, other=0.0)
            noise = tl.load(noise_base + offs, mask=mask, other=1.0)
            if HAS_DRAFT:
                q = tl.load(q_base + offs, mask=offs < q_limit, other=0.0)
                residual = tl.maximum(p - q, 0.0)
            else:
                residual = p
            # div_rn: correctly rounded like torch, so the race picks the
            # reference's token (plain '/' may lower to an approximate divide).
            res_score = tl.where(mask, tl.div_rn(residual, noise), -1.0)
            p_score = tl.where(mask, tl.div_rn(p, noise), -1.0)
            # Strict '>' keeps the first maximum, as torch.argmax does.
            block_best = tl.max(res_score, axis=0)
            if block_best > best_res:
                best_res = block_best
                best_res_idx = start + tl.argmax(res_score, axis=0).to(tl.int64)
            block_best = tl.max(p_score, axis=0)
            if block_best > best_p:
                best_p = block_best
                best_p_idx = start + tl.argmax(p_score, axis=0).to(tl.int64)
        tl.store(residual_score_ptr + row * SPLITS + split, best_res)
        tl.store(residual_index_ptr + row * SPLITS + split, best_res_idx)
        tl.store(target_score_ptr + row * SPLITS + split, best_p)
        tl.store(target_index_ptr + row * SPLITS + split, best_p_idx)


@triton.jit
def _emit_combine_kernel(
    out_ptr,  # [B, K + 1] int64
    residual_score_ptr,  # [B, SPLITS] float32
    residual_index_ptr,  # [B, SPLITS] int64
    target_score_ptr,  # [B, SPLITS] float32
    target_index_ptr,  # [B, SPLITS] int64
    num_accepted_ptr,  # [B] int64
    is_greedy_ptr,  # [B] bool
    K,
    SPLITS,
    BLOCK_S: tl.constexpr,  # next power of two >= SPLITS
):
    row = tl.program_id(0).to(tl.int64)
    if tl.load(is_greedy_ptr + row) == 0:
        s = tl.arange(0, BLOCK_S)
        mask = s < SPLITS
        res = tl.load(residual_score_ptr + row * SPLITS + s, mask=mask, other=-1.0)
        tgt = tl.load(target_score_ptr + row * SPLITS + s, mask=mask, other=-1.0)
        res_split = tl.argmax(res, axis=0)
        tgt_split = tl.argmax(tgt, axis=0)
        # A zero residual everywhere means p == q: rejection had probability
        # zero, so fall back to sampling p (see reference._sample_emitted).
        if tl.max(res, axis=0) > 0.0:
            token = tl.load(residual_index_ptr + row * SPLITS + res_split)
        else:
            token = tl.load(target_index_ptr + row * SPLITS + tgt_split)
        j = tl.load(num_accepted_ptr + row)
        tl.store(out_ptr + row * (K + 1) + j, token)


def runs_in_interpreter() -> bool:
    """Whether this module's kernels were decorated for the Triton interpreter."""
    return not isinstance(_accept_kernel, triton.runtime.JITFunction)


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [B, K] int64
    num_draft_tokens: torch.Tensor,  # [B] int64 in 0..K
    draft_probs: torch.Tensor | None,  # [B, K, V] float32
    target_logits: torch.Tensor,  # [B, K + 1, V] float32
    target_probs: torch.Tensor | None,  # [B, K + 1, V] float32
    is_greedy: torch.Tensor,  # [B] bool
    uniforms: torch.Tensor,  # [B, K] float32 in [0, 1)
    recovery_noise: torch.Tensor,  # [B, K + 1, V] float32, vocab dim dense
    num_splits: int | None = None,
    block_v: int = _BLOCK_V,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([B, K + 1] int64, [B] int64)
    """Launch the acceptance kernels; `ops.rejection_sample` has validated the arguments.

    `num_splits` and `block_v` override how many vocab slices each random
    row's emit step uses and the vocab block per loop step (tests shrink
    them to exercise the slice loop and the combine step on small vocabs).
    """
    B, K = draft_token_ids.shape
    V = target_logits.shape[-1]
    device = target_logits.device
    for tensor in (draft_token_ids, num_draft_tokens, target_logits, is_greedy, uniforms):
        assert tensor.is_contiguous() and tensor.device == device
    for tensor in (draft_probs, target_probs):
        assert tensor is None or (tensor.is_contiguous() and tensor.dtype == torch.float32)
    assert recovery_noise.stride(-1) == 1 and recovery_noise.dtype == torch.float32
    has_probs = target_probs is not None
    has_draft = draft_probs is not None and K > 0

    out = torch.full((B, K + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    num_accepted = torch.empty((B,), dtype=torch.int64, device=device)
    target_argmax = target_logits.argmax(dim=-1)  # [B, K + 1]
    unused = target_logits  # placeholder pointer for absent optional tensors
    _accept_kernel[(B,)](
        out, num_accepted, draft_token_ids, num_draft_tokens,
        draft_probs if has_draft else unused,
        target_probs if has_probs else unused,
        target_argmax, is_greedy, uniforms,
        K, V,
        HAS_PROBS=has_probs and has_draft,
    )
    if not has_probs:
        return out, num_accepted

    num_blocks = triton.cdiv(V, block_v)
    if num_splits is None:
        num_splits = triton.cdiv(_EMIT_PROGRAMS, B)
    splits = max(1, min(num_splits, num_blocks))
    split_size = triton.cdiv(num_blocks, splits) * block_v
    splits = triton.cdiv(V, split_size)
    # Per (row, split): best exponential-race score and its vocab index, for
    # the residual and for p.
    residual_score = torch.empty((B, splits), dtype=torch.float32, device=device)
    residual_index = torch.empty((B, splits), dtype=torch.int64, device=device)
    target_score = torch.empty((B, splits), dtype=torch.float32, device=device)
    target_index = torch.empty((B, splits), dtype=torch.int64, device=device)
    _emit_partial_kernel[(B, splits)](
        residual_score, residual_index, target_score, target_index,
        num_accepted, num_draft_tokens,
        draft_probs if has_draft else unused,
        target_probs, recovery_noise, is_greedy,
        K, V,
        recovery_noise.stride(0), recovery_noise.stride(1),
        splits,
        split_size,
        HAS_DRAFT=has_draft,
        BLOCK_V=block_v,
    )
    _emit_combine_kernel[(B,)](
        out, residual_score, residual_index, target_score, target_index,
        num_accepted, is_greedy,
        K,
        splits,
        BLOCK_S=triton.next_power_of_2(splits),
    )
    return out, num_accepted
