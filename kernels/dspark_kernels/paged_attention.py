"""Triton kernel: the target's paged decode/verify attention, read through the request-to-token table.

NOTE: one program handles one batch row, one KV head and one split of the
row's keys. Its BLOCK_M query rows are all (step, head) pairs sharing the KV
head: T query tokens (the pending token and k drafts) times the GQA group,
so each K/V entry is loaded once per group. The program walks the key
positions [lo, hi) any of its queries can see,

    lo = max(0, min_t p_t - window + 1),   hi = max_t p_t + 1,

BLOCK_N at a time. Key position kp lives at pool index
``req_to_token[row_of_b, kp]``: the kernel loads those indices and then the
K/V rows they name, in place, never gathering a contiguous copy (what
PackedAttention's SDPA path must do). Scores and the online softmax (running
max, running sum, rescaled accumulator) are float32 in base 2; as in
``window_attention`` both matmuls take float32 operands (bf16/fp16 are exact
in tf32, and the interpreter's bf16 ``tl.dot`` is wrong). The per-(query, key)
mask ``p - window < kp <= p`` applies the causal order inside the verified
block and the optional sliding window; padding queries (p < 0) load nothing
and return zeros.

Split-K (flash-decoding): at small batch B x kv_heads programs cannot fill
the GPU, so a long context is cut into ``num_splits`` ranges of whole key
blocks, each program writes its normalised partial output and its
log-sum-exp (base 2), and a second kernel merges the splits:

    out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M),   M = max_s lse_s.

A split that sees no key has lse = -inf and weight 0.

Reference: `dspark_kernels.reference.paged_attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# Keys per split below which splitting costs more (a second launch, partials in memory) than it gains.
MIN_SPLIT_KEYS = 256
MAX_SPLITS = 16
# No window: a query sees every earlier key. Large, but p - NO_WINDOW cannot overflow int64.
NO_WINDOW = 1 << 40


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [B, T, num_heads, head_dim]
    k_pool_ptr,  # [P, kv_heads, head_dim]
    v_pool_ptr,  # [P, kv_heads, head_dim]
    table_ptr,  # [R, C] int32/int64 request-to-token table
    rows_ptr,  # [B] int64 table row of each batch row
    positions_ptr,  # [B, T] int64, < 0 = padding
    out_ptr,  # [B, T, num_heads, head_dim] (one split) or [B, T, num_heads, S, head_dim] float32
    lse_ptr,  # [B, T, num_heads, S] float32 (split-K only)
    T,
    window,
    split_keys,  # keys per split, a multiple of BLOCK_N
    qk_scale,  # softmax scale * log2(e): scores are kept in base 2
    q_row_stride,
    q_step_stride,
    q_head_stride,
    table_row_stride,
    pool_token_stride,
    pool_head_stride,
    GROUP: tl.constexpr,  # num_heads // kv_heads
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= T * GROUP
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,  # >= HEAD_DIM
    PRECISION: tl.constexpr,  # tl.dot input precision for the float32 operands
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    m = tl.arange(0, BLOCK_M)
    step = m // GROUP
    head = kv_head * GROUP + m % GROUP
    pos = tl.load(positions_ptr + b * T + step, mask=step < T, other=-1)  # [BLOCK_M]
    live = pos >= 0
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM

    # Keys any live query of this row can see, then this split's share of them.
    p_max = tl.max(pos, axis=0)
    p_min = tl.min(tl.where(live, pos, p_max), axis=0)
    lo = tl.maximum(p_min - window + 1, 0)
    hi = p_max + 1
    start = lo + split * split_keys
    end = tl.where(split == NUM_SPLITS - 1, hi, tl.minimum(hi, start + split_keys))
    table_row = table_ptr + tl.load(rows_ptr + b) * table_row_stride

    q_offs = b * q_row_stride + step[:, None] * q_step_stride + head[:, None] * q_head_stride
    q = tl.load(q_ptr + q_offs + d[None, :], mask=live[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    head_offs = kv_head * pool_head_stride + d[None, :]  # [1, BLOCK_D]

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for block in range(start, end, BLOCK_N):
        kp = block + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        kp_mask = kp < end
        token = tl.load(table_row + kp, mask=kp_mask, other=0).to(tl.int64)  # [BLOCK_N] pool indices
        kv_offs = token[:, None] * pool_token_stride + head_offs  # [BLOCK_N, BLOCK_D]
        kv_mask = kp_mask[:, None] & d_mask[None, :]
        k = tl.load(k_pool_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
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
        v = tl.load(v_pool_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    store_mask = (step < T)[:, None] & d_mask[None, :]
    query = (b * T + step) * NUM_HEADS + head  # [BLOCK_M] index of (b, step, head)
    if NUM_SPLITS == 1:
        tl.store(out_ptr + query[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=store_mask)
    else:
        partial = query * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(out_ptr + partial[:, None] * HEAD_DIM + d[None, :], out, mask=store_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + partial, lse, mask=step < T)


@triton.jit
def _merge_splits_kernel(
    partial_ptr,  # [Q, S, head_dim] float32, Q = B * T * num_heads
    lse_ptr,  # [Q, S] float32
    out_ptr,  # [Q, head_dim]
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= NUM_SPLITS
    BLOCK_D: tl.constexpr,  # >= HEAD_DIM
):
    query = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    lse = tl.load(lse_ptr + query * NUM_SPLITS + s, mask=s_mask, other=float("-inf"))  # [BLOCK_S]
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no split saw a key: all weights 0
    weight = tl.exp2(lse - top)  # [BLOCK_S]
    o = tl.load(
        partial_ptr + (query * NUM_SPLITS + s[:, None]) * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    total = tl.sum(weight, axis=0)
    out = tl.sum(o * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + query * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def runs_in_interpreter() -> bool:
    """Whether this module's kernels were decorated for the Triton interpreter."""
    return not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)


def choose_splits(batch: int, kv_heads: int, max_keys: int, num_sms: int) -> int:
    """Key splits per (row, KV head): enough programs for about two waves over the GPU's
    multiprocessors, but never splits shorter than MIN_SPLIT_KEYS keys. A large batch
    (or a short context) gets 1: no second kernel, no partials."""
    programs = max(1, batch * kv_heads)
    wanted = -(-2 * num_sms // programs)
    return max(1, min(wanted, max_keys // MIN_SPLIT_KEYS, MAX_SPLITS))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: any small number keeps the heuristic testable


def paged_attention(
    q: torch.Tensor,  # [B, T, num_heads, head_dim]
    k_pool: torch.Tensor,  # [P, kv_heads, head_dim]
    v_pool: torch.Tensor,  # [P, kv_heads, head_dim]
    req_to_token: torch.Tensor,  # [R, C] int32/int64
    rows: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, T] int64, < 0 = padding
    scale: float,
    window: int | None = None,
    num_splits: int | None = None,
    max_keys: int | None = None,
    block_n: int | None = None,
    num_stages: int = 2,
) -> torch.Tensor:  # [B, T, num_heads, head_dim], q.dtype
    """Launch the kernel (and the merge for split-K); `ops.paged_attention` has validated the arguments.

    ``num_splits`` None: ``choose_splits`` with ``max_keys`` (an upper bound on any row's
    keys known on the host; default the table's width), so the choice never syncs."""
    B, T, num_heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    group = num_heads // kv_heads
    for tensor in (q, k_pool, v_pool, req_to_token, rows, positions):
        assert tensor.is_contiguous() and tensor.device == q.device
    assert k_pool.dtype == v_pool.dtype and k_pool.stride(2) == 1
    assert num_heads == group * kv_heads and (window is None or window >= 1)
    max_keys = req_to_token.shape[1] if max_keys is None else max_keys
    if window is not None:  # a row's queries see at most window + T - 1 keys together
        max_keys = min(max_keys, window + T - 1)
    if num_splits is None:
        num_splits = choose_splits(B, kv_heads, max_keys, _num_sms(q.device))
    # tl.dot needs every block dim >= 16 on GPUs; float32 tiles are twice as big per key.
    block_n = block_n or (32 if k_pool.dtype == torch.float32 and head_dim > 64 else 64)
    block_m = max(16, triton.next_power_of_2(T * group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    split_keys = -(-max(1, max_keys) // (num_splits * block_n)) * block_n  # whole key blocks
    out = torch.empty_like(q)
    if num_splits == 1:
        partial, lse = out, out  # lse unused
    else:
        partial = torch.empty((B, T, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((B, T, num_heads, num_splits), dtype=torch.float32, device=q.device)
    _paged_attention_kernel[(B, kv_heads, num_splits)](
        q, k_pool, v_pool, req_to_token, rows, positions, partial, lse,
        T, NO_WINDOW if window is None else window, split_keys, scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        req_to_token.stride(0), k_pool.stride(0), k_pool.stride(1),
        GROUP=group,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        BLOCK_M=block_m,
        BLOCK_N=max(16, block_n),
        BLOCK_D=block_d,
        # float32 inputs get exact products; narrower inputs are exact in tf32.
        PRECISION="ieee" if q.dtype == torch.float32 and k_pool.dtype == torch.float32 else "tf32",
        num_stages=num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(B * T * num_heads,)](
            partial, lse, out,
            NUM_SPLITS=num_splits,
            HEAD_DIM=head_dim,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            BLOCK_D=block_d,
        )
    return out
