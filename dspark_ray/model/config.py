"""ModelConfig: the subset of a Hugging Face config.json the model needs.

Parsed once, validated in ``__post_init__``, frozen afterwards. Field names
follow the Llama family's config.json where one exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from dspark_ray.model.errors import ModelLoadError, UnsupportedArchitecture

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "DeepseekV3ForCausalLM",
)


ROPE_KINDS = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are rescaled for long contexts (HF ``rope_scaling``); the
    frequencies each kind gives are in ``dspark_ray.model.rope``."""

    kind: str = "default"  # default | linear | dynamic | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn: the context the model was pretrained with
    beta_fast: float = 32.0  # yarn: dimensions turning more often than this in that context keep their frequency
    beta_slow: float = 1.0  # yarn: those turning less often than this are interpolated by factor
    mscale: float | None = None  # yarn: with mscale_all_dim, sets the attention factor (DeepSeek-V3)
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn: cos/sin multiplier; None = derived from factor and mscale
    truncate: bool = True  # yarn: round the ends of the interpolation ramp to whole dimensions

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise UnsupportedArchitecture(
                f"rope_scaling type {self.kind!r} is not supported; use none, 'linear', 'dynamic', 'llama3' or 'yarn'"
            )
        if not self.factor > 0 or math.isinf(self.factor):
            raise ModelLoadError(f"rope_scaling factor must be > 0, got {self.factor}; fix rope_scaling in config.json")
        if self.kind in ("llama3", "yarn") and self.original_max_position_embeddings <= 0:
            raise ModelLoadError(
                "rope_scaling original_max_position_embeddings must be positive, got "
                f"{self.original_max_position_embeddings}; fix rope_scaling in config.json"
            )
        for name in ("beta_fast", "beta_slow", "attention_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ModelLoadError(f"rope_scaling {name} must be > 0, got {value}; fix rope_scaling in config.json")


@dataclass(frozen=True)
class MoeConfig:
    """The routed experts of a mixture-of-experts model (dspark_ray/model/moe.py).

    Router settings for training only (Mixtral's ``router_jitter_noise``, the
    auxiliary-loss coefficients) do not change inference and are not read.
    """

    num_experts: int  # experts per sparse layer (num_experts; Mixtral: num_local_experts)
    top_k: int  # experts per token (num_experts_per_tok)
    intermediate_size: int  # each expert's MLP width (moe_intermediate_size; Mixtral: intermediate_size)
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1 (Mixtral: always)
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (those stay dense)
    first_dense: int = 0  # ... and i >= first_dense (DeepSeek-V3: first_k_dense_replace)
    # DeepSeek-V3's router: sigmoid scores plus a per-expert selection bias (e_score_correction_bias),
    # experts in n_group groups of which each token may use topk_group (ranked by their two best
    # scores), the chosen weights times routed_scaling_factor. False: softmax over all experts.
    grouped_sigmoid: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0  # an always-on shared expert this wide (0: none)

    def __post_init__(self) -> None:
        for name, key in (("num_experts", "num_experts"), ("top_k", "num_experts_per_tok"),
                          ("intermediate_size", "moe_intermediate_size"),
                          ("decoder_sparse_step", "decoder_sparse_step"), ("n_group", "n_group"),
                          ("topk_group", "topk_group"), ("routed_scaling_factor", "routed_scaling_factor")):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"config value {key} must be positive, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ModelLoadError(
                f"num_experts_per_tok ({self.top_k}) exceeds the number of experts ({self.num_experts}); "
                "a token cannot visit more experts than there are"
            )
        if self.grouped_sigmoid:
            self._check_groups()

    def _check_groups(self) -> None:
        if self.num_experts % self.n_group or self.num_experts // self.n_group < 2:
            raise ModelLoadError(
                f"n_group ({self.n_group}) must divide n_routed_experts ({self.num_experts}) into groups of "
                "at least 2 experts (a group is ranked by its two best scores)"
            )
        if self.topk_group > self.n_group:
            raise ModelLoadError(f"topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
        reachable = self.topk_group * (self.num_experts // self.n_group)
        if self.top_k > reachable:
            raise ModelLoadError(
                f"num_experts_per_tok ({self.top_k}) exceeds the {reachable} experts in topk_group "
                f"({self.topk_group}) groups of {self.num_experts // self.n_group}"
            )


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, dspark_ray/model/mla.py): keys and values are
    expanded per head from one compressed latent of kv_lora_rank features per token, plus one
    rotary key part shared by all heads; queries optionally through a low-rank q_lora_rank."""

    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int  # per-head query/key features without rotation
    qk_rope_head_dim: int  # per-head query/key features with rotation (the rotary head_dim)
    v_head_dim: int
    rope_interleave: bool = True  # rotary pairs are (x0, x1), (x2, x3), ... rather than the halves

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"config value {name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ModelLoadError(f"config value q_lora_rank must be positive or null, got {self.q_lora_rank}")


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
    moe: MoeConfig | None = None  # None: every layer has a dense MLP
    mla: MlaConfig | None = None  # None: ordinary multi-head attention (q/k/v/o projections)

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
        if self.moe is not None:
            outside = [i for i in self.moe.mlp_only_layers if not 0 <= i < self.num_layers]
            if outside:
                raise ModelLoadError(
                    f"mlp_only_layers lists layer(s) {outside} but the model has layers 0..{self.num_layers - 1}"
                )

    def is_sparse(self, layer: int) -> bool:
        """Layer ``layer`` has a mixture-of-experts block (transformers' Qwen3MoeDecoderLayer rule)."""
        moe = self.moe
        return (moe is not None and layer not in moe.mlp_only_layers and layer >= moe.first_dense
                and (layer + 1) % moe.decoder_sparse_step == 0)

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
        mla = _mla(arch, raw)
        if mla is not None:  # rotary embeddings cover the rotated part of each head only
            head_dim = mla.qk_rope_head_dim
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
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=_sliding_window(arch, raw),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            moe=_moe(arch, raw),
            mla=mla,
        )

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        """The config of a checkpoint folder (its config.json) or a GGUF file (its metadata)."""
        from dspark_ray.model.checkpoint import is_gguf, locate, read_config

        path = locate(path)
        raw = read_config(path)
        try:
            return cls.from_dict(raw)
        except KeyError as exc:
            source = path if is_gguf(path) or not path.is_dir() else path / "config.json"
            raise ModelLoadError(f"{source} lacks the required key {exc.args[0]!r}") from exc


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
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):  # never any bias
        return False, False, False
    attn_bias = bool(raw.get("attention_bias", False))  # Llama, Qwen3, Qwen3-MoE: q/k/v and o_proj alike
    mlp_bias = bool(raw.get("mlp_bias", False)) and arch == "LlamaForCausalLM"
    return attn_bias, attn_bias, mlp_bias


def _rope_theta(raw: dict) -> float:
    params = raw.get("rope_parameters") or {}
    return float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(raw: dict) -> RopeScaling:
    """``rope_scaling`` with transformers' defaults (``modeling_rope_utils``) where a key is left out."""
    # transformers 5 folds rope_scaling into rope_parameters; accept both.
    rs = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    max_positions = raw.get("max_position_embeddings", 2048)
    # A top-level original_max_position_embeddings (Phi-3's layout) takes precedence, as in transformers.
    original = (raw.get("original_max_position_embeddings") or rs.get("original_max_position_embeddings")
                or max_positions)
    factor = rs.get("factor")
    if factor is None:  # YaRN without a factor: the ratio of the two lengths (DeepSeek-V3's convention)
        factor = max_positions / _rope_number("original_max_position_embeddings", original) if kind == "yarn" else 1.0
    optional = {key: None if rs.get(key) is None else _rope_number(key, rs[key])
                for key in ("mscale", "mscale_all_dim", "attention_factor")}
    return RopeScaling(
        kind=kind,
        factor=_rope_number("factor", factor),
        low_freq_factor=_rope_number("low_freq_factor", rs.get("low_freq_factor", 1.0)),
        high_freq_factor=_rope_number("high_freq_factor", rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(_rope_number("original_max_position_embeddings", original)),
        beta_fast=_rope_number("beta_fast", rs.get("beta_fast") or 32),  # `or`: transformers reads 0 as unset too
        beta_slow=_rope_number("beta_slow", rs.get("beta_slow") or 1),
        truncate=bool(rs.get("truncate", True)),
        **optional,
    )


def _rope_number(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelLoadError(f"rope_scaling {key} must be a number, got {value!r}; fix rope_scaling in config.json")
    return float(value)


def _sliding_window(arch: str, raw: dict) -> int | None:
    window = raw.get("sliding_window")
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return window or None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and raw.get("use_sliding_window"):
        raise UnsupportedArchitecture(
            f"{arch} with use_sliding_window=true (per-layer windows) is not supported; "
            "set use_sliding_window to false in config.json"
        )
    return None


def _moe(arch: str, raw: dict) -> MoeConfig | None:
    """The experts' settings, with transformers' defaults where config.json leaves a key out."""
    if arch == "MixtralForCausalLM":  # every layer sparse, top-k always renormalised
        return MoeConfig(num_experts=_required(raw, "num_local_experts"), top_k=_required(raw, "num_experts_per_tok"),
                         intermediate_size=raw["intermediate_size"], norm_topk_prob=True)
    if arch == "Qwen3MoeForCausalLM":
        # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts; released checkpoints use num_experts.
        num_experts = raw.get("num_experts") if raw.get("num_experts") is not None else raw.get("num_local_experts")
        if num_experts is None:
            raise ModelLoadError("config.json lacks the required key 'num_experts' (the experts per sparse layer)")
        only = raw.get("mlp_only_layers") or ()
        if not isinstance(only, (list, tuple)) or not all(isinstance(i, int) for i in only):
            raise ModelLoadError(f"mlp_only_layers must be a list of layer indices, got {only!r}")
        return MoeConfig(num_experts=num_experts, top_k=_required(raw, "num_experts_per_tok"),
                         intermediate_size=_required(raw, "moe_intermediate_size"),
                         norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                         decoder_sparse_step=_or_default(raw, "decoder_sparse_step", 1), mlp_only_layers=tuple(only))
    if arch == "DeepseekV3ForCausalLM":  # transformers' DeepseekV3 reads neither scoring_func nor topk_method
        inter = _required(raw, "moe_intermediate_size")
        return MoeConfig(num_experts=_required(raw, "n_routed_experts"), top_k=_required(raw, "num_experts_per_tok"),
                         intermediate_size=inter, norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                         first_dense=_or_default(raw, "first_k_dense_replace", 3), grouped_sigmoid=True,
                         n_group=_or_default(raw, "n_group", 8), topk_group=_or_default(raw, "topk_group", 4),
                         routed_scaling_factor=float(_or_default(raw, "routed_scaling_factor", 2.5)),
                         shared_intermediate_size=_or_default(raw, "n_shared_experts", 1) * inter)
    return None


def _mla(arch: str, raw: dict) -> MlaConfig | None:
    if arch != "DeepseekV3ForCausalLM":
        return None
    return MlaConfig(q_lora_rank=raw.get("q_lora_rank"), kv_lora_rank=_required(raw, "kv_lora_rank"),
                     qk_nope_head_dim=_required(raw, "qk_nope_head_dim"),
                     qk_rope_head_dim=_required(raw, "qk_rope_head_dim"), v_head_dim=_required(raw, "v_head_dim"),
                     rope_interleave=bool(raw.get("rope_interleave", True)))


def _or_default(raw: dict, key: str, default: int) -> int:
    return default if raw.get(key) is None else raw[key]


def _required(raw: dict, key: str) -> int:
    if raw.get(key) is None:
        raise ModelLoadError(f"config.json lacks the required key {key!r}")
    return raw[key]
