"""Triton kernel: sliding-window decode attention over a slot's ring buffer.

NOTE: one program handles one batch row and one KV head. Its BLOCK_M query
rows are all (step, head) pairs that share the KV head: T speculative steps
times the GQA group, so K/V are read once per group. The program walks the
absolute key positions [lo, hi) that any of its queries can see,

    lo = max(0, min_t p_t - window + 1),   hi = min(max_t p_t + 1, length),

BLOCK_N at a time, loading each from ring index kp % ring, and keeps an
online softmax (running max, running sum, rescaled accumulator) in float32.
Both matmuls take float32 operands: bf16/fp16 values are exact in tf32, so
the tensor cores lose nothing on q.k, the probabilities keep 10 mantissa bits
instead of 7, and the Triton interpreter (whose bf16 tl.dot is wrong) runs
the same code as the GPU. Decode attention is bound by loading K/V, not by
the matmuls.
The per-(query, key) mask max(0, p - window + 1) <= kp <= p applies the
window and the causal order inside the speculative block; kp < length is the
epoch check. Ring entries outside [lo, hi) are never loaded, and padding
queries (p < 0) load nothing and store zeros.

Reference: `dspark_kernels.reference.window_attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _window_attention_kernel(
    q_ptr,  # [B, T, num_heads, head_dim]
    k_cache_ptr,  # [num_slots + 1, ring, kv_heads, head_dim]
    v_cache_ptr,  # [num_slots + 1, ring, kv_heads, head_dim]
    slots_ptr,  # [B] int64
    positions_ptr,  # [B, T] int64
    lengths_ptr,  # [num_slots + 1] int64
    out_ptr,  # [B, T, num_heads, head_dim]
    T,
    window,
    ring,
    qk_scale,  # softmax scale * log2(e): scores are kept in base 2
    q_row_stride,
    q_step_stride,
    q_head_stride,
    cache_slot_stride,
    cache_ring_stride,
    cache_head_stride,
    GROUP: tl.constexpr,  # num_heads // kv_heads
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= T * GROUP
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,  # >= HEAD_DIM
    PRECISION: tl.constexpr,  # tl.dot input precision for the float32 operands
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)

    m = tl.arange(0, BLOCK_M)
    step = m // GROUP
    head = kv_head * GROUP + m % GROUP
    pos = tl.load(positions_ptr + row * T + step, mask=step < T, other=-1)  # [BLOCK_M]
    live = pos >= 0
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM

    # Key range any live query of this row can see; empty when none is live.
    p_max = tl.max(pos, axis=0)
    p_min = tl.min(tl.where(live, pos, p_max), axis=0)
    slot = tl.load(slots_ptr + row)
    length = tl.load(lengths_ptr + slot)
    lo = tl.maximum(p_min - window + 1, 0)
    hi = tl.minimum(p_max + 1, length)

    q_offs = row * q_row_stride + step[:, None] * q_step_stride + head[:, None] * q_head_stride
    q = tl.load(q_ptr + q_offs + d[None, :], mask=live[:, None] & d_mask[None, :], other=0.0)
    q = q.to(tl.float32)
    cache_base = slot * cache_slot_stride + kv_head * cache_head_stride

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        kp = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] absolute key positions
        kp_mask = kp < hi
        ring_offs = cache_base + (kp % ring) * cache_ring_stride
        k = tl.load(
            k_cache_ptr + ring_offs[None, :] + d[:, None],
            mask=kp_mask[None, :] & d_mask[:, None],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = (
            live[:, None]
            & kp_mask[None, :]
            & (kp[None, :] <= pos[:, None])
            & (kp[None, :] > pos[:, None] - window)
        )
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows that have seen no visible key yet keep m = -inf; shift them by
        # 0 instead so exp2 gives 0 rather than NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_cache_ptr + ring_offs[:, None] + d[None, :],
            mask=kp_mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_offs = row * q_row_stride + step[:, None] * q_step_stride + head[:, None] * q_head_stride
    tl.store(
        out_ptr + out_offs + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(step < T)[:, None] & d_mask[None, :],
    )


def runs_in_interpreter() -> bool:
    """Whether this module's kernels were decorated for the Triton interpreter."""
    return not isinstance(_window_attention_kernel, triton.runtime.JITFunction)


def window_attention(
    q: torch.Tensor,  # [B, T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots + 1, ring, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots + 1, ring, kv_heads, head_dim]
    slots: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, T] int64, < 0 = padding
    cache_lengths: torch.Tensor,  # [num_slots + 1] int64
    window: int,
    scale: float,
    block_n: int = 32,
    num_stages: int = 2,
) -> torch.Tensor:  # [B, T, num_heads, head_dim], q.dtype
    """Launch the attention kernel; `ops.window_attention` has validated the arguments."""
    B, T, num_heads, head_dim = q.shape
    ring, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    for tensor in (q, k_cache, v_cache, slots, positions, cache_lengths):
        assert tensor.is_contiguous() and tensor.device == q.device
    assert k_cache.dtype == v_cache.dtype == q.dtype
    assert num_heads == group * kv_heads and 1 <= window <= ring
    out = torch.empty_like(q)
    # tl.dot needs every block dim >= 16 on GPUs.
    block_m = max(16, triton.next_power_of_2(T * group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    _window_attention_kernel[(B, kv_heads)](
        q, k_cache, v_cache, slots, positions, cache_lengths, out,
        T, window, ring, scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=max(16, block_n),
        BLOCK_D=block_d,
        # float32 inputs get exact products; narrower inputs are exact in tf32.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # float32 K/V tiles of 32 x 128 per stage: two stages stay far below
        # the shared-memory limit even at head_dim 256.
        num_stages=num_stages,
    )
    return out
