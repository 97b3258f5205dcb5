"""``draft: ngram``: prompt-lookup drafting (engine/ngram_proposer.py).

The proposer on its own (the longest, most recent match; a loop drafted whole; per-slot state that
a new epoch empties and a bad row leaves untouched), then the engine with it: greedy output token
for token the target's own, in process and through a replica's Ray services (where it runs in
target rank 0's process, with no proposer actor). Sampled output with its point-mass drafts follows
the target's distribution in tests/test_engine_sampling.py; the real model with it in
tests/test_real_model.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import ray

from dspark_ray.engine import Engine, EngineConfig, SamplingParams
from dspark_ray.engine.config import ConfigError
from dspark_ray.engine.draft_proposer import DraftCacheBehind
from dspark_ray.engine.interfaces import ProposeRow, SamplingRow
from dspark_ray.engine.local import build_local_engine
from dspark_ray.engine.ngram_proposer import NgramProposer
from dspark_ray.serve.config import AppConfig
from dspark_ray.tokenizer import Tokenizer
from serve_fixtures import OBJECT_STORE_BYTES, serve_models  # noqa: F401 - fixture

GREEDY = SamplingRow(temperature=0.0, top_p=1.0, top_k=0, seed=0)
SAMPLED = SamplingRow(temperature=0.8, top_p=1.0, top_k=0, seed=3)


def row(slot: int, epoch: int, start: int, tokens, k: int = 4, sampling: SamplingRow = GREEDY) -> ProposeRow:
    return ProposeRow(slot, epoch, start, tuple(tokens), k, sampling)


def test_lookup_takes_the_longest_suffix_at_its_most_recent_occurrence():
    p = NgramProposer(capacity=2, max_context=64, max_spec_tokens=4, vocab_size=50, min_n=1, max_n=3)
    # "7 8" occurs twice before, followed by 1 then by 2: the most recent wins.
    assert p.lookup(np.array([7, 8, 1, 5, 7, 8, 2, 6, 7, 8]), 2) == [2, 6]
    # The 3-token suffix "4 7 8" beats the more recent 1-token "8".
    assert p.lookup(np.array([4, 7, 8, 9, 9, 8, 3, 4, 7, 8]), 3) == [9, 9, 8]
    # A loop shorter than k is drafted whole, past the end of the history (an LZ77 copy).
    assert p.lookup(np.array([5, 1, 2, 1, 2]), 4) == [1, 2, 1, 2]
    assert p.lookup(np.array([3, 3]), 3) == [3, 3, 3]
    assert p.lookup(np.array([1, 2, 3, 4]), 4) == []  # nothing repeats
    assert p.lookup(np.array([1, 2, 1]), 0) == []


def test_no_draft_from_a_suffix_shorter_than_min_n():
    p = NgramProposer(capacity=2, max_context=64, max_spec_tokens=4, vocab_size=50, min_n=2, max_n=4)
    assert p.lookup(np.array([1, 9, 2, 3, 9]), 4) == []  # only "9" repeats
    assert p.lookup(np.array([1, 9, 2, 1, 9]), 4) == [2, 1, 9, 2]  # "1 9" does
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(capacity=2, max_context=64, max_spec_tokens=4, vocab_size=50, min_n=3, max_n=2)


def test_slots_keep_their_own_tokens_and_a_new_epoch_empties_one():
    p = NgramProposer(capacity=3, max_context=64, max_spec_tokens=4, vocab_size=50, min_n=1, max_n=3)
    out = p.propose([row(1, 10, 0, [5, 6, 7, 5, 6]), row(2, 11, 0, [5, 6, 9, 5, 6])])
    assert out.draft_token_ids == [[7, 5, 6, 7], [9, 5, 6, 9]]  # the same suffix, each slot its own history
    assert out.draft_probs is None  # greedy rows need no q
    # Slot 1: two drafts accepted (7, 5), then the target's own token 1; the row starts after them.
    out = p.propose([row(1, 10, 7, [1])])
    assert p.tokens[1, :8].tolist() == [5, 6, 7, 5, 6, 7, 5, 1]
    assert out.draft_token_ids == [[]]  # "1" never occurred before
    # The slot is reused by another request (a new epoch): it starts empty.
    assert p.propose([row(1, 12, 0, [9, 9])]).draft_token_ids == [[9, 9, 9, 9]]
    assert p.tokens[2, :5].tolist() == [5, 6, 9, 5, 6]  # slot 2 untouched throughout


def test_a_row_ahead_of_the_proposer_changes_nothing():
    """After a restart (or a missed step) a row may start past what the slot holds: the call fails as a
    model draft's does (the engine then resends the tokens from 0), and no slot's state changed."""
    p = NgramProposer(capacity=3, max_context=64, max_spec_tokens=4, vocab_size=50, min_n=1, max_n=3)
    p.propose([row(1, 1, 0, [1, 2, 1])])
    before = (p.tokens.copy(), p.length.copy(), p.epoch.copy())
    for bad in ([row(2, 2, 0, [4, 4]), row(1, 1, 9, [3])],  # slot 1 holds 3 + 4 drafted positions
                [row(2, 2, 0, [4, 4]), row(1, 5, 2, [3])]):  # a new epoch holds nothing
        with pytest.raises(DraftCacheBehind, match="slot 1"):
            p.propose(bad)
        assert all(np.array_equal(a, b) for a, b in zip((p.tokens, p.length, p.epoch), before))
    with pytest.raises(ValueError, match="slot 0"):  # the padding row is never a request's
        p.propose([row(0, 1, 0, [1])])
    with pytest.raises(ValueError, match="exceed"):
        p.propose([row(2, 2, 0, list(range(66)))])
    assert all(np.array_equal(a, b) for a, b in zip((p.tokens, p.length, p.epoch), before))


def test_sampled_rows_draft_point_masses():
    p = NgramProposer(capacity=3, max_context=64, max_spec_tokens=4, vocab_size=50, min_n=1, max_n=3)
    out = p.propose([row(1, 1, 0, [1, 2, 1]), row(2, 2, 0, [3, 4, 3], k=2, sampling=SAMPLED)])
    assert out.draft_token_ids == [[2, 1, 2, 1], [4, 3]]
    q = out.draft_probs
    assert q.shape == (2, 4, 50)
    assert not q[0].any()  # the greedy row's q is unused: zeros
    assert q[1, 0, 4] == 1 and q[1, 1, 3] == 1 and q[1].sum() == 2


def test_config_names_ngram_instead_of_a_checkpoint(serve_models):
    config = AppConfig(model=str(serve_models.target), draft="ngram", http_port=None, prompt_lookup_max=3,
                       prompt_lookup_min=1)
    engine = config.engine_config()
    assert engine.draft == "ngram" and engine.spec_tokens == 4
    assert (engine.prompt_lookup_min, engine.prompt_lookup_max) == (1, 3)
    assert not engine.pipeline  # one call a step: rank 0 drafts and verifies
    assert config.memory_plan().draft is None  # no draft weights, no window cache
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        AppConfig(model=str(serve_models.target), draft="ngram", http_port=None, prompt_lookup_min=5)
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        EngineConfig(model=str(serve_models.target), draft="ngram", prompt_lookup_min=0)
    with pytest.raises(ValueError, match="ngrams"):  # any other name is still a checkpoint to find
        AppConfig(model=str(serve_models.target), draft="ngrams", http_port=None)


# Prompts the small Shakespeare model answers with repeats (greedy), and one it does not.
PROMPTS = ["ROMEO:\nI will, I will, I will", "First Citizen:\nSpeak, speak.\n\nAll:\nSpeak, speak.", "KING"]
MAX_TOKENS = 48


def ngram_config(models, **overrides) -> EngineConfig:
    fields = dict(model=str(models.target), draft="ngram", num_speculative_tokens=4, adaptive_speculation=False,
                  prompt_lookup_min=1, capacity=8, max_context=128, max_num_seqs=8)
    return EngineConfig(**{**fields, **overrides})


def run_all(engine: Engine, specs: list | None = None) -> dict[str, list[int]]:
    """``PROMPTS`` greedy to the end; each finished request's speculation summary into ``specs``."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = {engine.add_request(p, greedy, f"r{i}"): [] for i, p in enumerate(PROMPTS)}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.req_id] += out.new_token_ids
            if out.finished and specs is not None:
                specs.append(out.spec)
    return tokens


def assert_drafts_verified(specs: list) -> None:
    """Both paths taken: drafts accepted, and drafts rejected."""
    proposed, accepted = sum(s.draft_tokens for s in specs), sum(s.accepted_tokens for s in specs)
    print(f"ngram: {accepted} of {proposed} drafts accepted")
    assert 0 < accepted < proposed


def test_engine_greedy_with_ngram_equals_the_target_alone(serve_models):
    alone = run_all(build_local_engine(EngineConfig(model=str(serve_models.target), capacity=8, max_context=128)))
    engine = build_local_engine(ngram_config(serve_models))
    specs = []
    assert run_all(engine, specs) == alone
    assert engine.counters.draft_failures == 0
    assert_drafts_verified(specs)


@pytest.fixture(scope="module")
def cluster():
    assert not ray.is_initialized(), "another test left Ray initialised in this process"
    ray.init(num_cpus=2, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False,
             namespace="dspark-ngram-tests", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.ray
def test_served_ngram_runs_in_target_rank0_and_equals_the_target_alone(cluster, serve_models):
    from dspark_ray.runtime.actors import start_replica_services

    alone = run_all(build_local_engine(EngineConfig(model=str(serve_models.target), capacity=8, max_context=128)))
    config = ngram_config(serve_models, pipeline=False)
    services = start_replica_services(config, app_name="ngram", replica="n0", tensor_parallel_size=1,
                                      placement_strategy="PACK", cpus_per_shard=0.25, torch_threads=1,
                                      slot_timeout_s=30)
    try:
        assert services.draft_worker is None and services.draft.worker == services.shards[0]
        with pytest.raises(ValueError):  # no proposer actor was started
            ray.get_actor("dspark:proposer:n0")
        assert services.target.drafts  # drafted inside the step's call
        engine = Engine(config, Tokenizer.from_path(config.model), services.slots, services.target,
                        services.draft, owner="n0")
        specs = []
        assert run_all(engine, specs) == alone
        assert engine.counters.draft_failures == 0
        assert_drafts_verified(specs)
    finally:
        services.shutdown()


def test_a_row_offered_no_drafts_counts_as_a_miss_for_adaptive_k(serve_models):
    """Prompt lookup that finds nothing yields one token a step: adaptive speculation must see that
    (a first position missed), not an idle step, or it keeps choosing k for rows that verify little."""
    from dspark_ray.engine.adaptive import PRIOR_ACCEPTANCE

    engine = build_local_engine(ngram_config(serve_models, adaptive_speculation=True, prompt_lookup_min=4))
    req = engine.add_request([5, 6, 7, 8, 9, 10, 11, 12],
                             SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), "nomatch")
    engine.step()  # the prefill: nothing drafted yet
    request = engine.requests[req]
    steps = []
    while engine.has_unfinished():
        before = request.spec.draft_tokens
        engine.step()
        steps.append(request.spec.draft_tokens - before)
    assert sum(steps) == 0  # no 4-token suffix of this request ever occurred before in it
    assert request.acceptance.rate(0) < PRIOR_ACCEPTANCE - 0.1  # idle steps would leave it at the prior
