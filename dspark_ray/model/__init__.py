"""The model: a Llama-family decoder (dense or mixture-of-experts) in plain PyTorch and its loader."""

from dspark_ray.model.config import SUPPORTED_ARCHITECTURES, MlaConfig, ModelConfig, MoeConfig, RopeScaling
from dspark_ray.model.errors import (
    CheckpointFileMissing,
    ContextTooLong,
    ModelLoadError,
    TensorMissing,
    TensorShapeMismatch,
    UnsupportedArchitecture,
    UnsupportedDtype,
    UnsupportedQuantization,
)
from dspark_ray.model.llama import CausalAttention, CausalLM
from dspark_ray.model.loader import load

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalAttention",
    "CausalLM",
    "CheckpointFileMissing",
    "ContextTooLong",
    "MlaConfig",
    "ModelConfig",
    "ModelLoadError",
    "MoeConfig",
    "RopeScaling",
    "TensorMissing",
    "TensorShapeMismatch",
    "UnsupportedArchitecture",
    "UnsupportedDtype",
    "UnsupportedQuantization",
    "load",
]
