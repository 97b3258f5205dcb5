"""A DSpark draft with a reduced vocabulary (``draft_vocab_size`` N < V, ``d2t``; EAGLE-3 / FR-Spec).

Its LM head holds N rows and its Markov head's output projection N rows; a block's logits are
placed at their target ids (-inf elsewhere) before anything is drawn, so tokens are target ids and
q is a distribution over the target's vocabulary, zero outside the N. What is checked:

- the block equals the full-vocabulary draft's restricted to the N ids (same weights on those
  rows), logits, greedy tokens and the ids they map to;
- the checkpoint needs ``d2t`` (and refuses a bad one); without ``lm_head.weight`` the target
  head's rows are taken;
- in the engine: greedy output equals the target alone on the shipped pair, and drafts never
  leave the N ids; ids past the tokenizer's vocabulary are never proposed;
- sampled output follows the target's distribution (test_engine_sampling's chi-square test) with a
  draft that can propose only 3 of the 5 tiny-vocabulary ids.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
from engine_fixtures import TinyVocabModels, generate, make_engine, tiny_vocab_models  # noqa: F401 - fixture
from safetensors.torch import load_file
from test_dspark_draft import (
    DRAFT_CONFIG,
    context_of,
    draft_tensors,
    prompt,
    write_checkpoint,
)
from test_dspark_engine import (  # noqa: F401 - fixtures
    BLOCK,
    CONFIG,
    MAX_TOKENS,
    dspark_path,
    prompt_set,
    reference,
    target_path,
)
from test_engine_sampling import (
    LENGTH,
    NUM_SAMPLES,
    P_VALUE_FLOOR,
    chi_square,
    exact_distribution,
    sample_counts,
)

from dspark_ray.engine import SamplingParams
from dspark_ray.engine.dspark_proposer import DSparkProposer
from dspark_ray.engine.interfaces import ProposeRow, SamplingRow
from dspark_ray.model import ModelLoadError, TensorMissing, TensorShapeMismatch, load
from dspark_ray.model.dspark import load_dspark

KEEP = [0, 3, 5, 7, 11, 12, 20, 21, 30, 33, 40, 46, 47]  # the tiny draft's N = 13 of 48 ids (47: the mask)


def reduced(tensors: dict[str, torch.Tensor], config: dict, ids: list[int], lm: torch.Tensor | None,
            folder: Path, head: bool = True) -> Path:
    """``tensors`` of a full-vocabulary draft cut to the vocabulary ``ids``: its Markov output rows
    and (``head``) the LM head ``lm``'s rows shipped, ``d2t`` as offsets."""
    idx = torch.tensor(ids)
    out = {**tensors, "markov_head.markov_w2.weight": tensors["markov_head.markov_w2.weight"][idx],
           "d2t": idx - torch.arange(len(ids))}
    if head:
        out["lm_head.weight"] = lm[idx].clone()
    return write_checkpoint(folder, {**config, "draft_vocab_size": len(ids)}, out)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from test_dspark_draft import TARGET_CONFIG
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in TARGET_CONFIG.items() if k != "architectures"}))
    folder = tmp_path_factory.mktemp("target") / "qwen3"
    hf.save_pretrained(folder, safe_serialization=True)
    return load(folder, dtype="float32", pack=False)


@torch.no_grad()
def test_block_is_the_full_drafts_restricted_to_its_ids(tiny_target, tmp_path):
    tensors = draft_tensors(DRAFT_CONFIG)
    full = load_dspark(write_checkpoint(tmp_path / "full", DRAFT_CONFIG, tensors), tiny_target)
    small = load_dspark(reduced(tensors, DRAFT_CONFIG, KEEP, tiny_target.lm_head.weight, tmp_path / "small"),
                        tiny_target)
    assert small.lm_weight.shape == (len(KEEP), DRAFT_CONFIG["hidden_size"])
    assert small.draft_to_target.tolist() == KEEP
    ids = torch.tensor(KEEP)

    def restricted(logits, j):  # the full draft's argmax among KEEP (what the small one can propose)
        return ids[logits[:, ids].argmax(-1)], None

    for length, seed in ((1, 0), (7, 1), (12, 2)):
        _, ctx = context_of(full, tiny_target, prompt(length, seed))
        anchor, pos = torch.tensor([5]), torch.tensor([length])
        ours = small.draft(anchor, pos, ctx)
        hidden = full.block_hidden(anchor, pos, ctx)
        tokens, logits, _, embeds = full.sample_block(full.base_logits(hidden), anchor, restricted)
        assert ours.tokens.tolist() == tokens.tolist() and set(ours.tokens.flatten().tolist()) <= set(KEEP)
        torch.testing.assert_close(ours.logits[..., ids], logits[..., ids], atol=1e-5, rtol=1e-5)
        outside = torch.ones(DRAFT_CONFIG["vocab_size"], dtype=torch.bool)
        outside[ids] = False
        assert bool(torch.isinf(ours.logits[..., outside]).all())
        torch.testing.assert_close(ours.confidence, full.confidence(hidden, embeds))


def test_head_taken_from_the_target_when_not_shipped(tiny_target, tmp_path):
    tensors = draft_tensors(DRAFT_CONFIG)
    shipped_head = load_dspark(reduced(tensors, DRAFT_CONFIG, KEEP, tiny_target.lm_head.weight, tmp_path / "a"),
                               tiny_target)
    no_head = load_dspark(reduced(tensors, DRAFT_CONFIG, KEEP, None, tmp_path / "b", head=False), tiny_target)
    assert torch.equal(no_head.lm_weight, shipped_head.lm_weight)


@pytest.mark.parametrize("change, error, words", [
    ("no d2t", TensorMissing, ["d2t", "draft_vocab_size 13"]),
    ("short d2t", TensorShapeMismatch, ["d2t", "[13]"]),
    ("repeated id", ModelLoadError, ["distinct target ids"]),
    ("id past the vocabulary", ModelLoadError, ["0..47"]),
    ("head of the wrong size", TensorShapeMismatch, ["lm_head.weight", "(13, 32)"]),
])
def test_bad_maps_refused(tiny_target, tmp_path, change, error, words):
    folder = reduced(draft_tensors(DRAFT_CONFIG), DRAFT_CONFIG, KEEP, tiny_target.lm_head.weight, tmp_path / "r")
    tensors = load_file(folder / "model.safetensors")
    d2t = tensors.pop("d2t")
    if change == "short d2t":
        d2t = d2t[:-1]
    elif change == "repeated id":
        d2t = d2t.clone()
        d2t[1] = KEEP[0] - 1  # draft id 1 -> target id 0, as draft id 0
    elif change == "id past the vocabulary":
        d2t = d2t.clone()
        d2t[-1] += 1
    elif change == "head of the wrong size":
        tensors["lm_head.weight"] = tensors["lm_head.weight"][:-1]
    if change != "no d2t":
        tensors["d2t"] = d2t
    bad = write_checkpoint(tmp_path / "bad", {**DRAFT_CONFIG, "draft_vocab_size": len(KEEP)}, tensors)
    with pytest.raises(error) as info:
        load_dspark(bad, tiny_target)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# -- in the engine -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reduced_shipped(tmp_path_factory, dspark_path, reference, target_path) -> tuple[Path, list[int]]:  # noqa: F811
    """test_dspark_engine's draft for the shipped target (its Markov head knows the target's most
    frequent greedy transitions) cut to 1024 ids: every id of the reference outputs but every
    other one of the 64 most frequent (so some of the target's tokens cannot be drafted and
    those steps reject), then others up to 1024."""
    counts: dict[int, int] = {}
    for out in reference.values():
        for t in out:
            counts[t] = counts.get(t, 0) + 1
    frequent = sorted(counts, key=lambda t: -counts[t])
    dropped = set(frequent[1:64:2])
    keep = [t for t in frequent if t not in dropped]
    rng = random.Random(0)
    rest = [t for t in range(4096) if t not in counts and t != DRAFT_CONFIG["mask_token_id"]]
    keep = sorted(keep + rng.sample(rest, 1024 - len(keep)))
    tensors = load_file(dspark_path / "model.safetensors")
    config = json.loads((dspark_path / "config.json").read_text())
    head = load(target_path, dtype="float32").lm_weight
    folder = reduced(tensors, config, keep, head, tmp_path_factory.mktemp("reduced") / "shipped")
    return folder, keep


class KeptProposals:
    def __init__(self, inner) -> None:
        self.inner, self.tokens = inner, set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, rows):
        proposal = self.inner.propose(rows)
        for drafts in proposal.draft_token_ids:
            self.tokens.update(drafts)
        return proposal


def test_greedy_equals_the_target_alone(target_path, reduced_shipped, reference):  # noqa: F811
    folder, keep = reduced_shipped
    engine = make_engine(target_path, folder, **CONFIG)
    assert isinstance(engine.draft, DSparkProposer) and engine.draft.model.config.reduced_vocab
    engine.draft = kept = KeptProposals(engine.draft)
    prompts = prompt_set()
    results = generate(engine, prompts, [SamplingParams(max_tokens=n) for n in MAX_TOKENS])
    for p, res in zip(prompts, results):
        assert res.token_ids == reference[tuple(p)], f"prompt of {len(p)} tokens"
    assert kept.tokens and kept.tokens <= set(keep)
    spec = [r.spec for r in results]
    rate = sum(s.accepted_tokens for s in spec) / sum(s.draft_tokens for s in spec)
    assert 0.1 < rate < 0.95, rate
    assert any(set(out) - set(keep) for out in reference.values())  # the target said what the draft could not


def test_ids_past_the_tokenizer_are_never_proposed(target_path, reduced_shipped):  # noqa: F811
    """A vocab_limit below some of the draft's ids (embedding padding): those are masked in the
    draft's own vocabulary, greedy and sampled."""
    folder, keep = reduced_shipped
    engine = make_engine(target_path, folder, **CONFIG)
    limit = keep[len(keep) // 2]
    proposer = DSparkProposer(engine.draft.model, 3, 64, 4, vocab_limit=limit)
    rows = [ProposeRow(1, 1, 0, (5, 6, 7), 4, SamplingRow(0.0, 1.0, 0, 0)),
            ProposeRow(2, 1, 0, (9,), 4, SamplingRow(2.0, 1.0, 0, 3))]
    for _ in range(3):
        proposal = proposer.propose(rows)
        assert all(t < limit for drafts in proposal.draft_token_ids for t in drafts)
        assert float(proposal.draft_probs[1, :, limit:].sum()) == 0.0
    allowed = torch.zeros(4096, dtype=torch.bool)
    allowed[torch.tensor([t for t in keep if t < limit])] = True
    assert float(proposal.draft_probs[1][:, ~allowed].sum()) == 0.0
    torch.testing.assert_close(proposal.draft_probs[1, :BLOCK].sum(-1), torch.ones(BLOCK))


@pytest.fixture(scope="module")
def tiny_reduced(tmp_path_factory, tiny_vocab_models: TinyVocabModels) -> TinyVocabModels:  # noqa: F811
    """The tiny-vocabulary pair (5 ids) with a DSpark draft that proposes only ids 0, 2 and 3."""
    cfg = {**DRAFT_CONFIG, "vocab_size": 5, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 8, "intermediate_size": 40, "num_hidden_layers": 1, "layer_types": ["full_attention"],
           "block_size": BLOCK, "mask_token_id": 4, "target_layer_ids": [0, 1], "num_target_layers": 2,
           "markov_rank": 3}
    target = load(tiny_vocab_models.target, dtype="float32")
    path = reduced(draft_tensors(cfg, seed=3), cfg, [0, 2, 3], target.lm_weight,
                   tmp_path_factory.mktemp("dspark") / "tiny_reduced")
    return dataclasses.replace(tiny_vocab_models, draft=path)


@pytest.mark.parametrize("k, params", [(2, dict(temperature=1.0)), (3, dict(temperature=1.5, top_k=4, top_p=0.95))])
def test_sampled_sequences_follow_the_target_distribution(tiny_reduced: TinyVocabModels, k, params):
    """test_engine_sampling's chi-square test (its power is shown there) with the reduced draft: ids
    1 and 4 are never drafted, so every one of them the output holds came from a recovery or bonus
    draw, and the law is the target's all the same."""
    expected = exact_distribution(tiny_reduced.target, tiny_reduced.vocab, params["temperature"],
                                  params.get("top_k", 0), params.get("top_p", 1.0))
    counts, specs, _ = sample_counts(tiny_reduced, k, params)
    assert sum(counts.values()) == NUM_SAMPLES and all(len(s) == LENGTH for s in counts)
    stat, df, p_value = chi_square(counts, expected, NUM_SAMPLES)
    assert df >= 6
    assert p_value > P_VALUE_FLOOR, f"chi2 {stat:.1f} on {df} df: p = {p_value:.2e}"
    accepted = sum(s.accepted_tokens for s in specs) / sum(s.draft_tokens for s in specs)
    assert 0.1 < accepted < 0.95, f"acceptance {accepted:.2f}: the draft should be partly right"
    assert any({1, 4} & set(seq) for seq in counts)
