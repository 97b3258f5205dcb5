"""The building blocks the models share: the attention protocol, RMSNorm, rotary embedding, linears.

The decoder (``llama.py``) and multi-head latent attention (``mla.py``) are
made of these, and the tensor-parallel, FP8, GGUF and packed-CPU matmuls
(``parallel.py``, ``fp8.py``, ``quantized.py``, ``cpu_gemm.py``) act on its
``Linear``; kept apart from the decoder, so that none of them needs the
decoder (which needs some of them) for a building block.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class Attention(Protocol):
    """Computes attention for one layer once q/k/v are projected and rotated."""

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,  # [B, T, Hq, D]
        k: torch.Tensor,  # [B, T, Hkv, D]
        v: torch.Tensor,  # [B, T, Hkv, D]
    ) -> torch.Tensor:  # [B, T, Hq, D]
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def apply_rope(
    x: torch.Tensor,  # [B, T, H, D]
    cos: torch.Tensor,  # [B, T, D]
    sin: torch.Tensor,  # [B, T, D]
) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


class Linear(nn.Linear):
    """``nn.Linear`` whose matmul may run on a prepacked copy of its weight (``gemm``, set by
    ``dspark_ray.model.cpu_gemm.pack_weights`` on CPU); parameters and names are nn.Linear's."""

    gemm = None  # PackedGemm | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm is not None:
            return self.gemm(x, self.bias)
        return F.linear(x, self.weight, self.bias)


class FusedLinears:
    """Several linears over the same input as one matmul (e.g. q/k/v): one weight, outputs split.

    The fused weight (and bias) is one tensor and each linear's parameters are
    made views of its rows, so the state dict, its names and the memory used
    are unchanged; only the number of matmuls per layer drops (on the small
    models of the CPU development box, op count rather than arithmetic sets
    the step time). Built after the weights are loaded (``fuse_projections``).
    """

    gemm = None  # PackedGemm | None, as for Linear

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.sizes = [lin.out_features for lin in linears]
        self.in_features = linears[0].in_features
        # GGUF blocks kept (dspark_ray/model/quantized.py): uint8 rows, stacked the same way.
        self.qtype = getattr(linears[0], "qtype", None)
        self.weight = torch.cat([lin.weight.detach() for lin in linears])
        has_bias = [lin.bias is not None for lin in linears]
        self.bias = torch.cat([lin.bias.detach() for lin in linears]) if all(has_bias) else None
        start = 0
        for lin, n in zip(linears, self.sizes):
            rows = self.weight[start:start + n]
            # A parameter stays a parameter; kept blocks are a buffer and stay one.
            lin.weight = nn.Parameter(rows, requires_grad=False) if isinstance(lin.weight, nn.Parameter) else rows
            if self.bias is not None:
                lin.bias = nn.Parameter(self.bias[start:start + n], requires_grad=False)
            start += n

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The outputs side by side, unsplit: [..., sum(sizes)]."""
        return self.gemm(x, self.bias) if self.gemm is not None else F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.matmul(x).split(self.sizes, dim=-1)
