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

NOTE: a small float32 matmul (one row of any weight, or at most
``UNPACKED_MAX_MACS`` multiply-adds in all) keeps torch's own matmul on the
unpacked weight. There oneDNN's blocked kernel is no help: its per-call cost
(~15-20 us on the AVX512-BF16 Xeon, 1 thread) is more than the arithmetic.
Measured on that box (1 thread, best of 5, us, ``F.linear`` against packed)
for the shipped pair's float32 shapes: q/k/v [512, 256] 19.4 / 42.0 at 5
rows, 32.2 / 35.2 at 10, level at 20; o [256, 256] 13.0 / 24.1 at 5; gate/up
[1536, 256] 46.9 / 52.8 at 5 and 90.8 / 73.8 at 10; down [256, 768] 18.2 /
29.3 at 5 and 77.8 / 64.6 at 20; the LM head [4096, 256] 143 / 174 at 2 rows
and 288 / 184 at 5: the unpacked kernel wins up to about 2M multiply-adds and
loses beyond. In process (the shipped pair, k = 4, 1 thread, median of 3
interleaved rounds) a step at batch 1 went from 11.75 to 11.20 ms with the
bfloat16 draft, and with a float32 draft from 11.23 to 10.49 ms at batch 1,
15.27 to 14.89 at 4, 19.63 to 19.08 at 8. Earlier, on an AVX2-only CPU (AMD
EPYC, 1 thread, best of 5), the shipped draft's five weight shapes cost 645 us
packed against 340-386 us through ``F.linear`` at one row, and from four rows
up the packed kernel won in all (946 against 1524 us at four); the threshold
was not measured per shape there. A bfloat16 weight (packed only
where the CPU multiplies bfloat16 natively: ``available``) always takes the
packed kernel: there torch's matmul at one row is the slower one (AVX512-BF16
EPYC, 1 thread, best of 3, the draft's q/k/v, o, gate/up, down and LM head
shapes: 27/22/51/34/113 us unpacked against 18/16/40/29/73 packed). On big
models every shape is far over the threshold beyond a row, so they run packed.

NOTE: bfloat16 copies for small calls. A bfloat16 checkpoint loaded in float32
(``dtype: auto`` on CPU; the shipped pair) has float32 weights that are
bfloat16 values widened, so a bfloat16 copy is the same numbers in half the
bytes. ``pack_weights`` makes one per linear (``dspark_kernels.cpu.Bf16Gemm``,
column panels) when every weight of the model is such, the CPU kernels are
built here, and the copies come to at most ``BF16_COPY_MAX_BYTES``
(``DSPARK_BF16_COPIES=0``: none). Calls of at most ``BF16_MAX_ROWS`` rows run
on it, and on one torch thread (a served worker's) calls of up to
``BF16_MAX_ROWS_ONE_THREAD`` (its kernel is single-threaded; more than six rows
widen each panel to float32 once and reuse it): products and sums in float32, so the float32 model up to the order of
the sums (~1e-6, like another BLAS), each row computed alone (its bits do not
depend on its batch). A decode or verify step of a small model streams every
weight from the last-level cache for a few rows, so half the bytes is most of
the gain: with cold weights (each read once in a round of 12 copies, 1 thread,
us, float32 path / copy) q/k/v [512, 256] 31/26 at one row and 43/30 at five,
gate/up [1536, 256] 59/47 and 94/60, the LM head [4096, 256] 149/110 and
232/145; about level at 16 rows (the LM head slower), slower beyond. In
process (shipped pair, k = 4, 1 thread, interleaved) an engine step went 7.8
-> 6.4 ms at batch 1 and 11.3 -> 10.2 at batch 4; at batch 16 the draft's
passes (16 rows) on the copies made a step 20.9 -> 19.5 ms against a limit of
12 rows. With each panel widened once for many rows the copy also wins with
cold weights at 20 to 80 rows (us, float32 path / copy, 20 rows: 107/68,
67/36, 206/163, 120/95, 480/409 for q/k/v, o, gate/up, down, LM head; 80
rows: 224/191, 115/95, 524/477, 289/258, 1353/1275), and on one thread a step
went 9.3 -> 8.2 ms at batch 4 and 17.5 -> 16.2 at 16 (bench/HISTORY.md,
twentieth session). The copies add half the
float32 weights' bytes to the process.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from dspark_kernels import cpu as cpu_kernels

log = logging.getLogger(__name__)

# Calls of at most this many rows run on the bfloat16 copy when a linear has one (module docstring);
# on one torch thread, calls of up to BF16_MAX_ROWS_ONE_THREAD (the copy's kernel is single-threaded,
# and with more threads oneDNN's parallel one wins beyond a few rows).
BF16_MAX_ROWS = 16
BF16_MAX_ROWS_ONE_THREAD = 96
# The most bytes of bfloat16 copies a model gets (its float32 weights' half): small models, where a
# decode step streams every weight for a few rows; a bigger one keeps its memory.
BF16_COPY_MAX_BYTES = 1 << 30
# oneDNN picks the packed layout for this many rows; it is correct for any number.
BATCH_HINT = 32
# A float32 call of one row, or of at most this many multiply-adds (rows x in x out), uses torch's
# matmul on the unpacked weight (module docstring); bfloat16 weights always run packed.
UNPACKED_MAX_MACS = 2**21
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
    """``x @ weight.T (+ bias)`` through oneDNN with ``weight`` [out, in] reordered once; with ``bf16``,
    calls of at most ``BF16_MAX_ROWS`` rows run on a bfloat16 copy of a float32 weight of bfloat16
    values (module docstring)."""

    def __init__(self, weight: torch.Tensor, bf16: bool = False) -> None:
        assert weight.dim() == 2 and weight.device.type == "cpu", weight.shape
        self.out_features = weight.shape[0]
        self.weight = weight.detach()  # the parameter itself (no copy), for small calls
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.contiguous(), BATCH_HINT)
        # The most rows a call may have and still run unpacked (0: never).
        self.unpacked_max_rows = max(1, UNPACKED_MAX_MACS // weight.numel()) if weight.dtype == torch.float32 else 0
        self.bf16 = cpu_kernels.Bf16Gemm(self.weight) if bf16 else None

    def __call__(
        self,
        x: torch.Tensor,  # [..., in], the weight's dtype
        bias: torch.Tensor | None = None,  # [out]
    ) -> torch.Tensor:  # [..., out]
        if self.bf16 is not None:
            rows = x.numel() // x.shape[-1]
            if rows <= BF16_MAX_ROWS or (rows <= BF16_MAX_ROWS_ONE_THREAD and torch.get_num_threads() == 1):
                return self.bf16(x, bias)
        if x.numel() <= self.unpacked_max_rows * x.shape[-1]:
            return F.linear(x, self.weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def pack_weights(model: nn.Module) -> nn.Module:
    """Give every linear of ``model`` that can take one a ``PackedGemm`` (``gemm``), in place.

    Linears are the model's ``Linear`` modules (tensor-parallel shards
    included), its fused projections and the LM head (``CausalLM.lm_gemm``).
    Does nothing where oneDNN cannot run the weights (CUDA, float16).
    """
    from dspark_ray.model.layers import FusedLinears, Linear
    from dspark_ray.model.llama import CausalLM

    param = next(model.parameters())
    if not available(param.device, param.dtype):
        return model
    owners = [module for module in model.modules() if isinstance(module, Linear)]
    owners += [value for module in model.modules() for value in vars(module).values() if isinstance(value, FusedLinears)]
    # GGUF blocks kept (uint8: dspark_ray/model/quantized.py) keep their own matmul.
    owners = [owner for owner in owners if owner.weight.dtype == param.dtype]
    head = isinstance(model, CausalLM) and model.lm_weight.dtype == param.dtype
    weights = [owner.weight for owner in owners] + ([model.lm_weight] if head else [])
    bf16 = bf16_copies(weights)
    for owner in owners:
        owner.gemm = PackedGemm(owner.weight, bf16)
    if head:
        model.lm_gemm = PackedGemm(model.lm_weight, bf16)
    return model


def bf16_copies(weights: list[torch.Tensor]) -> bool:
    """Whether the linears of these float32 ``weights`` get bfloat16 copies for their small calls: the
    CPU kernels are built here, every weight holds bfloat16 values only (so the copy is the same
    numbers), and the copies come to at most ``BF16_COPY_MAX_BYTES`` (module docstring)."""
    if (not weights or weights[0].dtype != torch.float32 or not cpu_kernels.takes(weights[0])
            or os.environ.get("DSPARK_BF16_COPIES", "1") == "0"):
        return False
    total = 2 * sum(w.numel() for w in weights)
    if total > BF16_COPY_MAX_BYTES:
        log.info("no bfloat16 weight copies for small matmuls: they would take %.1f GB (at most %.1f)",
                 total / 1e9, BF16_COPY_MAX_BYTES / 1e9)
        return False
    return all(cpu_kernels.bf16_exact(w) for w in weights)
