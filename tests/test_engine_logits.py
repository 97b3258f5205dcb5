"""Logits rules and log-probabilities under speculation, against independent references.

- Log-probabilities (emitted and prompt tokens) equal a full forward of the
  target in transformers, and speculation on and off report the same values;
  ``max_tokens=0`` scores a prompt without generating.
- Greedy output with a repetition penalty equals transformers' own
  ``generate(repetition_penalty=...)``; with presence/frequency penalties,
  logit_bias and min_tokens it equals a plain greedy loop written here.
  Speculation is on in each (the shipped pair accepts most drafts).
- Sampled output with the rules follows the rule-adjusted target distribution:
  the chi-square test of ``test_engine_sampling`` over every 3-token output of
  a 5-word vocabulary, the expected probabilities computed here from
  transformers' logits and the rules written out by hand.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from conftest import SHIPPED_DRAFT, SHIPPED_TARGET, shipped
from dspark_ray.engine import SamplingParams
from engine_fixtures import TinyVocabModels, assert_drained, make_engine, tiny_vocab_models  # noqa: F401
from test_engine_sampling import LENGTH, NUM_SAMPLES, P_VALUE_FLOOR, PROMPT, chi_square, sample_counts

TEXT = "ROMEO:\nBut soft, what light through yonder"
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def hf_target():
    from transformers import AutoModelForCausalLM

    shipped(SHIPPED_TARGET, "model.safetensors")
    return AutoModelForCausalLM.from_pretrained(SHIPPED_TARGET, dtype=torch.float32).eval()


def run_one(draft, prompt, params: SamplingParams):
    """(engine, tokens, logprobs, prompt_logprobs, spec) of one request run alone."""
    engine = make_engine(SHIPPED_TARGET, draft, max_context=256)
    engine.add_request(prompt, params)
    tokens, logprobs, prompt_lp, spec, outputs = [], [], None, None, []
    while engine.has_unfinished():
        for out in engine.step():
            outputs.append(out)
            tokens += out.new_token_ids
            if out.logprobs is not None:
                assert len(out.logprobs) == len(out.new_token_ids)
                logprobs += out.logprobs
            if out.prompt_logprobs is not None:
                assert prompt_lp is None, "prompt log-probabilities sent twice"
                prompt_lp = out.prompt_logprobs
            spec = out.spec or spec
    assert_drained(engine)
    return engine, tokens, logprobs, prompt_lp, spec


def reference_logprobs(hf, ids: list[int]) -> torch.Tensor:  # [len(ids) - 1, V]: log p(ids[i] | ids[:i]) rows
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].double(), dim=-1)


def test_logprobs_equal_transformers_with_speculation_on_and_off(hf_target):
    params = SamplingParams(max_tokens=12, logprobs=3, prompt_logprobs=2)
    engine, tokens, lps, prompt_lps, spec = run_one(SHIPPED_DRAFT, TEXT, params)
    assert spec.accepted_tokens > 0, "speculation accepted nothing: the test would not cover the verify pass"
    _, tokens_off, lps_off, prompt_off, _ = run_one(None, TEXT, params)
    assert tokens == tokens_off and len(lps) == len(tokens) == 12
    prompt = engine.tokenizer.encode(TEXT)
    ref = reference_logprobs(hf_target, prompt + tokens)  # [P + 11, V]
    assert prompt_lps[0] is None and len(prompt_lps) == len(prompt)
    scored = [lp for lp in prompt_lps[1:]] + lps
    for i, lp in enumerate(scored):
        assert lp.token_id == (prompt + tokens)[i + 1]
        assert abs(lp.logprob - float(ref[i, lp.token_id])) < LOGPROB_TOL
        assert lp.rank == int((ref[i] > ref[i, lp.token_id]).sum()) + 1
        want = len(lp.top)
        assert want == (3 if i >= len(prompt) - 1 else 2)
        assert [t for t, _ in lp.top] == ref[i].topk(want).indices.tolist()
    for on, off in zip(prompt_lps[1:] + lps, prompt_off[1:] + lps_off):  # speculation changes no value
        assert on.token_id == off.token_id and [t for t, _ in on.top] == [t for t, _ in off.top]
        assert abs(on.logprob - off.logprob) < 1e-5


def test_max_tokens_zero_scores_the_prompt(hf_target):
    params = SamplingParams(max_tokens=0, prompt_logprobs=0, logprobs=0)
    engine, tokens, lps, prompt_lps, _ = run_one(SHIPPED_DRAFT, TEXT, params)
    assert tokens == [] and lps == []
    prompt = engine.tokenizer.encode(TEXT)
    assert [lp.token_id for lp in prompt_lps[1:]] == prompt[1:]
    ref = reference_logprobs(hf_target, prompt)
    total = sum(lp.logprob for lp in prompt_lps[1:])
    expected = float(sum(ref[i, t] for i, t in enumerate(prompt[1:])))
    assert abs(total - expected) < 1e-3 and prompt_lps[1].top == ()


def test_repetition_penalty_greedy_equals_transformers_generate(hf_target):
    params = SamplingParams(max_tokens=24, repetition_penalty=1.3, ignore_eos=True)
    engine, tokens, _, _, spec = run_one(SHIPPED_DRAFT, TEXT, params)
    assert spec.accepted_tokens > 0
    prompt = engine.tokenizer.encode(TEXT)
    expected = hf_target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, repetition_penalty=1.3,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    plain = run_one(SHIPPED_DRAFT, TEXT, SamplingParams(max_tokens=24, ignore_eos=True))[1]
    assert tokens == expected
    assert tokens != plain, "the penalty changed nothing: the test would not show it is applied"


def adjust(logits: torch.Tensor, prompt: list[int], output: list[int], p: dict) -> torch.Tensor:
    """The rules written out token by token (independently of dspark_ray.engine.logits_rules)."""
    out = logits.double().clone()
    if len(output) < p.get("min_tokens", 0):
        for t in p.get("stop_token_ids", ()):
            out[t] = float("-inf")
    for t, b in p.get("logit_bias", {}).items():
        out[t] += b
    r = p.get("repetition_penalty", 1.0)
    for t in set(prompt) | set(output):
        out[t] = out[t] / r if out[t] > 0 else out[t] * r
    for t in set(output):
        out[t] -= p.get("presence_penalty", 0.0) + p.get("frequency_penalty", 0.0) * output.count(t)
    return out


def test_penalties_bias_min_tokens_greedy_equal_a_plain_loop(hf_target):
    rules = dict(presence_penalty=0.7, frequency_penalty=0.4, logit_bias={203: -3.0, 11: 2.5}, min_tokens=6,
                 stop_token_ids=[203])
    engine, tokens, _, _, spec = run_one(SHIPPED_DRAFT, TEXT, SamplingParams(max_tokens=20, ignore_eos=True,
                                                                             **rules))
    assert spec.accepted_tokens > 0
    prompt = engine.tokenizer.encode(TEXT)
    expected = []
    with torch.no_grad():
        for _ in range(20):
            logits = hf_target(torch.tensor([prompt + expected])).logits[0, -1]
            tok = int(adjust(logits, prompt, expected, rules).argmax())
            expected.append(tok)
            if tok == 203:
                break
    assert tokens == expected
    assert 203 not in tokens[:6]


# -- sampling with rules: the distribution -----------------------------------------------------------


def rule_distribution(model_dir, vocab: int, temperature: float, rules: dict) -> dict:
    """P(x1, x2, x3 | PROMPT) under the rules (and min_p), from full transformers forwards."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prefixes = list(itertools.product(range(vocab), repeat=LENGTH - 1))
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + list(p) for p in prefixes])).logits  # [N, len, V]
    dist = {}
    for n, prefix in enumerate(prefixes):
        steps = []
        for i in range(LENGTH):
            probs = torch.softmax(adjust(logits[n, len(PROMPT) - 1 + i], PROMPT, list(prefix[:i]), rules)
                                  / temperature, dim=-1)
            probs = torch.where(probs >= rules.get("min_p", 0.0) * probs.max(), probs, 0.0)
            steps.append(probs / probs.sum())
        for last in range(vocab):
            seq = prefix + (last,)
            dist[seq] = math.prod(float(steps[i][seq[i]]) for i in range(LENGTH))
    assert abs(sum(dist.values()) - 1.0) < 1e-9
    return dist


RULE_CASES = {
    "penalties-spec2": dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.6),
    "bias-min-tokens-min-p-spec2": dict(logit_bias={3: 1.5, 1: -1.0}, min_tokens=3, stop_token_ids=[4], min_p=0.08),
}


@pytest.mark.parametrize("case", list(RULE_CASES))
def test_sampling_with_rules_follows_the_adjusted_target(tiny_vocab_models: TinyVocabModels, case):
    rules = RULE_CASES[case]
    m = tiny_vocab_models
    expected = rule_distribution(m.target, m.vocab, 1.0, rules)
    plain = rule_distribution(m.target, m.vocab, 1.0, {})
    # The rules move the distribution far enough that the test could tell them apart.
    assert NUM_SAMPLES * sum((plain[s] - expected[s]) ** 2 / expected[s] for s in expected if expected[s] > 0) > 200
    counts, specs, _ = sample_counts(m, 2, dict(temperature=1.0, **rules))
    assert all(expected[seq] > 0 for seq in counts), "sampled a sequence the rules rule out"
    stat, df, p_value = chi_square(counts, expected, NUM_SAMPLES)
    print(f"{case}: chi2 {stat:.1f} on {df} df, p = {p_value:.3f}")
    assert df >= 6 and p_value > P_VALUE_FLOOR, f"chi2 {stat:.1f} on {df} df: p = {p_value:.2e}"
    accepted = sum(s.accepted_tokens for s in specs) / sum(s.draft_tokens for s in specs)
    assert 0.1 < accepted, f"acceptance {accepted:.2f}: speculation barely ran"
