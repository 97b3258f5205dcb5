"""Every way loading a checkpoint can fail: a named error whose message says what and how to fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import save_tiny_checkpoint
from dspark_ray.model import (
    SUPPORTED_ARCHITECTURES,
    CheckpointFileMissing,
    ModelLoadError,
    TensorMissing,
    TensorShapeMismatch,
    UnsupportedArchitecture,
    UnsupportedDtype,
    load,
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pristine") / "ckpt"
    save_tiny_checkpoint(folder)
    return folder


@pytest.fixture(scope="module")
def pristine_sharded(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pristine") / "sharded"
    save_tiny_checkpoint(folder, max_shard_size="40KB")
    return folder


@pytest.fixture
def ckpt(pristine, tmp_path) -> Path:
    """A fresh copy of a valid tiny Llama checkpoint, for a test to break."""
    return Path(shutil.copytree(pristine, tmp_path / "ckpt"))


def edit_config(folder: Path, **changes) -> None:
    file = folder / "config.json"
    raw = json.loads(file.read_text())
    raw.update(changes)
    file.write_text(json.dumps(raw))


def edit_weights(folder: Path, edit) -> None:
    file = folder / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_valid_checkpoint_loads(ckpt):
    load(ckpt)


def test_unsupported_architecture_lists_supported(ckpt):
    edit_config(ckpt, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedArchitecture) as err:
        load(ckpt)
    assert "GPT2LMHeadModel" in str(err.value)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)


def test_config_without_architectures(ckpt):
    edit_config(ckpt, architectures=[])
    with pytest.raises(UnsupportedArchitecture, match="exactly one architecture.*supported: LlamaForCausalLM"):
        load(ckpt)


def test_unsupported_activation(ckpt):
    edit_config(ckpt, hidden_act="gelu")
    with pytest.raises(UnsupportedArchitecture, match="hidden_act 'gelu'.*silu"):
        load(ckpt)


def test_unsupported_rope_scaling(ckpt):
    edit_config(ckpt, rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(UnsupportedArchitecture,
                       match="rope_scaling type 'longrope'.*'linear', 'dynamic', 'llama3' or 'yarn'"):
        load(ckpt)


def test_path_is_not_a_folder(tmp_path):
    with pytest.raises(CheckpointFileMissing, match="is not a folder"):
        load(tmp_path / "nowhere")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointFileMissing, match=r"config\.json not found"):
        load(ckpt)


def test_malformed_config(ckpt):
    (ckpt / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(ModelLoadError, match=r"config\.json is not valid JSON"):
        load(ckpt)


def test_config_lacking_a_key(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    del raw["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="lacks the required key 'hidden_size'"):
        load(ckpt)


def test_inconsistent_heads(ckpt):
    edit_config(ckpt, num_key_value_heads=3)
    with pytest.raises(ModelLoadError, match=r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"):
        load(ckpt)


def test_missing_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointFileMissing, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        load(ckpt)


def test_shard_listed_but_absent(pristine_sharded, tmp_path):
    ckpt = Path(shutil.copytree(pristine_sharded, tmp_path / "sharded"))
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (ckpt / shard).unlink()
    with pytest.raises(CheckpointFileMissing, match=f"lists shards that are not in .*{shard}"):
        load(ckpt)


@pytest.mark.parametrize("content", ['{"metadata": {}}', "[1, 2]", "{not json"])
def test_malformed_shard_index(pristine_sharded, tmp_path, content):
    ckpt = Path(shutil.copytree(pristine_sharded, tmp_path / "sharded"))
    (ckpt / "model.safetensors.index.json").write_text(content)
    with pytest.raises(ModelLoadError, match=r"index\.json .*re-save the checkpoint"):
        load(ckpt)


def test_tensor_missing_is_named(ckpt):
    edit_weights(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(TensorMissing, match=r"lacks 1 tensor.*'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load(ckpt)


def test_untied_checkpoint_without_lm_head(ckpt):
    edit_weights(ckpt, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(TensorMissing, match="'lm_head.weight'"):
        load(ckpt)


def test_tensor_of_wrong_shape_names_it_and_both_shapes(ckpt):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    edit_weights(ckpt, shrink)
    with pytest.raises(TensorShapeMismatch) as err:
        load(ckpt)
    message = str(err.value)
    assert "'model.layers.0.self_attn.k_proj.weight'" in message
    assert "(16, 64)" in message and "(32, 64)" in message


def test_unexpected_tensor_is_named(ckpt):
    edit_weights(ckpt, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.self_attn\.q_proj\.bias' has no place"):
        load(ckpt)


@pytest.mark.parametrize("dtype", ["float64", "int8", "fp8", torch.float64])
def test_unsupported_dtype(ckpt, dtype):
    with pytest.raises(UnsupportedDtype, match="use one of float32, bfloat16, float16"):
        load(ckpt, dtype=dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_cuda(ckpt):
    with pytest.raises(UnsupportedDtype, match="CUDA is not available; use device='cpu'"):
        load(ckpt, device="cuda")


@pytest.mark.parametrize("architecture", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_sliding_window_rejected(ckpt, architecture):
    edit_config(ckpt, architectures=[architecture], use_sliding_window=True, sliding_window=16)
    with pytest.raises(UnsupportedArchitecture, match="use_sliding_window=true.*set use_sliding_window to false"):
        load(ckpt)
