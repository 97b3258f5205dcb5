"""Rotary scalings (dspark_ray/model/rope.py): YaRN and dynamic NTK against transformers, and the
context length each scaling supports, enforced at start-up.

Parity as in test_model_parity.py: a tiny random checkpoint saved by transformers, loaded with
``dspark_ray.model.load``, full-sequence logits compared in float32 (max abs error <= 1e-4). The
frequencies and YaRN's attention factor are also compared directly with transformers'
``ROPE_INIT_FUNCTIONS`` over a grid of parameters.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import TINY, save_tiny_checkpoint
from dspark_ray.model import ModelConfig, ModelLoadError, RopeScaling, UnsupportedArchitecture, load
from dspark_ray.model.errors import ContextTooLong
from dspark_ray.model.rope import check_max_context, max_context_length, rope_attention_scaling, rope_inv_freq
from test_model_parity import assert_parity

# original_max_position_embeddings 1024 with head_dim 16 and theta 10000 puts the YaRN ramp over
# dimensions 1..5 of 8: some frequencies kept, some interpolated, some blended.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
YARN_CASES = {
    "yarn": YARN,  # attention factor 0.1 ln(4) + 1 from factor alone (Qwen3's long-context recipe)
    "yarn-mscale": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5},  # DeepSeek-V3's fields
    "yarn-mscale-equal": {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707},  # attention factor exactly 1
    "yarn-attention-factor": {**YARN, "attention_factor": 0.8, "beta_fast": 16, "beta_slow": 2},
    "yarn-no-truncate": {**YARN, "truncate": False},
}
ARCHITECTURES = {"llama": ("LlamaForCausalLM", {}), "qwen3": ("Qwen3ForCausalLM", {"head_dim": 16})}


def hf_rope(rope: dict, head_dim: int = 16, theta: float = 10000.0, max_positions: int = 4096):
    """transformers' (inv_freq, attention_scaling) for ``rope`` on a Llama config."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_theta=theta,
                         max_position_embeddings=max_positions, rope_scaling=dict(rope))
    return ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")


def ours(rope: dict, head_dim: int = 16, theta: float = 10000.0, max_positions: int = 4096) -> ModelConfig:
    raw = {"architectures": ["LlamaForCausalLM"], **TINY, "hidden_size": 4 * head_dim, "head_dim": head_dim,
           "rope_theta": theta, "max_position_embeddings": max_positions, "rope_scaling": dict(rope)}
    return ModelConfig.from_dict(raw)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_logits_match_transformers(make_checkpoint, arch, case):
    architecture, extra = ARCHITECTURES[arch]
    folder, reference = make_checkpoint(architecture, rope_scaling=dict(YARN_CASES[case]),
                                        max_position_embeddings=4096, **extra)
    assert_parity(folder, reference, seq_len=40)
    model = load(folder, dtype="float32")
    # The test has power: the frequencies really are rescaled, and the attention factor applied.
    default = rope_inv_freq(model.config.head_dim, model.config.rope_theta, RopeScaling())
    assert not torch.allclose(model.inv_freq, default)
    assert model.attention_scaling == pytest.approx(reference.model.rotary_emb.attention_scaling, rel=1e-12)
    assert (model.attention_scaling != 1.0) == (case != "yarn-mscale-equal")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_dynamic_ntk_logits_match_transformers(make_checkpoint, arch):
    """Within max_position_embeddings dynamic NTK's frequencies are the default ones."""
    architecture, extra = ARCHITECTURES[arch]
    folder, reference = make_checkpoint(architecture, rope_scaling={"rope_type": "dynamic", "factor": 4.0},
                                        max_position_embeddings=64, **extra)
    assert_parity(folder, reference, seq_len=64)  # every position up to the limit


@settings(max_examples=60, deadline=None)
@given(
    head_dim=st.sampled_from([8, 16, 64, 128]),
    theta=st.sampled_from([500.0, 10000.0, 1e6]),
    factor=st.sampled_from([1.0, 2.0, 4.0, 40.0]),
    original=st.sampled_from([256, 4096, 32768]),
    betas=st.sampled_from([(None, None), (32, 1), (16, 2), (64, 0.5)]),
    mscales=st.sampled_from([(None, None), (1.0, 1.0), (1.0, 0.5), (0.707, 0.707), (2.0, None)]),
    attention_factor=st.sampled_from([None, 0.9]),
    truncate=st.sampled_from([None, True, False]),
)
def test_yarn_parameters_match_transformers(head_dim, theta, factor, original, betas, mscales, attention_factor,
                                            truncate):
    rope = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    for key, value in (("beta_fast", betas[0]), ("beta_slow", betas[1]), ("mscale", mscales[0]),
                       ("mscale_all_dim", mscales[1]), ("attention_factor", attention_factor), ("truncate", truncate)):
        if value is not None:
            rope[key] = value
    expected_freq, expected_scaling = hf_rope(rope, head_dim, theta, max_positions=int(original * factor))
    cfg = ours(rope, head_dim, theta, max_positions=int(original * factor))
    assert torch.equal(rope_inv_freq(head_dim, theta, cfg.rope_scaling), expected_freq)  # bit for bit
    assert rope_attention_scaling(cfg.rope_scaling) == pytest.approx(expected_scaling, rel=1e-12)


def test_yarn_factor_defaults_to_the_ratio_of_the_lengths():
    """transformers: a YaRN config without ``factor`` uses max_position_embeddings / original (DeepSeek-V3)."""
    rope = {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 1024, "mscale": 1.0,
            "mscale_all_dim": 0.5}
    cfg = ours(rope, max_positions=8192)
    assert cfg.rope_scaling.factor == 8.0
    expected_freq, expected_scaling = hf_rope(rope, max_positions=8192)
    assert torch.equal(rope_inv_freq(16, 10000.0, cfg.rope_scaling), expected_freq)
    assert rope_attention_scaling(cfg.rope_scaling) == pytest.approx(expected_scaling, rel=1e-12)


def test_original_max_position_embeddings_defaults_as_in_transformers():
    """Left out of rope_scaling: max_position_embeddings (transformers' standardize_rope_params),
    or a top-level original_max_position_embeddings, which takes precedence (Phi-3's layout)."""
    cfg = ours({"rope_type": "yarn", "factor": 2.0}, max_positions=2048)
    assert cfg.rope_scaling.original_max_position_embeddings == 2048
    raw = {"architectures": ["LlamaForCausalLM"], **TINY, "original_max_position_embeddings": 512,
           "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024}}
    assert ModelConfig.from_dict(raw).rope_scaling.original_max_position_embeddings == 512


# -- the context length -------------------------------------------------------------------------


@pytest.mark.parametrize("rope,max_positions,limit", [
    (None, 2048, 2048),
    ({"rope_type": "linear", "factor": 4.0}, 2048, 8192),
    ({"rope_type": "dynamic", "factor": 4.0}, 2048, 2048),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}, 131072, 131072),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 40960, 131072),  # Qwen3
    ({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096}, 163840, 163840),  # DeepSeek-V3
])
def test_max_context_length_follows_vllm(rope, max_positions, limit):
    raw = {"architectures": ["LlamaForCausalLM"], **TINY, "max_position_embeddings": max_positions}
    if rope:
        raw["rope_scaling"] = rope
    cfg = ModelConfig.from_dict(raw)
    assert max_context_length(cfg) == limit
    check_max_context(cfg, limit)
    with pytest.raises(ContextTooLong, match=f"max_context {limit + 1} exceeds the model's context length {limit}"):
        check_max_context(cfg, limit + 1)


def test_dynamic_ntk_beyond_max_position_embeddings_says_why():
    cfg = ours({"rope_type": "dynamic", "factor": 4.0}, max_positions=2048)
    with pytest.raises(ContextTooLong, match=r"max_context 4096 exceeds the model's context length 2048 "
                                             r"\(max_position_embeddings 2048; rope_scaling 'dynamic'.*KV cache"):
        check_max_context(cfg, 4096)


@pytest.mark.parametrize("rope,max_context,match", [
    (None, 129, r"max_context 129 exceeds the model's context length 128 \(max_position_embeddings 128\); "
                r"set max_context to at most 128"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 257,
     r"context length 256 \(rope_scaling original_max_position_embeddings 64 x factor 4\)"),
])
def test_start_up_refuses_a_max_context_beyond_the_model(tmp_path, rope, max_context, match):
    """The target runner (built by the in-process engine and by every tensor-parallel shard) checks
    max_context against the checkpoint before loading it; at the limit it starts."""
    from dspark_ray.engine import EngineConfig
    from dspark_ray.engine.local import make_target_runner

    save_tiny_checkpoint(tmp_path, rope_scaling=rope)
    with pytest.raises(ContextTooLong, match=match):
        make_target_runner(EngineConfig(model=str(tmp_path), capacity=2, max_context=max_context), None)
    runner = make_target_runner(EngineConfig(model=str(tmp_path), capacity=2, max_context=max_context - 1), None)
    assert runner.table.max_context == max_context - 1


# -- refused values -----------------------------------------------------------------------------


@pytest.mark.parametrize("rope,error,match", [
    ({"rope_type": "yarn", "factor": 0.0}, ModelLoadError, r"rope_scaling factor must be > 0, got 0\.0"),
    ({"rope_type": "yarn", "factor": -2.0}, ModelLoadError, r"rope_scaling factor must be > 0, got -2\.0"),
    ({"rope_type": "linear", "factor": 0}, ModelLoadError, r"rope_scaling factor must be > 0"),
    ({"rope_type": "dynamic", "factor": -1}, ModelLoadError, r"rope_scaling factor must be > 0"),
    ({"rope_type": "yarn", "factor": "4"}, ModelLoadError, r"rope_scaling factor must be a number, got '4'"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": "x"}, ModelLoadError,
     r"rope_scaling beta_fast must be a number"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_slow": -1}, ModelLoadError, r"rope_scaling beta_slow must be > 0"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.0}, ModelLoadError,
     r"rope_scaling attention_factor must be > 0"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": -5}, ModelLoadError,
     r"rope_scaling original_max_position_embeddings must be positive, got -5"),
    ({"rope_type": "longrope", "factor": 4.0}, UnsupportedArchitecture,
     r"rope_scaling type 'longrope' is not supported; use none, 'linear', 'dynamic', 'llama3' or 'yarn'"),
    ({"type": "su"}, UnsupportedArchitecture, r"rope_scaling type 'su' is not supported"),
])
def test_bad_rope_scaling_is_refused_naming_the_field(rope, error, match):
    with pytest.raises(error, match=match):
        ours(rope)


def test_bad_rope_scaling_in_a_checkpoint_is_refused_at_load(make_checkpoint):
    folder, _ = make_checkpoint(rope_scaling=dict(YARN), max_position_embeddings=4096)
    raw = json.loads((folder / "config.json").read_text())
    key = "rope_parameters" if "rope_parameters" in raw else "rope_scaling"
    raw[key]["factor"] = 0
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="rope_scaling factor must be > 0"):
        load(folder)
