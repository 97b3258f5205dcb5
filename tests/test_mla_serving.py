"""DeepSeek-V3 (multi-head latent attention) served through the engine.

The target's paged pool keeps MLA's compressed latent and rotated shared key
per token (dspark_ray/engine/latent_attention.py), and attention over it runs
in the absorbed form (attention in latent space) or the expanded one
(dspark_ray/model/mla.py). Checked against transformers, in float32:

- logits: each form over a pool filled in chunks, rows of different lengths
  packed in one step, equal the plain model's (which equals transformers');
- greedy tokens: the engine (paged latent KV, packed batches, drafts verified)
  equals transformers' ``generate`` token for token, with no draft and with
  dense drafts sharing the tokenizer (one that agrees often, one perturbed so
  that most proposals are rejected), several requests of different lengths at
  once, chunked prefill, slot reuse, preemption, prefix caching, and tensor
  parallel 2 over gloo;
- the pool's payload per token is the latent plus the rotated key, as the
  memory planner assumes;
- in bfloat16 the router keeps float32 weights and picks transformers' experts.

The target is a tiny random DeepSeek-V3 (YaRN rope, a dense first layer,
routed and shared experts) whose attention and MLP outputs are scaled down
(``BRANCH_SCALE``) so that a dense draft can share its embeddings, final norm
and LM head and guess many of its tokens (the "bigram" draft); the branches
still move a good share of the greedy tokens (asserted), so a wrong attention
shows in the tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from conftest import save_tiny_checkpoint
from dspark_ray.engine import SamplingParams
from dspark_ray.engine.latent_attention import LatentKVPool
from dspark_ray.engine.attention_group import AttentionGroup
from dspark_ray.model import load
from dspark_ray.model.memory import Checkpoint, read_config
from dspark_ray.model.moe import SparseMoE
from engine_fixtures import (EOS_ID, assert_drained, copy_shipped_tokenizer, generate, make_engine, save_model,
                             spawn_tp2, tp_speculative_engine)
from test_model_moe import DEEPSEEK_TINY, YARN, save_deepseek

KV_LORA_RANK, ROPE_DIM = DEEPSEEK_TINY["kv_lora_rank"], DEEPSEEK_TINY["qk_rope_head_dim"]
IDS = dict(vocab_size=4096, eos_token_id=EOS_ID, bos_token_id=EOS_ID, pad_token_id=EOS_ID,
           max_position_embeddings=128, rope_parameters=YARN)  # YaRN: 32 original positions x factor 4
VARIANTS = {
    "low-rank-q": {},
    "plain-q-halves-rope": dict(q_lora_rank=None, rope_interleave=False),
}
# The attention and MLP outputs' scale in the residual stream, per variant (module docstring): the
# random embeddings are small beside O(1) branches, so at 1.0 the branches decide every token.
BRANCH_SCALE = {"low-rank-q": 0.02, "plain-q-halves-rope": 1.0}
MAX_TOKENS = [1, 6, 12, 20, 24]
MAX_CONTEXT = 96


def prompt_set() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, 4096) for _ in range(n)] for n in (1, 3, 8, 17, 30)]


def sampling() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n) for n in MAX_TOKENS]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                      eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    return out[0, len(prompt):].tolist()


def bigram_draft(folder: Path, target, seed: int, noise: float = 0.0):
    """A one-layer dense Llama with the target's embeddings, final norm and LM head (plus ``noise``
    times its spread on the LM head) and no-op layers: its greedy guess is the target's without
    attention and MLPs."""
    draft = save_tiny_checkpoint(folder, seed=seed, num_hidden_layers=1, **{**IDS, "rope_parameters": None})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            draft.get_parameter(name).copy_(target.get_parameter(name))
        head = draft.lm_head.weight
        head.add_(noise * head.std() * torch.randn(head.shape, generator=gen))
        for name, p in draft.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
    save_model(folder, draft)
    copy_shipped_tokenizer(folder)


@pytest.fixture(scope="module")
def mla_models(tmp_path_factory) -> dict[str, dict]:
    """Per variant: the target folder, the transformers model, its greedy tokens for every prompt."""
    root = tmp_path_factory.mktemp("mla_engine")
    models = {}
    for variant, overrides in VARIANTS.items():
        hf = save_deepseek(root / variant, **{**IDS, **overrides})
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if "o_proj" in name or "down_proj" in name:
                    p.mul_(BRANCH_SCALE[variant])
        save_model(root / variant, hf)
        copy_shipped_tokenizer(root / variant)
        reference = [hf_greedy(hf, p, n) for p, n in zip(prompt_set(), MAX_TOKENS)]
        assert sum(len(r) for r in reference) > 40, "the reference stopped early: a weak comparison"
        models[variant] = {"target": root / variant, "hf": hf, "reference": reference}
    hf = models["low-rank-q"]["hf"]
    bigram_draft(root / "bigram", hf, seed=3)
    bigram_draft(root / "perturbed", hf, seed=4, noise=1.0)
    for m in models.values():
        m["drafts"] = {"bigram": root / "bigram", "perturbed": root / "perturbed"}
    return models


# -- the pool and its attention, against the plain model ------------------------------------------


def test_pool_keeps_the_latent_and_rotated_key_per_token(mla_models):
    """One [pool_tokens, kv_lora_rank + qk_rope_head_dim] tensor per layer (not heads x head_dim),
    the bytes per token the memory planner counts (dspark_ray/model/memory.py)."""
    m = mla_models["low-rank-q"]
    engine = make_engine(m["target"], max_context=MAX_CONTEXT, kv_pool_tokens=200)
    target = engine.target
    assert target.k_pools == [] and target.v_pools == []
    assert [tuple(p.shape) for p in target.latent.pools] == [(201, KV_LORA_RANK + ROPE_DIM)] * 3
    per_token = sum(p[0].numel() * p.element_size() for p in target.latent.pools)
    assert per_token == Checkpoint.of(read_config(m["target"]), device="cpu").kv_bytes_per_token()
    heads, qk = DEEPSEEK_TINY["num_attention_heads"], DEEPSEEK_TINY["qk_nope_head_dim"] + ROPE_DIM
    v = DEEPSEEK_TINY["v_head_dim"]
    assert KV_LORA_RANK + ROPE_DIM < heads * (qk + v)  # what an expanded cache would hold


def packed_step(
    rows: list[tuple[int, int, torch.Tensor]],  # per row (start, tokens fed, the whole sequence)
    pool_index: list[torch.Tensor],  # per row [len(sequence)] int64: its positions' pool indices
) -> tuple[torch.Tensor, list[AttentionGroup]]:
    """The write indices [N] and one attention group (as TargetRunner._group builds them) for rows
    feeding ``fed`` tokens from ``start``, packed in row order."""
    T, L = max(n for _, n, _ in rows), max(s + n for s, n, _ in rows)
    offsets = [0]
    for _, n, _ in rows:
        offsets.append(offsets[-1] + n)
    steps = torch.arange(T)[None]
    n = torch.tensor([r[1] for r in rows])[:, None]
    valid = steps < n
    queries = torch.where(valid, torch.tensor(offsets[:-1])[:, None] + steps, 0)
    positions = torch.tensor([r[0] for r in rows])[:, None] + torch.minimum(steps, n - 1)
    key_pos = torch.arange(L)[None, None]
    lengths = torch.tensor([s + f for s, f, _ in rows])[:, None, None]
    mask = (key_pos <= positions[:, :, None]) & (key_pos < lengths)
    key_index = torch.stack([torch.cat([idx[:L], torch.zeros(max(0, L - len(idx)), dtype=torch.int64)])
                             for idx in pool_index])  # padding keys (masked) read token 0
    write = torch.cat([idx[s:s + f] for (s, f, _), idx in zip(rows, pool_index)])
    whole = len(rows) == 1
    return write, [AttentionGroup(queries, valid, key_index, mask[:, None], whole)]


@pytest.mark.parametrize("form", ["absorbed", "expanded", "auto"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_latent_attention_over_the_pool_equals_the_plain_model(tmp_path, variant, form):
    """Two sequences of different lengths fed in two packed steps (a prefill, then a chunk that
    attends to the first one's cached latents) at scattered pool indices: every position's logits
    equal the plain model's over the whole sequence. Full-strength random weights, float32."""
    save_deepseek(tmp_path / "ckpt", **{**DEEPSEEK_TINY, **VARIANTS[variant], "rope_parameters": YARN})
    model = load(tmp_path / "ckpt", dtype="float32")
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 96, (n,), generator=gen) for n in (21, 9)]
    cuts = [13, 4]  # the first step feeds this many of each sequence
    plain = [model(s[None])[0] for s in seqs]
    pool = LatentKVPool(model.config, 64, torch.float32, torch.device("cpu"), form)
    order = torch.randperm(63, generator=gen) + 1  # token 0 is padding
    pool_index = [order[:21], order[21:30]]
    got: list[list[torch.Tensor]] = [[], []]
    for first in (True, False):
        rows = [(0, c, s) if first else (c, len(s) - c, s) for s, c in zip(seqs, cuts)]
        write, groups = packed_step(rows, pool_index)
        ids = torch.cat([s[start:start + fed] for start, fed, s in rows])[None]
        positions = torch.cat([torch.arange(start, start + fed) for start, fed, _ in rows])[None]
        logits = model(ids, positions, pool.attention(write, groups))[0]
        offset = 0
        for b, (_, fed, _) in enumerate(rows):
            got[b].append(logits[offset:offset + fed])
            offset += fed
    for b in range(2):
        err = (torch.cat(got[b]) - plain[b]).abs().max().item()
        assert err <= 1e-4, f"sequence {b}: max abs logits error {err:.3g}"
    assert all(p.abs().sum() > 0 for p in pool.pools)


# -- greedy through the engine ---------------------------------------------------------------------


def acceptance(results) -> tuple[int, float]:
    drafted = sum(r.spec.draft_tokens for r in results)
    return drafted, sum(r.spec.accepted_tokens for r in results) / max(drafted, 1)


@pytest.mark.parametrize("variant, draft, form", [
    ("low-rank-q", None, "auto"),
    ("low-rank-q", None, "expanded"),
    ("low-rank-q", "bigram", "auto"),
    ("low-rank-q", "bigram", "expanded"),
    ("low-rank-q", "perturbed", "auto"),
    ("plain-q-halves-rope", None, "auto"),
    ("plain-q-halves-rope", "perturbed", "absorbed"),
])
def test_engine_greedy_equals_transformers(mla_models, variant, draft, form):
    """Five requests of different lengths at once; with a draft, each step verifies up to 4
    proposals per row: the engine's tokens are transformers' greedy tokens."""
    m = mla_models[variant]
    engine = make_engine(m["target"], m["drafts"].get(draft), num_speculative_tokens=4, draft_window=MAX_CONTEXT,
                         max_context=MAX_CONTEXT)
    engine.target.latent.form = form
    results = generate(engine, prompt_set(), sampling())
    for prompt, expected, res in zip(prompt_set(), m["reference"], results):
        assert res.token_ids == expected, f"prompt of {len(prompt)} tokens"
    drafted, rate = acceptance(results)
    if draft is None:
        assert drafted == 0
    else:
        low, high = {"bigram": (0.15, 0.9), "perturbed": (0.0, 0.3)}[draft]
        assert drafted > 20 and low <= rate <= high, rate
    assert_drained(engine, len(results))


def test_attention_moves_the_tokens(mla_models):
    """The bigram guess (the scaled-down target without its attention and MLPs) misses a good
    share of the target's greedy tokens, so the comparisons do depend on the latent attention."""
    m = mla_models["low-rank-q"]
    hf = m["hf"]
    same = total = 0
    with torch.no_grad():
        for prompt, out in zip(prompt_set(), m["reference"]):
            ids = torch.tensor(prompt + out)
            guess = hf.lm_head(hf.model.norm(hf.model.embed_tokens(ids))).argmax(-1)
            same += int((guess[len(prompt) - 1:-1] == torch.tensor(out)).sum())
            total += len(out)
    assert 0.1 <= same / total <= 0.8, same / total


def test_chunked_prefill_slot_reuse_and_preemption(mla_models):
    """Prompts fed in chunks of at most 7 tokens, three slots for five requests, a KV pool of one
    full request while three run and grow (so requests are preempted and recomputed): tokens
    unchanged."""
    from engine_fixtures import run_all

    m = mla_models["low-rank-q"]
    max_tokens = [40, 40, 40, 30, 24]
    reference = [hf_greedy(m["hf"], p, n) for p, n in zip(prompt_set(), max_tokens)]
    engine = make_engine(m["target"], m["drafts"]["bigram"], num_speculative_tokens=3, draft_window=16,
                         capacity=3, max_context=64, kv_pool_tokens=67, max_num_batched_tokens=7)
    preemptions = []
    ids = [engine.add_request(p, SamplingParams(max_tokens=n)) for p, n in zip(prompt_set(), max_tokens)]
    results = run_all(engine, after_step=lambda e: preemptions.append(e.counters.preemptions))
    assert [results[i].token_ids for i in ids] == reference
    assert engine.counters.prefill_chunks > 0, "no prompt was chunked"
    assert preemptions[-1] > 0, "the KV pool was never short: preemption went untested"
    assert engine.slots.counters().allocations > 3, "no slot was reused"
    assert_drained(engine, len(ids))


def test_prefix_caching_changes_no_token(mla_models):
    """Prompts sharing a 37-token system prompt, one after another (later ones map the earlier
    ones' cached latent blocks) and all at once: transformers' tokens, cache on and off."""
    m = mla_models["low-rank-q"]
    rng = random.Random(5)
    system = [rng.randrange(1, 4096) for _ in range(37)]
    prompts = [system + [rng.randrange(1, 4096) for _ in range(n)] for n in (1, 5, 12)]
    reference = [hf_greedy(m["hf"], p, 10) for p in prompts]
    params = SamplingParams(max_tokens=10)
    kw = dict(num_speculative_tokens=3, draft_window=16, capacity=4, max_context=MAX_CONTEXT)
    cached = make_engine(m["target"], m["drafts"]["bigram"], **kw)
    assert [generate(cached, [p], params)[0].token_ids for p in prompts] == reference
    assert cached.counters.prefix_cache_hit_tokens >= 2 * 32, "later requests did not map the system prompt"
    assert [r.token_ids for r in generate(cached, prompts, params)] == reference
    plain = make_engine(m["target"], m["drafts"]["bigram"], **kw, enable_prefix_caching=False)
    assert [r.token_ids for r in generate(plain, prompts, params)] == reference
    assert_drained(cached)


# -- tensor parallel 2 -----------------------------------------------------------------------------


def _tp_rank(rank: int, target: str, draft: str, out: str) -> None:
    """One rank of TP 2: a speculative greedy engine over this rank's shard; its tokens and pools."""
    engine = tp_speculative_engine(target, draft, rank, MAX_CONTEXT)
    runner = engine.target
    tokens = [r.token_ids for r in generate(engine, prompt_set(), sampling())]
    attn = runner.model.model.layers[0].self_attn
    torch.save({"tokens": tokens, "pools": [tuple(p.shape) for p in runner.latent.pools],
                "heads": attn.num_heads}, f"{out}/rank{rank}.pt")


def test_tensor_parallel_2_equals_transformers(mla_models, tmp_path):
    """Two ranks over gloo: each keeps the whole latent per token and expands only its own two of
    the four heads; each rank's speculative greedy engine produces transformers' tokens."""
    m = mla_models["low-rank-q"]
    spawn_tp2(_tp_rank, str(m["target"]), str(m["drafts"]["bigram"]), str(tmp_path))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["heads"] == 2
        assert got["pools"][0][1] == KV_LORA_RANK + ROPE_DIM
        assert got["tokens"] == m["reference"]


# -- dtypes, released configs ------------------------------------------------------------------------------


def test_bfloat16_routing_picks_transformers_experts(tmp_path):
    """transformers keeps DeepSeek-V3's router weight and selection bias in float32 in a bfloat16
    model; so do we, and given the same bfloat16 hidden states each router picks the same experts.
    Rounded to bfloat16, the router would pick others for some tokens (the check has power)."""
    from transformers import AutoModelForCausalLM

    save_deepseek(tmp_path / "ckpt", n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16).eval()
    ours = load(tmp_path / "ckpt", dtype="bfloat16")
    inputs: dict[int, torch.Tensor] = {}
    chosen: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        if hasattr(layer.mlp, "gate"):
            assert layer.mlp.gate.weight.dtype == torch.float32

            def hook(module, args, out, i=i):
                inputs[i] = args[0].reshape(-1, args[0].shape[-1])
                chosen[i] = out[2]

            hooks.append(layer.mlp.gate.register_forward_hook(hook))
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf(ids)
    for h in hooks:
        h.remove()
    assert inputs and all(x.dtype == torch.bfloat16 for x in inputs.values())
    differs = 0
    for i, x in inputs.items():
        moe = ours.model.layers[i].ffn
        assert isinstance(moe, SparseMoE)
        assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
        _, experts = moe.route(moe.gate(x))
        assert torch.equal(experts.sort(-1).values, chosen[i].sort(-1).values), f"layer {i}"
        rounded = torch.nn.functional.linear(x, moe.gate.weight.to(torch.bfloat16)).float()
        from dspark_ray.model.moe import route_grouped

        _, bf16_experts = route_grouped(rounded, moe.gate.e_score_correction_bias.to(torch.bfloat16), moe.moe)
        differs += int((bf16_experts.sort(-1).values != experts.sort(-1).values).any(-1).sum())
    assert differs > 0, "a bfloat16 router chose the same experts everywhere: the check has no power"


def test_the_released_deepseek_v3_config_stores_576_numbers_per_token_and_layer():
    from dspark_ray.model import ModelConfig

    file = Path(__file__).parent / "data" / "model_configs" / "DeepSeek-V3.json"
    if not file.is_file():
        pytest.skip(f"{file} is not in this checkout")
    mla = ModelConfig.from_dict(json.loads(file.read_text())).mla
    assert mla.kv_lora_rank + mla.qk_rope_head_dim == 576


def test_an_fp8_kv_b_proj_is_dequantised_once_for_the_cached_forms():
    """On CUDA an FP8 checkpoint's kv_b_proj may stay FP8 with a block-scaled matmul of its own
    (dspark_ray/model/fp8.py); the cached forms multiply by its weight directly, so they take its
    dequantised copy, made once. (Here on CPU, as keep_quantized would set it up on CUDA.)"""
    import transformers
    from torch import nn

    from dspark_ray.model import ModelConfig
    from dspark_ray.model.fp8 import Fp8Gemm, dequantize, quantize
    from dspark_ray.model.mla import LatentAttention

    config = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                           kv_lora_rank=128, q_lora_rank=None,
                                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    attn = LatentAttention(ModelConfig.from_dict({**config.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}))
    dense = torch.randn(128, 128, generator=torch.Generator().manual_seed(0)) / 128**0.5
    wq, scale = quantize(dense, Fp8Gemm.BLOCK)
    attn.kv_b_proj.weight = nn.Parameter(wq, requires_grad=False)
    attn.kv_b_proj.register_buffer("weight_scale_inv", scale)
    attn.kv_b_proj.gemm = Fp8Gemm(attn.kv_b_proj)
    got = attn.kv_b_weight()
    assert got.dtype == torch.float32 and torch.equal(got, dequantize(wq, scale, Fp8Gemm.BLOCK))
    assert (got - dense).abs().max() < 0.05 * dense.abs().max()
    assert attn.kv_b_weight() is got
    w_uk, w_uv = attn.absorbed_weights()
    assert w_uk.shape == (4, 16, 128) and w_uv.shape == (4, 16, 128)
    assert torch.equal(w_uv[1, 3], got[32 + 16 + 3])  # head 1's rows: 16 key rows, then its values
