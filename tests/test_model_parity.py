"""Logits parity with transformers for every supported architecture and option.

Each case saves a tiny random checkpoint with transformers, loads it with
``dspark_ray.model.load`` and compares the full-sequence logits with the
transformers model's (eager attention) in float32: max abs error <= 1e-4.
Weights are O(1) random (see ``conftest.randomize_``), so the logits are far
from zero and a missing norm, bias or rotation would show.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SHIPPED_DRAFT, SHIPPED_TARGET, save_tiny_checkpoint, shipped
from dspark_ray.model import load

TOL = 1e-4

LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    # Small enough that head_dim 16 has wavelengths in all three llama3 bands.
    "original_max_position_embeddings": 64,
}

CASES = {
    "llama-gqa1": ("LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama-gqa2": ("LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama-gqa4": ("LlamaForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2)),
    "llama-tied": ("LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama-bias": ("LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "llama-rope-linear": ("LlamaForCausalLM", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama-rope-llama3": ("LlamaForCausalLM", dict(rope_scaling=LLAMA3_ROPE)),
    "llama-rope-theta": ("LlamaForCausalLM", dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    "llama-head-dim": ("LlamaForCausalLM", dict(head_dim=32)),  # 4 heads x 32 != hidden 64
    "mistral-full": ("MistralForCausalLM", dict(sliding_window=None)),
    "mistral-window": ("MistralForCausalLM", dict(sliding_window=8)),  # sequence 24 > window
    "qwen2": ("Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=16)),
    "qwen3-bias-head-dim": ("Qwen3ForCausalLM", dict(head_dim=32, attention_bias=True)),
}


def assert_parity(folder: Path, reference, seq_len: int = 24, batch: int = 2, seed: int = 0) -> None:
    ours = load(folder, dtype="float32")
    vocab = reference.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = reference(ids).logits.float()
        got = ours(ids)
    assert got.shape == expected.shape == (batch, seq_len, vocab)
    assert got.dtype == torch.float32
    assert expected.std() > 0.3, "reference logits too flat for a meaningful comparison"
    err = (got - expected).abs().max().item()
    assert err <= TOL, f"max abs logits error {err:.3g} > {TOL}"


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(make_checkpoint, case):
    architecture, overrides = CASES[case]
    folder, reference = make_checkpoint(architecture, **overrides)
    assert_parity(folder, reference)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kv_heads=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([8, 16, 32]),
    tied=st.booleans(),
    bias=st.booleans(),
    rope=st.sampled_from([None, {"rope_type": "linear", "factor": 2.0}, LLAMA3_ROPE]),
    seq_len=st.integers(1, 20),
)
def test_llama_shapes_match_transformers(kv_heads, group, head_dim, tied, bias, rope, seq_len):
    with tempfile.TemporaryDirectory() as tmp:
        reference = save_tiny_checkpoint(
            Path(tmp), num_attention_heads=kv_heads * group, num_key_value_heads=kv_heads, head_dim=head_dim,
            tie_word_embeddings=tied, attention_bias=bias, mlp_bias=bias, rope_scaling=rope,
        )
        assert_parity(Path(tmp), reference, seq_len=seq_len, batch=1)


def test_sharded_checkpoint(make_checkpoint):
    folder, reference = make_checkpoint(max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert not (folder / "model.safetensors").exists()
    assert len(set(index["weight_map"].values())) > 1
    assert_parity(folder, reference)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint_loads_in_its_dtype(make_checkpoint, dtype):
    folder, reference = make_checkpoint(save_dtype=dtype)  # reference holds the rounded weights in float32
    auto = load(folder)  # dtype "auto": the checkpoint's own
    assert {p.dtype for p in auto.parameters()} == {dtype}
    assert auto.inv_freq.dtype == torch.float32, "rotary frequencies must stay float32"
    assert auto(torch.tensor([[1, 2, 3]])).dtype == torch.float32
    wide = load(folder, dtype="float32")
    assert {p.dtype for p in wide.parameters()} == {torch.float32}
    assert_parity(folder, reference)


def test_bfloat16_close_to_transformers_bfloat16(make_checkpoint):
    folder, reference = make_checkpoint()
    ours = load(folder, dtype=torch.bfloat16)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    ids = torch.randint(0, 96, (1, 128), generator=torch.Generator().manual_seed(1))  # up to the last position
    with torch.no_grad():
        exact = reference(ids).logits
        approx = reference.to(torch.bfloat16)(ids).logits.float()
    # bfloat16 keeps ~3 significant digits: allow the error transformers itself makes.
    hf_err = (approx - exact).abs().max().item()
    err = (ours(ids) - exact).abs().max().item()
    assert err <= 1.5 * hf_err, f"bfloat16 error {err:.3g}, transformers' {hf_err:.3g}"


def _shipped_parity(folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    from dspark_ray.tokenizer import Tokenizer

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    ids = Tokenizer.from_path(folder).encode(
        "ROMEO: But, soft! what light through yonder window breaks?\nJULIET: Ay me!"
    )
    ours = load(folder, dtype="float32")
    x = torch.tensor([ids])
    with torch.no_grad():
        err = (ours(x) - reference(x).logits.float()).abs().max().item()
    assert err <= TOL, f"{folder.name}: max abs logits error {err:.3g} > {TOL}"


def test_shipped_target_matches_transformers():
    _shipped_parity(shipped(SHIPPED_TARGET, "config.json"))


def test_shipped_draft_matches_transformers():
    _shipped_parity(shipped(SHIPPED_DRAFT, "config.json"))


@pytest.mark.parametrize("case", ["llama-gqa2", "llama-bias", "qwen3-bias-head-dim"])
def test_fused_projections_change_nothing_but_the_matmul_count(make_checkpoint, case):
    """``load`` fuses q/k/v and gate/up into one matmul each: same logits as the per-projection
    path, the same state dict (names, values, no extra memory), and the projections' parameters
    are views of the fused weight, so an in-place update of one is seen by both paths."""
    from dspark_ray.model.llama import SelfAttention

    architecture, overrides = CASES[case]
    folder, _ = make_checkpoint(architecture, **overrides)
    fused = load(folder, dtype="float32", pack=False)  # torch's matmul: an in-place change is seen (below)
    attn = fused.model.layers[0].self_attn
    assert attn.fused_qkv is not None and fused.model.layers[0].mlp.fused_gate_up is not None
    plain = load(folder, dtype="float32", pack=False)
    for layer in plain.model.layers:  # back to the per-projection path
        layer.self_attn.fused_qkv = layer.mlp.fused_gate_up = None
    assert fused.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(fused.state_dict()[k], v) for k, v in plain.state_dict().items())
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.fused_qkv.weight.untyped_storage().data_ptr()
    ids = torch.randint(0, fused.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), plain(ids), rtol=0, atol=1e-5)
        attn.v_proj.weight.mul_(0.5)  # an in-place change through the parameter
        plain.model.layers[0].self_attn.v_proj.weight.mul_(0.5)
        torch.testing.assert_close(fused(ids), plain(ids), rtol=0, atol=1e-5)
    assert SelfAttention.fused_qkv is None  # a model built without ``load`` keeps separate matmuls


@pytest.mark.parametrize("case", ["llama-gqa2", "llama-bias", "qwen3-bias-head-dim"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prepacked_cpu_matmuls_change_only_the_last_bits(make_checkpoint, case, dtype, monkeypatch):
    """On CPU ``load`` runs every linear (fused projections, o/down projections, the LM head) on a
    oneDNN-prepacked copy of its weight (dspark_ray/model/cpu_gemm.py): the same logits as torch's
    matmul up to rounding, the same state dict, and a weight changed afterwards is used again
    only once it is packed again. A single row (one token) of float32 weights runs torch's matmul
    on the unpacked weight: bit for bit the plain model's logits; bfloat16 weights take the packed
    kernel for a single row too (faster there), so only up to rounding. (The small float32 calls
    that also stay unpacked are turned off here, so that every call of several rows is packed;
    the next test covers them.)"""
    from dspark_ray.model import cpu_gemm
    from dspark_ray.model.cpu_gemm import available, pack_weights

    monkeypatch.setattr(cpu_gemm, "UNPACKED_MAX_MACS", 0)

    if not available(torch.device("cpu"), getattr(torch, dtype)):
        pytest.skip(f"oneDNN's prepacked linear cannot run {dtype} on this CPU or torch build")
    architecture, overrides = CASES[case]
    folder, _ = make_checkpoint(architecture, **overrides)
    packed, plain = load(folder, dtype=dtype), load(folder, dtype=dtype, pack=False)
    layer = packed.model.layers[0]
    assert packed.lm_gemm is not None and layer.self_attn.o_proj.gemm is not None
    assert layer.self_attn.fused_qkv.gemm is not None and layer.mlp.fused_gate_up.gemm is not None
    assert plain.lm_gemm is None and plain.model.layers[0].self_attn.o_proj.gemm is None
    assert all(torch.equal(packed.state_dict()[k], v) for k, v in plain.state_dict().items())
    ids = torch.randint(0, packed.config.vocab_size, (3, 19), generator=torch.Generator().manual_seed(5))
    tol = 1e-4 if dtype == "float32" else 0.1
    with torch.no_grad():
        torch.testing.assert_close(packed(ids), plain(ids), rtol=0, atol=tol)
        one = ids[:1, :1]
        if dtype == "float32":
            assert torch.equal(packed(one), plain(one))
        else:
            torch.testing.assert_close(packed(one), plain(one), rtol=0, atol=tol)
            assert packed.lm_gemm.unpacked_max_rows == 0 and layer.self_attn.o_proj.gemm.unpacked_max_rows == 0
        for model in (packed, plain):
            model.model.layers[0].mlp.down_proj.weight.mul_(0.5)
        assert (packed(ids) - plain(ids)).abs().max() > tol  # the packed copy is stale ...
        pack_weights(packed)
        torch.testing.assert_close(packed(ids), plain(ids), rtol=0, atol=tol)  # ... until packed again


def test_small_float32_matmuls_stay_unpacked_and_larger_ones_run_packed():
    """A float32 call of at most UNPACKED_MAX_MACS multiply-adds (or of one row) runs torch's matmul on
    the live weight, bit for bit ``F.linear``; a larger one runs oneDNN's packed copy. Which kernel ran
    shows in what a call sees after the weight changes in place: the live weight, or the stale copy.
    bfloat16 always runs packed."""
    import torch.nn.functional as F

    from dspark_ray.model.cpu_gemm import UNPACKED_MAX_MACS, PackedGemm, available

    if not available(torch.device("cpu"), torch.float32):
        pytest.skip("oneDNN's prepacked linear cannot run float32 on this CPU or torch build")
    gen = torch.Generator().manual_seed(0)
    for out_features, in_features in ((512, 256), (256, 768), (4096, 256), (8192, 512)):
        weight = torch.randn(out_features, in_features, generator=gen)
        gemm = PackedGemm(weight)
        most = max(1, UNPACKED_MAX_MACS // weight.numel())
        assert gemm.unpacked_max_rows == most
        small, large = torch.randn(most, in_features, generator=gen), torch.randn(most + 1, in_features, generator=gen)
        assert torch.equal(gemm(small), F.linear(small, weight))
        torch.testing.assert_close(gemm(large), F.linear(large, weight), rtol=0, atol=1e-4)
        before = gemm(large)
        weight.mul_(2)  # the parameter changes; the packed copy does not
        assert torch.equal(gemm(small), F.linear(small, weight))  # unpacked: sees the change
        assert torch.equal(gemm(large), before)  # packed: the stale copy
    if available(torch.device("cpu"), torch.bfloat16):
        assert PackedGemm(torch.randn(256, 256, dtype=torch.bfloat16)).unpacked_max_rows == 0


def test_prepacking_is_a_cpu_only_choice():
    from dspark_ray.model.cpu_gemm import available

    assert not available(torch.device("cuda"), torch.float32)
    assert not available(torch.device("cpu"), torch.float16)



@pytest.mark.parametrize("case", ["llama-gqa2", "llama-gqa1", "llama-bias"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_q_and_k_rotated_together_are_bit_identical_to_rotating_each(make_checkpoint, case, dtype):
    """With fused q/k/v and no q/k norm, ``SelfAttention`` rotates q and k as one tensor (half the
    rotary ops per layer): the same bits as rotating each, for every layer's attention inputs and
    output, at decode, verify and prefill shapes."""
    from dspark_ray.model.layers import apply_rope
    from dspark_ray.model.llama import CausalAttention

    architecture, overrides = CASES[case]
    folder, _ = make_checkpoint(architecture, **overrides)
    model = load(folder, dtype=dtype)
    attn = model.model.layers[0].self_attn
    assert attn.fused_qkv is not None and attn.q_norm is None

    seen = []

    class Recording(CausalAttention):
        def __call__(self, layer, q, k, v):
            seen.append((q, k, v))
            return super().__call__(layer, q, k, v)

    gen = torch.Generator().manual_seed(11)
    for b, t in [(1, 1), (1, 5), (3, 5), (2, 17)]:
        x = torch.randn(b, t, model.config.hidden_size, generator=gen).to(model.lm_weight.dtype)
        positions = torch.arange(40, 40 + t).expand(b, t)
        cos, sin = model.rope(positions, x.dtype)
        seen.clear()
        with torch.no_grad():
            got = attn(0, x, cos, sin, Recording())
            q, k, v = (y.reshape(b, t, -1, attn.head_dim) for y in attn.fused_qkv(x))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            want = attn.o_proj(CausalAttention()(0, q, k, v).reshape(b, t, -1))
        (gq, gk, gv), = seen
        assert torch.equal(gq, q) and torch.equal(gk, k) and torch.equal(gv, v), (b, t)
        assert torch.equal(got, want), (b, t)
