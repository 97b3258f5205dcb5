"""DSpark's block drafter (dspark_ray/model/dspark.py) and its per-slot context ring.

The draft under test is loaded from a random-weight checkpoint this file writes in the layout
vLLM loads as speculative method ``dspark``; its outputs are compared with a plain re-statement
of the algorithm below (``reference_block``), written from the description, not from the module.
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare

from conftest import VLLM_PYTHON
from dspark_ray.engine.interfaces import SamplingRow
from dspark_ray.engine.verifier import sample_draft_tokens
from dspark_ray.model import TensorMissing, TensorShapeMismatch, load
from dspark_ray.model.dspark import (
    BlockContext,
    DraftTargetMismatch,
    DSparkConfig,
    DSparkConfigError,
    TargetHeads,
    is_dspark_checkpoint,
    load_dspark,
    tap_hidden_states,
)
from dspark_ray.slots.context_ring import ContextRing

V, H, HEADS, KV_HEADS, HEAD_DIM, TARGET_LAYERS = 48, 32, 4, 2, 8, 4
BLOCK, RANK, MASK = 4, 6, 47

TARGET_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": V, "hidden_size": H,
    "intermediate_size": 64, "num_hidden_layers": TARGET_LAYERS, "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
}

DRAFT_CONFIG = {
    **TARGET_CONFIG, "architectures": ["Qwen3DSparkModel"], "num_hidden_layers": 2, "intermediate_size": 40,
    "block_size": BLOCK, "mask_token_id": MASK, "target_layer_ids": [0, 2], "num_target_layers": TARGET_LAYERS,
    "markov_rank": RANK, "markov_head_type": "vanilla", "enable_confidence_head": True,
    "confidence_head_with_markov": True, "layer_types": ["full_attention", "full_attention"],
}


def draft_tensors(cfg: dict, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random weights under the checkpoint's names (norm weights near 1, so they matter)."""
    gen = torch.Generator().manual_seed(seed)
    h, d, kv, q = cfg["hidden_size"], cfg["head_dim"], cfg["num_key_value_heads"], cfg["num_attention_heads"]
    n_in = len(cfg["target_layer_ids"]) * h
    shapes = {"fc.weight": (h, n_in), "hidden_norm.weight": (h,), "norm.weight": (h,),
              "markov_head.markov_w1.weight": (cfg["vocab_size"], cfg["markov_rank"]),
              "markov_head.markov_w2.weight": (cfg["vocab_size"], cfg["markov_rank"]),
              "confidence_head.proj.weight": (1, h + cfg["markov_rank"]), "confidence_head.proj.bias": (1,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
            p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, q * d),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (cfg["intermediate_size"], h),
            p + "mlp.up_proj.weight": (cfg["intermediate_size"], h),
            p + "mlp.down_proj.weight": (h, cfg["intermediate_size"]),
        })
    out = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen)
        out[name] = 1 + 0.2 * t if name.endswith("norm.weight") else t * (0.5 if "markov" in name else 0.3)
    return out


def write_checkpoint(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def target_path(tmp_path_factory) -> Path:
    """A random Qwen3 target saved by transformers (so its hidden states are an independent reference)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in TARGET_CONFIG.items() if k != "architectures"}))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("target") / "qwen3"
    hf.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def target(target_path):
    return load(target_path, dtype="float32", pack=False)


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("draft") / "dspark", DRAFT_CONFIG, draft_tensors(DRAFT_CONFIG))


@pytest.fixture(scope="module")
def draft(draft_path, target):
    return load_dspark(draft_path, target)


def prompt(length: int, seed: int) -> torch.Tensor:  # [1, length]
    return torch.randint(0, V - 1, (1, length), generator=torch.Generator().manual_seed(seed))


# -- the plain re-statement ---------------------------------------------------------------------


def rms(x, w, eps=1e-6):
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x, pos, theta=10000.0):  # x [T, heads, D], pos [T]
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv
    cos = torch.cat((ang.cos(), ang.cos()), -1).float()[:, None]
    sin = torch.cat((ang.sin(), ang.sin()), -1).float()[:, None]
    return x * cos + torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1) * sin


def reference_block(w, taps, anchor, embed, lm, size=BLOCK, window=None, layers=2, layer_windows=(None, None),
                    causal=(False, False)):
    """One request: ``taps`` [P, n*H] are the target layers' outputs at positions 0..P-1, ``anchor`` the
    token at P; ``window``: the context positions kept, ``layer_windows``/``causal``: each layer's
    sliding window and causality within the block. Returns the hidden states [S, H], the greedy
    Markov tokens, their logits and confidences."""
    p = taps.shape[0]
    ctx = rms(taps @ w["fc.weight"].T, w["hidden_norm.weight"])
    keep = range(p) if window is None else range(max(0, p - window), p)
    ctx_pos = torch.tensor(list(keep), dtype=torch.int64)
    ctx = ctx[ctx_pos]
    qpos = p + torch.arange(size)
    h = embed[torch.tensor([anchor] + [MASK] * (size - 1))]
    for i in range(layers):
        g = lambda n: w[f"layers.{i}.{n}.weight"]  # noqa: E731
        a = rms(h, g("input_layernorm"))
        q = rotate(rms((a @ g("self_attn.q_proj").T).view(size, HEADS, HEAD_DIM), g("self_attn.q_norm")), qpos)
        kb = rotate(rms((a @ g("self_attn.k_proj").T).view(size, KV_HEADS, HEAD_DIM), g("self_attn.k_norm")), qpos)
        vb = (a @ g("self_attn.v_proj").T).view(size, KV_HEADS, HEAD_DIM)
        kc = rotate(rms((ctx @ g("self_attn.k_proj").T).view(-1, KV_HEADS, HEAD_DIM), g("self_attn.k_norm")), ctx_pos)
        vc = (ctx @ g("self_attn.v_proj").T).view(-1, KV_HEADS, HEAD_DIM)
        keys, values = torch.cat((kc, kb)), torch.cat((vc, vb))
        key_pos = torch.cat((ctx_pos, qpos))
        seen = torch.ones(size, len(key_pos), dtype=torch.bool)  # non-causal: the whole block and context
        if causal[i]:
            seen &= (key_pos[None] < p) | (key_pos[None] <= qpos[:, None])
        if layer_windows[i] is not None:
            seen &= key_pos[None] > qpos[:, None] - layer_windows[i]
        out = torch.empty(size, HEADS, HEAD_DIM)
        for head in range(HEADS):
            kvh = head // (HEADS // KV_HEADS)
            scores = (q[:, head] @ keys[:, kvh].T / HEAD_DIM ** 0.5).masked_fill(~seen, float("-inf"))
            out[:, head] = torch.softmax(scores, dim=-1) @ values[:, kvh]
        h = h + out.reshape(size, -1) @ g("self_attn.o_proj").T
        m = rms(h, g("post_attention_layernorm"))
        h = h + (F.silu(m @ g("mlp.gate_proj").T) * (m @ g("mlp.up_proj").T)) @ g("mlp.down_proj").T
    hidden = rms(h, w["norm.weight"])
    base = hidden @ lm.T
    tokens, logits, conf, prev = [], [], [], anchor
    for j in range(size):
        e = w["markov_head.markov_w1.weight"][prev]
        logits.append(base[j] + w["markov_head.markov_w2.weight"] @ e)
        conf.append(torch.sigmoid(torch.cat((hidden[j], e)) @ w["confidence_head.proj.weight"][0]
                                  + w["confidence_head.proj.bias"][0]))
        prev = int(logits[-1].argmax())
        tokens.append(prev)
    return hidden, tokens, torch.stack(logits), torch.stack(conf)


def context_of(draft, target, ids: torch.Tensor) -> tuple[torch.Tensor, BlockContext]:
    """The target's taps for ``ids`` [1, P] and the draft's whole-sequence context from them."""
    _, taps = tap_hidden_states(target, ids, draft.config.target_layer_ids)
    pos = torch.arange(ids.shape[1])[None]
    k, v = draft.context_kv(taps, pos)
    return taps, BlockContext.of(k, v, pos)


# -- loading and the layout ---------------------------------------------------------------------


def test_detected_from_config(draft_path, target_path):
    assert is_dspark_checkpoint(draft_path)
    assert not is_dspark_checkpoint(target_path)
    alias = {**DRAFT_CONFIG, "architectures": ["DSparkDraftModel"]}
    assert DSparkConfig.from_dict(alias).block_size == BLOCK


def test_config_keys_resolved_as_vllm_does():
    # eagle_aux_hidden_state_layer_ids count one higher (the stream entering layer i + 1)
    cfg = DSparkConfig.from_dict({**DRAFT_CONFIG, "target_layer_ids": None, "eagle_aux_hidden_state_layer_ids": [1, 3]})
    assert cfg.target_layer_ids == (0, 2) and cfg.target_layer_key == "eagle_aux_hidden_state_layer_ids"
    cfg = DSparkConfig.from_dict({**DRAFT_CONFIG, "mask_token_id": None, "dspark_noise_token_id": 5,
                                  "block_size": None, "dspark_block_size": 7})
    assert (cfg.mask_token_id, cfg.block_size) == (5, 7)
    cfg = DSparkConfig.from_dict({**DRAFT_CONFIG, "dflash_config": {"mask_token_id": 3, "use_swa": True,
                                                                     "swa_window_size": 16}, "layer_types": None})
    assert cfg.mask_token_id == 3 and cfg.layer_windows == (16, 16) and cfg.layer_causal == (False, False)
    mixed = DSparkConfig.from_dict({**DRAFT_CONFIG, "layer_types": ["sliding_attention", "full_attention"],
                                    "sliding_window": 8})
    assert mixed.layer_windows == (8, None) and mixed.layer_causal == (True, False)


def test_shares_the_targets_embeddings_and_lm_head(draft, target):
    assert draft.embed.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert draft.lm_weight.data_ptr() == target.lm_head.weight.data_ptr()
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in draft.state_dict())


def test_heads_read_from_the_target_checkpoint_alone(draft_path, target_path, target):
    heads = TargetHeads.read(target_path)
    assert torch.equal(heads.embed, target.model.embed_tokens.weight)
    assert torch.equal(heads.lm_head, target.lm_head.weight)
    assert load_dspark(draft_path, heads).config.target_layer_ids == (0, 2)


def test_taps_are_the_residual_stream_after_each_layer(target_path, target):
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(target_path, torch_dtype=torch.float32).eval()
    ids = prompt(9, seed=3)
    with torch.no_grad():
        hf_states = hf(ids, output_hidden_states=True).hidden_states  # [0] embeddings, [i + 1] after layer i
        final, taps = tap_hidden_states(target, ids, (-1, 0, 2))
    expected = torch.cat((hf_states[0], hf_states[1], hf_states[3]), dim=-1)
    torch.testing.assert_close(taps, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, target.hidden_states(ids), atol=1e-6, rtol=1e-6)


# -- the block: our draft against the re-statement ----------------------------------------------


@torch.no_grad()
def test_block_matches_the_plain_restatement(draft, draft_path, target):
    w = load_file(draft_path / "model.safetensors")
    for length, seed in ((1, 0), (6, 1), (13, 2)):
        ids = prompt(length + 1, seed)
        taps, ctx = context_of(draft, target, ids[:, :-1])
        anchor = int(ids[0, -1])
        out = draft.draft(torch.tensor([anchor]), torch.tensor([length]), ctx)
        hidden, tokens, logits, conf = reference_block(w, taps[0], anchor, draft.embed, draft.lm_weight)
        torch.testing.assert_close(draft.block_hidden(torch.tensor([anchor]), torch.tensor([length]), ctx)[0],
                                   hidden, atol=1e-5, rtol=1e-5)
        assert out.tokens[0].tolist() == tokens
        torch.testing.assert_close(out.logits[0], logits, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(out.confidence[0], conf, atol=1e-5, rtol=1e-5)
        assert out.probs is None  # greedy


@torch.no_grad()
def test_sliding_and_causal_layers_match_the_restatement(draft_path, target, tmp_path):
    """A checkpoint whose first layer is a causal sliding-window layer (layer_types, sliding_window)."""
    w = load_file(draft_path / "model.safetensors")
    cfg = {**DRAFT_CONFIG, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3}
    mixed = load_dspark(write_checkpoint(tmp_path / "mixed", cfg, w), target)
    ids = prompt(9, seed=9)
    taps, ctx = context_of(mixed, target, ids[:, :-1])
    out = mixed.draft(ids[0, -1:], torch.tensor([8]), ctx)
    _, tokens, logits, _ = reference_block(w, taps[0], int(ids[0, -1]), mixed.embed, mixed.lm_weight,
                                           layer_windows=(3, None), causal=(True, False))
    assert out.tokens[0].tolist() == tokens
    torch.testing.assert_close(out.logits[0], logits, atol=1e-4, rtol=1e-5)
    plain = reference_block(w, taps[0], int(ids[0, -1]), mixed.embed, mixed.lm_weight)[2]
    assert not torch.allclose(plain, logits, atol=1e-3)  # the masks matter here


@torch.no_grad()
def test_padded_batch_equals_each_row_alone(draft, target):
    """Rows of different context lengths padded into one batch draft what each drafts alone."""
    lengths, anchors = (3, 11, 7), (5, 9, 2)
    alone, ks, vs, poss = [], [], [], []
    for i, n in enumerate(lengths):
        _, ctx = context_of(draft, target, prompt(n, seed=10 + i))
        alone.append(draft.draft(torch.tensor([anchors[i]]), torch.tensor([n]), ctx, num_query=3))
        pad = max(lengths) - n
        ks.append([F.pad(k, (0, 0, 0, 0, 0, pad)) for k in ctx.k])
        vs.append([F.pad(v, (0, 0, 0, 0, 0, pad)) for v in ctx.v])
        poss.append(F.pad(ctx.positions, (0, pad), value=-1))
    ctx = BlockContext.of([torch.cat(layer) for layer in zip(*ks)], [torch.cat(layer) for layer in zip(*vs)],
                          torch.cat(poss))
    batch = draft.draft(torch.tensor(anchors), torch.tensor(lengths), ctx, num_query=3)
    for i, one in enumerate(alone):
        assert batch.tokens[i].tolist() == one.tokens[0].tolist()
        torch.testing.assert_close(batch.logits[i], one.logits[0], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_ring_window_equals_the_restatement_with_that_window(draft, draft_path, target):
    """Through the per-slot ring, a block sees the last ``window`` context positions."""
    w = load_file(draft_path / "model.safetensors")
    window = 5
    ring = ContextRing(2, capacity=3, window=window, block_size=BLOCK, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    ids = prompt(17, seed=4)
    _, taps = tap_hidden_states(target, ids, draft.config.target_layer_ids)
    ring.bind([2], [1])
    for lo, hi in ((0, 12), (12, 13), (13, 16)):  # a prefill, then a token at a time (as the target commits)
        pos = torch.arange(lo, hi)[None]
        ring.write([2], pos, *draft.context_kv(taps[:, lo:hi], pos))
    anchor = int(ids[0, 16])
    out = draft.draft(torch.tensor([anchor]), torch.tensor([16]), ring.view([2], [16]))
    _, tokens, logits, _ = reference_block(w, taps[0, :16], anchor, draft.embed, draft.lm_weight, window=window)
    assert out.tokens[0].tolist() == tokens
    torch.testing.assert_close(out.logits[0], logits, atol=1e-4, rtol=1e-5)


@pytest.mark.vllm
@torch.no_grad()
def test_proposals_equal_vllms(draft, draft_path, target, target_path, tmp_path):
    """vLLM's own Qwen3DSparkForCausalLM, loaded from the same checkpoint by its own loader, gives
    the same context K/V, block hidden states, greedy proposals, logits and confidences
    (tests/vllm_dspark_pieces.py: its CPU build cannot run method dspark end to end, so the
    attention kernel alone is replaced there)."""
    ids = prompt(10, seed=8)
    length, anchor = 9, int(ids[0, 9])
    _, taps = tap_hidden_states(target, ids[:, :length], draft.config.target_layer_ids)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.save({"taps": taps[0], "positions": torch.arange(length), "anchor": anchor, "block_size": BLOCK,
                "embed": target.model.embed_tokens.weight, "lm_head": target.lm_head.weight, "port": port},
               tmp_path / "in.pt")
    run = subprocess.run([str(VLLM_PYTHON), str(Path(__file__).parent / "vllm_dspark_pieces.py"), str(target_path),
                          str(draft_path), str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                         capture_output=True, text=True, timeout=400,
                         env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")
    pos = torch.arange(length)[None]
    k, v = draft.context_kv(taps, pos)
    torch.testing.assert_close(torch.stack([x[0] for x in k]), theirs["context_k"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack([x[0] for x in v]), theirs["context_v"], atol=1e-5, rtol=1e-5)
    ours = draft.draft(torch.tensor([anchor]), torch.tensor([length]), BlockContext.of(k, v, pos))
    hidden = draft.block_hidden(torch.tensor([anchor]), torch.tensor([length]), BlockContext.of(k, v, pos))
    torch.testing.assert_close(hidden[0], theirs["hidden"], atol=1e-5, rtol=1e-5)
    assert ours.tokens[0].tolist() == theirs["tokens"]
    torch.testing.assert_close(ours.logits[0], theirs["logits"], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ours.confidence[0], theirs["confidence"], atol=1e-5, rtol=1e-5)


# -- the Markov head: greedy and sampled ----------------------------------------------------------


def row_sampler(rows: list[SamplingRow], anchor_positions: list[int]):
    """The engine's draft sampling (SamplingRow; draws keyed by (seed, the token's position))."""
    return lambda logits, j: sample_draft_tokens(logits, rows, [p + j + 1 for p in anchor_positions])


@torch.no_grad()
def test_greedy_is_deterministic_and_chains_the_argmax(draft, target):
    _, ctx = context_of(draft, target, prompt(8, seed=5))
    first = draft.draft(torch.tensor([7]), torch.tensor([8]), ctx)
    again = draft.draft(torch.tensor([7]), torch.tensor([8]), ctx)
    rows = [SamplingRow(temperature=0.0, top_p=1.0, top_k=0, seed=3)]
    via_rows = draft.draft(torch.tensor([7]), torch.tensor([8]), ctx, sample=row_sampler(rows, [8]))
    assert first.tokens.tolist() == again.tokens.tolist() == via_rows.tokens.tolist()
    assert first.tokens[0].tolist() == first.logits[0].argmax(-1).tolist()
    # each position's bias is the previous token's: flipping the anchor changes position 0's logits
    other = draft.draft(torch.tensor([8]), torch.tensor([8]), ctx)
    assert not torch.allclose(other.logits[0, 0], first.logits[0, 0])


@torch.no_grad()
def test_sampled_tokens_follow_q(draft, target):
    """q sums to 1, every token lies in q's support, and the token frequencies follow q (chi-square),
    at position 0 and, given the token drawn there, at position 1; the same test rejects the
    distribution without the Markov bias (it has the power to see the head)."""
    n = 6000
    _, ctx = context_of(draft, target, prompt(6, seed=6))
    base = draft.base_logits(draft.block_hidden(torch.tensor([4]), torch.tensor([6]), ctx, num_query=2))
    rows = [SamplingRow(temperature=0.8, top_p=0.95, top_k=30, seed=1000 + i) for i in range(n)]
    anchors = torch.full((n,), 4)
    tokens, logits, probs, _ = draft.sample_block(base.expand(n, -1, -1), anchors, row_sampler(rows, [6] * n))
    torch.testing.assert_close(probs.sum(-1), torch.ones(n, 2))
    assert bool((probs.gather(-1, tokens[..., None]) > 0).all())

    def fits(sample: torch.Tensor, q: torch.Tensor) -> float:  # the chi-square p-value of sample ~ q
        support = q > 0
        counts = torch.bincount(sample, minlength=q.numel()).double()
        assert counts[~support].sum() == 0
        expected = q[support].double() / q[support].double().sum() * len(sample)
        return chisquare(counts[support].numpy(), expected.numpy()).pvalue

    assert fits(tokens[:, 0], probs[0, 0]) > 1e-3
    t = int(torch.mode(tokens[:, 0]).values)
    given = tokens[:, 0] == t
    assert int(given.sum()) > 300
    assert fits(tokens[given, 1], probs[given][0, 1]) > 1e-3
    no_markov = sample_draft_tokens(base[:, 0].clone(), rows[:1], [7])[1][0]
    assert fits(tokens[:, 0], no_markov.clamp_min(1e-6)) < 1e-6


# -- the per-slot ring under a random schedule --------------------------------------------------


class SlotReference:
    """What one slot should show: the positions written in its current epoch (``data``) that its
    ring still holds (``held``: ring index -> the position written there last)."""

    def __init__(self) -> None:
        self.epoch, self.length, self.data, self.held, self.high, self.deep = 0, 0, set(), {}, 0, False

    def visible(self, anchor: int, window: int, ring: int) -> set[int]:
        return {p for p in self.data if anchor - window <= p < anchor and self.held.get(p % ring) == p}


def tagged(slot: int, epoch: int, positions: torch.Tensor, layers: int) -> tuple[list, list]:
    """K/V whose values name their slot, epoch, position and layer (any mixing shows)."""
    tag = (slot * 100000 + epoch * 1000 + positions.clamp_min(0)).float()[..., None, None]  # [B, T, 1, 1]
    k = [torch.cat((tag, torch.full_like(tag, layer)), dim=-1) for layer in range(layers)]
    return k, [-x for x in k]


@pytest.mark.parametrize("seed", range(4))
def test_ring_never_mixes_slots_under_a_random_schedule(seed):
    rnd = random.Random(seed)
    capacity, window, block, layers = 4, 5, 3, 2
    ring = ContextRing(layers, capacity, window, block, kv_heads=1, head_dim=2)
    refs = {s: SlotReference() for s in range(1, capacity + 1)}
    next_epoch, seen = 1, {"rollback": 0, "gap": 0, "reuse": 0, "long": 0, "exact": 0}
    for _ in range(300):
        slots = rnd.sample(range(1, capacity + 1), rnd.randint(1, capacity))  # rows in a random order
        for s in slots:
            if refs[s].epoch == 0 or rnd.random() < 0.08:  # (re)allocated: a new epoch
                seen["reuse"] += refs[s].epoch != 0
                refs[s] = SlotReference()
                refs[s].epoch, next_epoch = next_epoch, next_epoch + 1
        ring.bind(slots, [refs[s].epoch for s in slots])
        op = rnd.random()
        if op < 0.5:  # write: continue, rewrite rejected drafts, or jump past a gap
            starts, ends = [], []
            for s in slots:
                r, kind = refs[s], rnd.random()
                start = r.length if kind < 0.6 else max(0, r.length - rnd.randint(1, block)) if kind < 0.9 \
                    else r.length + rnd.randint(1, 4)
                starts.append(start)
                ends.append(start + rnd.choice([1, 2, 3, rnd.randint(1, 3 * (window + block))]))
            width = max(e - a for a, e in zip(starts, ends))
            pos = torch.tensor([list(range(a, e)) + [-1] * (width - (e - a)) for a, e in zip(starts, ends)])
            k, v = zip(*[tagged(s, refs[s].epoch, pos[i:i + 1], layers) for i, s in enumerate(slots)])
            ring.write(slots, pos, [torch.cat(x) for x in zip(*k)], [torch.cat(x) for x in zip(*v)])
            for s, a, e in zip(slots, starts, ends):
                r = refs[s]
                seen["gap"] += a > r.length
                seen["long"] += e - a > window + block
                r.data = set() if a > r.length else {p for p in r.data if p < a}
                for p in range(max(a, e - window - block), e):
                    r.data.add(p)
                    r.held[p % (window + block)] = p
                r.deep |= a < r.high - block  # further back than rejected drafts ever go
                r.length, r.high = e, max(r.high, e)
        elif op < 0.75:  # rollback after rejection (sometimes deeper than a block)
            lengths = []
            for s in slots:
                r = refs[s]
                # rejected drafts go back to the committed length (at most a block behind what was
                # written); now and then a deeper cut (a resent request), which may only show less
                cut = max(0, min(rnd.randint(0, block), r.length - r.high + block)) if rnd.random() < 0.9 \
                    else rnd.randint(0, r.length)
                r.length = max(0, r.length - cut)
                r.data = {p for p in r.data if p < r.length}
                lengths.append(r.length)
                seen["rollback"] += cut > 0
            ring.set_length(slots, lengths)
        anchors = [refs[s].length if rnd.random() < 0.8 else rnd.randint(0, refs[s].length + 3) for s in slots]
        view = ring.view(slots, anchors)
        for i, s in enumerate(slots):
            r = refs[s]
            shown = {int(p): float(view.k[layer][i, j, 0, 0]) for layer in range(layers)
                     for j, p in enumerate(view.positions[i]) if view.visible[i, j]}
            expected = r.visible(anchors[i], window, window + block)
            assert set(shown) <= expected, (s, shown, expected)
            if not (r.deep or r.length < r.high - block):  # a deep rollback may show less, never more
                assert set(shown) == expected
                seen["exact"] += bool(expected)
            for p, value in shown.items():
                assert value == s * 100000 + r.epoch * 1000 + p  # this slot's, this epoch's, this position's
            for layer in range(layers):
                vis = view.visible[i]
                assert bool((view.k[layer][i, vis, 0, 1] == layer).all())
                assert torch.equal(view.v[layer][i, vis], -view.k[layer][i, vis])
    # the schedule really reused slots, rolled back, jumped, wrote long rows, and mostly checked exactly
    assert all(seen.values()) and seen["exact"] > 200, seen


# -- bad checkpoints ---------------------------------------------------------------------------


@pytest.mark.parametrize("change, error, words", [
    ({"target_layer_ids": [0, 4]}, DraftTargetMismatch, ["target_layer_ids", "[0, 4]", "4 layers"]),
    ({"target_layer_ids": [-2, 1]}, DSparkConfigError, ["target_layer_ids"]),
    ({"target_layer_ids": [2, 0]}, DSparkConfigError, ["target_layer_ids", "strictly increasing"]),
    ({"target_layer_ids": None, "eagle_aux_hidden_state_layer_ids": [1, 5]}, DraftTargetMismatch,
     ["eagle_aux_hidden_state_layer_ids", "4 layers"]),
    ({"num_target_layers": 6}, DraftTargetMismatch, ["num_target_layers", "6", "4 layers"]),
    ({"hidden_size": 24}, DraftTargetMismatch, ["hidden_size", "24", "hidden_size 32"]),
    ({"target_hidden_size": 40}, DraftTargetMismatch, ["target_hidden_size", "40", "hidden_size 32"]),
    ({"vocab_size": 50}, DraftTargetMismatch, ["vocab_size", "50", "vocab_size 48"]),
    ({"draft_vocab_size": 50}, DSparkConfigError, ["draft_vocab_size", "50", "1..vocab_size (48)"]),
    ({"draft_vocab_size": 40}, TensorShapeMismatch, ["markov_w2", "(40, 6)"]),  # a reduced head's weights
    ({"mask_token_id": 99}, DSparkConfigError, ["mask_token_id", "99"]),
    ({"mask_token_id": None}, DSparkConfigError, ["mask_token_id"]),
    ({"markov_head_type": "rnn"}, DSparkConfigError, ["markov_head_type"]),
    ({"sample_from_anchor": False}, DSparkConfigError, ["sample_from_anchor"]),
    ({"block_size": 0}, DSparkConfigError, ["block_size"]),
])
def test_bad_config_refused_naming_the_field(draft_path, target, tmp_path, change, error, words):
    folder = write_checkpoint(tmp_path / "bad", {**DRAFT_CONFIG, **change}, load_file(draft_path / "model.safetensors"))
    with pytest.raises(error) as info:
        load_dspark(folder, target)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_bad_tensors_refused_naming_them(draft_path, target, tmp_path):
    tensors = load_file(draft_path / "model.safetensors")
    missing = {k: v for k, v in tensors.items() if k != "markov_head.markov_w1.weight"}
    with pytest.raises(TensorMissing, match="markov_head.markov_w1.weight"):
        load_dspark(write_checkpoint(tmp_path / "missing", DRAFT_CONFIG, missing), target)
    wrong = {**tensors, "fc.weight": tensors["fc.weight"][:, :H]}
    with pytest.raises(TensorShapeMismatch, match=r"fc.weight.*\(32, 32\).*\(32, 64\)"):
        load_dspark(write_checkpoint(tmp_path / "shape", DRAFT_CONFIG, wrong), target)


def test_own_embedding_kept_only_when_it_differs(draft_path, target, tmp_path):
    tensors = load_file(draft_path / "model.safetensors")
    same = {**tensors, "embed_tokens.weight": target.model.embed_tokens.weight.clone()}
    shared = load_dspark(write_checkpoint(tmp_path / "same", DRAFT_CONFIG, same), target)
    assert shared.embed.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    own = {**tensors, "lm_head.weight": torch.randn(V, H)}
    kept = load_dspark(write_checkpoint(tmp_path / "own", DRAFT_CONFIG, own), target)
    assert torch.equal(kept.lm_weight, own["lm_head.weight"])


def test_confidence_head_absent_when_not_shipped(draft_path, target, tmp_path):
    tensors = {k: v for k, v in load_file(draft_path / "model.safetensors").items() if "confidence" not in k}
    model = load_dspark(write_checkpoint(tmp_path / "noconf", DRAFT_CONFIG, tensors), target)
    _, ctx = context_of(model, target, prompt(4, seed=7))
    assert model.draft(torch.tensor([1]), torch.tensor([4]), ctx).confidence is None
