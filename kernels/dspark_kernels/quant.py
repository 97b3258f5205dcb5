"""GGUF quantized weights kept as their blocks, and the matmul that reads them.

A GGUF file (llama.cpp's format) stores a linear weight [out_features, in_features] row by row, each
row cut into blocks of ``block`` weights along in_features, each block a few bytes: a float16 scale
(and for some types a float16 offset) and packed small integers. ``QuantWeight`` holds those bytes
as they are, a uint8 tensor [out_features, row_bytes]; ``quant_matmul`` multiplies float32
activations by the weight without ever widening it in memory. A decode step reads every weight once
for one or a few rows, so reading the file's 4.5-8.5 bits a weight instead of a float32 or
bfloat16 copy is most of its cost: SmolLM2-135M's blocks (Q4_1, its LM head Q8_0) are ~96 MB a step
against ~270 MB in bfloat16.

The formats (``FORMATS``; w is the weight, q the stored integer, d and m float16):

- Q8_0: 32 weights in 34 bytes: d, then 32 int8 q; w = d * q.
- Q4_0: 32 weights in 18 bytes: d, then 16 bytes whose low nibbles are weights 0..15 and high
  nibbles 16..31; w = d * (q - 8).
- Q4_1: 32 weights in 20 bytes: d, m, then 16 bytes of nibbles as Q4_0; w = d * q + m.
- Q4_K: 256 weights in 144 bytes: d, dmin, 12 bytes packing eight 6-bit scales and mins, 128 bytes
  of nibbles (32-byte chunk c: low nibbles sub-block 2c, high 2c + 1); w = (d * sc) * q - dmin * mn.
- Q6_K: 256 weights in 210 bytes: 128 bytes of low 4 bits, 64 of high 2 bits, sixteen int8 scales
  (one per 16 weights), d last; w = (d * sc) * (q - 32).

``dequantize`` is the torch reference: the same products and sums as gguf's numpy dequantizers
(``gguf.quants.dequantize``), so bit for bit the same floats (tests/test_kernels_quant.py).

``quant_matmul`` runs, by device and backend (``ops.set_backend``):

- CPU: the C kernel (csrc/quant_gemm.c) when built and enabled (``cpu.enabled()``): weights decoded
  in registers to those same floats, float32 products and sums, so the result is the reference's up
  to the order of the sums, and each row's result is the same whatever rows share its call (batch
  invariance). Otherwise the reference: dequantize, then ``x @ w.T``.
- CUDA (or backend "triton" under the interpreter): the Triton kernel (``quant_triton``) for Q8_0,
  Q4_0, Q4_1; the reference for the K-quants.

``quant_matmul_int8`` (CPU, Q8_0 / Q4_0 / Q4_1): llama.cpp's scheme, a separate entry point.
Each 32-block of a row of x is rounded to int8 with its own scale (``quantize_rows_int8``: llama.cpp's
Q8_0 / Q8_1 activations, the same integers), so block dot products are exact in int32
(AVX512-VNNI, or AVX2's byte multiply-adds as llama.cpp does there), then scaled in float32:
faster, and about as accurate as x's rounding to 8 bits, which every weight meets alike (Q4_1's offset times the rounded block's sum, as llama.cpp's Q8_1
``s``). It differs from llama.cpp's only in keeping the two activation scales float32 where
llama.cpp stores float16 (and in the order of float sums). Error bounds, and the comparison with a
transcription of llama.cpp's arithmetic and with llama.cpp's own logits, in
tests/test_kernels_quant.py. Its reference is ``reference_int8``.

Tensor parallelism slices a weight on block boundaries: ``slice_rows`` keeps output rows (column
parallel: any rows), ``slice_cols`` keeps input columns (row parallel: a multiple of the block).

Threads (``set_threads``; the engine passes its torch thread count): a big enough call is split by
output rows between its calling thread and the C library's own small pool of pthreads (not OpenMP,
which would fight torch's libgomp for the cores); each output row is computed whole by one thread,
so the bits are the same on any thread count. Idle workers spin 200 us, then sleep: a process that
has used them and waits burns no CPU. Details in csrc/quant_gemm.c.

NOTE: measured on the 2-core development box (AMD EPYC KVM, AVX-512 with VNNI and BF16, 2.6 GHz,
~31-35 GB/s; bench/quant_gemm.py). On one thread both C paths are bound by the core's arithmetic,
not by memory, at one row: with the weight in cache the float path decodes Q4_1 at ~8-9 GB/s of
blocks (~6 cycles a 32-weight block: a 16-entry table d * q + m, two lookups, two multiply-adds),
the int8 path at ~17-18 GB/s. At M >= 4 the float path takes ~2.5 cycles per (row of x, weight row,
32-block) and the int8 path ~1.7-2.2, near what their instructions allow (two multiply-adds; two
VNNI dot products and four float operations per 4 blocks), so a register-tiled kernel, which would
save loads only, was not written. The kernel reads one weight row after another: reading four rows
side by side halved the rate from memory. The 211 linears of SmolLM2-135M in a step's order, cold
(96 MB), box otherwise idle, ms on 1 -> 2 threads:

    M             1            8            32
    float     11.2 -> 6.8  35.6 -> 19.2  130.5 -> 68.5
    int8      10.5 -> 6.1  24.0 -> 15.1   83.2 -> 49.5
    int8, q/k/v and gate/up fused (121 calls): 8.6 -> 4.4 at M = 1 (22 GB/s), 82.0 -> 43.7 at 32

On an AVX2 box without AVX-512 (AMD EPYC Zen 3 KVM, 2 cores, ~19 / 29 GB/s on 1 / 2 threads), the same
211 calls at M = 1: float 18.6 -> 10.6 ms, int8 on AVX2 (maddubs) 12.1 -> 9.2 ms.

The LM head alone (Q8_0, 30 MB) at M = 1: ~2.0 ms on one thread, ~0.9-1.3 on two (~30 GB/s: the
memory). A ``QuantGemm`` call costs ~4 us of Python and ctypes besides the kernel, which is why
fusing (``QuantWeight.cat_rows``) saves most of what is left at M = 1. A compiled model's
``dspark::linear`` calls ``QuantGemm.bind``'s short path instead (AVX2 box, 1 thread, int8, one row
times a [64, 576] Q4_1 weight: the bare ctypes call, kernel included, 4.6 us; the op through
``BlockGemm`` and ``__call__`` 18.2 us, through the short path 15.4, of which ~4 us is the
dispatcher's boxed call into Python and 1.2 us ``torch.empty``).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dspark_kernels import cpu, ops


class QuantError(ValueError):
    """A quantized weight or its input does not fit (type, shape, bytes)."""


class BlockBoundaryError(QuantError):
    """A slice of input columns does not start and stop on a block boundary."""


@dataclass(frozen=True)
class QuantFormat:
    """One GGUF block format: its GGML type id (``gguf.GGMLQuantizationType``), weights a block and
    bytes a block."""

    name: str
    qtype: int
    block: int
    nbytes: int


FORMATS: dict[int, QuantFormat] = {f.qtype: f for f in (
    QuantFormat("Q4_0", 2, 32, 18),
    QuantFormat("Q4_1", 3, 32, 20),
    QuantFormat("Q8_0", 8, 32, 34),
    QuantFormat("Q4_K", 12, 256, 144),
    QuantFormat("Q6_K", 14, 256, 210),
)}
Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 2, 3, 8, 12, 14
# The types quant_matmul_int8 takes, and the Triton kernel (the K-quants take the reference on CUDA).
INT8_TYPES = TRITON_TYPES = (Q4_0, Q4_1, Q8_0)
# Where each format keeps its float16 scales: byte offsets in a block.
SCALE_OFFSETS = {Q8_0: (0,), Q4_0: (0,), Q4_1: (0, 2), Q4_K: (0, 2), Q6_K: (208,)}


def quant_format(qtype: int) -> QuantFormat:
    """The format of GGML type ``qtype`` (an int or ``gguf.GGMLQuantizationType``)."""
    fmt = FORMATS.get(int(qtype))
    if fmt is None:
        names = ", ".join(f"{f.name} ({f.qtype})" for f in FORMATS.values())
        raise QuantError(f"GGML type {int(qtype)} is not a block format this package reads; it reads {names}")
    return fmt


# ---- the reference ------------------------------------------------------------------------------------


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte ``start`` of each block, as float32 [nb, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[nb, c, 16 * k] bytes -> [nb, c, 2, 16 * k]: low nibbles, then high nibbles."""
    return torch.stack((qs & 15, qs >> 4), dim=-2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _half(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, None, 2:]).reshape(-1, 32).to(torch.int8) - 8
    return _half(b, 0) * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, None, 4:]).reshape(-1, 32).float()
    return _half(b, 0) * q + _half(b, 2)


def _q4_k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins packed in 12 bytes [nb, 12] -> ([nb, 8], [nb, 8])."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), dim=1)
    mn = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), dim=1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    sc, mn = _q4_k_scale_min(b[:, 4:16])
    dsc = (_half(b, 0) * sc.float())[:, :, None]  # [nb, 8, 1]
    dmn = (_half(b, 2) * mn.float())[:, :, None]
    q = _nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32).float()
    return (dsc * q - dmn).reshape(-1, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = _nibbles(b[:, :128].reshape(-1, 2, 64)).reshape(-1, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)[:, None]
    qh = ((b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(-1, 16, 16).float()
    dsc = (_half(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float())[:, :, None]  # [nb, 16, 1]
    return (dsc * q).reshape(-1, 256)


_DEQUANTIZE = {Q8_0: _q8_0, Q4_0: _q4_0, Q4_1: _q4_1, Q4_K: _q4_k, Q6_K: _q6_k}


def dequantize(
    blocks: torch.Tensor,  # [N, row_bytes] uint8
    qtype: int,
    shape: tuple[int, int],  # (N, K)
) -> torch.Tensor:  # [N, K] float32
    """The weights of ``blocks`` as float32, bit for bit as ``gguf.quants.dequantize`` gives them."""
    fmt = quant_format(qtype)
    n, k = shape
    _check_blocks(blocks, fmt, n, k)
    flat = blocks.reshape(-1, fmt.nbytes)
    return _DEQUANTIZE[fmt.qtype](flat).reshape(n, k)


def _check_blocks(blocks: torch.Tensor, fmt: QuantFormat, n: int, k: int) -> None:
    if k % fmt.block != 0:
        raise QuantError(f"in_features {k} is not a multiple of {fmt.name}'s {fmt.block}-weight block")
    want = (n, k // fmt.block * fmt.nbytes)
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != want:
        raise QuantError(f"{fmt.name} blocks of a [{n}, {k}] weight must be uint8 {want}, got "
                         f"{blocks.dtype} {tuple(blocks.shape)}")


# ---- the weight ---------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class QuantWeight:
    """The GGUF blocks of one linear weight [out_features, in_features], as stored.

    ``blocks`` is uint8 [out_features, row_bytes], row n holding output n's in_features weights in
    in_features / block blocks (a GGUF tensor's data, its rows in the file's order)."""

    blocks: torch.Tensor  # [out_features, row_bytes] uint8, contiguous
    qtype: int
    shape: tuple[int, int]  # (out_features, in_features)

    def __post_init__(self) -> None:
        fmt = quant_format(self.qtype)
        object.__setattr__(self, "qtype", fmt.qtype)
        object.__setattr__(self, "shape", (int(self.shape[0]), int(self.shape[1])))
        _check_blocks(self.blocks, fmt, *self.shape)
        if not self.blocks.is_contiguous():
            raise QuantError("QuantWeight blocks must be contiguous (call .contiguous())")

    @property
    def format(self) -> QuantFormat:
        return FORMATS[self.qtype]

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def row_bytes(self) -> int:
        return self.blocks.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of blocks: what a matmul at one row reads."""
        return self.blocks.numel()

    def dequantize(self) -> torch.Tensor:  # [out_features, in_features] float32
        return dequantize(self.blocks, self.qtype, self.shape)

    def slice_rows(self, start: int, stop: int) -> QuantWeight:
        """Output rows start..stop (column-parallel shard): any rows, a view of the same blocks."""
        if not 0 <= start < stop <= self.out_features:
            raise QuantError(f"rows {start}:{stop} are not inside out_features {self.out_features}")
        return QuantWeight(self.blocks[start:stop], self.qtype, (stop - start, self.in_features))

    def slice_cols(self, start: int, stop: int) -> QuantWeight:
        """Input columns start..stop (row-parallel shard), a copy: both on a block boundary.

        Raises:
          BlockBoundaryError: start or stop is not a multiple of the format's block."""
        fmt = self.format
        if not 0 <= start < stop <= self.in_features:
            raise QuantError(f"columns {start}:{stop} are not inside in_features {self.in_features}")
        if start % fmt.block or stop % fmt.block:
            raise BlockBoundaryError(
                f"columns {start}:{stop} of a {fmt.name} weight cut its {fmt.block}-weight blocks: a "
                f"row-parallel shard must start and stop on a multiple of {fmt.block} (split in_features "
                f"{self.in_features} into shards of whole blocks, or keep this weight unsplit)")
        cols = slice(start // fmt.block * fmt.nbytes, stop // fmt.block * fmt.nbytes)
        return QuantWeight(self.blocks[:, cols].contiguous(), self.qtype, (self.out_features, stop - start))

    def to(self, device: torch.device | str) -> QuantWeight:
        return QuantWeight(self.blocks.to(device), self.qtype, self.shape)

    @staticmethod
    def cat_rows(weights: list[QuantWeight]) -> QuantWeight:
        """Weights of one type and in_features stacked along out_features (a fused q/k/v or gate/up
        projection: one call, one stream, in place of several)."""
        first = weights[0]
        if any(w.qtype != first.qtype or w.in_features != first.in_features for w in weights):
            raise QuantError("cat_rows takes weights of one type and one in_features, got "
                             + ", ".join(f"{w.format.name} {w.shape}" for w in weights))
        blocks = torch.cat([w.blocks for w in weights])
        return QuantWeight(blocks, first.qtype, (blocks.shape[0], first.in_features))


def random_blocks(
    qtype: int,
    shape: tuple[int, int],  # (N, K)
    generator: torch.Generator,
    scale: float = 0.02,
) -> torch.Tensor:  # [N, row_bytes] uint8
    """Valid blocks for tests and benchmarks: random bytes, each float16 scale replaced by a finite
    one of magnitude below ``scale`` (any bytes are valid integers; a random scale could be inf or NaN)."""
    fmt = quant_format(qtype)
    n, k = shape
    blocks = torch.randint(0, 256, (n * (k // fmt.block), fmt.nbytes), dtype=torch.uint8, generator=generator)
    for offset in SCALE_OFFSETS[fmt.qtype]:
        halves = ((torch.rand(blocks.shape[0], generator=generator) * 2 - 1) * scale).half()
        blocks[:, offset:offset + 2] = halves.view(torch.uint8).view(-1, 2)
    return blocks.view(n, -1)


# ---- the matmuls --------------------------------------------------------------------------------------


def reference_matmul(
    x: torch.Tensor,  # [..., K] float32
    weight: QuantWeight,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N] float32
    """The oracle: dequantize, then ``x @ w.T (+ bias)``."""
    y = x @ weight.dequantize().to(x.device).T
    return y if bias is None else y + bias


def _check_x(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None) -> None:
    if x.dtype != torch.float32 or x.shape[-1] != weight.in_features:
        raise QuantError(f"x must be float32 [..., {weight.in_features}], got {x.dtype} {tuple(x.shape)}")
    if x.device != weight.blocks.device:
        raise QuantError(f"x is on {x.device}, the weight's blocks on {weight.blocks.device}")
    if bias is not None and tuple(bias.shape) != (weight.out_features,):
        raise QuantError(f"bias must be [{weight.out_features}], got {tuple(bias.shape)}")


def quant_matmul(
    x: torch.Tensor,  # [..., K] float32
    weight: QuantWeight,  # [N, K] as blocks
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N] float32
    """``x @ dequantize(weight).T (+ bias)`` without widening the weight (module docstring)."""
    _check_x(x, weight, bias)
    if bias is not None:
        bias = bias.float().contiguous()
    if weight.qtype in TRITON_TYPES and ops.uses_triton("quant_triton", x.device):
        from dspark_kernels import quant_triton

        return quant_triton.quant_matmul(x, weight, bias)
    if x.is_cuda or not cpu.enabled() or _library() is None:
        return reference_matmul(x, weight, bias)
    return QuantGemm(weight)(x, bias)


def quant_matmul_int8(
    x: torch.Tensor,  # [..., K] float32, CPU
    weight: QuantWeight,  # [N, K] as Q8_0, Q4_0 or Q4_1 blocks
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N] float32
    """``x @ dequantize(weight).T (+ bias)`` with each 32-block of x rounded to int8 (llama.cpp's
    scheme; module docstring): the C kernel, or ``reference_int8`` where it is off or not built."""
    _check_x(x, weight, bias)
    if bias is not None:
        bias = bias.float().contiguous()
    if weight.qtype not in INT8_TYPES or x.is_cuda:
        raise QuantError(f"quant_matmul_int8 takes Q8_0, Q4_0, Q4_1 weights on CPU, got "
                         f"{weight.format.name} on {x.device}")
    if not cpu.enabled() or _library() is None:
        return reference_int8(x, weight, bias)
    return QuantGemm(weight, int8=True)(x, bias)


def set_threads(n: int) -> None:
    """Run each big enough quantized matmul on ``n`` threads: the calling one and ``n - 1`` workers of
    the C library's own pool (csrc/quant_gemm.c; not OpenMP), which it starts at the first call that
    wants them and which sleep when idle. ``n`` is meant to be the process's torch thread count. Each
    output row is computed whole by one thread, so results are the same bits for every ``n``.
    Nothing to do where the C kernels are off or not built.

    Raises:
      QuantError: n is not between 1 and 64."""
    if not 1 <= n <= 64:
        raise QuantError(f"set_threads takes 1 to 64 threads, got {n}")
    lib = _library()
    if lib is not None:
        lib.dspark_quant_set_threads(n)


def get_threads() -> int:
    """The threads a big quantized matmul runs on (``set_threads``; 1 until it is called)."""
    lib = _library()
    return 1 if lib is None else lib.dspark_quant_get_threads()


def int8_isa() -> str | None:
    """What quant_matmul_int8 runs on here: "avx512-vnni", "avx2" (llama.cpp's maddubs way), "scalar"
    (a portable loop, several times slower than the float path), or None (no C kernels: the reference)."""
    lib = _library()
    return None if lib is None else ("scalar", "avx2", "avx512-vnni")[lib.dspark_quant_gemm_q8act_native()]


def int8_native() -> bool:
    """Whether quant_matmul_int8 runs on vector instructions here (AVX512-VNNI or AVX2), not a scalar loop."""
    return int8_isa() in ("avx2", "avx512-vnni")


class QuantGemm:
    """``x @ dequantize(weight).T (+ bias)`` for one weight through the C kernel, the weight's checks
    done once: what a linear layer calls (``quant_matmul`` is the same call, checked each time).
    ``int8``: llama.cpp's int8 activations (``quant_matmul_int8``).

    Raises:
      QuantError: the CPU kernels are off or not built here, or the weight is on CUDA, or ``int8``
        for a type other than Q8_0, Q4_0, Q4_1."""

    def __init__(self, weight: QuantWeight, int8: bool = False) -> None:
        lib = _library() if cpu.enabled() else None
        if lib is None or weight.blocks.is_cuda:
            raise QuantError("QuantGemm needs the CPU kernels (enabled and built here) and a CPU weight")
        if int8 and weight.qtype not in INT8_TYPES:
            raise QuantError(f"int8 activations take Q8_0, Q4_0, Q4_1 weights, not {weight.format.name}")
        self.weight = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.int8 = int8
        self._call = lib.dspark_quant_gemm_q8act if int8 else lib.dspark_quant_gemm_f32
        self._scratch_size = lib.dspark_quant_gemm_q8act_scratch
        self._scratch_bytes: dict[int, int] = {}  # rows -> bytes of scratch an int8 call of that many rows takes
        self._args = (weight.blocks.data_ptr(), weight.out_features, weight.row_bytes, weight.qtype)

    def __call__(
        self,
        x: torch.Tensor,  # [..., K] float32
        bias: torch.Tensor | None = None,  # [N] float32
    ) -> torch.Tensor:  # [..., N] float32
        k = self.in_features
        if x.dtype != torch.float32 or x.shape[-1] != k or x.is_cuda:
            raise QuantError(f"x must be float32 [..., {k}] on CPU, got {x.dtype} {tuple(x.shape)} on {x.device}")
        x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()  # [M, K]
        y = torch.empty(*x.shape[:-1], self.out_features)  # [..., N]
        if bias is not None:
            assert bias.shape == (self.out_features,) and bias.dtype == torch.float32 and bias.is_contiguous()
        assert x2.is_contiguous() and y.is_contiguous()
        self._launch(x2.data_ptr(), x2.shape[0], None if bias is None else bias.data_ptr(), y.data_ptr())
        return y

    def _launch(self, x_ptr: int, m: int, bias_ptr: int | None, y_ptr: int) -> None:
        """The kernel over m contiguous rows of x into y (both checked by the caller)."""
        k = self.in_features
        if self.int8:
            # Records of x past what the C stack holds: a buffer per call, never shared between threads.
            size = self._scratch_bytes.get(m)
            if size is None:
                size = self._scratch_bytes[m] = self._scratch_size(self.weight.qtype, m, k)
            scratch = torch.empty(size, dtype=torch.uint8) if size > 0 else None
            code = self._call(x_ptr, m, k, *self._args, bias_ptr, y_ptr, None if scratch is None else scratch.data_ptr())
        else:
            code = self._call(x_ptr, m, k, *self._args, bias_ptr, y_ptr)
        if code != 0:
            raise QuantError(f"the quantized matmul refused {self.weight.format.name} "
                             f"[{self.out_features}, {k}] (error {code})")

    def bind(
        self,
        bias: torch.Tensor | None = None,  # [N]
        fallback: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> self(x, bias)`` with everything but x checked and resolved once: what a compiled
        model's ``dspark::linear`` calls, ~150 times a decode step (``__call__`` spends ~5 us a call
        on checks and argument packing). An x that is float32, contiguous and on the CPU takes the
        short path; any other goes to ``fallback`` (default: ``__call__``, which checks it)."""
        if bias is not None:
            if tuple(bias.shape) != (self.out_features,):
                raise QuantError(f"bias must be [{self.out_features}], got {tuple(bias.shape)}")
            bias = bias.detach().float().contiguous()
        k, n, launch = self.in_features, self.out_features, self._launch
        bias_ptr = None if bias is None else bias.data_ptr()
        f32, empty = torch.float32, torch.empty
        if fallback is None:
            def fallback(x: torch.Tensor) -> torch.Tensor:
                return self(x, bias)

        def short(x: torch.Tensor) -> torch.Tensor:
            if x.dtype is not f32 or x.shape[-1] != k or not x.is_contiguous() or x.is_cuda:
                return fallback(x)
            y = empty(x.shape[:-1] + (n,))
            launch(x.data_ptr(), x.numel() // k, bias_ptr, y.data_ptr())
            return y

        short.bias = bias  # held: the kernel reads it by pointer
        return short


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The CPU kernels with the quantized matmuls' signatures set, or None where they are not built."""
    lib = cpu.library()
    if lib is None:
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.dspark_quant_gemm_f32.argtypes = [p, i64, i64, p, i64, i64, i32, p, p]
    lib.dspark_quant_gemm_f32.restype = i32
    lib.dspark_quant_gemm_q8act.argtypes = [p, i64, i64, p, i64, i64, i32, p, p, p]
    lib.dspark_quant_gemm_q8act.restype = i32
    lib.dspark_quant_gemm_q8act_scratch.argtypes = [i32, i64, i64]
    lib.dspark_quant_gemm_q8act_scratch.restype = i64
    lib.dspark_quant_gemm_q8act_native.argtypes = []
    lib.dspark_quant_gemm_q8act_native.restype = i32
    lib.dspark_quant_set_threads.argtypes = [i32]
    lib.dspark_quant_set_threads.restype = i32
    for name in ("dspark_quant_get_threads", "dspark_quant_pool_workers"):
        getattr(lib, name).argtypes = []
        getattr(lib, name).restype = i32
    lib.dspark_quant_pool_worker_runs.argtypes = []
    lib.dspark_quant_pool_worker_runs.restype = i64
    return lib


# ---- llama.cpp's int8 activations: the reference ------------------------------------------------------


def quantize_rows_int8(
    x: torch.Tensor,  # [M, K] float32, K a multiple of 32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # xq [M, K/32, 32] int8, dx [M, K/32], sx [M, K/32]
    """Each 32-block of each row rounded to int8 as llama.cpp's quantize_row_q8_0 / q8_1 do it:
    dx = max|x| / 127, xq = round-half-even(x * (127 / max|x|)) (0 where the block is all zeros), and
    sx = dx * sum(xq), the rounded block's sum (Q8_1's s; not x's float sum: ``reference_int8``), all
    float32 as csrc/quant_gemm.c computes them. llama.cpp stores dx and sx as float16; these stay float32."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=-1)
    dx = amax / 127.0
    # A true division: torch computes ``127.0 / amax`` as 127 * (1 / amax), rounded twice, which
    # moves x * inv across a half now and then (llama.cpp and the C kernel divide once).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return xq, dx, dx * xq.sum(dim=-1, dtype=torch.int32).float()


def reference_int8(
    x: torch.Tensor,  # [..., K] float32
    weight: QuantWeight,  # Q8_0, Q4_0 or Q4_1
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N] float32
    """What quant_matmul_int8 computes, in float64: for each pair of blocks, d * dx * (q . xq), plus
    m * sx for Q4_1 (its offset times the rounded block's sum dx * sum(xq)), so that every weight
    d * q + m multiplies the same rounded x. (x's exact float sum there looks more accurate and is
    not: the block's error becomes sum_k (w_k - m) * (dx * xq_k - x_k), weights d * q of one sign
    whose roundings no longer cancel; on SmolLM2's Q4_1 layers 2-3 times the error of this.)"""
    fmt = weight.format
    k, n = weight.in_features, weight.out_features
    xq, dx, sx = quantize_rows_int8(x.reshape(-1, k))
    b = weight.blocks.reshape(-1, fmt.nbytes)
    d = _half(b, 0).double().reshape(n, -1)  # [N, K/32]
    if fmt.qtype == Q8_0:
        q = b[:, 2:].contiguous().view(torch.int8)
    else:
        q = _nibbles(b[:, None, 4 if fmt.qtype == Q4_1 else 2:]).reshape(-1, 32).to(torch.int8)
        q = q - 8 if fmt.qtype == Q4_0 else q
    dots = torch.einsum("nbk,mbk->mnb", q.double().reshape(n, -1, 32), xq.double())  # exact integers
    y = (dots * d * dx.double()[:, None, :]).sum(-1)
    if fmt.qtype == Q4_1:
        y = y + sx.double() @ _half(b, 2).double().reshape(n, -1).T
    y = y.float().reshape(*x.shape[:-1], n)
    return y if bias is None else y + bias
