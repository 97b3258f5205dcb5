"""Mixture-of-experts targets (Qwen3-MoE, Mixtral; DeepSeek-V3's plain model): parity with
transformers, batched experts, tensor parallel 2, the engine with speculation, and bad configs.

Checkpoints are tiny random models saved with transformers (``conftest.save_tiny_checkpoint``,
O(1) weights, so routers are decisive and a wrong expert, weight or normalisation shows in the
logits). Logits are compared in float32 with transformers' eager model; greedy engine output is
compared token for token with transformers' ``generate``. Tensor parallel 2 runs two processes
joined over gloo, each loading only its slices.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from conftest import save_tiny_checkpoint
from dspark_ray.model import ModelLoadError, TensorMissing, TensorShapeMismatch, UnsupportedArchitecture, load
from dspark_ray.model.moe import SparseMoE, grouped_experts, route, route_grouped
from dspark_ray.model.parallel import ExpertShard, TensorParallel
from engine_fixtures import (EOS_ID, copy_shipped_tokenizer, generate, make_engine, perturbed_copy, save_model,
                             spawn_tp2, tp_speculative_engine)
from test_model_parity import assert_parity

QWEN, MIXTRAL = "Qwen3MoeForCausalLM", "MixtralForCausalLM"
QWEN_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_hidden_layers=3)
MIXTRAL_MOE = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48, num_hidden_layers=2)

CASES = {
    "qwen3moe-renormalised": (QWEN, dict(QWEN_MOE, norm_topk_prob=True)),
    "qwen3moe-raw-topk": (QWEN, dict(QWEN_MOE, norm_topk_prob=False)),
    # layers 1 and 3 are sparse by the step, 3 is then forced dense: sparse only at 1
    "qwen3moe-mixed": (QWEN, dict(QWEN_MOE, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3],
                                  norm_topk_prob=True)),
    "qwen3moe-dense-first": (QWEN, dict(QWEN_MOE, mlp_only_layers=[0], num_experts_per_tok=3)),
    "qwen3moe-top1-bias-head-dim": (QWEN, dict(QWEN_MOE, num_experts_per_tok=1, attention_bias=True, head_dim=32)),
    "mixtral": (MIXTRAL, MIXTRAL_MOE),
    "mixtral-window-all-experts": (MIXTRAL, dict(MIXTRAL_MOE, num_local_experts=4, num_experts_per_tok=4,
                                                 sliding_window=8)),
}


def sparse_layers(hf_model) -> list[bool]:
    return [hasattr(getattr(layer, "mlp", None), "experts") for layer in hf_model.model.layers]


def experts_used(model, ids: torch.Tensor) -> set[tuple[int, int]]:
    """(layer, expert) pairs that received at least one token of ``ids``."""
    used: set[tuple[int, int]] = set()
    hooks = []
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.ffn, SparseMoE):
            moe = layer.ffn

            def hook(module, args, out, i=i, moe=moe):
                _, experts = moe.route(out)
                used.update((i, int(e)) for e in experts.unique())

            hooks.append(moe.gate.register_forward_hook(hook))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return used


# -- logits parity -----------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(make_checkpoint, case):
    architecture, overrides = CASES[case]
    folder, reference = make_checkpoint(architecture, **overrides)
    assert_parity(folder, reference)
    ours = load(folder, dtype="float32")
    assert [isinstance(layer.ffn, SparseMoE) for layer in ours.model.layers] == sparse_layers(reference)
    ids = torch.randint(0, reference.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    used = experts_used(ours, ids)
    for i, layer in enumerate(ours.model.layers):  # the grouping really ran many experts
        if isinstance(layer.ffn, SparseMoE):
            assert len({e for j, e in used if j == i}) >= min(len(layer.ffn.experts), 4)


def test_mixed_layers_follow_step_and_mlp_only_layers(make_checkpoint):
    architecture, overrides = CASES["qwen3moe-mixed"]
    folder, reference = make_checkpoint(architecture, **overrides)
    assert sparse_layers(reference) == [False, True, False, False]
    ours = load(folder, dtype="float32")
    assert [type(layer.ffn).__name__ for layer in ours.model.layers] == ["MLP", "SparseMoE", "MLP", "MLP"]
    assert ours.model.layers[0].ffn.gate_proj.weight.shape == (96, 64)  # dense layers: intermediate_size
    assert ours.model.layers[1].ffn.experts[0].gate_proj.weight.shape == (32, 64)  # experts: moe_intermediate_size


def test_renormalisation_changes_the_output(make_checkpoint):
    """Same weights, norm_topk_prob true vs false: the logits differ (so each parity case above
    checks the flag it was given), and each matches transformers under its own flag."""
    folder, reference = make_checkpoint(QWEN, **dict(QWEN_MOE, norm_topk_prob=True))
    raw = json.loads((folder / "config.json").read_text())
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(2))
    normalised = load(folder, dtype="float32")(ids)
    (folder / "config.json").write_text(json.dumps({**raw, "norm_topk_prob": False}))
    unnormalised = load(folder, dtype="float32")(ids)
    assert (normalised - unnormalised).abs().max() > 0.1
    reference.config.norm_topk_prob = False
    for layer in reference.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.norm_topk_prob = False
    with torch.no_grad():
        assert (unnormalised - reference(ids).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("case", ["qwen3moe-renormalised", "mixtral"])
def test_state_dict_keeps_checkpoint_names_and_experts_are_views(make_checkpoint, case):
    """The loaded model's state dict is the checkpoint's (HF names, per expert); the stacked expert
    weights the forward uses are the same memory, so an in-place change through a name is seen."""
    architecture, overrides = CASES[case]
    folder, _ = make_checkpoint(architecture, **overrides)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    ours = load(folder, dtype="float32")
    assert set(ours.state_dict()) == names
    moe = ours.model.layers[0].ffn
    gate, up, down = moe.experts[3].projections()
    assert gate.weight.data_ptr() == moe.w13[3].data_ptr()
    assert up.weight.data_ptr() == moe.w13[3, moe.w2.shape[2]:].data_ptr()
    assert down.weight.data_ptr() == moe.w2[3].data_ptr()
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(4))
    before = ours(ids)
    with torch.no_grad():
        for expert in moe.experts:
            expert.projections()[2].weight.mul_(2.0)
    assert (ours(ids) - before).abs().max() > 0.1


# -- the batched experts against a per-token reference -----------------------------------------


def per_token_reference(x, w13, w2, weights, experts):
    """One token and one expert at a time: the plainest statement of the routed sum."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            h = F.linear(x[t], w13[e])
            y = F.linear(F.silu(h[:inter]) * h[inter:], w2[e])
            out[t] += weights[t, j] * y.float()
    return out


@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("num_experts, top_k", [(1, 1), (4, 4), (8, 2), (16, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_per_token_reference(tokens, num_experts, top_k, dtype):
    gen = torch.Generator().manual_seed(tokens * 100 + num_experts * 10 + top_k)
    hidden, inter = 24, 10
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=gen)
    weights, experts = route(logits, top_k, renormalize=True)
    got = grouped_experts(x, w13, w2, weights, experts)
    assert got.dtype == torch.float32 and got.shape == (tokens, hidden)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, per_token_reference(x, w13, w2, weights, experts), rtol=tol, atol=tol)


@pytest.mark.parametrize("architecture, renormalize", [(QWEN, True), (QWEN, False), (MIXTRAL, True)])
def test_route_equals_transformers_routers(architecture, renormalize):
    import transformers

    kwargs = dict(hidden_size=16, num_experts_per_tok=3)
    if architecture == QWEN:
        config = transformers.Qwen3MoeConfig(num_experts=6, norm_topk_prob=renormalize, **kwargs)
        router = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(config)
    else:
        config = transformers.MixtralConfig(num_local_experts=6, **kwargs)
        router = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        router.weight.copy_(torch.randn(6, 16, generator=gen))
        x = torch.randn(9, 16, generator=gen)
        logits, hf_weights, hf_experts = router(x)
    weights, experts = route(logits, 3, renormalize)
    assert torch.equal(experts, hf_experts)
    torch.testing.assert_close(weights, hf_weights.float(), rtol=0, atol=1e-7)
    assert torch.allclose(weights.sum(-1), torch.ones(9)) == renormalize


# -- the engine, with speculation ---------------------------------------------------------------


ENGINE_IDS = dict(vocab_size=4096, eos_token_id=EOS_ID, bos_token_id=EOS_ID, pad_token_id=EOS_ID,
                  max_position_embeddings=256)
ENGINE_TARGETS = {
    "qwen3moe": (QWEN, dict(QWEN_MOE, mlp_only_layers=[1], norm_topk_prob=True)),
    "mixtral": (MIXTRAL, MIXTRAL_MOE),
}
MAX_TOKENS = [1, 6, 12, 20, 24]
MAX_CONTEXT = 96


def prompt_set() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, 4096) for _ in range(n)] for n in (1, 3, 8, 17, 30)]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, dict]:
    """Per family: the target folder, its drafts (itself, a perturbed copy, an unrelated dense
    Llama) and transformers' greedy tokens for every prompt."""
    root = tmp_path_factory.mktemp("moe_engine")
    save_tiny_checkpoint(root / "other", seed=2, num_hidden_layers=1, **ENGINE_IDS)
    copy_shipped_tokenizer(root / "other")
    models = {}
    for family, (architecture, overrides) in ENGINE_TARGETS.items():
        hf = save_tiny_checkpoint(root / family, architecture, seed=5, **{**overrides, **ENGINE_IDS})
        save_model(root / f"{family}-near", perturbed_copy(hf, seed=1, scale=0.05))
        for name in (family, f"{family}-near"):
            copy_shipped_tokenizer(root / name)
        reference = []
        for prompt, n in zip(prompt_set(), MAX_TOKENS):
            ids = torch.tensor([prompt])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                              eos_token_id=EOS_ID, pad_token_id=EOS_ID)
            reference.append(out[0, len(prompt):].tolist())
        assert sum(len(r) for r in reference) > 40, "the reference stopped early: a weak comparison"
        models[family] = {"target": root / family, "drafts": {"same": root / family, "near": root / f"{family}-near",
                                                              "other": root / "other"}, "reference": reference}
    return models


def sampling():
    from dspark_ray.engine import SamplingParams

    return [SamplingParams(max_tokens=n) for n in MAX_TOKENS]


@pytest.mark.parametrize("family", ENGINE_TARGETS)
@pytest.mark.parametrize("draft", [None, "same", "near", "other"])
def test_engine_greedy_equals_transformers(moe_models, family, draft):
    """Invariant 4 on a MoE target: the engine's greedy output (paged KV, packed batch, drafts
    verified) is transformers' greedy output token for token, whatever the draft proposes."""
    m = moe_models[family]
    engine = make_engine(m["target"], m["drafts"].get(draft), num_speculative_tokens=4, draft_window=MAX_CONTEXT,
                         max_context=MAX_CONTEXT)
    results = generate(engine, prompt_set(), sampling())
    for prompt, expected, res in zip(prompt_set(), m["reference"], results):
        assert res.token_ids == expected, f"prompt of {len(prompt)} tokens"
    spec = [r.spec for r in results]
    if draft is None:
        assert all(s.drafts == 0 for s in spec)
    else:
        drafted = sum(s.draft_tokens for s in spec)
        rate = sum(s.accepted_tokens for s in spec) / drafted
        assert drafted > 20
        low, high = {"same": (1.0, 1.0), "near": (0.05, 0.95), "other": (0.0, 0.2)}[draft]
        assert low <= rate <= high, rate


# -- tensor parallel 2 ---------------------------------------------------------------------------


def _tp_rank(rank: int, target: str, draft: str, out: str) -> None:
    """One rank of TP 2: load its slices, run the logits and a speculative greedy engine; save both."""
    model = load(target, dtype="float32", tp=TensorParallel(rank, 2))
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    sharded = sum(isinstance(m, ExpertShard) for m in model.modules())
    ids = torch.tensor([p + [0] * (30 - len(p)) for p in prompt_set()])
    logits = model(ids)
    engine = tp_speculative_engine(target, draft, rank, MAX_CONTEXT)
    tokens = [r.token_ids for r in generate(engine, prompt_set(), sampling())]
    torch.save({"shapes": shapes, "sharded": sharded, "logits": logits, "tokens": tokens}, f"{out}/rank{rank}.pt")


@pytest.mark.parametrize("family", ENGINE_TARGETS)
def test_tensor_parallel_2_equals_transformers(moe_models, family, tmp_path):
    """Two ranks over gloo, every expert sliced in two: each rank holds half of every expert's
    gate/up rows and down columns (the router whole), its logits equal transformers', and a
    speculative greedy engine on each rank produces transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    m = moe_models[family]
    spawn_tp2(_tp_rank, str(m["target"]), str(m["drafts"]["near"]), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    whole = load(m["target"], dtype="float32")
    full = {name: tuple(p.shape) for name, p in whole.state_dict().items()}
    for r in ranks:
        assert r["sharded"] > 0 and r["shapes"].keys() == full.keys()
        for name, shape in r["shapes"].items():
            if ".experts." in name:
                halved = 0 if name.endswith(("gate_proj.weight", "up_proj.weight", "w1.weight", "w3.weight")) else 1
                assert shape[halved] * 2 == full[name][halved] and shape[1 - halved] == full[name][1 - halved], name
            elif name.endswith(".gate.weight"):
                assert shape == full[name], f"{name}: the router is replicated"
    reference = AutoModelForCausalLM.from_pretrained(m["target"], dtype=torch.float32, attn_implementation="eager")
    ids = torch.tensor([p + [0] * (30 - len(p)) for p in prompt_set()])
    with torch.no_grad():
        expected = reference(ids).logits
    for r in ranks:
        assert (r["logits"] - expected).abs().max() <= 1e-4
        assert r["tokens"] == m["reference"]


# -- bad configs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine_moe(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pristine_moe")
    save_tiny_checkpoint(root / "qwen", QWEN, **dict(QWEN_MOE, num_hidden_layers=2))
    save_tiny_checkpoint(root / "mixtral", MIXTRAL, **MIXTRAL_MOE)
    return {"qwen": root / "qwen", "mixtral": root / "mixtral"}


def broken(pristine_moe, tmp_path, family: str, **changes) -> Path:
    """A copy of a valid tiny checkpoint with config.json keys changed (None deletes a key)."""
    folder = Path(shutil.copytree(pristine_moe[family], tmp_path / family))
    raw = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


BAD_CONFIGS = [
    ("qwen", dict(num_experts_per_tok=9), r"num_experts_per_tok \(9\) exceeds the number of experts \(8\)"),
    ("mixtral", dict(num_experts_per_tok=9), r"num_experts_per_tok \(9\) exceeds the number of experts \(8\)"),
    ("qwen", dict(num_experts_per_tok=0), "num_experts_per_tok must be positive, got 0"),
    ("qwen", dict(num_local_experts=0), "num_experts must be positive, got 0"),
    ("qwen", dict(num_experts=0, num_local_experts=None), "num_experts must be positive, got 0"),
    ("qwen", dict(num_experts=None, num_local_experts=None), "lacks the required key 'num_experts'"),
    ("mixtral", dict(num_local_experts=None), "lacks the required key 'num_local_experts'"),
    ("qwen", dict(num_experts_per_tok=None), "lacks the required key 'num_experts_per_tok'"),
    ("qwen", dict(moe_intermediate_size=None), "lacks the required key 'moe_intermediate_size'"),
    ("qwen", dict(moe_intermediate_size=-4), "moe_intermediate_size must be positive, got -4"),
    ("qwen", dict(decoder_sparse_step=0), "decoder_sparse_step must be positive, got 0"),
    ("qwen", dict(mlp_only_layers=[0, 5]), r"mlp_only_layers lists layer\(s\) \[5\] but the model has layers 0..1"),
    ("qwen", dict(mlp_only_layers="all"), "mlp_only_layers must be a list of layer indices"),
]


@pytest.mark.parametrize("family, changes, message", BAD_CONFIGS)
def test_bad_moe_config_is_refused_naming_the_field(pristine_moe, tmp_path, family, changes, message):
    folder = broken(pristine_moe, tmp_path, family, **changes)
    with pytest.raises(ModelLoadError, match=message):
        load(folder)


def test_qwen3moe_sliding_window_rejected(pristine_moe, tmp_path):
    folder = broken(pristine_moe, tmp_path, "qwen", use_sliding_window=True, sliding_window=16)
    with pytest.raises(UnsupportedArchitecture, match="use_sliding_window=true"):
        load(folder)


def test_expert_width_not_divisible_by_tensor_parallel_size(pristine_moe, tmp_path):
    folder = broken(pristine_moe, tmp_path, "qwen", moe_intermediate_size=33)
    message = r"moe_intermediate_size \(33\) is not divisible by tensor_parallel_size 2"
    with pytest.raises(ModelLoadError, match=message):
        load(folder, tp=TensorParallel(0, 2))  # refused while building, before any collective


def test_missing_expert_tensor_is_named(pristine_moe, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = Path(shutil.copytree(pristine_moe["mixtral"], tmp_path / "mixtral"))
    tensors = load_file(folder / "model.safetensors")
    tensors.pop("model.layers.1.block_sparse_moe.experts.5.w3.weight")
    tensors["model.layers.0.block_sparse_moe.experts.2.w2.weight"] = torch.zeros(64, 40)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TensorShapeMismatch, match=r"experts\.2\.w2\.weight' has shape \(64, 40\).*\(64, 48\)"):
        load(folder)
    tensors["model.layers.0.block_sparse_moe.experts.2.w2.weight"] = torch.zeros(64, 48)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TensorMissing, match=r"'model\.layers\.1\.block_sparse_moe\.experts\.5\.w3\.weight'"):
        load(folder)


# -- DeepSeek-V3 (plain model) -------------------------------------------------------------------

DEEPSEEK = "DeepseekV3ForCausalLM"
DEEPSEEK_TINY = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=2, first_k_dense_replace=1,
                     n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                     v_head_dim=12)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
DEEPSEEK_CASES = {
    "deepseek-v3": {},
    "deepseek-v3-plain-q": dict(q_lora_rank=None),
    "deepseek-v3-halves-rope": dict(rope_interleave=False),
    "deepseek-v3-unnormalised-all-sparse": dict(first_k_dense_replace=0, n_group=2, topk_group=1, norm_topk_prob=False),
    "deepseek-v3-two-shared-bias": dict(n_shared_experts=2, attention_bias=True, num_experts_per_tok=3),
    "deepseek-v3-yarn-mscale": dict(rope_parameters=YARN),
}


def save_deepseek(folder: Path, **overrides):
    """A tiny DeepSeek-V3 checkpoint whose routers' selection biases (a buffer transformers
    leaves at zero) are random too, so the biased choice is exercised."""
    model = save_tiny_checkpoint(folder, DEEPSEEK, **{**DEEPSEEK_TINY, **overrides})
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.5 * torch.randn(buffer.shape, generator=gen))
    save_model(folder, model)
    return model


@pytest.mark.parametrize("case", DEEPSEEK_CASES)
def test_deepseek_v3_logits_match_transformers(tmp_path, case):
    reference = save_deepseek(tmp_path / "ckpt", **DEEPSEEK_CASES[case])
    assert_parity(tmp_path / "ckpt", reference)
    ours = load(tmp_path / "ckpt", dtype="float32")
    first_dense = reference.config.first_k_dense_replace
    assert [isinstance(layer.ffn, SparseMoE) for layer in ours.model.layers] == [i >= first_dense for i in range(3)]


def test_deepseek_v3_multi_token_prediction_layers_are_skipped(tmp_path):
    """Released checkpoints carry the multi-token-prediction module as one more layer; it is not
    used for decoding and must not stop the load."""
    from safetensors.torch import load_file, save_file

    reference = save_deepseek(tmp_path / "ckpt")
    tensors = load_file(tmp_path / "ckpt" / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(112, 16)
    save_file(tensors, tmp_path / "ckpt" / "model.safetensors", metadata={"format": "pt"})
    assert_parity(tmp_path / "ckpt", reference)


def test_grouped_route_equals_transformers_router():
    import transformers

    config = transformers.DeepseekV3Config(hidden_size=16, n_routed_experts=12, num_experts_per_tok=4, n_group=4,
                                           topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(12, 16, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(12, generator=gen))
        logits, hf_weights, hf_experts = router(torch.randn(20, 16, generator=gen))
    from dspark_ray.model import ModelConfig

    moe = ModelConfig.from_dict({**config.to_dict(), "architectures": [DEEPSEEK]}).moe
    weights, experts = route_grouped(logits, router.e_score_correction_bias, moe)
    assert torch.equal(experts.sort(-1).values, hf_experts.sort(-1).values)  # both unsorted top-k
    order, hf_order = experts.argsort(-1), hf_experts.argsort(-1)
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order), rtol=0, atol=1e-6)
    groups = experts // 3  # every token's experts come from at most topk_group groups
    assert all(len(set(g)) <= 2 for g in groups.tolist())


def _tp_logits_rank(rank: int, folder: str, out: str) -> None:
    model = load(folder, dtype="float32", tp=TensorParallel(rank, 2))
    ids = torch.arange(40).view(2, 20) % 96
    torch.save({"shapes": {n: tuple(p.shape) for n, p in model.state_dict().items()}, "logits": model(ids)},
               f"{out}/rank{rank}.pt")


def test_deepseek_v3_tensor_parallel_2_equals_transformers(tmp_path):
    """MLA split by heads (q_b_proj and kv_b_proj by rows, o_proj by columns, the latent projections
    whole), routed and shared experts sliced: each rank's logits equal transformers'."""
    reference = save_deepseek(tmp_path / "ckpt")
    spawn_tp2(_tp_logits_rank, str(tmp_path / "ckpt"), str(tmp_path))
    full = {n: tuple(p.shape) for n, p in load(tmp_path / "ckpt", dtype="float32").state_dict().items()}
    with torch.no_grad():
        expected = reference(torch.arange(40).view(2, 20) % 96).logits
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        shapes = {name.removeprefix("model.layers.1."): shape for name, shape in got["shapes"].items()}
        whole = {name.removeprefix("model.layers.1."): shape for name, shape in full.items()}
        assert shapes["self_attn.kv_b_proj.weight"][0] * 2 == whole["self_attn.kv_b_proj.weight"][0]
        assert shapes["self_attn.kv_a_proj_with_mqa.weight"] == whole["self_attn.kv_a_proj_with_mqa.weight"]
        assert shapes["mlp.shared_experts.down_proj.weight"][1] * 2 == whole["mlp.shared_experts.down_proj.weight"][1]
        assert shapes["mlp.experts.5.up_proj.weight"][0] * 2 == whole["mlp.experts.5.up_proj.weight"][0]
        assert (got["logits"] - expected).abs().max() <= 1e-4


def test_deepseek_v3_is_refused_as_the_draft_before_any_weight_is_read(tmp_path):
    """A real DeepSeek-V3 checkpoint is hundreds of GB: the engine refuses it as the draft (whose window
    cache holds per-head K/V) from config.json alone. The folder here has the config and no weights at
    all, so a load would fail differently. As the target it is served (tests/test_mla_serving.py)."""
    import shutil

    from dspark_ray.engine.config import EngineConfig
    from dspark_ray.engine.local import make_draft_proposer

    save_deepseek(tmp_path / "ckpt")
    bare = tmp_path / "config-only"
    bare.mkdir()
    shutil.copy(tmp_path / "ckpt" / "config.json", bare / "config.json")
    config = EngineConfig(model=str(bare), draft=str(bare), max_context=32)
    with pytest.raises(UnsupportedArchitecture, match="multi-head latent attention.*cannot be the draft.*not a use case.*small dense draft"):
        make_draft_proposer(config, None)


@pytest.mark.parametrize("changes, message", [
    (dict(n_group=3), r"n_group \(3\) must divide n_routed_experts \(8\)"),
    (dict(n_group=8), r"n_group \(8\) must divide n_routed_experts \(8\) into groups of at least 2"),
    (dict(topk_group=5), r"topk_group \(5\) exceeds n_group \(4\)"),
    (dict(topk_group=1, num_experts_per_tok=3), r"num_experts_per_tok \(3\) exceeds the 2 experts in topk_group"),
    (dict(routed_scaling_factor=0), "routed_scaling_factor must be positive"),
    (dict(kv_lora_rank=None), "lacks the required key 'kv_lora_rank'"),
    (dict(q_lora_rank=0), "q_lora_rank must be positive or null"),
])
def test_bad_deepseek_v3_config_is_refused_naming_the_field(tmp_path, changes, message):
    save_deepseek(tmp_path / "ckpt")
    raw = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    raw.update(changes)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    with pytest.raises(ModelLoadError, match=message):
        load(tmp_path / "ckpt")


RELEASED = Path(__file__).parent / "data" / "model_configs"


@pytest.mark.parametrize("name, experts, top_k, width, renormalise, dense_first, shared", [
    ("Qwen3-30B-A3B", 128, 8, 768, True, 0, 0),
    ("Qwen3-235B-A22B-FP8", 128, 8, 1536, True, 0, 0),
    ("Mixtral-8x7B-Instruct-v0.1", 8, 2, 14336, True, 0, 0),
    ("DeepSeek-V3", 256, 8, 2048, True, 3, 2048),
])
def test_released_configs_parse(name, experts, top_k, width, renormalise, dense_first, shared):
    """The config.json of released MoE checkpoints (copies kept in tests/data) parse to their experts."""
    from dspark_ray.model import ModelConfig

    file = RELEASED / f"{name}.json"
    if not file.is_file():
        pytest.skip(f"{file} is not in this checkout")
    moe = ModelConfig.from_dict(json.loads(file.read_text())).moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob, moe.first_dense,
            moe.shared_intermediate_size) == (experts, top_k, width, renormalise, dense_first, shared)
