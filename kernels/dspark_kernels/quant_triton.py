"""Triton kernel: x @ W^T with W held as GGUF blocks (Q8_0, Q4_0, Q4_1), dequantized in registers.

One program per tile of BLOCK_N output rows x BLOCK_M rows of x. It walks K one 32-weight block at
a time: loads the tile's blocks (scale bytes and quants), decodes them to float32 exactly as
``dspark_kernels.quant.dequantize`` does, and multiplies them into a float32 accumulator: by
broadcast and sum for a few rows (a decode step's shape, where tensor cores would idle), by
``tl.dot`` in IEEE float32 from 16 rows up. Reference: ``quant.reference_matmul`` (dequantize, then
``x @ w.T``); the CPU path is the C kernel of csrc/quant_gemm.c. The K-quants (Q4_K, Q6_K) take the
reference on CUDA (``quant.quant_matmul``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# GGML type ids (quant.FORMATS) this kernel decodes, and their bytes a 32-weight block.
TYPES = {2: 18, 3: 20, 8: 34}  # Q4_0, Q4_1, Q8_0
DOT_MIN_ROWS = 16  # from this many rows of x a tile multiplies with tl.dot


@triton.jit
def _half(ptr, mask):
    """The float16 at ptr (two bytes, little-endian) as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _quant_matmul_kernel(
    x_ptr,  # [M, K] float32
    w_ptr,  # [N, row_bytes] uint8: GGUF blocks
    bias_ptr,  # [N] float32 (unused without HAS_BIAS)
    y_ptr,  # [M, N] float32
    M,
    N,
    K,
    row_bytes,
    QTYPE: tl.constexpr,  # 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0)
    BLOCK_BYTES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 32)
    m_mask = offs_m < M
    n_mask = (offs_n < N)[:, None]  # [BLOCK_N, 1]
    rows = w_ptr + offs_n[:, None].to(tl.int64) * row_bytes  # [BLOCK_N, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(K // 32):
        blk = rows + b * BLOCK_BYTES
        d = _half(blk, n_mask)  # [BLOCK_N, 1]
        if QTYPE == 8:
            q = tl.load(blk + 2 + offs_k[None, :], mask=n_mask, other=0).to(tl.int8, bitcast=True)
            w = q.to(tl.float32) * d  # [BLOCK_N, 32]
        else:
            # Byte i holds weight i (low nibble) and weight i + 16 (high nibble).
            byte = tl.load(blk + (4 if QTYPE == 3 else 2) + (offs_k % 16)[None, :], mask=n_mask, other=0)
            q = tl.where(offs_k[None, :] < 16, byte & 15, byte >> 4).to(tl.int32)
            if QTYPE == 3:
                w = d * q.to(tl.float32) + _half(blk + 2, n_mask)
            else:
                w = d * (q - 8).to(tl.float32)
        xb = tl.load(x_ptr + offs_m[:, None] * K + b * 32 + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        if USE_DOT:
            acc += tl.dot(xb, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.sum(xb[:, None, :] * w[None, :, :], axis=2)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc, mask=m_mask[:, None] & (offs_n < N)[None, :])


def runs_in_interpreter() -> bool:
    """Whether this module's kernels were decorated for the Triton interpreter."""
    return not isinstance(_quant_matmul_kernel, triton.runtime.JITFunction)


def quant_matmul(
    x: torch.Tensor,  # [..., K] float32
    weight,  # quant.QuantWeight [N, K], Q8_0 / Q4_0 / Q4_1, on x's device
    bias: torch.Tensor | None = None,  # [N] float32
) -> torch.Tensor:  # [..., N] float32
    """``x @ dequantize(weight).T (+ bias)``: the Triton kernel (module docstring)."""
    blocks = weight.blocks
    n, k = weight.shape
    assert weight.qtype in TYPES, f"the Triton kernel takes Q8_0, Q4_0, Q4_1, not {weight.format.name}"
    assert x.dtype == torch.float32 and x.shape[-1] == k and x.device == blocks.device, (x.dtype, x.shape, x.device)
    assert blocks.dtype == torch.uint8 and blocks.is_contiguous() and blocks.shape == (n, k // 32 * TYPES[weight.qtype])
    x2 = x.reshape(-1, k).contiguous()  # [M, K]
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)  # [M, N]
    if bias is not None:
        assert bias.shape == (n,) and bias.device == x.device, (bias.shape, bias.device)
        bias = bias.float().contiguous()
    use_dot = m >= DOT_MIN_ROWS
    block_m = 16 if use_dot else min(triton.next_power_of_2(max(m, 1)), 8)
    block_n = 64 if use_dot else 32
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    if m > 0:
        _quant_matmul_kernel[grid](
            x2, blocks, y if bias is None else bias, y, m, n, k, blocks.shape[1],
            QTYPE=weight.qtype, BLOCK_BYTES=TYPES[weight.qtype], HAS_BIAS=bias is not None, USE_DOT=use_dot,
            BLOCK_M=block_m, BLOCK_N=block_n,
        )
    return y.reshape(*x.shape[:-1], n)
