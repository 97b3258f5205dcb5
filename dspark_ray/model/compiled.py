"""The decoder's forward pass compiled by ``torch.compile`` (Inductor) on CPU: fewer, fused ops per step.

On the small models of a CPU box a step's time is mostly the number of ops,
not their arithmetic: the shipped target's pass over 5 tokens is ~36M
multiply-adds, under a millisecond of one core's float32 throughput, yet
eager PyTorch took ~3.5 ms for it (each RMSNorm is eight ops, each rotary
embedding ten, each op a few microseconds of dispatch). Inductor fuses each
run of elementwise ops between two matmuls (norm, rotary, SiLU x up, the
residual adds) into one generated C++ loop and calls the rest straight from
its wrapper. What it must not touch is left opaque, as two custom ops:

- ``dspark::linear``: every matmul runs the model's own kernel
  (``cpu_gemm.PackedGemm``: oneDNN's prepacked weight, or torch's matmul for
  small calls; the GGUF block kernels), so the matmuls' results are the eager
  path's bit for bit. It takes the linear's weight tensor, which names its
  kernel in a registry, so the graph holds no per-layer constant;
- ``dspark::attention``: the attention callable of the current pass (the
  target's paged ``PackedAttention``, the draft's window-cache
  ``RingAttention``), which reads and writes the engine's caches in Python.
  ``CompiledForward`` hands the pass's callable over through a thread-local,
  so one compiled graph serves every step whatever its rows.

Only the fused elementwise code differs from eager: a reduction's order (the
RMSNorm's mean) and fused multiply-adds move logits by ~1e-5, so greedy
output can differ from the eager model's where two tokens' logits tie to
that precision (speculation stays lossless: draft and target are each
compiled or not, and the target decides every token). Every row is computed
alone (per-row reductions, the same matmul kernels), so a request's tokens do
not depend on its neighbours any more than in eager.

The model is compiled by regions (``CompiledForward``): the embedding, the
layers in groups of up to ``LAYER_GROUP``, the final norm. Identical layers
share one graph, so a 30-layer model builds the code of 6 layers, not 30:
SmolLM2-135M's cold start (1 thread, the 2-core box) took 116 s as one graph
and 42 s in groups of 6, at about the same step time.

Shapes are dynamic: the first call with a dimension other than 1 compiles a
graph for every size of it (torch specialises sizes 0 and 1, so a draft at
one row and one token has graphs of its own); ``warm_up`` compiles them at
load time, not on a request's path. Compiled code is cached on disk by
Inductor (``TORCHINDUCTOR_CACHE_DIR``, by default under the system's temp
folder): a restart on the same machine loads it in seconds.

Measured on the 2-core development box (1 thread, shipped pair, float32,
mean of 100 calls, eager with the packed matmuls against compiled): the
target's pass over 5 tokens 3.07 -> 2.52 ms, 20 tokens 5.45 -> 4.43 ms; the
draft's pass at one row 0.68 -> 0.58 ms, four rows of one token 0.80 -> 0.73
ms. A small pass is now mostly its matmuls streaming float32 weights from
the cache (bench/HISTORY.md, nineteenth session).

Not for tensor parallelism (the all-reduces stay eager), mixture-of-experts
or latent-attention layers, or CUDA (``compile_model`` refuses them).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sysconfig
import threading
import time
import weakref
from collections.abc import Callable

import torch

from dspark_ray.model.quantized import follow_torch_threads

log = logging.getLogger(__name__)

_local = threading.local()
# (weight's data pointer, out features) -> (x -> matmul(x, bias), matmul, weight): the weight held, so
# that its memory (and so its key) cannot be taken by another tensor while the entry stands.
_gemms: dict[tuple[int, int], tuple[Callable, Callable, torch.Tensor]] = {}
_lock = threading.Lock()


# The two ops, defined through torch.library's plain registration rather than ``torch.library.custom_op``,
# whose Python wrappers (aliasing checks, a Dynamo-disable layer) cost 3.5-4 us a call against 1.6 here
# (the 2-core box): a step of the shipped pair makes about 80 of these calls.
_lib = torch.library.Library("dspark", "FRAGMENT")
_lib.define("attention(Tensor q, Tensor k, Tensor v, SymInt layer) -> Tensor")
_lib.define("linear(Tensor x, Tensor weight) -> Tensor")


def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return _local.attention(layer, q, k, v).contiguous()


def _linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _gemms[weight.data_ptr(), weight.shape[0]][0](x)


_lib.impl("attention", _attention_op, "CPU")
_lib.impl("linear", _linear_op, "CPU")


@torch.library.register_fake("dspark::attention")
def _(q, k, v, layer):
    return q.new_empty(q.shape)


@torch.library.register_fake("dspark::linear")
def _(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The attention the compiled graph calls: the current pass's callable, behind the custom op."""
    return torch.ops.dspark.attention(q, k, v, layer)


class _OpGemm:
    """Stands in a linear's ``gemm``: its matmul behind ``dspark::linear`` (the graph sees one opaque op)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.dspark.linear(x, self.weight)


def _key(weight: torch.Tensor) -> tuple[int, int]:
    return weight.data_ptr(), weight.shape[0]


def _bound(matmul: Callable, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> matmul(x, bias)``, contiguous as the op's fake says: the matmul's own short path where it
    has one (``bind``: the GGUF block kernels, ~150 calls a decode step), else a plain closure."""
    if hasattr(matmul, "bind"):
        return matmul.bind(bias)
    return lambda x: matmul(x, bias).contiguous()


def _register(matmul: Callable, bias: torch.Tensor | None, weight: torch.Tensor) -> tuple[int, int]:
    key = _key(weight)
    with _lock:
        if key in _gemms and _gemms[key][1] is not matmul:
            raise ValueError(f"compile_model: two matmuls on one weight ({tuple(weight.shape)})")
        if key not in _gemms:
            _gemms[key] = (_bound(matmul, bias), matmul, weight)
    return key


def _forget(keys: list[tuple[int, int]]) -> None:
    with _lock:
        for key in keys:
            _gemms.pop(key, None)


def cxx_compiler() -> str | None:
    """The C++ compiler Inductor would use here (``CXX``, else ``g++``, else ``c++``), or None."""
    return next((found for name in (os.environ.get("CXX"), "g++", "c++") if name and (found := shutil.which(name))),
                None)


def missing_toolchain() -> str | None:
    """What torch.compile on CPU lacks here, or None: a C++ compiler, and this Python's headers
    (Inductor builds its kernels as Python extension modules)."""
    if cxx_compiler() is None:
        return "no C++ compiler (g++ or c++ on PATH, or CXX)"
    include = sysconfig.get_paths()["include"]
    if not os.path.isfile(os.path.join(include, "Python.h")):
        return f"no Python headers ({include}/Python.h; Debian: python3-dev)"
    return None


def unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot be compiled, or None."""
    from dspark_ray.model.layers import Linear
    from dspark_ray.model.llama import MLP, CausalLM, SelfAttention

    if type(model) is not CausalLM:
        return f"{type(model).__name__} is not the plain decoder"
    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"the model is on {param.device}, and compile_model is for CPU"
    for layer in model.model.layers:
        if not isinstance(layer.self_attn, SelfAttention) or type(layer.ffn) is not MLP:
            return "its layers are not plain attention + MLP (mixture of experts or latent attention)"
        attn, ffn = layer.self_attn, layer.ffn
        if any(type(linear) is not Linear for linear in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                                                           ffn.gate_proj, ffn.up_proj, ffn.down_proj)):
            return "its linears are sharded (tensor parallelism)"
    return None


# Layers per compiled call (``layer_group``): a graph of this many layers is traced, lowered and built
# once and serves every group of the model. One graph of all of SmolLM2's 30 layers took 116 s to build
# cold on the 2-core box (one thread), one layer at a time 25 s but ~3 ms more a step (a compiled call's
# guards and wrappers, ~100 us each); groups of 6 took 42 s and cost about what the whole graph does.
LAYER_GROUP = 8


def layer_group(layers: int) -> int:
    """How many layers each compiled call runs: all of them up to ``LAYER_GROUP``; else the largest
    divisor of ``layers`` from ``LAYER_GROUP // 2`` to ``LAYER_GROUP`` (one graph for every group), else
    ``LAYER_GROUP`` (a shorter last group: a second graph)."""
    if layers <= LAYER_GROUP:
        return max(layers, 1)
    return next((d for d in range(LAYER_GROUP, LAYER_GROUP // 2 - 1, -1) if layers % d == 0), LAYER_GROUP)


class CompiledForward:
    """``model.hidden_states`` without taps, compiled by regions; installed as ``model.compiled`` by
    ``compile_model``: the embedding and rotary tables, then the layers in groups of ``layer_group``,
    then the final norm, each a compiled function whose graphs every model in the process shares (a
    model's parameters are its graphs' inputs, not constants in them: Dynamo's inlined nn.Modules,
    and ``dspark::linear`` taking the weight)."""

    def __init__(self, model: torch.nn.Module) -> None:
        # Dynamo keeps one list of graphs per code object, shared by every model in the process: a
        # worker's target and draft, each with a graph per specialisation (1 or more rows, 1 or more
        # tokens) and group length, would pass the default limit of 8 and fall back to eager for good.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.model = model
        layers = list(model.model.layers)
        size = layer_group(len(layers))
        self._groups = [(start, tuple(layers[start:start + size])) for start in range(0, len(layers), size)]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Callable) -> torch.Tensor:
        previous = getattr(_local, "attention", None)
        _local.attention = attention
        follow_torch_threads()  # the kernels' pool, which the bound block matmuls no longer check (_bound)
        try:
            # Contiguous: an expanded view (stride 0) would be a graph of its own.
            embed, layers, norm = _compiled()
            x, cos, sin = embed(self.model, input_ids.contiguous(), positions.contiguous())
            for start, group in self._groups:
                x = layers(group, start, x, cos, sin)
            return norm(self.model.model.norm, x)
        finally:
            _local.attention = previous


def _embed(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor):
    x = model.model.embed_tokens(input_ids)
    cos, sin = model.rope(positions, x.dtype)
    return x, cos, sin


def _layers(layers: tuple, start: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    for j, layer in enumerate(layers):
        x = layer(start + j, x, cos, sin, _attend)  # start: a symbolic int, one graph for every group
    return x


def _norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return norm(x)


@functools.cache
def _compiled() -> tuple[Callable, Callable, Callable]:
    """The three compiled regions, made once per process (Dynamo is imported on first use)."""
    return tuple(torch.compile(fn, dynamic=True) for fn in (_embed, _layers, _norm))


def compile_model(model: torch.nn.Module) -> bool:
    """Route ``model``'s matmuls through ``dspark::linear`` and compile its forward (module docstring);
    in place, after ``pack_weights``. Raises ValueError for a model it cannot compile (``unsupported``).
    Without a C++ compiler on the machine it logs a warning and leaves the model eager. Returns
    whether the model is compiled."""
    from dspark_ray.model.layers import FusedLinears, Linear

    reason = unsupported(model)
    if reason is not None:
        raise ValueError(f"compile_model: {reason}; set compile_model: false")
    lacking = missing_toolchain()
    if lacking is not None:
        log.warning("compile_model: %s here, which torch.compile needs on CPU; the model runs eager "
                    "(deploy/setup.sh installs both where it can)", lacking)
        return False
    keys: list[tuple[int, int]] = []
    for module in model.modules():
        owners = [module] if isinstance(module, Linear) else []
        owners += [value for value in vars(module).values() if isinstance(value, FusedLinears)]
        # A linear with a matmul of its own (cpu_gemm's PackedGemm) keeps it, behind the opaque op; one
        # without (no oneDNN for its dtype here) is plain F.linear, which Inductor compiles itself.
        for owner in owners:
            if owner.gemm is not None and not isinstance(owner.gemm, _OpGemm):
                keys.append(_register(owner.gemm, owner.bias, owner.weight))
                owner.gemm = _OpGemm(owner.weight)
    weakref.finalize(model, _forget, keys)
    model.compiled = CompiledForward(model)
    return True


def warm_up(model: torch.nn.Module, shapes: list[tuple[int, int]]) -> float:
    """Compile ``model``'s graphs now for inputs of these ``[rows, tokens]`` shapes (one per
    specialisation: a dimension of 1, or of more), over a throwaway attention; returns the seconds.
    Should compiling fail (a broken toolchain), logs why and leaves the model eager."""
    from dspark_ray.model.llama import CausalAttention

    if model.compiled is None:
        return 0.0
    start = time.perf_counter()
    param = next(model.parameters())
    try:
        with torch.inference_mode():
            for rows, tokens in shapes:
                ids = torch.zeros(rows, tokens, dtype=torch.int64, device=param.device)
                positions = torch.arange(tokens, device=param.device).expand(rows, tokens)
                model.compiled(ids, positions, CausalAttention())
    except Exception:  # noqa: BLE001 - the eager forward computes the same; only speed is lost
        log.exception("compile_model: compiling %s's forward failed; it runs eager", model.config.architecture)
        model.compiled = None
        return 0.0
    seconds = time.perf_counter() - start
    log.info("compiled %s's forward for shapes %s in %.1f s", model.config.architecture, shapes, seconds)
    return seconds
