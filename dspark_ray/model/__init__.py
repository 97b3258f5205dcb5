"""The model: a Llama-family decoder (dense or mixture-of-experts) in plain PyTorch and its loader,
and DSpark's block drafter (``dspark``), which shares the target's embeddings and LM head."""

from dspark_ray.model.config import SUPPORTED_ARCHITECTURES, MlaConfig, ModelConfig, MoeConfig, RopeScaling
from dspark_ray.model.dspark import DSparkConfig, DSparkDraft, TargetHeads, is_dspark_checkpoint, load_dspark
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
    "DSparkConfig",
    "DSparkDraft",
    "MlaConfig",
    "ModelConfig",
    "ModelLoadError",
    "MoeConfig",
    "RopeScaling",
    "TargetHeads",
    "TensorMissing",
    "TensorShapeMismatch",
    "UnsupportedArchitecture",
    "UnsupportedDtype",
    "UnsupportedQuantization",
    "is_dspark_checkpoint",
    "load",
    "load_dspark",
]
