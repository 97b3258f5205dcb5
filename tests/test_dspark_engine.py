"""DSpark's block drafter in the engine (engine/dspark_proposer.py): taps from the target, context
kept by request, one block forward per step, lossless verification.

The drafts are random-weight DSpark checkpoints written here (test_dspark_draft.py's writer).
Against the shipped target (vocabulary 4096) a random draft is almost always wrong, so its Markov
head is also given the target's most frequent greedy transitions ("prev -> next", a bigram table
from the target's own greedy output): those drafts are accepted, so accepted drafts' positions
really become context, while the base logits (the block forward over the context) still decide
every other draft. Against the tiny-vocabulary target (5 ids) a random draft is right by chance
often enough for the sampled distribution test.

What is checked: greedy output equals the target's alone; sampled output follows the target's
distribution; a request's output does not depend on who else runs (solo vs a random schedule,
sequential and pipelined); and every block the engine's proposer drafts equals
``DSparkDraft.draft`` over the row's whole context computed from scratch with
``tap_hidden_states`` (so the taps, the engine's bookkeeping and the ring are exact).
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import SHIPPED_TARGET, shipped
from dspark_ray.engine import EngineConfig, SamplingParams
from dspark_ray.engine.adaptive import confident_drafts
from dspark_ray.engine.dspark_proposer import DSparkProposer
from dspark_ray.engine.interfaces import ContextStates, Proposal, ProposeRow, SamplingRow
from dspark_ray.engine.local import build_local_engine
from dspark_ray.model.dspark import BlockContext, DraftTargetMismatch, tap_hidden_states
from engine_fixtures import (  # noqa: F401 - fixtures
    TinyVocabModels,
    assert_drained,
    generate,
    make_engine,
    make_pipelined_engine,
    run_all,
    tiny_vocab_models,
)
from test_dspark_draft import DRAFT_CONFIG, draft_tensors, write_checkpoint
from test_engine_adaptive import adaptive_engine
from test_engine_contamination import CONFIG as SCHEDULE_CONFIG
from test_engine_contamination import NUM_REQUESTS, drive, random_schedule
from test_engine_sampling import (
    LENGTH,
    NUM_SAMPLES,
    P_VALUE_FLOOR,
    PROMPT,
    chi_square,
    exact_distribution,
    sample_counts,
)

BLOCK = 4
SHIPPED_DRAFT_CONFIG = {
    **DRAFT_CONFIG, "vocab_size": 4096, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "intermediate_size": 64, "num_hidden_layers": 1, "layer_types": ["full_attention"],
    "block_size": BLOCK, "mask_token_id": 4095,
    "target_layer_ids": [1, 4, 7], "num_target_layers": 8, "markov_rank": 64, "max_position_embeddings": 1024,
}
CONFIG = dict(num_speculative_tokens=4, capacity=3, max_num_seqs=3, max_context=64)
TIGHT = dict(CONFIG, kv_pool_tokens=68)  # one full request (64 + k): preemption
MAX_TOKENS = [20, 30, 1, 24, 7, 2]


def prompt_set(seed: int = 0) -> list[list[int]]:
    """Six prompts of 40..1 tokens (with MAX_TOKENS: at most 60 positions; the first two, side by
    side, outgrow a KV pool of one full request)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 4096) for _ in range(n)] for n in (40, 21, 13, 5, 2, 1)]


@pytest.fixture(scope="module")
def target_path() -> Path:
    return shipped(SHIPPED_TARGET, "model.safetensors")


@pytest.fixture(scope="module")
def reference(target_path) -> dict[tuple, list[int]]:
    """The target's own greedy tokens (no draft) for every prompt of ``prompt_set``."""
    results = generate(make_engine(target_path, None, **CONFIG), prompt_set(),
                       [SamplingParams(max_tokens=n) for n in MAX_TOKENS])
    return {tuple(p): r.token_ids for p, r in zip(prompt_set(), results)}


@pytest.fixture(scope="module")
def dspark_path(tmp_path_factory, reference) -> Path:
    """A random DSpark draft for the shipped target whose Markov head also knows the target's
    most frequent greedy transitions (one rank each, a bias that wins where it applies)."""
    cfg = SHIPPED_DRAFT_CONFIG
    tensors = draft_tensors(cfg, seed=7)
    pairs = Counter((a, b) for p, out in reference.items() for a, b in zip((p[-1], *out), out))
    best: dict[int, int] = {}
    for (a, b), _ in pairs.most_common():
        best.setdefault(a, b)
    w1, w2 = torch.zeros(cfg["vocab_size"], cfg["markov_rank"]), torch.zeros(cfg["vocab_size"], cfg["markov_rank"])
    for i, (a, b) in enumerate(list(best.items())[:cfg["markov_rank"]]):
        w1[a, i], w2[b, i] = 1.0, 100.0
    tensors["markov_head.markov_w1.weight"], tensors["markov_head.markov_w2.weight"] = w1, w2
    return write_checkpoint(tmp_path_factory.mktemp("dspark") / "shipped", cfg, tensors)


class CheckedProposer:
    """The engine's real DSparkProposer; each greedy block it drafts is compared with
    ``DSparkDraft.draft`` over the row's whole context, computed from scratch: the target's taps
    over the request's tokens before the anchor (``tap_hidden_states``), then ``context_kv``."""

    def __init__(self, engine) -> None:
        self.engine, self.inner = engine, engine.draft
        self.target = engine.target.model
        self.checked = 0

    @torch.inference_mode()
    def propose(self, rows: list[ProposeRow]) -> Proposal:
        proposal = self.inner.propose(rows)
        draft = self.inner.model
        for row, drafts in zip(rows, proposal.draft_token_ids):
            assert len(drafts) == min(row.num_draft, BLOCK)
            req = next(r for r in self.engine.requests.values() if (r.slot, r.epoch) == (row.slot, row.epoch))
            p0 = row.start + len(row.token_ids) - 1
            tokens = req.tokens
            assert tokens[p0] == row.token_ids[-1]
            if not row.sampling.greedy or p0 == 0:
                continue
            ids = torch.tensor([tokens[:p0]])
            pos = torch.arange(p0)[None]
            _, taps = tap_hidden_states(self.target, ids, draft.config.target_layer_ids, pos)
            k, v = draft.context_kv(taps, pos)
            # a non-causal draft's block always has its most queries (DSparkProposer._queries)
            queries = len(drafts) if self.inner.causal else min(BLOCK, self.engine.max_spec_tokens)
            expected = draft.draft(torch.tensor([tokens[p0]]), torch.tensor([p0]), BlockContext.of(k, v, pos),
                                   num_query=queries)
            assert drafts == expected.tokens[0, :len(drafts)].tolist(), (row.slot, p0)
            if proposal.confidence is not None:
                torch.testing.assert_close(torch.tensor(proposal.confidence[rows.index(row)]),
                                           expected.confidence[0, :len(drafts)], atol=1e-5, rtol=1e-5)
            self.checked += 1
        return proposal


def test_greedy_equals_the_target_alone_and_blocks_are_exact(target_path, dspark_path, reference):
    """Six prompts of 1..40 tokens through three slots (slots reused, requests preempted and
    recomputed): the target's own greedy tokens, and every block equals the from-scratch draft."""
    engine = make_engine(target_path, dspark_path, **TIGHT)
    assert isinstance(engine.draft, DSparkProposer) and engine.target.taps == (1, 4, 7)
    assert engine.target.prefix_cache is None  # positions from the cache would lack taps
    engine.draft = checked = CheckedProposer(engine)
    prompts = prompt_set()
    results = generate(engine, prompts, [SamplingParams(max_tokens=n) for n in MAX_TOKENS])
    for prompt, res in zip(prompts, results):
        assert res.token_ids == reference[tuple(prompt)], f"prompt of {len(prompt)} tokens"
    assert engine.counters.preemptions > 0, "no request was preempted"
    assert engine.slots.counters().allocations == len(prompts) > CONFIG["capacity"]
    spec = [r.spec for r in results]
    rate = sum(s.accepted_tokens for s in spec) / sum(s.draft_tokens for s in spec)
    assert 0.1 < rate < 0.95, rate  # accepted drafts' positions became context, rejected ones did not
    assert checked.checked > 20
    assert_drained(engine, len(prompts))


def test_more_drafts_asked_than_the_block_holds(target_path, dspark_path, reference):
    """k = 6 > the block (4): every step drafts at most the block, output unchanged."""
    engine = make_engine(target_path, dspark_path, **{**CONFIG, "num_speculative_tokens": 6})
    prompts = prompt_set()[3:5]
    results = generate(engine, prompts, [SamplingParams(max_tokens=n) for n in MAX_TOKENS[3:5]])
    for prompt, res in zip(prompts, results):
        assert res.token_ids == reference[tuple(prompt)]
        assert sum(res.spec.steps_by_k[BLOCK + 1:]) == 0 and res.spec.steps_by_k[BLOCK] > 0
    rows = [ProposeRow(1, 1, 0, (5, 6, 7), 6, SamplingRow(0.0, 1.0, 0, 0)),
            ProposeRow(2, 1, 0, (9,), 2, SamplingRow(1.0, 1.0, 0, 3))]
    proposal = engine.draft.propose(rows)
    assert [len(d) for d in proposal.draft_token_ids] == [BLOCK, 2]
    assert proposal.draft_probs.shape == (2, 6, 4096)
    torch.testing.assert_close(proposal.draft_probs[1, :BLOCK].sum(-1), torch.ones(BLOCK))


def test_a_rows_block_does_not_depend_on_what_the_other_rows_ask(target_path, dspark_path):
    """The test drafts' layers are non-causal: a block's queries see each other, so the proposer
    gives every block its most queries. A row's drafts, q and confidences are the same alone and
    beside a row that asks for more drafts."""
    engine = make_engine(target_path, dspark_path, **CONFIG)
    assert not engine.draft.causal
    context = ContextStates(0, torch.randn(6, 3 * 256, generator=torch.Generator().manual_seed(0)))
    row = ProposeRow(1, 1, 0, (5, 6, 7, 8, 9, 10, 11), 1, SamplingRow(0.8, 1.0, 0, 11), context=context)
    other = ProposeRow(2, 1, 0, (9, 3), 4, SamplingRow(0.0, 1.0, 0, 0))
    alone = engine.draft.propose([row])
    beside = engine.draft.propose([dataclasses.replace(row, context=None), other])
    assert beside.draft_token_ids[0] == alone.draft_token_ids[0] and len(alone.draft_token_ids[0]) == 1
    torch.testing.assert_close(beside.draft_probs[0], alone.draft_probs[0])
    assert beside.confidence[0] == pytest.approx(alone.confidence[0], abs=1e-6)


def test_context_states_merge():
    """ContextStates.then: appended, replaced from a recompute's start, a gap keeps the later ones,
    at most ``keep`` positions."""
    a = ContextStates(0, torch.arange(5.0)[:, None])
    assert a.then(ContextStates(5, torch.tensor([[5.0]]))).states.flatten().tolist() == [0, 1, 2, 3, 4, 5]
    assert a.then(ContextStates(3, torch.tensor([[9.0]]))).states.flatten().tolist() == [0, 1, 2, 9]
    assert a.then(ContextStates(0, torch.tensor([[7.0]]))).states.flatten().tolist() == [7]
    gap = a.then(ContextStates(7, torch.tensor([[8.0]])))
    assert (gap.start, gap.states.flatten().tolist()) == (7, [8])
    kept = a.then(ContextStates(5, torch.tensor([[5.0]])), keep=2)
    assert (kept.start, kept.states.flatten().tolist()) == (4, [4, 5])


@pytest.fixture(scope="module")
def alone(target_path, dspark_path):
    """Runs one request with nothing else in the engine (a fresh engine per request would only
    cost start-ups: requests one after another share nothing but reused slots)."""
    engine = make_engine(target_path, dspark_path, **SCHEDULE_CONFIG)
    return lambda prompt, params: generate(engine, [prompt], params)[0]


@pytest.mark.parametrize("seed, rules, pipelined", [(0, False, False), (2, True, True)])
def test_random_schedule_matches_solo_runs(target_path, dspark_path, alone, seed, rules, pipelined):
    """No contamination (invariant 3): requests of a random schedule (arrivals, aborts, slot
    reuse, preemption; greedy and seeded sampled; logits rules) produce what they produce alone,
    drafts and acceptances included; pipelined, the other half's verification overlaps each
    proposal. Compared: the seeded sampled requests that speculated (their tokens depend on the
    drafts) and a greedy one."""
    schedule = random_schedule(seed, rules)
    build = make_pipelined_engine if pipelined else make_engine
    engine = build(target_path, dspark_path, **SCHEDULE_CONFIG)
    results, _ = drive(engine, schedule)
    assert engine.counters.preemptions > 0 and engine.counters.draft_failures == 0
    assert all(r.finished and r.error is None for r in results.values())
    done = [p for p in schedule if results[p.req_id].finish_reason != "abort" and results[p.req_id].spec.drafts]
    sampled = [p for p in done if not p.params.greedy][:3]
    assert len(sampled) >= 2 and sum(results[p.req_id].spec.accepted_tokens for p in sampled) > 0
    for p in sampled + [p for p in done if p.params.greedy][:1]:
        got, solo_run = results[p.req_id], alone(p.prompt, p.params)
        assert (got.token_ids, got.spec) == (solo_run.token_ids, solo_run.spec), p.req_id
    assert_drained(engine, NUM_REQUESTS)


# -- the confidence head: adaptive verification ------------------------------------------------------


class CountedProposer:
    """The engine's proposer; per request, the drafts it was given and those ``confident_drafts``
    keeps of each block."""

    def __init__(self, engine, inner) -> None:
        self.engine, self.inner = engine, inner
        self.kept: Counter = Counter()
        self.given: Counter = Counter()

    def propose(self, rows: list[ProposeRow]) -> Proposal:
        proposal = self.inner.propose(rows)
        assert proposal.confidence is not None
        for row, drafts, conf in zip(rows, proposal.draft_token_ids, proposal.confidence):
            assert len(conf) == len(drafts) and all(0 < c < 1 for c in conf)
            req = next(r for r in self.engine.requests.values() if (r.slot, r.epoch) == (row.slot, row.epoch))
            self.kept[req.req_id] += confident_drafts(conf)
            self.given[req.req_id] += len(drafts)
        return proposal


def test_the_confidence_head_cuts_blocks_and_greedy_output_is_unchanged(target_path, dspark_path, reference):
    """Adaptive speculation with a confidence head: each row verifies its block as far as
    ``confident_drafts`` says (the step's k cycling through 4, 2, 0 and 3), output is the
    target's own, the proposer's confidences equal the from-scratch draft's, and a request that
    fixed its k verifies all it asked for; with confidence_verification off nothing is cut."""
    prompts = prompt_set()[:4]
    params = [SamplingParams(max_tokens=n) for n in MAX_TOKENS[:3]] + [
        SamplingParams(max_tokens=MAX_TOKENS[3], num_speculative_tokens=4)]
    for on in (True, False):
        engine = adaptive_engine(target_path, dspark_path, [4, 4, 2, 0, 3], **CONFIG, confidence_verification=on)
        checked = CheckedProposer(engine)
        engine.draft = counted = CountedProposer(engine, checked)
        ids = [engine.add_request(prompt, sp) for prompt, sp in zip(prompts, params)]
        results = run_all(engine)
        for prompt, i in zip(prompts, ids):
            assert results[i].token_ids == reference[tuple(prompt)], f"prompt of {len(prompt)} tokens"
        assert checked.checked > 10
        verified = {i: results[i].spec.draft_tokens for i in ids}
        adapted, fixed = ids[:3], ids[3]
        if on:
            assert {i: verified[i] for i in adapted} == {i: counted.kept[i] for i in adapted}
            assert engine.counters.confidence_cut_drafts == sum(counted.given[i] - counted.kept[i] for i in adapted) > 0
        else:
            assert {i: verified[i] for i in adapted} == {i: counted.given[i] for i in adapted}
            assert engine.counters.confidence_cut_drafts == 0
        assert verified[fixed] == counted.given[fixed] and results[fixed].spec.drafts > 0
        assert counted.kept[fixed] < counted.given[fixed]  # it would have been cut
        assert_drained(engine, len(prompts))


# -- the tiny vocabulary: sampled output follows the target distribution -----------------------------


@pytest.fixture(scope="module")
def tiny_dspark(tmp_path_factory, tiny_vocab_models: TinyVocabModels) -> TinyVocabModels:
    """The tiny-vocabulary pair with a random DSpark draft in place of the independent one."""
    cfg = {**DRAFT_CONFIG, "vocab_size": 5, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 8, "intermediate_size": 40, "num_hidden_layers": 1, "layer_types": ["full_attention"],
           "block_size": BLOCK, "mask_token_id": 4, "target_layer_ids": [0, 1], "num_target_layers": 2,
           "markov_rank": 3}
    path = write_checkpoint(tmp_path_factory.mktemp("dspark") / "tiny", cfg, draft_tensors(cfg, seed=3))
    return dataclasses.replace(tiny_vocab_models, draft=path)


@pytest.mark.parametrize("k, params", [(2, dict(temperature=1.0)), (3, dict(temperature=1.5, top_k=4, top_p=0.95))])
def test_sampled_sequences_follow_the_target_distribution(tiny_dspark: TinyVocabModels, k, params):
    """test_engine_sampling's chi-square test (its power is shown there) with the DSpark draft."""
    expected = exact_distribution(tiny_dspark.target, tiny_dspark.vocab, params["temperature"],
                                  params.get("top_k", 0), params.get("top_p", 1.0))
    counts, specs, _ = sample_counts(tiny_dspark, k, params)
    assert sum(counts.values()) == NUM_SAMPLES and all(len(s) == LENGTH for s in counts)
    assert all(expected[seq] > 0 for seq in counts)
    stat, df, p_value = chi_square(counts, expected, NUM_SAMPLES)
    assert df >= 6
    assert p_value > P_VALUE_FLOOR, f"chi2 {stat:.1f} on {df} df: p = {p_value:.2e}"
    accepted = sum(s.accepted_tokens for s in specs) / sum(s.draft_tokens for s in specs)
    assert 0.1 < accepted < 0.95, f"acceptance {accepted:.2f}: the draft should be partly right"


def test_sampled_sequences_with_confidence_cuts_follow_the_target_distribution(tiny_dspark: TinyVocabModels,
                                                                                tmp_path):
    """The same chi-square test with adaptive speculation and the confidence head cutting blocks
    (seeded requests: their k follows their own acceptance and their own block's confidence). The
    head reads the Markov embedding of the token before each position only: its estimates spread
    with that token, around the cap's threshold."""
    cfg = json.loads((tiny_dspark.draft / "config.json").read_text())
    tensors = load_file(tiny_dspark.draft / "model.safetensors")
    h, r = cfg["hidden_size"], cfg["markov_rank"]
    weight = torch.zeros(1, h + r)
    weight[0, h:] = 2.0 * torch.randn(r, generator=torch.Generator().manual_seed(4))
    tensors["confidence_head.proj.weight"], tensors["confidence_head.proj.bias"] = weight, torch.tensor([-1.0])
    m = dataclasses.replace(tiny_dspark, draft=write_checkpoint(tmp_path / "spread", cfg, tensors))
    expected = exact_distribution(m.target, m.vocab, 1.0, 0, 1.0)
    engine = adaptive_engine(m.target, m.draft, [3], num_speculative_tokens=3, capacity=64, max_num_seqs=64,
                             max_context=16)
    counts: dict[tuple, int] = {}
    for start in range(0, NUM_SAMPLES, 64):
        # Two tokens more than the distribution covers, so that the step after the prompt's may
        # draft three (and the confidence cut them): the first LENGTH tokens' law is the same.
        params = [SamplingParams(max_tokens=LENGTH + 2, ignore_eos=True, seed=s, temperature=1.0)
                  for s in range(start, start + 64)]
        for res in generate(engine, [PROMPT] * 64, params):
            seq = tuple(res.token_ids[:LENGTH])
            counts[seq] = counts.get(seq, 0) + 1
    assert engine.counters.confidence_cut_drafts > NUM_SAMPLES // 4, engine.counters
    stat, df, p_value = chi_square(counts, expected, NUM_SAMPLES)
    assert df >= 6 and p_value > P_VALUE_FLOOR, f"chi2 {stat:.1f} on {df} df: p = {p_value:.2e}"


# -- bad input ---------------------------------------------------------------------------------------


def test_a_draft_that_does_not_fit_is_refused_before_loading(target_path, dspark_path, tmp_path, monkeypatch):
    bad = write_checkpoint(tmp_path / "bad", {**SHIPPED_DRAFT_CONFIG, "target_layer_ids": [1, 9]},
                           draft_tensors(SHIPPED_DRAFT_CONFIG))

    def no_weights(*args, **kwargs):
        raise AssertionError("a weight was read before the draft was checked")

    monkeypatch.setattr("dspark_ray.engine.local.load", no_weights)
    with pytest.raises(DraftTargetMismatch, match="target_layer_ids.*8 layers"):
        build_local_engine(EngineConfig(model=str(target_path), draft=str(bad), **CONFIG))


class RecordedDraft:
    """A draft service (here the served ``RayDraft``) whose every block is kept: (slot, anchor
    position, drafts, confidences), in the order the engine collected them."""

    def __init__(self, inner) -> None:
        self.inner, self.blocks = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose_async(self, rows: list[ProposeRow]):
        pending, blocks = self.inner.propose_async(rows), self.blocks

        class Reply:
            def result(self) -> Proposal:
                proposal = pending.result()
                blocks.extend((r.slot, r.start + len(r.token_ids) - 1, tuple(t), tuple(c))
                              for r, t, c in zip(rows, proposal.draft_token_ids, proposal.confidence))
                return proposal

        return Reply()


@pytest.mark.ray
def test_through_the_ray_workers_at_tensor_parallel_2(target_path, dspark_path, reference):
    """The served services (a draft worker and two target shards as Ray actors, the engine
    pipelined over their channels, as a Serve replica drives them), once with the context states
    sent by target rank 0 to the draft worker directly (runtime/context_push.py, the default) and
    once relayed through the engine (``context_path="replica"``): greedy output is the target's
    own both times; sent directly, no state passes the engine and the worker reads them all; and
    every block is the same either way, drafts and confidences (both read the block's context: a
    state missing or late would change them)."""
    import ray

    from dspark_ray.engine import Engine
    from dspark_ray.runtime.actors import start_replica_services
    from dspark_ray.runtime.metrics import StepObserver
    from dspark_ray.tokenizer import Tokenizer
    from serve_fixtures import OBJECT_STORE_BYTES

    assert not ray.is_initialized(), "another test left Ray initialised in this process"
    ray.init(num_cpus=2, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False,
             namespace="dspark-dspark-tests", log_to_driver=False)
    # A fixed k (adaptive speculation would follow the machine's step times) and a float32 draft.
    config = EngineConfig(model=str(target_path), draft=str(dspark_path), adaptive_speculation=False,
                          draft_dtype="float32", **CONFIG)
    prompts = prompt_set()
    runs = {}
    try:
        for path, placement in (("direct", "worker"), ("replica", "worker"), ("direct", "target")):
            services = start_replica_services(config, app_name="dspark-tp2", replica="r0", tensor_parallel_size=2,
                                              placement_strategy="PACK", cpus_per_shard=0.25, torch_threads=1,
                                              slot_timeout_s=30, context_path=path, draft_placement=placement)
            try:
                assert services.draft.context_window == config.max_context  # the draft attends to all of it
                draft = RecordedDraft(services.draft)
                engine = Engine(config, Tokenizer.from_path(config.model), services.slots, services.target,
                                draft, owner="r0")
                assert engine.pipelined
                observer = StepObserver(engine)  # the replica's metrics: ray_dspark_context_relayed_total
                results = generate(engine, prompts, [SamplingParams(max_tokens=n) for n in MAX_TOKENS])
                assert observer.observe([], 0).counts["context_relayed"] == services.target.context_relayed
                proposer = services.draft_worker or services.shards[0]
                counts = ray.get(proposer.__ray_call__.remote(lambda self: dict(self.inbox.counts)))
                runs[path if placement == "worker" else "in rank 0"] = (
                    results, services.target.context_relayed, counts, draft.blocks)
            finally:
                services.shutdown()
    finally:
        ray.shutdown()
    for results, *_ in runs.values():
        for prompt, res in zip(prompts, results):
            assert res.token_ids == reference[tuple(prompt)], f"prompt of {len(prompt)} tokens"
    direct, relayed, in_rank0 = runs["direct"], runs["replica"], runs["in rank 0"]
    assert direct[1] == 0 and direct[2]["positions"] > 0 and direct[2]["wait_expired"] == 0
    assert relayed[1] > 0 and relayed[2]["positions"] == 0
    # Every position the target committed reached the draft once either way.
    assert direct[2]["positions"] == relayed[1]
    # The draft in rank 0's process (draft_placement target): its states never left the process.
    assert in_rank0[1] == 0 and in_rank0[2]["positions"] == direct[2]["positions"]
    blocks = {path: run[3] for path, run in runs.items()}
    assert len(blocks["direct"]) == len(blocks["replica"]) == len(blocks["in rank 0"]) > 20
    for a, b, c in zip(blocks["direct"], blocks["replica"], blocks["in rank 0"]):
        assert a[:3] == b[:3] == c[:3]
        torch.testing.assert_close(torch.tensor(a[3]), torch.tensor(b[3]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.tensor(a[3]), torch.tensor(c[3]), atol=1e-5, rtol=1e-5)
    assert sum(r.spec.accepted_tokens for r in direct[0] if r.spec) > 0
