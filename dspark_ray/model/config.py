"""ModelConfig: the subset of a Hugging Face config.json the model needs.

Parsed once, validated in ``__post_init__``, frozen afterwards. Field names
follow the Llama family's config.json where one exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dspark_ray.model.errors import CheckpointFileMissing, ModelLoadError, UnsupportedArchitecture

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are rescaled for long contexts (HF ``rope_scaling``)."""

    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("default", "linear", "llama3"):
            raise UnsupportedArchitecture(
                f"rope_scaling type {self.kind!r} is not supported; use none, 'linear' or 'llama3'"
            )
        if self.factor <= 0:
            raise ModelLoadError(f"rope_scaling factor must be > 0, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2; optional in Llama)
    o_proj_bias: bool = False  # Llama's attention_bias also covers o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # Mistral-style attention window, None = full
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitecture(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"config value {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        archs = raw.get("architectures") or []
        if len(archs) != 1:
            raise UnsupportedArchitecture(
                f"config.json must name exactly one architecture, got {archs!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        head_dim = raw.get("head_dim") or hidden // num_heads
        _check_activation(raw)
        attn_bias, o_proj_bias, mlp_bias = _biases(arch, raw)
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(raw),
            rope_scaling=_rope_scaling(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attn_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=mlp_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=_sliding_window(arch, raw),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        )

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise CheckpointFileMissing(
                f"{cfg_file} not found: point the model path at a Hugging Face checkpoint "
                "folder containing config.json and *.safetensors"
            )
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{cfg_file} is not valid JSON: {exc}") from exc
        try:
            return cls.from_dict(raw)
        except KeyError as exc:
            raise ModelLoadError(f"{cfg_file} lacks the required key {exc.args[0]!r}") from exc


def _check_activation(raw: dict) -> None:
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedArchitecture(
            f"hidden_act {act!r} is not supported; the Llama family uses 'silu'"
        )


def _biases(arch: str, raw: dict) -> tuple[bool, bool, bool]:
    """(q/k/v bias, o_proj bias, MLP bias) as each architecture's HF modeling code builds them."""
    if arch == "Qwen2ForCausalLM":  # always biased q/k/v, whatever config.json says
        return True, False, False
    if arch == "MistralForCausalLM":  # never any bias
        return False, False, False
    attn_bias = bool(raw.get("attention_bias", False))  # Llama and Qwen3: q/k/v and o_proj alike
    mlp_bias = bool(raw.get("mlp_bias", False)) and arch == "LlamaForCausalLM"
    return attn_bias, attn_bias, mlp_bias


def _rope_theta(raw: dict) -> float:
    params = raw.get("rope_parameters") or {}
    return float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(raw: dict) -> RopeScaling:
    # transformers 5 folds rope_scaling into rope_parameters; accept both.
    rs = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    return RopeScaling(
        kind=kind,
        factor=float(rs.get("factor", 1.0)),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
    )


def _sliding_window(arch: str, raw: dict) -> int | None:
    window = raw.get("sliding_window")
    if arch == "MistralForCausalLM":
        return window or None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and raw.get("use_sliding_window"):
        raise UnsupportedArchitecture(
            f"{arch} with use_sliding_window=true (per-layer windows) is not supported; "
            "set use_sliding_window to false in config.json"
        )
    return None
