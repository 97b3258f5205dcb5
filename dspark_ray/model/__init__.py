"""The model: a Llama-family decoder in plain PyTorch and its checkpoint loader."""

from dspark_ray.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from dspark_ray.model.errors import (
    CheckpointFileMissing,
    ModelLoadError,
    TensorMissing,
    TensorShapeMismatch,
    UnsupportedArchitecture,
    UnsupportedDtype,
)
from dspark_ray.model.llama import CausalAttention, CausalLM
from dspark_ray.model.loader import load

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalAttention",
    "CausalLM",
    "CheckpointFileMissing",
    "ModelConfig",
    "ModelLoadError",
    "RopeScaling",
    "TensorMissing",
    "TensorShapeMismatch",
    "UnsupportedArchitecture",
    "UnsupportedDtype",
    "load",
]
