"""Adaptive speculation (engine/adaptive.py): the policy, and that switching k changes no output.

The policy's inputs are measured step times, so the engine tests drive it with
a scripted step k (``ScriptedK``: every k from 0 to the maximum, long stretches
without speculation included) and compare every token with what the target
alone produces; the policy itself is tested on given times. The draft's
catch-up after stretches without speculation is compared with a proposer that
saw every token as it came.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from dspark_ray.engine import SamplingParams
from dspark_ray.engine.adaptive import (
    CAP_PROB,
    PRIOR_ACCEPTANCE,
    Acceptance,
    SpecController,
    bucket,
    confident_drafts,
)
from dspark_ray.engine.draft_proposer import DraftProposer
from dspark_ray.engine.interfaces import ProposeRow, SamplingRow
from dspark_ray.model.llama import CausalAttention
from dspark_ray.model.loader import load
from engine_fixtures import (  # noqa: F401 - fixtures
    TinyModels,
    TinyVocabModels,
    assert_drained,
    generate,
    make_engine,
    make_pipelined_engine,
    solo,
    tiny_models,
    tiny_vocab_models,
)
from test_engine_greedy import hf_greedy
from test_engine_sampling import LENGTH, NUM_SAMPLES, P_VALUE_FLOOR, PROMPT, chi_square, exact_distribution

PROMPTS = [[(53 * i + 7 * j) % 4000 + 1 for j in range(4 + i % 6)] for i in range(6)]


class ScriptedK(SpecController):
    """The real controller with its choice replaced by a fixed cycle of k (its bookkeeping kept)."""

    def __init__(self, max_k: int, cycle: list[int]) -> None:
        super().__init__(max_k)
        self.cycle = itertools.cycle(cycle)

    def choose(self, batch: int, expected: list[float]) -> int:
        k = next(self.cycle)
        self.chosen[k] = self.chosen.get(k, 0) + 1
        return k


def adaptive_engine(target, draft, cycle: list[int], **config):
    engine = make_engine(target, draft, adaptive_speculation=True, **config)
    engine.spec_controller = ScriptedK(engine.max_spec_tokens, cycle)
    return engine


# -- the policy ----------------------------------------------------------------------------------


def test_acceptance_learns_caps_and_fades_back_to_the_prior():
    a = Acceptance(4)
    assert a.rate(0) == pytest.approx(PRIOR_ACCEPTANCE) and a.expected[0] == 1.0
    assert a.expected == sorted(a.expected)  # more drafts never expect fewer tokens
    for _ in range(12):
        a.record(4, 4)
    assert a.rate(3) > 0.9 and a.cap == 4 and a.expected[4] > 4.5
    for _ in range(30):
        a.record(4, 0)  # the first draft token rejected every time: only position 1 was reached
    assert a.rate(0) < 0.15 and a.cap == 1  # never below one token: it keeps learning
    assert a.rate(1) > 0.9  # positions never reached keep what they knew
    low = a.rate(0)
    for _ in range(40):
        a.idle()
    assert low < a.rate(0) < PRIOR_ACCEPTANCE + 1e-9 and a.rate(0) > 0.6
    a.record(2, 1)  # a k below max_k updates only what it reached
    chain = 1.0
    for i in range(4):
        chain *= a.rate(i)
        assert (chain >= CAP_PROB) == (i < a.cap) or i == 0


def test_confident_drafts_is_the_cap_rule_on_one_blocks_estimate():
    """A block's drafts are verified as far as a request with those acceptance rates would be
    capped: while P(all accepted so far) >= CAP_PROB, at least one."""
    assert confident_drafts([]) == 0
    assert confident_drafts([0.01, 0.99]) == 1  # never fewer than one
    assert confident_drafts([0.9, 0.5, 0.9, 0.1]) == 3  # 0.9, 0.45, 0.405 stay; 0.04 does not
    assert confident_drafts([0.99] * 6) == 6
    rng = random.Random(5)
    for _ in range(200):
        rates = [rng.uniform(0.05, 1.0) for _ in range(rng.randint(1, 6))]
        assert confident_drafts(rates) == Acceptance(len(rates), tuple(rates)).cap, rates


def test_a_request_starts_from_the_prior_it_is_given():
    a = Acceptance(3, prior=(0.9, 0.8, 0.5))
    assert [round(a.rate(i), 6) for i in range(3)] == [0.9, 0.8, 0.5]
    a.record(3, 0)
    for _ in range(60):
        a.idle()
    assert a.rates() == pytest.approx((0.9, 0.8, 0.5), abs=1e-3)  # it fades back to its own prior


def test_controller_tries_every_k_then_takes_the_fastest_in_tokens_per_second():
    c = SpecController(4)
    times = {0: 10.0, 1: 14.0, 2: 17.0, 3: 20.0, 4: 23.0}  # a step's ms at each k
    probed = []
    for _ in range(5 * SpecController.PROBE_STEPS):
        k = c.choose(8, [1.0] * 5)
        probed.append(k)
        c.observe(8, k, times[k])
    assert probed[0] == 4 and sorted(set(probed)) == [0, 1, 2, 3, 4]
    assert all(probed.count(k) == SpecController.PROBE_STEPS for k in range(5))
    high = [1.0, 1.9, 2.7, 3.4, 4.0]  # tokens per step: k=4 gives 4.0/23 > 1/10
    low = [1.0, 1.3, 1.4, 1.45, 1.5]  # poor acceptance: no draft is best
    assert c.choose(8, high) == 4
    assert c.choose(8, low) == 0
    # Another batch size is another bucket: it is measured on its own first, from the side of
    # batch 8's best k where its own can lie (verifying costs more at more rows: not more drafts
    # than at 8, and at 1 not fewer).
    assert bucket(8) != bucket(32) and bucket(8) != bucket(1)
    assert [c.choose(32, low) for _ in range(3)] == [0, 0, 0]  # batch 8's best here is 0: only k = 0
    assert [c.choose(1, high) for _ in range(3)] == [4, 4, 4]  # ... and 4 with good acceptance: only 4
    assert c.choose(1, high) == 4 and c.step_times(bucket(1))[:4] == [None] * 4
    # Later it tries other k again, so a change of load is seen.
    seen = set()
    for _ in range(2 * SpecController.REPROBE_MAX):
        k = c.choose(8, high)
        seen.add(k)
        c.observe(8, k, times[k])
    assert len(seen) >= 3


def test_a_ks_first_slow_step_does_not_set_its_cost():
    """The first step at a k is slow (new shapes for the kernels): with the 3 probes of a new bucket
    it must not count, or k looks dearer than it is (measured: 35.4 ms, then 24.1 and 23.9)."""
    from dspark_ray.engine.adaptive import _Cell

    cell = _Cell()
    for ms in (35.4, 24.1, 23.9):
        cell.add(ms)
    assert cell.seconds == pytest.approx(24.0)
    one = _Cell()
    one.add(35.4)
    assert one.seconds == pytest.approx(35.4)  # a single step is all there is


def test_controller_fits_one_line_through_the_drafting_ks():
    c = SpecController(4)
    for k, t in ((1, 12.0), (1, 12.0), (3, 16.0), (3, 16.0)):
        c.observe(1, k, t)
    c.observe(1, 0, 7.0)
    times = c.step_times(bucket(1))
    assert times[0] == 7.0 and times[2] == pytest.approx(14.0) and times[4] == pytest.approx(18.0)


# -- output does not change ---------------------------------------------------------------------------


CYCLES = {
    "all-k": [0, 1, 2, 3, 3, 2, 1],
    "long-stretches-off": [0] * 9 + [3, 2, 3, 1] + [0] * 20 + [1, 3, 3, 2],  # catch-ups: ring rounds, the tail
}


@pytest.mark.parametrize("cycle", list(CYCLES))
def test_switching_k_keeps_greedy_output_the_targets(tiny_models: TinyModels, cycle):
    n = 60
    engine = adaptive_engine(tiny_models.target, tiny_models.drafts["near"], CYCLES[cycle],
                             num_speculative_tokens=3, draft_window=8, capacity=8, max_context=96)
    got = generate(engine, PROMPTS, SamplingParams(max_tokens=n, ignore_eos=True))
    for prompt, g in zip(PROMPTS, got):
        assert g.token_ids == hf_greedy(tiny_models.hf_target, prompt, n)
    # (The window of 8 makes this draft a poor guess on long contexts: what counts is that it drafted.)
    assert sum(g.spec.draft_tokens for g in got) > 6 * len(PROMPTS), "speculation did not run"
    assert {k for k, n in engine.spec_controller.chosen.items() if n} >= {0, 1, 3}
    assert_drained(engine, len(PROMPTS))


@pytest.mark.parametrize("cycle", list(CYCLES))
def test_switching_k_in_the_pipelined_engine_keeps_output(tiny_models: TinyModels, cycle):
    """Pipelined (draft and target in other processes, as served): a step whose k is 0 verifies
    the half drafted before together with the rest of the batch, in one target call."""
    n, near = 40, tiny_models.drafts["near"]
    engine = make_pipelined_engine(tiny_models.target, near, num_speculative_tokens=3, draft_window=8,
                                   capacity=8, max_context=96, adaptive_speculation=True)
    engine.spec_controller = ScriptedK(engine.max_spec_tokens, CYCLES[cycle])
    seeded = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.9, seed=3)
    fixed = SamplingParams(max_tokens=n, ignore_eos=True, num_speculative_tokens=2)
    params = [SamplingParams(max_tokens=n, ignore_eos=True)] * 4 + [seeded, fixed]
    got = generate(engine, PROMPTS, params)
    for prompt, g in zip(PROMPTS[:4], got):
        assert g.token_ids == hf_greedy(tiny_models.hf_target, prompt, n)
    assert got[5].token_ids == hf_greedy(tiny_models.hf_target, PROMPTS[5], n)
    assert got[5].spec.drafts and got[5].spec.draft_tokens >= 2 * got[5].spec.drafts - 1  # k fixed at 2
    alone = solo(tiny_models.target, near, PROMPTS[4], seeded, num_speculative_tokens=3, draft_window=8,
                 capacity=8, max_context=96, adaptive_speculation=True)
    assert got[4].token_ids == alone.token_ids  # the seeded request ignores the step's k
    assert engine.spec_controller.chosen.get(0) and engine.spec_controller.chosen.get(3)
    rows = []  # the rows of each target call: a k = 0 step takes every request at once
    engine2 = make_pipelined_engine(tiny_models.target, near, num_speculative_tokens=3, draft_window=8,
                                    capacity=8, max_context=96, adaptive_speculation=True)
    engine2.spec_controller = ScriptedK(3, [3, 3, 0])
    inner = engine2.target.inner.step
    engine2.target.inner.step = lambda batch: rows.append(len(batch.rows)) or inner(batch)
    generate(engine2, PROMPTS[:4], SamplingParams(max_tokens=n, ignore_eos=True))
    assert 4 in rows and 2 in rows, rows
    assert_drained(engine, len(PROMPTS))


def test_the_pipelined_engine_measures_every_k_even_with_one_request(tiny_models: TinyModels):
    """One request alternates between a drafting step and a verifying step: both are steps of
    its k, and k = 0 runs it whole; the controller gets times for every k it tries."""
    engine = make_pipelined_engine(tiny_models.target, tiny_models.drafts["near"], num_speculative_tokens=3,
                                   draft_window=8, capacity=8, max_context=96, adaptive_speculation=True)
    generate(engine, PROMPTS[:1], SamplingParams(max_tokens=60, ignore_eos=True))
    cells = engine.spec_controller.table[bucket(1)]
    assert all(cell.n > 0 for cell in cells), [cell.n for cell in cells]


def test_a_seeded_sampled_request_ignores_the_step_k(tiny_models: TinyModels):
    """Its k follows its own acceptance only, so its tokens are the same whatever else runs."""
    near = tiny_models.drafts["near"]
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=7)
    alone = solo(tiny_models.target, near, PROMPTS[0], params, num_speculative_tokens=3, adaptive_speculation=True)
    engine = adaptive_engine(tiny_models.target, near, [0, 0, 1, 3, 0], num_speculative_tokens=3)
    others = [SamplingParams(max_tokens=30, ignore_eos=True)] * 4
    got = generate(engine, [PROMPTS[0], *PROMPTS[1:5]], [params, *others])
    assert got[0].token_ids == alone.token_ids and got[0].spec == alone.spec


def test_a_request_that_fixed_k_keeps_it(tiny_models: TinyModels):
    engine = adaptive_engine(tiny_models.target, tiny_models.drafts["near"], [0], num_speculative_tokens=3)
    (got,) = generate(engine, PROMPTS[:1], SamplingParams(max_tokens=20, ignore_eos=True, num_speculative_tokens=2))
    # Two every step (the last may have room for one only), never the step's 0.
    assert got.spec.drafts >= 6 and 2 * got.spec.drafts - 1 <= got.spec.draft_tokens <= 2 * got.spec.drafts


@pytest.mark.parametrize("adaptive", [False, True])
def test_above_speculation_max_batch_only_requests_that_fixed_their_k_speculate(tiny_models: TinyModels, adaptive):
    """A step of more requests than ``speculation_max_batch`` verifies no drafts for the requests that
    adapt to the batch; greedy output is still the target's, a seeded sampled request and one that
    fixed its k keep their own k (the seeded one's tokens are those it gives alone), and once the batch
    is small again the others speculate again."""
    near, n = tiny_models.drafts["near"], 40
    cfg = dict(num_speculative_tokens=3, draft_window=8, capacity=8, max_context=96, adaptive_speculation=adaptive)
    engine = make_engine(tiny_models.target, near, speculation_max_batch=3, **cfg)
    if adaptive:
        engine.spec_controller = ScriptedK(3, [3])  # below the cap, always 3
    seeded = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.9, seed=3)
    fixed = SamplingParams(max_tokens=n, ignore_eos=True, num_speculative_tokens=2)
    greedy = SamplingParams(max_tokens=n, ignore_eos=True)
    short = SamplingParams(max_tokens=8, ignore_eos=True)  # three short requests leave the batch early
    params = [greedy, seeded, fixed, short, short, short]
    seen = []  # per step: (requests running, drafts per slot)
    inner = engine.target.step
    engine.target.step = lambda batch: seen.append(
        (len(engine.scheduler.running), {r.slot: len(r.draft_token_ids) for r in batch.rows})) or inner(batch)
    got = generate(engine, PROMPTS, params)
    for i in (0, 2, 3, 4, 5):
        assert got[i].token_ids == hf_greedy(tiny_models.hf_target, PROMPTS[i], params[i].max_tokens)
    alone = solo(tiny_models.target, near, PROMPTS[1], seeded, **cfg)
    assert got[1].token_ids == alone.token_ids and got[1].spec == alone.spec
    big = [drafts for running, drafts in seen if running > 3]
    small = [drafts for running, drafts in seen if 0 < running <= 3]
    assert big and small
    # Above the cap only the seeded and the fixed request draft: at most two rows with drafts a step.
    assert all(sum(1 for d in drafts.values() if d) <= 2 for drafts in big)
    assert any(sum(1 for d in drafts.values() if d) == 2 for drafts in big)
    assert got[0].spec.draft_tokens > 0  # the greedy request speculated once the batch was small
    assert got[2].spec.drafts >= 6 and got[2].spec.draft_tokens >= 2 * got[2].spec.drafts - 1  # k fixed at 2
    assert_drained(engine, len(PROMPTS))


def test_speculation_max_batch_is_checked_and_reaches_the_engine(shipped_target, shipped_draft):
    from dspark_ray.engine import EngineConfig
    from dspark_ray.engine.config import ConfigError
    from dspark_ray.serve.config import AppConfig

    with pytest.raises(ConfigError, match="speculation_max_batch"):
        EngineConfig(model="m", speculation_max_batch=0)
    args = dict(model=str(shipped_target), draft=str(shipped_draft), http_port=None)
    assert AppConfig(**args).engine_config().speculation_max_batch is None
    assert AppConfig(**args, speculation_max_batch=8).engine_config().speculation_max_batch == 8
    with pytest.raises(ValueError, match="speculation_max_batch"):
        AppConfig(**args, speculation_max_batch=0)


def test_unseeded_sampling_with_switching_k_follows_the_target_distribution(tiny_vocab_models: TinyVocabModels):
    m = tiny_vocab_models
    expected = exact_distribution(m.target, m.vocab, 1.0, 0, 1.0)
    engine = adaptive_engine(m.target, m.draft, [0, 1, 2, 2, 1], num_speculative_tokens=2, capacity=64,
                             max_num_seqs=64, max_context=16)
    counts: dict[tuple, int] = {}
    drafted = 0
    for _ in range(0, NUM_SAMPLES, 64):
        for res in generate(engine, [PROMPT] * 64, SamplingParams(max_tokens=LENGTH, ignore_eos=True,
                                                                 temperature=1.0)):
            counts[tuple(res.token_ids)] = counts.get(tuple(res.token_ids), 0) + 1
            drafted += res.spec.draft_tokens
    assert drafted > NUM_SAMPLES // 2, "the switching k hardly drafted"
    stat, df, p_value = chi_square(counts, expected, NUM_SAMPLES)
    assert df >= 6 and p_value > P_VALUE_FLOOR, f"chi2 {stat:.1f} on {df} df: p = {p_value:.2e}"


# -- the draft's catch-up --------------------------------------------------------------------------


def draft_greedy(model, tokens: list[int], window: int, k: int) -> list[int]:
    """The draft's own greedy continuation: full windowed forwards over the whole sequence, no cache."""
    seq = list(tokens)
    with torch.inference_mode():
        for _ in range(k):
            hidden = model.hidden_states(torch.tensor([seq]), None, CausalAttention(window))
            seq.append(int(model.logits(hidden[0, -1]).argmax()))
    return seq[len(tokens):]


@pytest.mark.parametrize("gap", [3, 11, 40])  # one ring round, several rounds, the tail forward
def test_catch_up_after_a_gap_equals_following_every_token(tiny_models: TinyModels, gap: int):
    model = load(tiny_models.drafts["near"], dtype=torch.float32)
    window, k = 8, 3
    follows, skips = (DraftProposer(model, 4, window, k) for _ in range(2))
    tokens = [(17 * i) % 4000 + 1 for i in range(12 + gap + 1)]
    greedy = SamplingRow(0.0, 1.0, 0, 0)

    def propose(p: DraftProposer, start: int, end: int) -> list[int]:
        return p.propose([ProposeRow(2, 1, start, tuple(tokens[start:end]), k, greedy, None)]).draft_token_ids[0]

    propose(follows, 0, 12)
    propose(skips, 0, 12)
    for end in range(13, 12 + gap):  # one token at a time, as a request speculating every step
        propose(follows, end - 1, end)
    want = propose(follows, 11 + gap, 12 + gap + 1)
    got = propose(skips, 12, 12 + gap + 1)  # everything since position 12 at once
    assert got == want == draft_greedy(model, tokens, window, k)
    # ... and the cache it left drafts on exactly as the other's.
    more = tokens[-1:] + [5, 9]
    tokens.extend(more[1:])
    assert propose(skips, 12 + gap, len(tokens)) == propose(follows, 12 + gap, len(tokens))
