"""Triton kernel: scatter a step's new K/V into each slot's ring buffer.

One program per (row, step) entry copies that token's [kv_heads, head_dim]
keys and values to `cache[slot, position % ring]`; padding entries
(position < 0) return before touching memory. Reference:
`dspark_kernels.reference.ring_write`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ring_write_kernel(
    k_cache_ptr,  # [num_slots + 1, ring, kv_heads, head_dim]
    v_cache_ptr,  # [num_slots + 1, ring, kv_heads, head_dim]
    slots_ptr,  # [B] int64
    positions_ptr,  # [B, T] int64
    k_ptr,  # [B, T, kv_heads, head_dim]
    v_ptr,  # [B, T, kv_heads, head_dim]
    T,
    ring,
    cache_slot_stride,
    cache_ring_stride,
    new_row_stride,
    new_step_stride,
    ROW_SIZE: tl.constexpr,  # kv_heads * head_dim
    BLOCK: tl.constexpr,
):
    entry = tl.program_id(0)
    row = entry // T
    step = entry % T
    position = tl.load(positions_ptr + row * T + step)
    if position >= 0:
        slot = tl.load(slots_ptr + row)
        dst = slot * cache_slot_stride + (position % ring) * cache_ring_stride
        src = row * new_row_stride + step * new_step_stride
        for start in range(0, ROW_SIZE, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < ROW_SIZE
            k = tl.load(k_ptr + src + offs, mask=mask)
            v = tl.load(v_ptr + src + offs, mask=mask)
            tl.store(k_cache_ptr + dst + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + dst + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def runs_in_interpreter() -> bool:
    """Whether this module's kernels were decorated for the Triton interpreter."""
    return not isinstance(_ring_write_kernel, triton.runtime.JITFunction)


def ring_write(
    k_cache: torch.Tensor,  # [num_slots + 1, ring, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots + 1, ring, kv_heads, head_dim]
    slots: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, T] int64, < 0 = padding
    k: torch.Tensor,  # [B, T, kv_heads, head_dim]
    v: torch.Tensor,  # [B, T, kv_heads, head_dim]
) -> None:
    """Launch the ring write; `ops.ring_write` has validated the arguments."""
    B, T, kv_heads, head_dim = k.shape
    ring = k_cache.shape[1]
    for tensor in (k_cache, v_cache, slots, positions, k, v):
        assert tensor.is_contiguous() and tensor.device == k_cache.device
    assert slots.dtype == positions.dtype == torch.int64
    assert v_cache.shape == k_cache.shape and v.shape == k.shape
    row_size = kv_heads * head_dim
    _ring_write_kernel[(B * T,)](
        k_cache, v_cache, slots, positions, k, v,
        T, ring,
        k_cache.stride(0), k_cache.stride(1),
        k.stride(0), k.stride(1),
        ROW_SIZE=row_size,
        BLOCK=min(triton.next_power_of_2(row_size), 4096),
    )
