"""Triton kernel: the DSpark Markov head's left-to-right sampling of a draft block.

NOTE: one program handles one batch row and walks its block positions
j = 0 .. num_query - 1 in order, because position j's logits need the token
sampled at j - 1 (the anchor prev0 for j = 0):

    logits_j = base[j] + round(w2 @ w1[prev]) * logit_scale

where round() is the rounding of the float32 product to the weights' dtype
(what ``MarkovHead.bias``'s Linear returns). Each step reads the previous
token's embedding row w1[prev] and computes the [V] x r product tile by tile: a
BLOCK_V x BLOCK_R slice of w2 times the matching slice of the embedding,
reduced over r in float32 (r is looped in BLOCK_R chunks).

- Greedy rows keep the running first argmax over the vocab tiles (strict '>'
  between tiles, tl.argmax's first index inside one), as torch.argmax.
- Sampled rows take two passes. Pass 1 writes logits / T into the row's q
  slot (scratch) and keeps an online max and sum of exp. Pass 2 reads them
  back, stores q = softmax(logits / T) and runs the exponential race
  argmax(q / noise), the same first-index tie-breaking. So w2 is read once
  per step, and the scaled logits make the round trip through memory.

Every program reads all of w2 at every step; the programs of one launch run
roughly in step, so concurrent rows share w2's tiles through L2, but a batch
of one row runs on one SM (splitting the vocabulary would need a grid-wide
sync per step).

Reference: `dspark_kernels.reference.markov_sample`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark_kernels.reference import PLACEHOLDER_TOKEN_ID

_BLOCK_V = 128
_MAX_BLOCK_R = 64

_WEIGHT_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@triton.jit
def _markov_sample_kernel(
    tokens_ptr,  # [B, S] int64 out, prefilled with -1
    q_ptr,  # [B, S, V] float32 out, prefilled with 0 (scratch for sampled rows' logits / T)
    base_ptr,  # [B, S, V] float32
    prev0_ptr,  # [B] int64
    w1_ptr,  # [V_in, R]
    w2_ptr,  # [V, R]
    num_query_ptr,  # [B] int64
    is_greedy_ptr,  # [B] bool
    temperature_ptr,  # [B] float32
    noise_ptr,  # [B, S, V] float32, vocab dim dense
    logit_scale,
    S,
    V,
    V_in,
    R,
    noise_row_stride,
    noise_pos_stride,
    BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    WEIGHTS: tl.constexpr,  # the weights' dtype: 0 float32, 1 float16, 2 bfloat16
):
    # One function, no nested jit calls: the interpreter re-patches triton.language on each.
    row = tl.program_id(0).to(tl.int64)
    n = tl.load(num_query_ptr + row)
    greedy = tl.load(is_greedy_ptr + row) != 0
    temperature = tl.load(temperature_ptr + row)
    prev = tl.load(prev0_ptr + row)
    # An anchor outside w1 samples nothing (ops.markov_sample refuses it on CPU).
    live = (prev >= 0) & (prev < V_in)
    for j in range(0, S):
        if live & (j < n):
            base_row = base_ptr + (row * S + j) * V
            q_row = q_ptr + (row * S + j) * V
            embed_row = w1_ptr + prev * R
            # Greedy: running first argmax. Sampled: logits / T to scratch, online max and sum.
            best = tl.full((), float("-inf"), tl.float32)
            token = tl.full((), 0, tl.int64)
            m = tl.full((), float("-inf"), tl.float32)
            total = tl.full((), 0.0, tl.float32)
            for start in range(0, V, BLOCK_V):
                offs = start + tl.arange(0, BLOCK_V)
                in_vocab = offs < V
                acc = tl.zeros((BLOCK_V,), dtype=tl.float32)
                for r0 in range(0, R, BLOCK_R):
                    offs_r = r0 + tl.arange(0, BLOCK_R)
                    in_rank = offs_r < R
                    e = tl.load(embed_row + offs_r, mask=in_rank, other=0.0).to(tl.float32)
                    w = tl.load(
                        w2_ptr + offs[:, None] * R + offs_r[None, :],
                        mask=in_vocab[:, None] & in_rank[None, :],
                        other=0.0,
                    ).to(tl.float32)
                    acc += tl.sum(w * e[None, :], axis=1)
                # The bias in the weights' dtype, as MarkovHead's Linear returns it (nearest even).
                if WEIGHTS == 1:
                    acc = acc.to(tl.float16).to(tl.float32)
                elif WEIGHTS == 2:
                    # By hand: the interpreter's float32 -> bfloat16 cast truncates.
                    bits = acc.to(tl.uint32, bitcast=True)
                    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
                    acc = bits.to(tl.float32, bitcast=True)
                base = tl.load(base_row + offs, mask=in_vocab, other=float("-inf"))
                x = tl.where(in_vocab, base + acc * logit_scale, float("-inf"))
                if greedy:
                    tile_best = tl.max(x, axis=0)
                    # Strict '>' keeps the first maximum, as torch.argmax does.
                    if tile_best > best:
                        best = tile_best
                        token = start + tl.argmax(x, axis=0).to(tl.int64)
                else:
                    # div_rn: correctly rounded like torch's logits / T.
                    y = tl.div_rn(x, temperature)
                    tl.store(q_row + offs, y, mask=in_vocab)
                    m_new = tl.maximum(m, tl.max(y, axis=0))
                    # Tiles of -inf only (draft_topk, masked vocab) must not make exp(-inf + inf).
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                    total = total * tl.exp(m - m_safe) + tl.sum(tl.exp(y - m_safe), axis=0)
                    m = m_new
            if ~greedy:
                # Pass 2 reads what other threads of this program wrote in pass 1.
                tl.debug_barrier()
                best = tl.full((), -1.0, tl.float32)
                noise_row = noise_ptr + row * noise_row_stride + j * noise_pos_stride
                for start in range(0, V, BLOCK_V):
                    offs = start + tl.arange(0, BLOCK_V)
                    in_vocab = offs < V
                    y = tl.load(q_row + offs, mask=in_vocab, other=float("-inf"))
                    p = tl.exp(y - m) / total
                    tl.store(q_row + offs, p, mask=in_vocab)
                    noise = tl.load(noise_row + offs, mask=in_vocab, other=1.0)
                    score = tl.where(in_vocab, tl.div_rn(p, noise), -1.0)
                    tile_best = tl.max(score, axis=0)
                    if tile_best > best:
                        best = tile_best
                        token = start + tl.argmax(score, axis=0).to(tl.int64)
            tl.store(tokens_ptr + row * S + j, token)
            prev = token


def runs_in_interpreter() -> bool:
    """Whether this module's kernels were decorated for the Triton interpreter."""
    return not isinstance(_markov_sample_kernel, triton.runtime.JITFunction)


def markov_sample(
    base: torch.Tensor,  # [B, S, V] float32
    prev0: torch.Tensor,  # [B] int64
    w1: torch.Tensor,  # [V_in, r]
    w2: torch.Tensor,  # [V, r], w1's dtype
    logit_scale: float,
    num_query: torch.Tensor,  # [B] int64
    is_greedy: torch.Tensor,  # [B] bool
    temperature: torch.Tensor,  # [B] float32
    noise: torch.Tensor,  # [B, S, V] float32, vocab dim dense
    block_v: int = _BLOCK_V,
    block_r: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([B, S] int64, [B, S, V] float32)
    """Launch the kernel; `ops.markov_sample` has validated the arguments.

    `block_v` and `block_r` override the vocab tile and the rank chunk (tests
    shrink them to exercise the tile loops and their tie-breaking on small
    shapes); `block_r` defaults to r rounded up to a power of two, at most 64.
    """
    B, S, V = base.shape
    V_in, R = w1.shape
    device = base.device
    for tensor in (base, prev0, w1, w2, num_query, is_greedy, temperature):
        assert tensor.is_contiguous() and tensor.device == device
    assert base.dtype == torch.float32 and w1.dtype == w2.dtype and w2.shape == (V, R)
    assert noise.stride(-1) == 1 and noise.dtype == torch.float32
    if block_r is None:
        block_r = min(triton.next_power_of_2(R), _MAX_BLOCK_R)

    tokens = torch.full((B, S), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    q = torch.zeros((B, S, V), dtype=torch.float32, device=device)
    _markov_sample_kernel[(B,)](
        tokens, q, base, prev0, w1, w2, num_query, is_greedy, temperature, noise,
        float(logit_scale),
        S, V, V_in, R,
        noise.stride(0), noise.stride(1),
        BLOCK_V=block_v,
        BLOCK_R=block_r,
        WEIGHTS=_WEIGHT_KINDS[w1.dtype],
    )
    return tokens, q
