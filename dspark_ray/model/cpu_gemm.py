"""Prepacked CPU matmuls for the model's linears (oneDNN), in place of torch's default.

On CPU, ``F.linear`` hands every call to MKL's sgemm with the weight in
PyTorch's row-major layout, and for the few rows a decode or verify step
multiplies (1 to a few hundred) that layout is packed again on every call.
oneDNN's linear with the weight reordered once, at load, into its blocked
layout skips that: measured in process on the 2-core development box
(interleaved A/B, shipped pair, float32), the target's verify step at batch 1
with 4 drafts went from 13.0 to 7.9 ms, at batch 8 from 20.8 to 17.4 ms, at
batch 32 (k = 1) from 35.6 to 30.2 ms; the draft's proposal at batch 8 from
12.9 to 9.8 ms and at batch 1 was unchanged. vLLM's CPU backend does the
same for its unquantized linears (``create_onednn_mm``).

The packed copy sits beside the parameter, which keeps its name, shape and
storage (checkpoints, the state dict and tensor parallelism see a plain
linear). It is a copy: a weight changed after packing is not seen by the
packed matmul (``pack_weights`` again). Results differ from MKL's in the last
bits (about 1e-6 relative in float32), as two BLAS libraries do.

NOTE: one row at a time (the draft's passes at batch 1) of a float32 weight
keeps torch's own matmul on the unpacked weight. There oneDNN's blocked kernel
is no help and, on an AVX2-only CPU, slower: measured on such a box (AMD EPYC,
1 thread, best of 5), the shipped draft's five weight shapes cost 645 us packed
against 340-386 us through ``F.linear`` at one row, while from four rows up
the packed kernel wins (946 against 1524 us at four, 1414 against 2029 at
eight). On the AVX512-BF16 box the two were level at one row in float32. A
bfloat16 weight (packed only where the CPU multiplies bfloat16 natively:
``available``) always takes the packed kernel: there torch's matmul at one
row is the slower one (AVX512-BF16 EPYC, 1 thread, best of 3, the draft's
q/k/v, o, gate/up, down and LM head shapes: 27/22/51/34/113 us unpacked
against 18/16/40/29/73 packed), and the shipped pair's bfloat16 draft
proposed 4 tokens at batch 1 in 10.6 ms instead of 14.0 (in process, 1
thread, the median over 4 interleaved rounds of 64 greedy tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN picks the packed layout for this many rows; it is correct for any number.
BATCH_HINT = 32
# Calls with at most this many rows of a float32 weight use torch's matmul on the unpacked weight
# (module docstring); bfloat16 weights always run packed.
UNPACKED_MAX_ROWS = 1
PACKABLE = (torch.float32, torch.bfloat16)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's prepacked linear can run weights of ``dtype`` on ``device``.

    bfloat16 needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: on an AVX2-only CPU oneDNN refuses to
    reorder a bfloat16 weight, and those linears keep torch's own matmul."""
    if not (device.type == "cpu" and dtype in PACKABLE and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedGemm:
    """``x @ weight.T (+ bias)`` through oneDNN with ``weight`` [out, in] reordered once."""

    def __init__(self, weight: torch.Tensor) -> None:
        assert weight.dim() == 2 and weight.device.type == "cpu", weight.shape
        self.out_features = weight.shape[0]
        self.weight = weight.detach()  # the parameter itself (no copy), for single rows
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.contiguous(), BATCH_HINT)
        self.unpacked_max_rows = UNPACKED_MAX_ROWS if weight.dtype == torch.float32 else 0

    def __call__(
        self,
        x: torch.Tensor,  # [..., in], the weight's dtype
        bias: torch.Tensor | None = None,  # [out]
    ) -> torch.Tensor:  # [..., out]
        if x.numel() <= self.unpacked_max_rows * x.shape[-1]:
            return F.linear(x, self.weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def pack_weights(model: nn.Module) -> nn.Module:
    """Give every linear of ``model`` that can take one a ``PackedGemm`` (``gemm``), in place.

    Linears are the model's ``Linear`` modules (tensor-parallel shards
    included), its fused projections and the LM head (``CausalLM.lm_gemm``).
    Does nothing where oneDNN cannot run the weights (CUDA, float16).
    """
    from dspark_ray.model.llama import CausalLM, FusedLinears, Linear

    param = next(model.parameters())
    if not available(param.device, param.dtype):
        return model
    for module in model.modules():
        if isinstance(module, Linear):
            module.gemm = PackedGemm(module.weight)
        for value in vars(module).values():
            if isinstance(value, FusedLinears):
                value.gemm = PackedGemm(value.weight)
    if isinstance(model, CausalLM):
        model.lm_gemm = PackedGemm(model.lm_weight)
    return model
