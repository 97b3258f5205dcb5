"""Loading a local checkpoint into ``CausalLM``: a Hugging Face folder or a GGUF file.

A folder: reads ``config.json``, then either ``model.safetensors`` or the shards
listed in ``model.safetensors.index.json``. A GGUF file: its metadata gives the
config and its tensors are dequantized as they are copied, each rank only its
slice (``dspark_ray.model.gguf``). The module is built on the meta device
and materialised directly in the requested dtype and device, so no random
initialisation is ever computed for weights that are about to be overwritten.
Block-wise FP8 checkpoints (config.json's ``quantization_config``) are
dequantised as they are read, or kept in FP8 on CUDA where a block-scaled
matmul runs (``dspark_ray.model.fp8``).
Every failure is a named ``ModelLoadError`` that says what to fix.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dspark_ray.model.checkpoint import is_gguf, locate, tensor_handles, weight_files
from dspark_ray.model.config import ModelConfig
from dspark_ray.model.gguf import release as release_gguf
from dspark_ray.model.errors import (
    CheckpointFileMissing,
    ModelLoadError,
    TensorMissing,
    TensorShapeMismatch,
    UnsupportedDtype,
)
from dspark_ray.model.cpu_gemm import pack_weights
from dspark_ray.model.fp8 import Fp8Checkpoint, refuse_unscaled_float8
from dspark_ray.model.llama import CausalLM, fuse_projections
from dspark_ray.model.moe import Router
from dspark_ray.model.parallel import TensorParallel, shard_slice
from dspark_ray.model.quantized import attach_gemms, keep_blocks
from dspark_ray.model.rope import rope_inv_freq
from dspark_ray.model.tp import shard

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# GGUF weights: "auto" keeps the file's blocks where a kernel reads them, "int8" too with activations
# rounded to int8 per block (llama.cpp's scheme), "none" dequantizes all.
QUANTIZATION_MODES = ("auto", "int8", "none")

# Tensors some checkpoints carry that this implementation recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype: str | torch.dtype | None, cfg: ModelConfig | None = None) -> torch.dtype:
    """'auto'/None takes the checkpoint's torch_dtype (float32 if unset)."""
    if dtype is None or dtype == "auto":
        dtype = (cfg.torch_dtype if cfg else None) or "float32"
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise UnsupportedDtype(f"dtype {dtype} is not supported; use one of {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise UnsupportedDtype(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def check_device_dtype(device: torch.device, dtype: torch.dtype) -> None:
    """Raise UnsupportedDtype unless a matmul in ``dtype`` runs on ``device``."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UnsupportedDtype(f"device {device} requested but CUDA is not available; use device='cpu'")
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise UnsupportedDtype(f"{device} cannot run bfloat16; use dtype='float16' or 'float32'")
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device)
        (a @ a).sum().item()
    except (RuntimeError, TypeError) as exc:
        raise UnsupportedDtype(f"device {device} cannot run {dtype}: {exc}; choose another dtype") from exc


def load(
    path: str | Path,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    tp: TensorParallel | None = None,
    pack: bool = True,
    quantization: str = "auto",
) -> CausalLM:
    """Load the checkpoint folder at ``path`` as an eval-mode ``CausalLM``.

    Args:
        path: a local folder with config.json and safetensors weights, a .gguf file, or
            ``package:<distribution>/<file>`` (``dspark_ray.model.checkpoint.locate``).
        dtype: 'float32', 'bfloat16', 'float16', a torch dtype, or 'auto'
            (the checkpoint's torch_dtype).
        device: where the weights are placed ('cpu', 'cuda', 'cuda:1', ...).
        tp: this process's tensor-parallel rank; it then reads only its slices.
        pack: on CPU, run the linears on oneDNN-prepacked weights (``cpu_gemm``); False keeps
            torch's own matmul.
        quantization: for a GGUF file, "auto" keeps the file's blocks wherever a kernel reads them
            (``dspark_ray.model.quantized``), "int8" as well and rounds activations to int8 for the
            Q8_0/Q4_0/Q4_1 ones (faster, not bit-faithful), "none" dequantizes every weight into ``dtype``.
    """
    if quantization not in QUANTIZATION_MODES:
        raise ModelLoadError(f"quantization {quantization!r} is not one of {', '.join(QUANTIZATION_MODES)}")
    path = locate(path)
    gguf = is_gguf(path)
    if not gguf and not path.is_dir():
        raise CheckpointFileMissing(f"model path {path} is not a folder or a .gguf file; give a local checkpoint")
    cfg = ModelConfig.from_path(path)
    dtype = resolve_dtype(dtype, cfg)
    device = torch.device(device)
    check_device_dtype(device, dtype)
    files = [] if gguf else weight_files(path)

    with torch.device("meta"):
        model = CausalLM(cfg)
        if tp is not None:
            shard(model, tp)
    model = model.to(dtype)
    _keep_routers_float32(model)
    fp8 = None if gguf else Fp8Checkpoint.open(path, files, model)  # None unless config.json has a quantization_config
    if fp8 is not None:
        fp8.keep_quantized(model, device, dtype)  # CUDA: FP8 weights and scaled matmuls where they run
    kept: set[str] = set()
    if gguf and quantization != "none":  # the file's blocks where a kernel reads them
        kept = keep_blocks(model, dict(tensor_handles(path)), device, dtype)
    model = model.to_empty(device=device)
    # Rotary frequencies stay float32 whatever the weights' dtype: in bfloat16
    # they carry 3 significant digits and angles drift visibly by position ~100.
    model.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    _fill_parameters(model, tensor_handles(path), path, fp8, kept)
    model = fuse_projections(model.eval().requires_grad_(False))
    if kept:
        attach_gemms(model, int8=quantization == "int8")
    if gguf:
        release_gguf()  # the model holds its own copy now; the file's mapped pages may go
    return pack_weights(model) if pack else model


def _keep_routers_float32(model: CausalLM) -> None:
    """DeepSeek-V3's router weight and selection bias stay float32 whatever the model's dtype, as
    transformers keeps them (``_keep_in_fp32_modules_strict``): its sigmoid scores, biased and
    compared across groups, pick other experts when the weight or the bias is rounded to bfloat16."""
    for module in model.modules():
        if isinstance(module, Router) and module.float32:
            module.float()


def _fill_parameters(model: CausalLM, tensors: Iterable[tuple[str, Any]], path: Path,
                     fp8: Fp8Checkpoint | None = None, kept: set[str] = frozenset()) -> None:
    """Copy every checkpoint tensor (``tensors``: name and a slice handle) into its parameter, or for
    GGUF blocks kept (``kept``) this rank's blocks into the module's uint8 buffer."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    params.update({name: buffers[name] for name in kept})
    pending = set(params)
    with tqdm(total=len(params), unit="tensor", desc=f"loading {path.name}",
              disable=None if model.config.num_layers * model.config.hidden_size > 2**17 else True) as bar:
        for name, tensor in tensors:
            if fp8 is not None and fp8.is_companion(name):
                continue  # a scale, read with its weight
            if name not in params:
                if _ignorable(model, name):
                    continue
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} has no place in {model.config.architecture}; "
                    "check that config.json matches the weights"
                )
            if name in kept:
                with torch.no_grad():
                    params[name].copy_(tensor.blocks(shard_slice(model, name, tuple(tensor.get_shape()))))
            else:
                _copy_param(model, name, params[name], tensor, tuple(tensor.get_shape()), fp8)
            pending.discard(name)
            bar.update(1)
    if pending:
        names = sorted(pending)
        raise TensorMissing(
            f"checkpoint at {path} lacks {len(names)} tensor(s) the config needs, e.g. {names[0]!r}"
            + (f" (and {', '.join(repr(n) for n in names[1:4])})" if len(names) > 1 else "")
        )


def _ignorable(model: CausalLM, name: str) -> bool:
    return ((name == "lm_head.weight" and model.lm_head is None) or name.endswith(_IGNORED_SUFFIXES)
            or _multi_token_prediction_layer(model, name))


def _multi_token_prediction_layer(model: CausalLM, name: str) -> bool:
    """DeepSeek-V3 checkpoints store their multi-token-prediction module as the layers after the
    last one (``model.layers.61.*``); decoding does not use it (transformers skips it too)."""
    if model.config.mla is None or not name.startswith("model.layers."):
        return False
    return int(name.split(".")[2]) >= model.config.num_layers


def _copy_param(model: CausalLM, name: str, param: torch.nn.Parameter, tensor, shape: tuple[int, ...],
                fp8: Fp8Checkpoint | None = None) -> None:
    """Copy checkpoint tensor ``name`` (a safetensors slice handle) into ``param``, only this rank's part."""
    index = shard_slice(model, name, shape)
    expected = tuple(param.shape)
    if index is not None:
        dim = next(i for i, s in enumerate(index) if s != slice(None))
        full = list(param.shape)
        full[dim] = param.shape[dim] * _world(model, name)
        expected = tuple(full)
    if shape != expected:
        raise TensorShapeMismatch(
            f"tensor {name!r} has shape {shape} but config.json implies {expected}; "
            "check hidden_size/heads/head_dim in config.json"
        )
    with torch.no_grad():
        if fp8 is not None and fp8.is_quantized(name):
            fp8.copy(model, name, param, tensor, index)
            return
        refuse_unscaled_float8(name, tensor)
        param.copy_(tensor[index] if index is not None else tensor[:])


def _world(model: CausalLM, name: str) -> int:
    return model.get_submodule(name.rpartition(".")[0]).tp.world_size
