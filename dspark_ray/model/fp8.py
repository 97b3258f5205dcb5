"""Block-wise FP8 checkpoints: the Hugging Face layout of DeepSeek-V3 and Qwen3-FP8.

The format (transformers' ``FineGrainedFP8Config`` and ``integrations/finegrained_fp8``):
config.json carries

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                            "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

and each quantised linear's weight W [out, in] is stored as float8_e4m3fn beside
``<module>.weight_scale_inv`` [ceil(out/bo), ceil(in/bi)] float32, one inverse scale per
(bo x bi) block, the last block row and column possibly partial:

    W[i, j] ~= float(W_fp8[i, j]) * weight_scale_inv[i // bo, j // bi]

Modules matched by ``modules_to_not_convert`` (typically the LM head, the MoE routers) are stored
unquantised, as are embeddings and norms. With ``activation_scheme`` "static" every quantised
linear also carries a per-tensor ``input_scale`` (transformers: ``activation_scale``).

How the model holds the weights:

- CPU, and CUDA wherever the block-scaled matmul cannot run: dequantised at load into the model
  dtype; the model is then an ordinary one. Activations are never quantised on this path, so
  neither activation scheme changes its output (static input scales are checked, then unused).
- CUDA on sm90 with torch's ``F.scaled_mm`` (cuBLAS block scaling, CUDA >= 12.9): a linear whose
  128 x 128 blocks line up with its shard keeps W in FP8 with its scales, and multiplies through
  ``Fp8Gemm``: activations quantised on the fly per 1 x 128 group (the "dynamic" scheme, as
  transformers' and DeepSeek's kernels do; a "static" checkpoint's input scales are not used)
  and one block-scaled FP8 matmul. A linear whose slice is not whole 128 x 128 blocks is
  dequantised instead, so on CUDA the tensor-parallel split can decide which linears also
  quantise their activations, and so the output within FP8's error.

Tensor parallelism: a rank reads only its slice of W and the block rows (or columns) of the scale
that cover it; a shard boundary inside a block is exact, since the slice's offset within its
first block is kept when the scales are expanded.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from dspark_ray.model.errors import TensorShapeMismatch, UnsupportedQuantization

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_SAFETENSORS_FP8 = {"F8_E4M3": "e4m3", "F8_E5M2": "e5m2", "F8_E4M3FNUZ": "e4m3fnuz", "F8_E5M2FNUZ": "e5m2fnuz"}
_INPUT_SCALES = (".input_scale", ".activation_scale")  # vLLM's and transformers' names for a static scale


@dataclass(frozen=True)
class Fp8Config:
    """config.json's ``quantization_config`` for block-wise FP8, validated."""

    block: tuple[int, int]  # (rows, columns) of weight that share one scale
    activation_scheme: str = "dynamic"  # dynamic | static
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, raw: object) -> Fp8Config:
        """Validate ``raw`` (the ``quantization_config`` object); UnsupportedQuantization names the field."""
        if not isinstance(raw, dict):
            raise _config_error(f"quantization_config must be an object, got {raw!r}")
        method = raw.get("quant_method")
        if method != "fp8":
            raise _config_error(
                f"quantization_config.quant_method {method!r} is not supported; only 'fp8' (block-wise FP8, "
                "the DeepSeek-V3 / Qwen3-FP8 layout) loads; use an unquantised or an FP8 checkpoint"
            )
        fmt = raw.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise _config_error(f"quantization_config.fmt {fmt!r} is not supported; FP8 weights load as 'e4m3' only")
        scale_fmt = raw.get("scale_fmt", "float")
        if scale_fmt != "float":
            raise _config_error(
                f"quantization_config.scale_fmt {scale_fmt!r} is not supported; the scales must be 'float' (float32)"
            )
        block = raw.get("weight_block_size", [128, 128])
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise _config_error(
                f"quantization_config.weight_block_size must be two positive integers such as [128, 128], "
                f"got {block!r} (per-tensor FP8 is not supported)"
            )
        scheme = str(raw.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise _config_error(
                f"quantization_config.activation_scheme {raw.get('activation_scheme')!r} is not supported; "
                "use 'dynamic' or 'static'"
            )
        skip = raw.get("modules_to_not_convert") or raw.get("ignored_layers") or []
        if not isinstance(skip, (list, tuple)) or not all(isinstance(s, str) for s in skip):
            raise _config_error(
                f"quantization_config.modules_to_not_convert must be a list of module names, got {skip!r}"
            )
        return cls(block=(block[0], block[1]), activation_scheme=scheme, modules_to_not_convert=tuple(skip))

    def converts(self, module: str) -> bool:
        """Whether ``module`` (e.g. 'model.layers.0.mlp.gate') is quantised: not matched by
        ``modules_to_not_convert`` as transformers' ``should_convert_module`` matches it (a prefix or a
        regular expression ending at a module boundary, or a suffix)."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return not any(re.match(rf"(?:{key}){boundary}", module) or module.endswith(key)
                       for key in self.modules_to_not_convert)


def _config_error(message: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(f"{message} (config.json)")


# -- the format ---------------------------------------------------------------------------------


def scale_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The shape of ``weight_scale_inv`` for a weight of ``shape``: one entry per (partial) block."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def quantize(
    weight: torch.Tensor,  # [N, K], any float dtype
    block: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:  # W_fp8 [N, K] float8_e4m3fn, weight_scale_inv [ceil(N/bo), ceil(K/bi)] float32
    """Quantise as FP8 checkpoints are written: per block, scale_inv = amax / 448 (1 for an all-zero
    block) and W / scale_inv rounded to e4m3. The reference the tests write their checkpoints with."""
    n, k = weight.shape
    gn, gk = scale_grid((n, k), block)
    padded = F.pad(weight.float(), (0, gk * block[1] - k, 0, gn * block[0] - n))
    blocks = padded.reshape(gn, block[0], gk, block[1])
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(gn * block[0], gk * block[1])[:n, :k].contiguous(), scale_inv


def dequantize(
    weight: torch.Tensor,  # [n, k] float8_e4m3fn: a whole weight or one rank's slice of it
    scale_inv: torch.Tensor,  # [gn, gk] float32: the scale blocks covering ``weight``
    block: tuple[int, int],
    offset: tuple[int, int] = (0, 0),  # where ``weight`` starts within its first block (rows, columns)
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [n, k] in ``dtype``
    """float(W_fp8) times its block's inverse scale, computed in float32."""
    n, k = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[offset[0]:offset[0] + n]
    scale = scale.repeat_interleave(block[1], 1)[:, offset[1]:offset[1] + k]
    assert scale.shape == (n, k), (scale.shape, weight.shape, scale_inv.shape, offset)
    return (weight.float() * scale).to(dtype)


def scale_index(
    index: tuple[slice, ...] | None,  # the weight slice a rank reads (parallel.shard_slice), None = whole
    shape: tuple[int, int],  # the full weight's shape
    block: tuple[int, int],
) -> tuple[tuple[slice, slice], tuple[int, int]]:
    """(the slice of weight_scale_inv covering that weight slice, the slice's offset within its first block)."""
    index = index or (slice(None), slice(None))
    scale_slices, offsets = [], []
    for sl, size, b in zip(index, shape, block):
        start, stop, _ = sl.indices(size)
        scale_slices.append(slice(start // b, math.ceil(stop / b)))
        offsets.append(start - (start // b) * b)
    return (scale_slices[0], scale_slices[1]), (offsets[0], offsets[1])


# -- the checkpoint -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Quantized:
    shape: tuple[int, int]  # the full weight's
    scale_name: str
    scale_file: Path


class Fp8Checkpoint:
    """The FP8 weights of a checkpoint folder, their scales and where they are.

    ``open`` validates the whole checkpoint against config.json before any weight is read; the
    loader then skips the scales (``is_companion``) and copies each quantised weight with ``copy``,
    which reads the matching scale blocks and dequantises this rank's slice, or keeps it FP8 for
    ``Fp8Gemm`` where ``keep_quantized`` arranged that.
    """

    def __init__(self, config: Fp8Config, quantized: dict[str, _Quantized], companions: set[str]) -> None:
        self.config = config
        self.quantized = quantized  # weight name -> its shape and scale
        self.companions = companions  # scales and input scales: read with their weight, or unused

    @classmethod
    def open(cls, path: Path, files: list[Path], model: nn.Module) -> Fp8Checkpoint | None:
        """The checkpoint's FP8 layout, None if config.json has no quantization_config.

        Raises UnsupportedQuantization (or TensorShapeMismatch for a scale of the wrong shape) when the
        config or the tensors do not fit the format; float8 tensors without a quantization_config
        are refused by the loader (``refuse_unscaled_float8``).
        """
        raw = json.loads((path / "config.json").read_text()).get("quantization_config")
        if raw is None:
            return None
        config = Fp8Config.from_dict(raw)
        headers = {}  # name -> (file, safetensors dtype, shape)
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    headers[name] = (file, sl.get_dtype(), tuple(sl.get_shape()))
        quantized = {}
        for name, (_, dtype, shape) in headers.items():
            if dtype in _SAFETENSORS_FP8:
                quantized[name] = _check_weight(name, dtype, shape, headers, config, model)
        scales = {q.scale_name for q in quantized.values()}
        for name in headers:
            if name.endswith("_scale_inv") and name not in scales:
                weight = name.removesuffix("_scale_inv")
                raise UnsupportedQuantization(
                    f"checkpoint tensor {name!r} is a scale but {weight!r} is not stored as float8; "
                    "re-export the checkpoint (its weights and scales do not match)"
                )
        companions = scales | {n for n in headers if n.endswith(_INPUT_SCALES)}
        return cls(config, quantized, companions)

    def is_companion(self, name: str) -> bool:
        """A scale that is read together with its weight, or an input scale (not needed), not a parameter."""
        return name in self.companions

    def is_quantized(self, name: str) -> bool:
        return name in self.quantized

    def keep_quantized(self, model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        """Where ``Fp8Gemm`` can run, give each quantised linear an FP8 weight and a ``weight_scale_inv``
        buffer (this rank's shapes) instead of a weight in ``dtype``; the others are dequantised at load.
        Run on the meta model, after ``.to(dtype)`` and before ``.to_empty``."""
        from dspark_ray.model.layers import Linear
        from dspark_ray.model.parallel import shard_slice

        if not Fp8Gemm.available(device, dtype):
            return
        for name, q in self.quantized.items():
            try:
                module = model.get_submodule(name.removesuffix(".weight"))
            except AttributeError:
                continue  # no such module: the loader names the tensor that has no place
            if not isinstance(module, Linear) or not Fp8Gemm.fits(q.shape, shard_slice(model, name, q.shape),
                                                                  self.config.block):
                continue
            local = tuple(module.weight.shape)
            module.weight = nn.Parameter(torch.empty(local, dtype=FP8, device="meta"), requires_grad=False)
            module.register_buffer("weight_scale_inv", torch.empty(scale_grid(local, self.config.block), device="meta"))
            module.gemm = Fp8Gemm(module)

    def copy(self, model: nn.Module, name: str, param: torch.Tensor, tensor, index: tuple[slice, ...] | None) -> None:
        """Fill ``param`` with this rank's slice (``index``) of quantised weight ``name`` (``tensor``: its
        safetensors slice handle): FP8 as stored, with its scales, or dequantised into ``param``'s dtype."""
        q = self.quantized[name]
        weight = (tensor[index] if index is not None else tensor[:]).to(param.device)
        rows_cols, offset = scale_index(index, q.shape, self.config.block)
        with safe_open(str(q.scale_file), framework="pt") as f:
            scale = f.get_slice(q.scale_name)[rows_cols].to(device=param.device, dtype=torch.float32)
        if param.dtype == FP8:
            param.copy_(weight)
            model.get_submodule(name.removesuffix(".weight")).weight_scale_inv.copy_(scale)
        else:
            param.copy_(dequantize(weight, scale, self.config.block, offset, param.dtype))


def _check_weight(name: str, dtype: str, shape: tuple[int, ...], headers: dict, config: Fp8Config,
                  model: nn.Module) -> _Quantized:
    """Validate one float8 tensor of the checkpoint against the format and the model."""
    if dtype != "F8_E4M3":
        raise UnsupportedQuantization(
            f"checkpoint tensor {name!r} is {_SAFETENSORS_FP8[dtype]} but quantization_config.fmt is 'e4m3'; "
            "only e4m3 FP8 weights load"
        )
    module_name = name.removesuffix(".weight")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        module = None
    if not name.endswith(".weight") or len(shape) != 2 or (module is not None and not isinstance(module, nn.Linear)):
        raise UnsupportedQuantization(
            f"checkpoint tensor {name!r} is float8 but only the weights of linear layers may be; "
            "re-export the checkpoint with it unquantised (quantization_config.modules_to_not_convert)"
        )
    if not config.converts(module_name):
        raise UnsupportedQuantization(
            f"quantization_config.modules_to_not_convert matches {module_name!r} but the checkpoint stores "
            f"{name!r} as float8; remove it from modules_to_not_convert or store the weight unquantised"
        )
    scale_name = name + "_scale_inv"
    if scale_name not in headers:
        raise UnsupportedQuantization(
            f"checkpoint tensor {name!r} is float8 but its scale {scale_name!r} is missing; "
            "an FP8 checkpoint stores one weight_scale_inv per quantised weight"
        )
    scale_file, _, scale_shape = headers[scale_name]
    if scale_shape != scale_grid(shape, config.block):
        raise TensorShapeMismatch(
            f"scale {scale_name!r} has shape {scale_shape} but weight {shape} in blocks of "
            f"quantization_config.weight_block_size {list(config.block)} needs {scale_grid(shape, config.block)}; "
            "check weight_block_size in config.json"
        )
    if config.activation_scheme == "static" and not any(module_name + s in headers for s in _INPUT_SCALES):
        raise UnsupportedQuantization(
            f"quantization_config.activation_scheme is 'static' but {module_name!r} has no input scale "
            f"({module_name}.input_scale); use 'dynamic' or a checkpoint with its input scales"
        )
    return _Quantized(shape, scale_name, scale_file)


def refuse_unscaled_float8(name: str, tensor) -> None:
    """Raise UnsupportedQuantization if checkpoint tensor ``name`` (a safetensors slice handle) is float8:
    without a quantization_config its scale is unknown, and a plain cast would be silently wrong."""
    if tensor.get_dtype() in _SAFETENSORS_FP8:
        raise UnsupportedQuantization(
            f"checkpoint tensor {name!r} is stored as float8 but config.json has no quantization_config; "
            "add the checkpoint's quantization_config (quant_method 'fp8', weight_block_size) to config.json"
        )


# -- the CUDA matmul ----------------------------------------------------------------------------


def quantize_activations(
    x: torch.Tensor,  # [M, K], K a multiple of 128
) -> tuple[torch.Tensor, torch.Tensor]:  # x_fp8 [M, K] float8_e4m3fn, scale [M, K/128] float32
    """Dynamic activation quantisation: one scale (amax / 448) per row and 128 columns."""
    groups = x.float().unflatten(-1, (-1, 128))
    scale = groups.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    return (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).flatten(-2), scale


def fp8_linear_reference(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale_inv: torch.Tensor,  # [N/128, K/128] float32
) -> torch.Tensor:  # [M, N] float32
    """What ``Fp8Gemm`` computes, in plain float32: both operands quantised and dequantised, then multiplied."""
    xq, xs = quantize_activations(x)
    x_deq = dequantize(xq, xs, (1, 128))
    return x_deq @ dequantize(weight, scale_inv, (128, 128)).T


class Fp8Gemm:
    """``x @ W.T (+ bias)`` for a linear holding W [N, K] in FP8 and its ``weight_scale_inv`` [N/128, K/128],
    as one block-scaled matmul (``F.scaled_mm``, 1 x 128 activation and 128 x 128 weight scales).

    The ``gemm`` protocol of ``llama.Linear`` (and ``cpu_gemm.PackedGemm``): tensor-parallel linears
    all-reduce its output as they would their own. Off CUDA it computes its reference,
    ``fp8_linear_reference`` (the same quantised operands in float32), so the path can be run and
    tested on CPU; only ``F.scaled_mm`` itself needs the GPU.
    """

    BLOCK = (128, 128)

    def __init__(self, linear: nn.Linear) -> None:
        self.linear = linear  # read at each call: to_empty and loading replace its tensors

    @staticmethod
    def available(device: torch.device, dtype: torch.dtype) -> bool:
        """cuBLAS's block-scaled FP8 matmul through torch runs here: sm90, CUDA >= 12.9, output ``dtype``."""
        if device.type != "cuda" or not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
            return False
        cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
        return (cuda >= (12, 9) and dtype in (torch.bfloat16, torch.float32)
                and torch.cuda.get_device_capability(device) == (9, 0))

    @classmethod
    def fits(cls, shape: tuple[int, int], index: tuple[slice, ...] | None, block: tuple[int, int]) -> bool:
        """The weight's 128 x 128 blocks line up with this rank's slice of it (else it is dequantised)."""
        if tuple(block) != cls.BLOCK:
            return False
        index = index or (slice(None), slice(None))
        bounds = [sl.indices(size)[:2] for sl, size in zip(index, shape)]
        return all(start % 128 == 0 and stop % 128 == 0 for start, stop in bounds)

    def __call__(
        self,
        x: torch.Tensor,  # [..., K] bfloat16 or float32
        bias: torch.Tensor | None = None,  # [N]
    ) -> torch.Tensor:  # [..., N] in x's dtype
        weight, scale_inv = self.linear.weight, self.linear.weight_scale_inv
        assert weight.dtype == FP8 and weight.is_contiguous() and scale_inv.dtype == torch.float32
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        if not weight.is_cuda:
            y = fp8_linear_reference(x2, weight, scale_inv).to(x.dtype)
        else:
            x2 = F.pad(x2, (0, 0, 0, -m % 4))  # cuBLAS wants the activation scales' rows in fours
            xq, xs = quantize_activations(x2)
            # cuBLAS's layouts: activation scales outer-dim-major [M, K/128]; weight scales
            # [round4(K/128), N/128] K-major: weight_scale_inv padded to 4 columns, transposed (a view).
            ws = F.pad(scale_inv, (0, -scale_inv.shape[1] % 4))
            y = F.scaled_mm(xq, weight.t(), xs.t().contiguous().t(), F.ScalingType.BlockWise1x128,
                            ws.t(), F.ScalingType.BlockWise128x128, output_dtype=x.dtype)[:m]
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, -1)
