"""Sampling: seeded runs repeat exactly, and sampled output follows the target's distribution.

The distribution test uses a 5-token vocabulary, so every 3-token output can
be enumerated: its exact probability under the target (temperature, top-k
and top-p applied here independently of the engine, on transformers' logits)
is compared with thousands of sampled requests by a chi-square test at fixed
seeds. The draft is an unrelated random model, so its q differs from p and
acceptance is partial (or prompt lookup, ``draft: ngram``, whose drafts are point masses); ``test_chi_square_has_power`` checks that the same
test rejects the distribution a broken rule would give (every draft
accepted), so a pass is evidence, not an accident of a weak test.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dspark_ray.engine import SamplingParams
from engine_fixtures import (  # noqa: F401 - fixtures
    ProposalLog,
    TinyModels,
    TinyVocabModels,
    assert_drained,
    generate,
    make_engine,
    tiny_models,
    tiny_vocab_models,
)

PROMPT = [1, 2]  # "a b"
LENGTH = 3
NUM_SAMPLES = 2560  # 40 batches of 64
P_VALUE_FLOOR = 1e-3


def processed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[V] logits -> [V] probabilities: temperature, then top-k, then top-p over the top-k renormalised."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    kept_mass = 0.0
    top = probs[order[: top_k or len(probs)]]
    top = top / top.sum()
    for rank, idx in enumerate(order[: top_k or len(probs)].tolist()):
        if rank > 0 and kept_mass >= top_p:
            break
        keep[idx] = True
        kept_mass += float(top[rank])
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


def exact_distribution(model_dir, vocab: int, temperature: float, top_k: int, top_p: float) -> dict:
    """P(x1, x2, x3 | PROMPT) for every sequence, from full forwards of the transformers model."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prefixes = list(itertools.product(range(vocab), repeat=LENGTH - 1))
    ids = torch.tensor([PROMPT + list(p) for p in prefixes])
    with torch.no_grad():
        logits = model(ids).logits  # [N, len, V]
    dist = {}
    first = len(PROMPT) - 1
    for n, prefix in enumerate(prefixes):
        step_probs = [processed(logits[n, first + i], temperature, top_k, top_p) for i in range(LENGTH)]
        for last in range(vocab):
            seq = prefix + (last,)
            dist[seq] = math.prod(float(step_probs[i][seq[i]]) for i in range(LENGTH))
    total = sum(dist.values())
    assert abs(total - 1.0) < 1e-9
    return dist


def chi_square(counts: dict, expected_probs: dict, n: int) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value); cells expected below 5 are pooled."""
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for seq, p in expected_probs.items():
        e = n * p
        if e < 5:
            pooled_obs += counts.get(seq, 0)
            pooled_exp += e
        else:
            cells.append((counts.get(seq, 0), e))
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, df, p_value


def sample_counts(models: TinyVocabModels, k: int | None, params: dict, n: int = NUM_SAMPLES,
                  wide: bool = False, ngram: bool = False) -> tuple[dict, list, list]:
    target = models.wide_target if wide else models.target
    draft = (models.wide_draft if wide else models.draft) if k else None
    lookup = {}
    if ngram:  # prompt lookup from the shortest suffix: in a 5-token vocabulary most steps find one
        draft, lookup = "ngram", dict(prompt_lookup_min=1, prompt_lookup_max=2)
    engine = make_engine(target, draft, num_speculative_tokens=k or 1, capacity=64, max_num_seqs=64,
                         max_context=16, **lookup)
    if draft:
        engine.draft = log = ProposalLog(engine.draft)
    counts: dict[tuple, int] = {}
    specs = []
    for start in range(0, n, 64):
        sp = [SamplingParams(max_tokens=LENGTH, ignore_eos=True, seed=s, **params) for s in range(start, start + 64)]
        for res in generate(engine, [PROMPT] * 64, sp):
            assert len(res.token_ids) == LENGTH and res.finish_reason == "length"
            counts[tuple(res.token_ids)] = counts.get(tuple(res.token_ids), 0) + 1
            specs.append(res.spec)
    assert_drained(engine, n)
    return counts, specs, (log.token_ids if draft else [])


CASES = {
    "t1-spec2": (2, dict(temperature=1.0)),
    "t1-spec2-wide-draft": (2, dict(temperature=1.0)),
    "t1-spec1": (1, dict(temperature=1.0)),
    "t1-ngram2": (2, dict(temperature=1.0)),
    "t1-nospec": (None, dict(temperature=1.0)),
    "topk-topp-spec2": (2, dict(temperature=1.5, top_k=4, top_p=0.95)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_sequences_follow_the_target_distribution(tiny_vocab_models: TinyVocabModels, case):
    k, params = CASES[case]
    expected = exact_distribution(tiny_vocab_models.target, tiny_vocab_models.vocab, params["temperature"],
                                  params.get("top_k", 0), params.get("top_p", 1.0))
    wide = case.endswith("wide-draft")
    counts, specs, proposed = sample_counts(tiny_vocab_models, k, params, wide=wide, ngram="ngram" in case)
    assert all(expected[seq] > 0 for seq in counts), "sampled a sequence the target gives probability 0"
    if wide:  # the draft proposed ids the target lacks (always rejected), and the rule stayed exact
        print(f"{case}: {sum(t >= tiny_vocab_models.vocab for t in proposed) / len(proposed):.2f} of drafts outside")
        assert sum(t >= tiny_vocab_models.vocab for t in proposed) > len(proposed) // 10
    if "top_k" in params:  # the filters really cut tokens, or this case would test nothing new
        assert sum(p == 0 for p in expected.values()) > len(expected) // 3
    stat, df, p_value = chi_square(counts, expected, NUM_SAMPLES)
    assert df >= 6
    print(f"{case}: chi2 {stat:.1f} on {df} df, p = {p_value:.3f}")
    assert p_value > P_VALUE_FLOOR, f"chi2 {stat:.1f} on {df} df: p = {p_value:.2e}"
    if k:
        accepted = sum(s.accepted_tokens for s in specs) / sum(s.draft_tokens for s in specs)
        print(f"{case}: acceptance {accepted:.2f}")
        assert 0.2 < accepted < 0.9, f"acceptance {accepted:.2f}: the draft should be partly right"


def test_chi_square_has_power(tiny_vocab_models: TinyVocabModels):
    """The distribution of a broken rule (accept every draft, k = 2) is far outside the test's range.

    Accept-all emits x1 ~ q, x2 ~ q and x3 ~ p. With the sample size above, the
    expected chi-square statistic under that distribution is the noncentrality
    N * sum((P_broken - P)^2 / P) plus df: it must clear the rejection threshold
    by a wide margin.
    """
    from transformers import LlamaForCausalLM

    m = tiny_vocab_models
    p = exact_distribution(m.target, m.vocab, 1.0, 0, 1.0)
    draft = LlamaForCausalLM.from_pretrained(m.draft, dtype=torch.float32).eval()
    target = LlamaForCausalLM.from_pretrained(m.target, dtype=torch.float32).eval()
    broken = {}
    with torch.no_grad():
        for seq in p:
            ids = torch.tensor([PROMPT + list(seq)])
            q_logits, p_logits = draft(ids).logits[0], target(ids).logits[0]
            f = len(PROMPT) - 1
            broken[seq] = (float(torch.softmax(q_logits[f], -1)[seq[0]]) * float(torch.softmax(q_logits[f + 1], -1)[seq[1]])
                           * float(torch.softmax(p_logits[f + 2], -1)[seq[2]]))
    noncentrality = NUM_SAMPLES * sum((broken[s] - p[s]) ** 2 / p[s] for s in p)
    counts = {s: round(NUM_SAMPLES * broken[s]) for s in p}  # the broken rule's typical sample
    _, df, p_value = chi_square(counts, p, sum(counts.values()))
    assert noncentrality > 10 * df, noncentrality
    assert p_value < 1e-12


def test_seeded_runs_repeat_and_seeds_differ(tiny_models: TinyModels):
    """Same seed: same tokens, in any batch and any engine; different seeds: different tokens."""
    def run(engine, seeds, others=0):
        fillers = [[5, 6, 7]] * others
        params = [SamplingParams(max_tokens=20, temperature=1.0, seed=s) for s in seeds]
        params += [SamplingParams(max_tokens=8, temperature=0.7)] * others
        return [r.token_ids for r in generate(engine, [[100, 200, 300]] * len(seeds) + fillers, params)]

    near = tiny_models.drafts["near"]
    first = run(make_engine(tiny_models.target, near, num_speculative_tokens=3), list(range(8)))
    again = run(make_engine(tiny_models.target, near, num_speculative_tokens=3), list(reversed(range(8))), others=5)
    assert again[:8] == first[::-1]
    assert len({tuple(t) for t in first}) == 8, "different seeds gave the same tokens"
    assert all(len(t) == 20 for t in first)
    # Without speculation the same seed also repeats (it is a different but fixed stream).
    plain = make_engine(tiny_models.target, None)
    assert run(plain, [3, 3]) == [run(make_engine(tiny_models.target, None), [3])[0]] * 2
    # Unseeded requests draw fresh randomness.
    engine = make_engine(tiny_models.target, near, num_speculative_tokens=3)
    free = [r.token_ids for r in generate(engine, [[100, 200, 300]] * 4,
                                           SamplingParams(max_tokens=20, temperature=1.0))]
    assert len({tuple(t) for t in free}) == 4
