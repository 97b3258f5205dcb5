"""The memory planner (dspark_ray/model/memory.py) and the start-up refusal built on it.

Parameter counts are checked against transformers' own models built from the
same config (every family the planner knows), the per-rank shares against
this codebase's shard transform, and the real checkpoints' totals (configs in
tests/data/model_configs, no weights) against their published figures. The
verdicts for one and two 128 GB DGX Sparks are what the numbers say.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import shutil

import pytest
import torch
import yaml
from pydantic import ValidationError

from conftest import REPO, SHIPPED_DRAFT, SHIPPED_DSPARK, SHIPPED_TARGET, shipped
from dspark_ray.model.memory import (
    DOES_NOT_FIT,
    FITS,
    FP8,
    GB,
    KV_LIMITED,
    Checkpoint,
    Placement,
    Workload,
    architecture,
    plan,
    pool_tokens_after_load,
    read_config,
)

CONFIGS = REPO / "tests" / "data" / "model_configs"
ONE_BOX = Placement(tensor_parallel_size=1, nodes=1, memory_bytes=128 * GB)
TWO_BOXES = Placement(tensor_parallel_size=2, nodes=2, memory_bytes=128 * GB)
# A long-context serving workload: 16 slots of 32k tokens, k = 4 with a draft.
LONG = Workload(capacity=16, max_context=32768, num_speculative_tokens=4, draft_window=256, max_num_seqs=16,
                max_num_batched_tokens=8192)


def checkpoint(name: str, **kwargs) -> Checkpoint:
    return Checkpoint.of(read_config(CONFIGS / f"{name}.json"), name=name, **kwargs)


# -- parameter counts -----------------------------------------------------------------

# Published (total, active per token). Totals are given to three significant digits and must match
# within 1%. The active figures are given to two and truncated (Qwen3-30B-A3B's 3.35B is "3.3B",
# DeepSeek-V3's 37.55B with both embedding matrices is "37B"), so within 2%.
PUBLISHED = {
    "Llama-3.1-8B": (8.03e9, None),
    "Llama-3.1-70B-Instruct": (70.6e9, None),
    "Mixtral-8x7B-Instruct-v0.1": (46.7e9, 12.9e9),
    "Qwen3-30B-A3B": (30.5e9, 3.3e9),
    "Qwen3-235B-A22B-FP8": (235e9, 22e9),
    "DeepSeek-V3": (671e9, 37e9),  # without its 14B multi-token-prediction module
    "Qwen3-0.6B": (0.6e9, None),
    "Llama-3.2-1B": (1.23e9, None),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_the_published_totals(name):
    arch = architecture(read_config(CONFIGS / f"{name}.json"))
    total, active = PUBLISHED[name]
    assert arch.params == pytest.approx(total, rel=0.01)
    if active is None:
        assert arch.active_params == arch.params
    else:
        assert arch.active_params == pytest.approx(active, rel=0.02)


def test_every_shipped_config_is_planned():
    assert {p.stem for p in CONFIGS.glob("*.json")} == set(PUBLISHED)


TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2)
FAMILIES = [  # (model_type, architecture, config): every branch of the counting
    ("llama", "LlamaForCausalLM", dict(TINY, attention_bias=True, mlp_bias=True)),
    ("llama", "LlamaForCausalLM", dict(TINY, tie_word_embeddings=True)),
    ("mistral", "MistralForCausalLM", dict(TINY, head_dim=24)),
    ("qwen2", "Qwen2ForCausalLM", dict(TINY)),
    ("qwen3", "Qwen3ForCausalLM", dict(TINY, head_dim=32, attention_bias=True)),
    ("qwen3_moe", "Qwen3MoeForCausalLM", dict(TINY, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
                                              decoder_sparse_step=2, mlp_only_layers=[3], head_dim=16)),
    ("qwen2_moe", "Qwen2MoeForCausalLM", dict(TINY, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
                                              shared_expert_intermediate_size=48)),
    ("mixtral", "MixtralForCausalLM", dict(TINY, num_local_experts=4, num_experts_per_tok=2)),
    ("deepseek_v3", "DeepseekV3ForCausalLM", dict(TINY, moe_intermediate_size=32, n_routed_experts=8,
                                                  num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
                                                  num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
                                                  qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_group=1,
                                                  topk_group=1)),
    ("deepseek_v3", "DeepseekV3ForCausalLM", dict(TINY, moe_intermediate_size=32, n_routed_experts=8,
                                                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=2,
                                                  num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                                                  qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_group=1,
                                                  topk_group=1)),
]


def hf_model(model_type: str, arch: str, kwargs: dict):
    """transformers' model for this config, on the meta device (no memory), and the config as a dict."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    raw = json.loads(config.to_json_string())
    raw["architectures"] = [arch]
    return model, raw


def stored_tensors(model, raw: dict) -> dict[str, torch.Size]:
    """What a checkpoint of ``model`` stores: its state dict (routing biases included), one embedding if tied."""
    sd = model.state_dict()
    if raw.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    return {k: v.shape for k, v in sd.items()}


@pytest.mark.parametrize("model_type, arch, kwargs", FAMILIES, ids=[f"{f[0]}-{i}" for i, f in enumerate(FAMILIES)])
def test_parameter_count_equals_transformers_model(model_type, arch, kwargs):
    model, raw = hf_model(model_type, arch, kwargs)
    expected = sum(math.prod(shape) for shape in stored_tensors(model, raw).values())
    assert architecture(raw).params == expected


def test_fp8_bytes_equal_a_block_quantized_checkpoint_of_the_model():
    """FP8: each decoder projection 1 byte a weight plus a float32 scale per 128 x 128 block (partial
    blocks count whole); embeddings, norms and the LM head stay in the activations' dtype."""
    kwargs = dict(TINY, hidden_size=320, intermediate_size=200, head_dim=96, num_attention_heads=5,
                  num_key_value_heads=1)
    model, raw = hf_model("qwen3", "Qwen3ForCausalLM", kwargs)
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    expected = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            out, inp = module.weight.shape
            expected += out * inp + math.ceil(out / 128) * math.ceil(inp / 128) * 4
        else:
            expected += sum(p.numel() * 2 for p in module.parameters(recurse=False))
    assert Checkpoint.of(raw, "cuda").weight_bytes() == expected
    assert Checkpoint.of(raw, "cuda", quantization="none").weight_bytes() == architecture(raw).params * 2
    assert Checkpoint.of(raw, "cpu").weight_bytes() == architecture(raw).params * 4  # dequantised on CPU
    # A module kept unquantized (modules_to_not_convert) in one layer is planned so in every layer.
    raw["quantization_config"]["modules_to_not_convert"] = ["lm_head", "model.layers.0.self_attn.q_proj"]
    q_proj = [m.weight.shape for n, m in model.named_modules() if n.endswith("self_attn.q_proj")]
    unconverted = sum(o * i * 2 - o * i - math.ceil(o / 128) * math.ceil(i / 128) * 4 for o, i in q_proj)
    assert Checkpoint.of(raw, "cuda").weight_bytes() == expected + unconverted


@pytest.mark.parametrize("arch_name, extra", [
    ("LlamaForCausalLM", dict(attention_bias=True)), ("Qwen2ForCausalLM", {}), ("Qwen3ForCausalLM", dict(head_dim=32)),
    ("Qwen3MoeForCausalLM", dict(moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2, head_dim=16)),
    ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
])
def test_per_rank_share_equals_the_shard_transform(arch_name, extra):
    """Rank r's weights as dspark_ray.model.tp.shard leaves them: heads, MLP and every expert split, the
    rest (embeddings, norms, routers, LM head) whole."""
    from dspark_ray.model import CausalLM, ModelConfig
    from dspark_ray.model.parallel import TensorParallel
    from dspark_ray.model.tp import shard

    raw = dict(TINY, architectures=[arch_name], **extra)
    for world in (1, 2):
        with torch.device("meta"):
            model = shard(CausalLM(ModelConfig.from_dict(raw)), TensorParallel(world - 1, world))
        params = sum(p.numel() for p in model.parameters())
        assert Checkpoint.of(raw, "cpu").weight_bytes(world) == 4 * params  # float32 on CPU


def test_kv_cache_per_token():
    """GQA: K and V of every layer's K/V heads, split among the ranks. MLA: the compressed latent
    (kv_lora_rank + qk_rope_head_dim) a token leaves per layer, on every rank."""
    llama = checkpoint("Llama-3.1-70B-Instruct")
    assert llama.kv_bytes_per_token(1) == 80 * 8 * 2 * 128 * 2
    assert llama.kv_bytes_per_token(2) == llama.kv_bytes_per_token(1) // 2
    deepseek = checkpoint("DeepSeek-V3")
    assert deepseek.kv_bytes_per_token(1) == deepseek.kv_bytes_per_token(8) == 61 * (512 + 64) * 2


# -- verdicts on real checkpoints -----------------------------------------------------------


def test_qwen3_30b_a3b_bf16_fits_one_box():
    target, draft = checkpoint("Qwen3-30B-A3B"), checkpoint("Qwen3-0.6B")
    assert 60 * GB < target.weight_bytes() < 62 * GB  # 30.5B parameters x 2 bytes
    short = plan(target, ONE_BOX, dataclasses.replace(LONG, max_context=16384), draft)
    assert short.verdict == FITS and short.kv_pool_tokens == short.needed_tokens
    long = plan(target, ONE_BOX, LONG, draft)  # 16 slots of 32k: only some at full context at once
    assert long.verdict == KV_LIMITED
    assert long.request_tokens <= long.kv_pool_tokens < long.needed_tokens
    assert f"{long.kv_pool_tokens // long.request_tokens} of the 16 slots" in long.message()
    assert plan(target, TWO_BOXES, LONG, draft).verdict == FITS


def test_qwen3_235b_fp8_does_not_fit_two_boxes():
    """~235 GB of FP8 weights over two 128 GB boxes: 119.5 GB a rank (the replicated embedding and LM
    head in bfloat16 included) is more than the 115.2 GB usable at memory_utilization 0.9."""
    target = checkpoint("Qwen3-235B-A22B-FP8")
    result = plan(target, TWO_BOXES, LONG, checkpoint("Qwen3-0.6B"))
    assert result.verdict == DOES_NOT_FIT
    assert result.rank.weights > TWO_BOXES.usable_bytes
    assert result.rank.weights == pytest.approx(target.arch.params / 2, rel=0.03)  # ~1 byte a weight
    message = result.message()
    assert f"{result.rank.weights / GB:.2f} GB of target weights" in message
    assert "no max_context or capacity" in message and "tensor_parallel_size 4 over 4 nodes" in message
    assert plan(target, Placement(4, 4, 128 * GB), LONG, checkpoint("Qwen3-0.6B")).fits
    # All of each box (memory_utilization 1) still leaves no room for one request of 32k tokens.
    whole = plan(target, Placement(2, 2, 128 * GB, memory_utilization=1.0), LONG, checkpoint("Qwen3-0.6B"))
    assert whole.verdict == DOES_NOT_FIT


def test_deepseek_v3_does_not_fit_two_boxes():
    target = checkpoint("DeepSeek-V3")
    assert target.arch.notes  # its multi-token-prediction layer is left out
    result = plan(target, TWO_BOXES, LONG)
    assert result.verdict == DOES_NOT_FIT
    assert 330 * GB < result.rank.weights < 345 * GB  # ~671 GB of FP8 over two ranks
    message = result.message()
    assert "DeepSeek-V3 with 16 slots x max_context 32768 on 2 GPU(s) of 128.0 GB" in message
    assert f"{result.rank.weights / GB:.2f} GB of target weights" in message
    # The fewest ranks that run, then the fewest that hold every slot at full context (the latent
    # KV cache is on every rank, so more ranks do not shrink it).
    assert "tensor_parallel_size 8 over 8 nodes like these" in message and " runs, " in message
    assert "tensor_parallel_size 16 over 16 nodes like these" in message


def test_llama_70b_bf16_needs_two_boxes():
    target, draft = checkpoint("Llama-3.1-70B-Instruct"), checkpoint("Llama-3.2-1B")
    assert 140 * GB < target.weight_bytes() < 142 * GB
    work = dataclasses.replace(LONG, max_context=8192)
    one = plan(target, ONE_BOX, work, draft)
    assert one.verdict == DOES_NOT_FIT and one.rank.weights > ONE_BOX.memory_bytes
    assert "tensor_parallel_size 2 over 2 nodes like these" in one.message()
    assert plan(target, TWO_BOXES, work, draft).verdict == FITS
    assert plan(target, TWO_BOXES, LONG, draft).verdict == KV_LIMITED  # 16 x 32k is too much KV


def test_mixtral_and_llama_8b():
    mixtral = plan(checkpoint("Mixtral-8x7B-Instruct-v0.1"), ONE_BOX, LONG)
    assert mixtral.verdict == KV_LIMITED
    assert plan(checkpoint("Llama-3.1-8B"), ONE_BOX, LONG, checkpoint("Llama-3.2-1B")).verdict == FITS


@pytest.mark.parametrize("name, placement", [("Qwen3-30B-A3B", ONE_BOX), ("Llama-3.1-70B-Instruct", TWO_BOXES),
                                             ("Mixtral-8x7B-Instruct-v0.1", ONE_BOX)])
def test_suggested_limits_are_the_largest_that_fit(name, placement):
    """What the message offers fits, and one more does not."""
    target = checkpoint(name)
    result = plan(target, placement, LONG)
    (context,) = [int(s.split()[1]) for s in result.suggestions if s.startswith("max_context ")]
    (slots,) = [int(s.split()[0]) for s in result.suggestions if s.endswith(f"at max_context {LONG.max_context}")]
    for changes, bigger in ((dict(max_context=context), dict(max_context=context + 1)),
                            (dict(capacity=slots), dict(capacity=slots + 1))):
        assert plan(target, placement, dataclasses.replace(LONG, **changes)).verdict == FITS
        assert plan(target, placement, dataclasses.replace(LONG, **bigger)).verdict != FITS


def test_fp8_weights_are_suggested_for_a_bf16_checkpoint_they_would_fit():
    target = checkpoint("Llama-3.1-70B-Instruct")
    result = plan(target, ONE_BOX, dataclasses.replace(LONG, max_context=4096, capacity=4))
    assert result.verdict == DOES_NOT_FIT
    (fp8,) = [s for s in result.suggestions if s.startswith("FP8 weights")]
    assert plan(dataclasses.replace(target, fp8=FP8()), ONE_BOX,
                dataclasses.replace(LONG, max_context=4096, capacity=4)).verdict == FITS


def test_the_table_shows_every_line_and_the_verdict():
    result = plan(checkpoint("Llama-3.1-70B-Instruct"), TWO_BOXES, LONG, checkpoint("Llama-3.2-1B"))
    text = result.table()
    for line in ("target weights", "workspace", "request-to-token table", "runtime", "draft weights (Llama-3.2-1B)",
                 "draft window cache", "KV cache, ", "verdict: KV-LIMITED"):
        assert line in text, line
    device = result.fixed_bytes + result.pool_bytes(result.kv_pool_tokens)
    assert device <= TWO_BOXES.usable_bytes < device + result.kv_bytes_per_token * 2


def test_pool_after_load_never_exceeds_the_plan():
    """CUDA: a rank that measures what its weights left sizes a pool no larger than the plan's, smaller
    by at most the runtime it cannot tell apart from the weights, and capped by the slots' need."""
    target, draft = checkpoint("Qwen3-30B-A3B"), checkpoint("Qwen3-0.6B")
    result = plan(target, ONE_BOX, LONG, draft)
    total = ONE_BOX.memory_bytes
    free = total - result.rank.weights - result.rank.runtime  # weights loaded, context made
    tokens = pool_tokens_after_load(result, free, total, draft_pending=True)
    slack = result.rank.runtime // result.kv_bytes_per_token + 2
    assert result.kv_pool_tokens - slack <= tokens <= result.kv_pool_tokens
    assert pool_tokens_after_load(result, free, total, draft_pending=False) > tokens  # the draft is in already
    roomy = plan(target, ONE_BOX, dataclasses.replace(LONG, capacity=2), draft)
    assert pool_tokens_after_load(roomy, free, total, draft_pending=True) == roomy.needed_tokens


# -- the serving config ---------------------------------------------------------------


def deploy_args(name: str) -> dict:
    (app,) = yaml.safe_load((REPO / "deploy" / name).read_text())["applications"]
    return dict(app["args"])


@pytest.mark.parametrize("name", ["shakespeare.yaml", "dspark-tp2.yaml"])
def test_the_shipped_cpu_deployment_fits_this_host(name):
    from dspark_ray.serve.config import AppConfig

    config = AppConfig(**deploy_args(name))  # validated against this host's available memory
    result = config.memory_plan()
    assert result.verdict == FITS and result.placement.device == "cpu"
    assert result.kv_pool_tokens == config.engine_config().kv_tokens  # today's CPU sizing, unchanged
    assert result.draft is not None and result.spec_tokens == config.num_speculative_tokens


def test_a_dspark_draft_is_planned_as_it_loads():
    """The shipped DSpark block draft: its planned weights are the loaded draft's parameters plus the
    copy of the target's embedding its process holds, its cache the context ring (window + block per
    slot, not draft_window + k), and a deployment serving it validates (it was refused before)."""
    from dspark_ray.engine.dtypes import draft_runtime_dtype
    from dspark_ray.model.dspark import DSparkConfig, TargetHeads, load_dspark
    from dspark_ray.serve.config import AppConfig
    from dspark_ray.slots.context_ring import ContextRing

    path = shipped(SHIPPED_DSPARK, "model.safetensors")
    draft = load_dspark(path, TargetHeads.read(SHIPPED_TARGET), dtype="float32")
    arch = architecture(json.loads((path / "config.json").read_text()))
    assert arch.params == sum(p.numel() for p in draft.parameters()) + draft.embed.numel()
    cfg = DSparkConfig.from_path(path)
    config = AppConfig(**{**deploy_args("shakespeare.yaml"), "draft": str(path), "capacity": 8, "draft_window": 5})
    result = config.memory_plan()
    assert result.verdict == FITS
    attn = draft.layers[0].self_attn
    # The ring holds the draft's runtime dtype: bfloat16 on a CPU with native bfloat16 (draft_dtype auto).
    ring_dtype = getattr(torch, draft_runtime_dtype(config.engine_config()))
    rows = config.engine_config().capacity  # this replica's slots (the YAML's replicas share the 8)
    ring = ContextRing(cfg.backbone.num_layers, rows, cfg.window, cfg.block_size, attn.k_proj.out_features // attn.head_dim,
                       attn.head_dim, dtype=ring_dtype)
    assert result.draft_costs.buffers == sum(t.numel() * t.element_size() for t in (*ring.k, *ring.v))


def test_cpu_pool_is_the_engines_own_sizing():
    from dspark_ray.engine.config import EngineConfig
    from dspark_ray.engine.memory_budget import memory_plan

    for capacity, context, k in ((64, 512, 4), (3, 48, 3), (1, 100, 0), (7, 999, 16)):
        config = EngineConfig(str(SHIPPED_TARGET), str(SHIPPED_DRAFT), num_speculative_tokens=k, capacity=capacity,
                              max_context=context)
        assert memory_plan(config, memory_bytes=64 * GB).kv_pool_tokens == config.kv_tokens


def test_a_deployment_too_large_for_the_memory_is_refused_before_loading(tmp_path):
    """A checkpoint with no weights at all (config.json and tokenizer only) is refused at validation,
    with the numbers and limits that would fit; the memory figure is the validation context's."""
    from dspark_ray.serve.config import AppConfig

    model = tmp_path / "target"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED_TARGET / name, model / name)
    args = dict(model=str(model), draft=None, max_context=1024, capacity=1024, device="cpu")
    with pytest.raises(ValidationError) as refused:
        AppConfig.model_validate(args, context={"memory_bytes": 2 * GB})
    message = str(refused.value)
    assert "target with 1024 slots x max_context 1024 on 1 node(s) with 2.0 GB available" in message
    assert "the KV pool of 262,144 tokens needs" in message and "What would fit: max_context" in message
    (suggested,) = [int(m) for m in message.split("What would fit: max_context ")[1].split()[:1]]
    AppConfig.model_validate({**args, "max_context": suggested}, context={"memory_bytes": 2 * GB})
    AppConfig.model_validate(args, context={"memory_bytes": 8 * GB})  # more memory: it fits
    cuda = dict(args, device="cuda")
    AppConfig(**cuda)  # the GPUs are not visible here: each shard checks its own before loading
    # Given a GPU's size, on cuda too; there the pool takes what is left, so only less than one
    # full-context request is refused.
    assert AppConfig.model_validate(cuda, context={"memory_bytes": 2 * GB}).memory_plan(2 * GB).verdict == KV_LIMITED
    with pytest.raises(ValidationError, match="does not fit"):
        AppConfig.model_validate(cuda, context={"memory_bytes": GB})


def test_memory_utilization_is_validated_and_reaches_the_engine():
    from dspark_ray.engine.config import ConfigError, EngineConfig
    from dspark_ray.serve.config import AppConfig

    args = deploy_args("shakespeare.yaml")
    for bad in (0, -0.1, 1.01):
        with pytest.raises(ValidationError, match="memory_utilization"):
            AppConfig(**args, memory_utilization=bad)
        with pytest.raises(ConfigError, match="memory_utilization"):
            EngineConfig(str(SHIPPED_TARGET), memory_utilization=bad)
    config = AppConfig(**args, memory_utilization=1.0)
    assert config.engine_config().memory_utilization == 1.0
    assert AppConfig(**args).memory_utilization == 0.9
    assert config.memory_plan(10 * GB).placement.usable_bytes == 10 * GB


def test_dspark_plan_prints_the_table_and_fails_when_it_does_not_fit():
    from dspark_ray.cli import main

    def run(*argv: str) -> tuple[int, str]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["plan", *argv])
        return code, out.getvalue()

    model = str(CONFIGS / "Llama-3.1-70B-Instruct.json")
    code, text = run("--model", model, "--tp", "2", "--nodes", "2", "--memory-gb", "128", "--max-context", "8192",
                     "--capacity", "16")
    assert code == 0 and "verdict: FITS" in text and "tensor_parallel_size 2 on 2 node(s)" in text
    code, text = run("--model", model, "--tp", "1", "--memory-gb", "128", "--max-context", "8192")
    assert code == 1 and "verdict: DOES NOT FIT" in text and "What would fit" in text

    def window_cache_mb(*extra: str) -> float:
        code, text = run("--model", str(SHIPPED_TARGET), "--draft", str(SHIPPED_DRAFT), "--device", "cpu",
                         "--memory-gb", "8", "--draft-window", "32", "-k", "4", *extra)
        assert code == 0, text
        line = next(line for line in text.splitlines() if "draft window cache" in line)
        return float(line.split()[-2])

    # --draft-ahead: the ring holds window + 2k positions per slot instead of window + k
    assert window_cache_mb("--draft-ahead") / window_cache_mb() == pytest.approx((32 + 8) / (32 + 4), rel=0.03)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_pool_is_sized_from_memory_and_a_hopeless_deployment_is_refused_before_loading():
    from dspark_ray.engine.config import EngineConfig
    from dspark_ray.engine.local import make_target_runner
    from dspark_ray.model.memory import MemoryPlanError

    config = EngineConfig(str(SHIPPED_TARGET), str(SHIPPED_DRAFT), capacity=8, max_context=256, device="cuda")
    runner = make_target_runner(config, None)
    assert runner.kv_capacity() == 8 * (256 + 4)  # a GPU has room for every slot at full context
    del runner
    before = torch.cuda.memory_allocated()
    with pytest.raises(MemoryPlanError, match="does not fit"):  # 0.5% of a GPU: not even the runtime
        make_target_runner(dataclasses.replace(config, memory_utilization=0.005), None)
    assert torch.cuda.memory_allocated() == before  # refused before a weight was read
