"""Drafting ahead (``draft_ahead``, engine/draft_proposer.py): the draft worker drafts a lone greedy
request's next proposal while the target verifies the current one.

In process the engine has no idle time to fill, so the first test wraps the proposer to draft
ahead right after every proposal (in the served worker it happens after the reply, while the
target verifies: the same order of cache operations), cut short at random as when a call comes
first, and drives it beside a plain engine through one random schedule: one request at a time
most of the time (where drafting ahead applies), greedy and seeded sampled requests, now and then
several rows at once (where it must not). The drafts kept ahead (whole, or cut short and finished
by the next proposal) must be exactly what the plain engine drafts, which the per-request
acceptance shows, and output must be unchanged. A proposal that does not ask for what was guessed
(a draft rejected, a bonus token other than the guess) rolls back over the 2k provisional
positions drafting ahead wrote, which needs the ring's 2k slack (with k, this test fails). The
last test runs the real draft worker on a real Ray cluster.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import ray

from dspark_ray.engine import Engine, EngineConfig, SamplingParams
from dspark_ray.engine.local import build_local_engine
from dspark_ray.runtime.actors import start_replica_services
from dspark_ray.serve.config import AppConfig
from dspark_ray.tokenizer import Tokenizer
from serve_fixtures import OBJECT_STORE_BYTES, serve_models  # noqa: F401 - fixture

K = 4


def config(target, draft, **overrides) -> EngineConfig:
    base = EngineConfig(model=str(target), draft=str(draft), num_speculative_tokens=K, adaptive_speculation=False,
                        draft_window=16, capacity=6, max_context=160, max_num_seqs=4, draft_dtype="float32",
                        enable_prefix_caching=False)
    return dataclasses.replace(base, **overrides)


class DraftingAhead:
    """The proposer as the served draft worker runs it: ``draft_ahead`` after every proposal, cut
    short at random (as when the next call comes before it is done)."""

    def __init__(self, proposer, rng: random.Random) -> None:
        self.proposer, self.rng = proposer, rng

    def propose(self, rows):
        proposal = self.proposer.propose(rows)
        self.proposer.draft_ahead(lambda: self.rng.random() < 0.15)
        return proposal

    def __getattr__(self, name):
        return getattr(self.proposer, name)


def test_drafting_ahead_proposes_what_the_plain_draft_does_and_changes_no_output(shipped_target, shipped_draft):
    plain = build_local_engine(config(shipped_target, shipped_draft))
    ahead = build_local_engine(config(shipped_target, shipped_draft, draft_ahead=True))
    assert ahead.draft.cache.ring == 16 + 2 * K and plain.draft.cache.ring == 16 + K
    rng = random.Random(5)
    ahead.draft = DraftingAhead(ahead.draft, random.Random(6))
    outputs = {"plain": {}, "ahead": {}}
    n = 0
    for _ in range(2000):
        idle = not plain.has_unfinished()
        # Mostly one request at a time; sometimes a second or third joins (multi-row proposals).
        if n < 16 and (idle or rng.random() < 0.04):
            prompt = [rng.randrange(5, 4000) for _ in range(rng.randrange(3, 30))]
            greedy = rng.random() < 0.75
            params = SamplingParams(max_tokens=rng.randrange(20, 90), ignore_eos=True,
                                    temperature=0.0 if greedy else 0.8, seed=None if greedy else rng.randrange(99))
            for engine in (plain, ahead):
                engine.add_request(prompt, params, f"r{n}")
            n += 1
        if not plain.has_unfinished():
            break
        for name, engine in (("plain", plain), ("ahead", ahead)):
            for out in engine.step():
                outputs[name].setdefault(out.req_id, []).extend(out.new_token_ids)
                if out.finished:
                    outputs[name][out.req_id + ":spec"] = out.spec
    assert n == 16 and not ahead.has_unfinished()
    # Same tokens, and the same drafts: every request accepted the same drafts at the same positions.
    assert outputs["ahead"] == outputs["plain"]
    counts = ahead.draft.ahead_counts
    # Drafted ahead for most steps, used where the target took every draft and the guessed bonus,
    # sometimes cut short (the rest drafted by the proposal that used them).
    assert counts.drafted > 60 and counts.used > 4 and counts.dropped > 40 and counts.cut_short > 20, counts
    assert plain.draft.ahead_counts.drafted == 0


def test_only_the_lone_greedy_request_is_drafted_ahead(shipped_target, shipped_draft):
    engine = build_local_engine(config(shipped_target, shipped_draft, draft_ahead=True))
    proposer = engine.draft
    engine.add_request("ROMEO:\n", SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True), "s")
    while engine.has_unfinished():
        engine.step()
        assert not proposer.draft_ahead()  # a sampled row's drafts must not depend on timing
    engine.add_request("ROMEO:\n", SamplingParams(max_tokens=30, ignore_eos=True), "a")
    engine.add_request("JULIET:\n", SamplingParams(max_tokens=30, ignore_eos=True), "b")
    while engine.has_unfinished():
        engine.step()
        assert not proposer.draft_ahead()  # two rows: the worker is not idle while they verify
    assert proposer.ahead_counts.drafted == 0
    engine.add_request("ROMEO:\n", SamplingParams(max_tokens=30, ignore_eos=True), "c")
    engine.step()  # its prompt
    engine.step()  # its first proposal, alone
    assert proposer.draft_ahead()
    engine.add_request("JULIET:\n" * 3, SamplingParams(max_tokens=30, ignore_eos=True), "d")
    engine.step()  # c alone proposes (d's prompt is fed, undrafted), but c is not the only request
    assert engine.scheduler.running and len(engine.scheduler.running) == 2
    assert not proposer.draft_ahead()


@pytest.mark.ray
def test_the_served_draft_worker_drafts_ahead_and_output_is_unchanged(serve_models):
    """The real draft worker on a real cluster, pipelined as served: one request at a time (each is
    drafted in one step and verified in the next, and the worker drafts ahead meanwhile)."""
    args = dict(model=str(serve_models.target), draft=str(serve_models.draft), http_port=None)
    assert not AppConfig(**args).engine_config().draft_ahead
    assert AppConfig(**args, draft_ahead=True).engine_config().draft_ahead
    assert not AppConfig(**args, draft_ahead=True, draft_placement="target").engine_config().draft_ahead
    cfg = config(serve_models.target, serve_models.draft, draft_ahead=True, pipeline=True, draft_dtype="auto")
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompts = ["ROMEO:\nBut soft, what light", "First Citizen:\nBefore we proceed any further", "To be"]
    local = build_local_engine(dataclasses.replace(cfg, draft_ahead=False))
    expected = {}
    for i, p in enumerate(prompts):
        local.add_request(p, params, f"r{i}")
        while local.has_unfinished():
            for out in local.step():
                expected.setdefault(out.req_id, []).extend(out.new_token_ids)

    assert not ray.is_initialized(), "another test left Ray initialised in this process"
    ray.init(num_cpus=2, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False,
             namespace="dspark-ahead-tests", log_to_driver=False)
    try:
        services = start_replica_services(cfg, app_name="ahead", replica="a0", tensor_parallel_size=1,
                                          placement_strategy="PACK", cpus_per_shard=0.25, torch_threads=1,
                                          slot_timeout_s=30)
        try:
            engine = Engine(cfg, Tokenizer.from_path(cfg.model), services.slots, services.target, services.draft,
                            owner="a0")
            assert engine.pipelined
            tokens = {}
            for i, p in enumerate(prompts):
                engine.add_request(p, params, f"r{i}")
                while engine.has_unfinished():
                    for out in engine.step():
                        tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            assert tokens == expected
            counts = ray.get(services.draft_worker.ahead_counts.remote())
            assert counts["drafted"] > 10 and counts["used"] > 0, counts
            assert engine.counters.draft_failures == 0
        finally:
            services.shutdown()
    finally:
        ray.shutdown()
