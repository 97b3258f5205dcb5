"""The CPU kernels of ``csrc/``: built at first use, called through ctypes.

Attention (``csrc/cpu_attention.c``):

``paged_attention`` (the target's packed step) and ``ring_attention`` (the
draft's window cache) each write a step's K/V and attend in one call, where
the torch path (``reference``) takes 10-20 small ops per layer. On the
2-core development box (1 thread, shipped pair, an engine step at batch 1)
the draft's attention went from ~175 to ~40 us a layer and the target's from
~120 to ~50-80 (contexts of 100-200 tokens), the step from 9.95 to 7.73 ms
(bench/HISTORY.md, twentieth session). Float32 only; the callers take the
torch path for any other dtype, for CUDA tensors, or when the kernels are
off or could not be built.

``Decoder`` (``csrc/cpu_decoder.c``): a Llama-family decoder's layers over
one packed step in one call, their linears GGUF blocks kept (``quant``'s
kernels) and their attention ``PagedStep``'s (``dspark_ray/model/native.py``
says when it is used).

``Bf16Gemm`` (``csrc/cpu_gemm.c``): a small matmul of a float32 weight of
bfloat16 values from a bfloat16 copy, every product and sum in float32
(``dspark_ray/model/cpu_gemm.py`` says when it is used).

Built with the system's C compiler (``CC``, else ``cc``/``gcc``/``clang`` on
PATH) for this machine's CPU (``-march=native``), into
``$DSPARK_CACHE_DIR`` (default ``~/.cache/dspark_ray``) under a name hashed
from the source, the compiler, the flags and the CPU, so a machine builds
it once (half a second here) and a shared home directory never hands one
CPU another's build. Processes that start together may each build it; each
writes a file of its own and renames it into place.

``DSPARK_CPU_KERNELS=0`` turns them off (the torch path everywhere); so does
``ops.set_backend("reference")``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark_kernels import ops

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name("csrc") / name for name in ("cpu_attention.c", "cpu_gemm.c", "quant_gemm.c",
                                                                              "cpu_decoder.c"))
FLAGS = ("-O3", "-std=gnu11", "-fopenmp-simd", "-fPIC", "-shared", "-Werror=implicit-function-declaration")
_ERRORS = {
    -1: "a write index is outside the KV cache",
    -2: "a key index is outside the KV pool",
    -3: "a slot is outside the window cache",
    -4: "head counts or head_dim this build does not take",
    -5: "out of memory",
}
_DECODER_ERRORS = {
    -1: "a matmul refused its weight (shape or type)",
    -2: "the attention refused the step (an index outside the table or the KV pool, or head counts)",
    -3: "out of memory",
}


class CpuKernelError(RuntimeError):
    """A CPU kernel refused its inputs (nothing was written)."""


def enabled() -> bool:
    """Whether the kernels may be used: not turned off, and the kernel backend not forced."""
    return os.environ.get("DSPARK_CPU_KERNELS", "1") != "0" and ops.get_backend() == "auto"


def can_build() -> bool:
    """Whether the kernels are enabled and this machine has a C compiler: then ``library()`` must build
    and load them, and a failure is a bug (the tests say so rather than skip)."""
    return enabled() and _compiler() is not None


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can run on ``tensors`` (float32, CPU) and are enabled and built here."""
    return (all(t.dtype == torch.float32 and not t.is_cuda for t in tensors)
            and enabled() and library() is not None)


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or (cc if os.path.isfile(cc) else None)
    return next((path for name in ("cc", "gcc", "clang") if (path := shutil.which(name))), None)


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the machine and its CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {flags}"


def _build(cc: str, target: Path) -> None:
    """Compile ``SOURCES`` to ``target`` (for this CPU if the compiler takes -march=native)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    try:
        errors = ""
        for march in (("-march=native",), ()):
            run = subprocess.run([cc, *FLAGS, *march, *map(str, SOURCES), "-o", tmp, "-lm"],
                                 capture_output=True, text=True, timeout=120)
            if run.returncode == 0:
                os.replace(tmp, target)
                return
            errors = run.stderr.strip()
        raise CpuKernelError(f"{cc} failed: {errors[-2000:]}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels (built now if this machine has none yet), or None, with a warning once,
    where there is no C compiler or the build fails."""
    if not enabled():
        return None
    cc = _compiler()
    if cc is None:
        log.warning("CPU attention kernels: no C compiler (cc, gcc or clang on PATH, or CC); attention "
                    "takes the slower torch path")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        texts = [source.read_text() for source in SOURCES]
        key = hashlib.sha256("\0".join([*texts, version, *FLAGS, _cpu_id()]).encode()).hexdigest()
        cache = Path(os.environ.get("DSPARK_CACHE_DIR") or Path.home() / ".cache" / "dspark_ray")
        path = cache / f"cpu_kernels-{key[:16]}.so"
        if not path.exists():
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError, CpuKernelError) as exc:
        log.warning("CPU attention kernels could not be built (%s); attention takes the slower torch path", exc)
        return None
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.dspark_paged_attention_f32.argtypes = [p, p, p, p, p, p, p, i64, p, p, p, i64, i64, i64, i64, i64, f32, p]
    lib.dspark_paged_attention_f32.restype = ctypes.c_int
    lib.dspark_ring_attention_f32.argtypes = [p, p, p, p, p, p, p, p, ctypes.c_int, i64, i64, i64, i64, i64,
                                              i64, i64, i64, f32, p]
    lib.dspark_ring_attention_f32.restype = ctypes.c_int
    lib.dspark_gemm_bf16w.argtypes = [p, i64, i64, p, i64, p, p, p]
    lib.dspark_gemm_bf16w.restype = None
    lib.dspark_decoder_f32.argtypes = [p, i64, p, p, p, p, i64, i64, i64, i64, i64, i64, f32, f32, p, p]
    lib.dspark_decoder_f32.restype = ctypes.c_int
    lib.dspark_silu_mul_f32.argtypes = [p, i64, i64, p]
    lib.dspark_silu_mul_f32.restype = None
    return lib


def _check(code: int) -> None:
    if code != 0:
        raise CpuKernelError(_ERRORS.get(code, f"error {code}"))


def _int64(t: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    if t.dtype != torch.int64 or tuple(t.shape) != shape:
        raise CpuKernelError(f"{name} must be int64 {shape}, got {t.dtype} {tuple(t.shape)}")
    return t.contiguous()


class PagedStep:
    """The target's attention callable for one packed step (``layer, q, k, v -> out``, each ``[1, N, H, D]``).

    Built once per step (the inputs every layer shares checked and held here); each layer is one
    kernel call: the step's K/V written to that layer's pools at ``write_index``, then token n's
    query attends over key positions ``key_lo[n]..key_hi[n]`` of its row, position ``kp`` at pool
    index ``table.view(-1)[key_base[n] + kp]`` (``key_base[n] < 0``: no query, zeros). What
    ``PackedAttention`` computes with a gather and a masked SDPA per group, the mask a run of keys."""

    def __init__(
        self,
        k_pools: list[torch.Tensor],  # per layer [P, Hkv, D] float32
        v_pools: list[torch.Tensor],
        write_index: torch.Tensor,  # [N] int64
        table: torch.Tensor,  # int32, contiguous: the request-to-token table
        key_base: torch.Tensor,  # [N] int64
        key_lo: torch.Tensor,  # [N] int64
        key_hi: torch.Tensor,  # [N] int64
    ) -> None:
        n = write_index.shape[0]
        self.k_pools, self.v_pools = k_pools, v_pools
        self._held = [_int64(t, (n,), name) for t, name in
                      ((write_index, "write_index"), (key_base, "key_base"), (key_lo, "key_lo"), (key_hi, "key_hi"))]
        if table.dtype != torch.int32 or not table.is_contiguous():
            raise CpuKernelError(f"the key table must be contiguous int32, got {table.dtype}")
        pool = k_pools[0]
        if any(not (p.is_contiguous() and p.shape == pool.shape and p.dtype == torch.float32)
               for p in (*k_pools, *v_pools)):
            raise CpuKernelError("the KV pools must be contiguous float32 [P, Hkv, D], alike")
        self._table = table
        write, base, lo, hi = (t.data_ptr() for t in self._held)
        self._step = (write, table.data_ptr(), table.numel(), base, lo, hi, n, pool.shape[0])
        self._call = library().dspark_paged_attention_f32

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        n, hq, d = q.shape[-3:]
        hkv = k.shape[-2]
        if q.dtype != torch.float32 or k.shape != (1, n, hkv, d) or v.shape != k.shape or n != self._step[6]:
            raise CpuKernelError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit this step")
        out = torch.empty_like(q)
        _check(self._call(q.data_ptr(), k.data_ptr(), v.data_ptr(), self.k_pools[layer].data_ptr(),
                          self.v_pools[layer].data_ptr(), *self._step, hq, hkv, d, d ** -0.5, out.data_ptr()))
        return out


class RingStep:
    """The draft's attention callable for one pass over the window cache (``layer, q, k, v -> out``,
    each ``[B, T, H, D]``): each layer is one kernel call, ``reference.ring_write`` then
    ``reference.window_attention``; the first call also grows each slot's length to cover its
    positions (``DraftWindowCache.cover``), which every later layer then sees."""

    def __init__(
        self,
        k_cache: list[torch.Tensor],  # per layer [S, ring, Hkv, D] float32
        v_cache: list[torch.Tensor],
        slots: torch.Tensor,  # [B] int64
        positions: torch.Tensor,  # [B, T] int64, < 0 = padding
        lengths: torch.Tensor,  # [S] int64, grown in place
        window: int,
    ) -> None:
        b, t = positions.shape
        cache = k_cache[0]
        if any(not (c.is_contiguous() and c.shape == cache.shape and c.dtype == torch.float32)
               for c in (*k_cache, *v_cache)):
            raise CpuKernelError("the window caches must be contiguous float32 [S, ring, Hkv, D], alike")
        if not lengths.is_contiguous():
            raise CpuKernelError("lengths must be contiguous (it is grown in place)")
        self.k_cache, self.v_cache = k_cache, v_cache
        self._held = [_int64(slots, (b,), "slots"), _int64(positions, (b, t), "positions"),
                      _int64(lengths, (cache.shape[0],), "lengths")]
        slots_p, positions_p, lengths_p = (x.data_ptr() for x in self._held)
        self._pass = (slots_p, positions_p, lengths_p)
        self._dims = (b, t, cache.shape[0], cache.shape[1], window)
        self._covered = False
        self._call = library().dspark_ring_attention_f32

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        b, t, hq, d = q.shape
        hkv = k.shape[2]
        if q.dtype != torch.float32 or k.shape != (b, t, hkv, d) or v.shape != k.shape or (b, t) != self._dims[:2]:
            raise CpuKernelError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit this pass")
        out = torch.empty_like(q)
        _check(self._call(q.data_ptr(), k.data_ptr(), v.data_ptr(), self.k_cache[layer].data_ptr(),
                          self.v_cache[layer].data_ptr(), *self._pass, int(not self._covered), *self._dims,
                          hq, hkv, d, d ** -0.5, out.data_ptr()))
        self._covered = True
        return out


class _Gemm(ctypes.Structure):  # csrc/cpu_decoder.c's DecoderGemm
    _fields_ = [("w", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("n", ctypes.c_int64),
                ("row_bytes", ctypes.c_int64), ("qtype", ctypes.c_int32), ("int8", ctypes.c_int32)]


class _Layer(ctypes.Structure):  # DecoderLayer
    _fields_ = [("norm_in", ctypes.c_void_p), ("norm_post", ctypes.c_void_p), ("qkv", _Gemm), ("o", _Gemm),
                ("gate_up", _Gemm), ("down", _Gemm)]


class _Step(ctypes.Structure):  # DecoderStep
    _fields_ = [("write_index", ctypes.c_void_p), ("key_base", ctypes.c_void_p), ("key_lo", ctypes.c_void_p),
                ("key_hi", ctypes.c_void_p), ("table", ctypes.c_void_p), ("table_numel", ctypes.c_int64),
                ("pool_rows", ctypes.c_int64)]


@dataclass(frozen=True)
class BlockLinear:
    """A linear kept as GGUF blocks, for ``Decoder``: ``blocks`` uint8 [out, row bytes] of type ``qtype``
    (a ``quant.FORMATS`` id), ``int8``: activations rounded to int8 (Q8_0, Q4_0, Q4_1 only), ``bias``
    float32 [out] or None."""

    blocks: torch.Tensor
    qtype: int
    int8: bool = False
    bias: torch.Tensor | None = None


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One layer for ``Decoder``: the two RMSNorms' weights (float32 [hidden]), q/k/v fused (rows q,
    then k, then v), o, gate/up fused (rows gate, then up), down."""

    norm_in: torch.Tensor
    norm_post: torch.Tensor
    qkv: BlockLinear
    o: BlockLinear
    gate_up: BlockLinear
    down: BlockLinear


class Decoder:
    """A Llama-family decoder's layers (RMSNorm, fused q/k/v, rotary, paged attention, o, RMSNorm,
    fused gate/up, SiLU x up, down, the residual adds) over one packed step, in one C call
    (csrc/cpu_decoder.c). The weights are checked here, once; the tensors are held (the kernel reads
    them by pointer).

    Raises:
      CpuKernelError: the kernels are not built here, or a weight does not fit the shapes."""

    def __init__(self, layers: list[DecoderLayerWeights], hidden: int, heads: int, kv_heads: int,
                 head_dim: int, intermediate: int, eps: float) -> None:
        from dspark_kernels import quant

        lib = library()
        if lib is None:
            raise CpuKernelError("the CPU kernels are off or not built here")
        if not layers or heads % kv_heads or head_dim % 2:
            raise CpuKernelError(f"{len(layers)} layers, {heads} heads over {kv_heads}, head_dim {head_dim}")
        self.dims = (hidden, heads, kv_heads, head_dim, intermediate)
        self.eps, self.scale = float(eps), head_dim ** -0.5
        width = (heads + 2 * kv_heads) * head_dim
        shapes = {"qkv": (width, hidden), "o": (hidden, heads * head_dim), "gate_up": (2 * intermediate, hidden),
                  "down": (hidden, intermediate)}
        self._held: list[torch.Tensor] = []
        self._layers = (_Layer * len(layers))()
        for i, layer in enumerate(layers):
            for name in ("norm_in", "norm_post"):
                norm = getattr(layer, name)
                if norm.dtype != torch.float32 or tuple(norm.shape) != (hidden,) or not norm.is_contiguous():
                    raise CpuKernelError(f"layer {i}'s {name} must be contiguous float32 [{hidden}]")
                self._held.append(norm)
                setattr(self._layers[i], name, norm.data_ptr())
            for name, (n, k) in shapes.items():
                lin: BlockLinear = getattr(layer, name)
                fmt = quant.FORMATS.get(lin.qtype)
                if fmt is None or k % fmt.block or tuple(lin.blocks.shape) != (n, k // fmt.block * fmt.nbytes) \
                        or lin.blocks.dtype != torch.uint8 or not lin.blocks.is_contiguous() or lin.blocks.is_cuda:
                    raise CpuKernelError(f"layer {i}'s {name} must be contiguous uint8 blocks of [{n}, {k}] on the "
                                         f"CPU, got {lin.blocks.dtype} {tuple(lin.blocks.shape)}")
                if lin.int8 and lin.qtype not in quant.INT8_TYPES:
                    raise CpuKernelError(f"layer {i}'s {name}: int8 activations take Q8_0, Q4_0, Q4_1, not {fmt.name}")
                bias = None
                if lin.bias is not None:
                    if tuple(lin.bias.shape) != (n,):
                        raise CpuKernelError(f"layer {i}'s {name} bias must be [{n}], got {tuple(lin.bias.shape)}")
                    bias = lin.bias.detach().float().contiguous()
                    self._held.append(bias)
                self._held.append(lin.blocks)
                setattr(self._layers[i], name, _Gemm(lin.blocks.data_ptr(), None if bias is None else bias.data_ptr(),
                                                     n, lin.blocks.shape[1], lin.qtype, int(lin.int8)))
        self._pools: tuple[list, ctypes.Array, ctypes.Array] | None = None
        self._call = lib.dspark_decoder_f32

    def __call__(
        self,
        x: torch.Tensor,  # [N, hidden] float32, contiguous: the residual stream, updated in place
        cos: torch.Tensor,  # [N, head_dim] float32
        sin: torch.Tensor,  # [N, head_dim] float32
        step: PagedStep,  # the step's attention: its pools (a layer each), indices and table
    ) -> torch.Tensor:  # x
        hidden, heads, kv_heads, head_dim, intermediate = self.dims
        n = x.shape[0]
        if x.dtype != torch.float32 or x.shape != (n, hidden) or not x.is_contiguous() or n != step._step[6]:
            raise CpuKernelError(f"x must be contiguous float32 [{step._step[6]}, {hidden}], got {x.dtype} "
                                 f"{tuple(x.shape)}")
        for t in (cos, sin):
            if t.dtype != torch.float32 or t.shape != (n, head_dim) or not t.is_contiguous():
                raise CpuKernelError(f"cos and sin must be contiguous float32 [{n}, {head_dim}]")
        if len(step.k_pools) != len(self._layers) or step.k_pools[0].shape[1:] != (kv_heads, head_dim):
            raise CpuKernelError(f"the step's pools ({len(step.k_pools)} of {tuple(step.k_pools[0].shape)}) do not "
                                 f"fit {len(self._layers)} layers of {kv_heads} KV heads of {head_dim}")
        if self._pools is None or self._pools[0] is not step.k_pools:  # the runner's lists: built once
            pointers = ctypes.c_void_p * len(self._layers)
            self._pools = (step.k_pools, pointers(*(p.data_ptr() for p in step.k_pools)),
                           pointers(*(p.data_ptr() for p in step.v_pools)))
        write, table, table_numel, base, lo, hi, _, pool_rows = step._step
        code = self._call(self._layers, len(self._layers), self._pools[1], self._pools[2],
                          ctypes.byref(_Step(write, base, lo, hi, table, table_numel, pool_rows)), x.data_ptr(), n,
                          hidden, heads, kv_heads, head_dim, intermediate, self.eps, self.scale, cos.data_ptr(),
                          sin.data_ptr())
        if code != 0:
            raise CpuKernelError(_DECODER_ERRORS.get(code, f"error {code}"))
        return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``Decoder``'s SiLU x up on its own: gate_up [N, 2I] float32 (rows [gate | up]) -> [N, I]."""
    n, width = gate_up.shape
    if gate_up.dtype != torch.float32 or width % 2:
        raise CpuKernelError(f"gate_up must be float32 [N, 2I], got {gate_up.dtype} {tuple(gate_up.shape)}")
    gate_up = gate_up.contiguous()
    out = torch.empty(n, width // 2)
    library().dspark_silu_mul_f32(gate_up.data_ptr(), n, width // 2, out.data_ptr())
    return out


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                    v_pool: torch.Tensor, write_index: torch.Tensor, table: torch.Tensor, key_base: torch.Tensor,
                    key_lo: torch.Tensor, key_hi: torch.Tensor) -> torch.Tensor:
    """One layer of ``PagedStep``: q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]."""
    step = PagedStep([k_pool], [v_pool], write_index, table, key_base, key_lo, key_hi)
    return step(0, q[None], k[None], v[None])[0]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor, window: int) -> torch.Tensor:
    """The first layer of a ``RingStep`` (lengths grown): q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq, D]."""
    return RingStep([k_cache], [v_cache], slots, positions, lengths, window)(0, q, k, v)


# Outputs per packed panel, and rows of x a pass over a panel (PANEL and ROWS in csrc/cpu_gemm.c).
GEMM_PANEL, GEMM_ROWS = 64, 6


def bf16_exact(weight: torch.Tensor) -> bool:
    """Whether a float32 ``weight`` holds bfloat16 values only (a bfloat16 checkpoint loaded in float32),
    so that its bfloat16 copy is the same numbers."""
    return weight.dtype == torch.float32 and torch.equal(weight.to(torch.bfloat16).float(), weight)


class Bf16Gemm:
    """``x @ weight.T (+ bias)`` for a float32 ``weight`` [out, in] of bfloat16 values (``bf16_exact``),
    from a bfloat16 copy packed in column panels (csrc/cpu_gemm.c), every product and sum in float32:
    the float32 matmul, reading half the bytes. For a few rows, where a matmul streams its weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dim() != 2 or not bf16_exact(weight) or weight.is_cuda:
            raise CpuKernelError("Bf16Gemm takes a 2-D float32 CPU weight of bfloat16 values")
        self.out_features, self.in_features = weight.shape
        panels = -(-self.out_features // GEMM_PANEL)
        padded = torch.zeros(panels * GEMM_PANEL, self.in_features, dtype=torch.bfloat16)
        padded[:self.out_features] = weight.detach()
        # [panels, in, PANEL]: each panel one contiguous stream of K rows of PANEL outputs.
        self.packed = padded.view(panels, GEMM_PANEL, self.in_features).transpose(1, 2).contiguous()
        self._call = library().dspark_gemm_bf16w

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.float32 or x.shape[-1] != self.in_features:
            raise CpuKernelError(f"x must be float32 [..., {self.in_features}], got {x.dtype} {tuple(x.shape)}")
        x2 = x.reshape(-1, self.in_features).contiguous()
        y = torch.empty(*x.shape[:-1], self.out_features)
        if bias is not None:
            bias = bias.float().contiguous()
        # One panel widened to float32 for a call of more rows than a pass takes (csrc/cpu_gemm.c ROWS);
        # a buffer per call, so that threads calling one weight at once never share it.
        scratch = torch.empty(self.in_features * GEMM_PANEL) if x2.shape[0] > GEMM_ROWS else None
        self._call(x2.data_ptr(), x2.shape[0], self.in_features, self.packed.data_ptr(), self.out_features,
                   None if bias is None else bias.data_ptr(), y.data_ptr(),
                   None if scratch is None else scratch.data_ptr())
        return y
