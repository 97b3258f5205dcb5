"""No contamination (invariant 3) and clean endings (invariants 1 and 5) under a random schedule.

A seeded schedule drives ``Engine.add_request`` / ``step`` / ``abort``
directly: requests arrive mid-flight and some are aborted (while waiting,
running or preempted); three slots serve fourteen requests, so slots are
reused; requests come and go, so a request's row in the batch changes from
step to step; the KV pool holds little more than one full request, so running
requests are skipped for a step or preempted and recomputed. (The scheduler
admits only into free batch rows, so a request is never left out for lack of
a row; it is for lack of KV.) Greedy and seeded sampled
requests, with speculation on, off and at different k, must each produce
exactly the tokens of their run alone in a fresh engine (aborted ones: a
prefix of it). The test also checks that reuse, skipping and preemption
really happened, so it cannot pass vacuously.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from dspark_ray.engine import SamplingParams
from dspark_ray.engine.request import Status
from engine_fixtures import (  # noqa: F401 - fixtures
    Collected,
    TinyModels,
    assert_drained,
    collect,
    make_engine,
    make_pipelined_engine,
    solo,
    tiny_models,
)

CONFIG = dict(num_speculative_tokens=3, draft_window=12, capacity=3, max_context=48, kv_pool_tokens=52,
              max_num_seqs=3)
NUM_REQUESTS = 14


@dataclass
class Planned:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: int  # step before which it is added
    abort_after: int | None  # steps after arrival at which it is aborted, if still running


def random_rules(rng: random.Random, max_tokens: int) -> dict:
    """Logits rules and log-probability requests: state that depends on each request's own output."""
    return dict(repetition_penalty=rng.choice([1.0, 1.4]), presence_penalty=rng.choice([0.0, 0.8]),
                frequency_penalty=rng.choice([0.0, 0.5]), logit_bias=rng.choice([{}, {rng.randrange(4096): 4.0}]),
                min_tokens=rng.choice([0, max_tokens // 2]), min_p=rng.choice([0.0, 0.05]),
                logprobs=rng.choice([None, 0, 3]), prompt_logprobs=rng.choice([None, 2]))


def random_schedule(seed: int, rules: bool = False, shared: bool = False) -> list[Planned]:
    """``shared``: most prompts start with one of two 18-token prefixes (a prefix-cache block and
    then some), so requests map blocks other requests computed, also while those still run."""
    rng = random.Random(seed)
    rules_rng = random.Random(seed + 1000)  # a separate stream: the base schedule of a seed stays the same
    prefix_rng = random.Random(seed + 2000)
    prefixes = [[prefix_rng.randrange(1, 4096) for _ in range(18)] for _ in range(2)]
    plan = []
    for i in range(NUM_REQUESTS):
        prompt = [rng.randrange(1, 4096) for _ in range(rng.randint(1, 16))]
        if shared and prefix_rng.random() < 0.8:
            prompt = prefix_rng.choice(prefixes) + prompt[:prefix_rng.randint(1, 6)]
        max_tokens = min(rng.randint(8, 30), CONFIG["max_context"] - len(prompt))
        spec = rng.choice([dict(), dict(), dict(num_speculative_tokens=rng.randint(0, 3)), dict(speculative=False)])
        if i % 2:
            sampling = dict(temperature=rng.choice([0.7, 1.0, 1.3]), seed=rng.randrange(2**32),
                            top_k=rng.choice([0, 0, 20]), top_p=rng.choice([1.0, 1.0, 0.9]))
        else:
            sampling = {}
        abort_after = rng.choice([None] * 5 + [0, rng.randint(1, 10)])
        extra = random_rules(rules_rng, max_tokens) if rules else {}
        plan.append(Planned(f"req{i}", prompt, SamplingParams(max_tokens=max_tokens, **spec, **sampling, **extra),
                            arrival=rng.randint(0, 12), abort_after=abort_after))
    return plan


@dataclass
class Observed:
    skipped: int = 0  # running requests left out of a step
    rows: dict[str, set[int]] | None = None  # request -> the batch rows it ran in
    preempted_aborts: int = 0
    waiting_aborts: int = 0
    slot_holders: dict[int, set[str]] | None = None


def drive(engine, schedule: list[Planned]) -> tuple[dict[str, Collected], Observed]:
    results: dict[str, Collected] = {}
    seen = Observed(slot_holders={}, rows={})
    aborted_preempted = False
    step = 0
    while step <= 12 or engine.has_unfinished():
        assert step < 2000, "the engine stalled"
        for p in schedule:
            if p.arrival == step:
                assert engine.add_request(p.prompt, p.params, req_id=p.req_id) == p.req_id
            if p.abort_after is not None and p.arrival + p.abort_after == step and p.req_id in engine.requests:
                seen.waiting_aborts += engine.requests[p.req_id].status is Status.WAITING
                assert engine.abort(p.req_id)
        preempted = [r for r in engine.requests.values() if r.status is Status.PREEMPTED]
        if preempted and not aborted_preempted:  # abort one preempted request, once
            aborted_preempted = True
            seen.preempted_aborts += 1
            assert engine.abort(preempted[0].req_id)
        running = [r.req_id for r in engine.scheduler.running]
        outputs = engine.step()
        collect(engine, results, outputs)
        progressed = [o.req_id for o in outputs if o.finish_reason != "abort"]  # in row order
        for row, req_id in enumerate(progressed):
            seen.rows.setdefault(req_id, set()).add(row)
        seen.skipped += sum(1 for r in running if r not in progressed and r in engine.requests)
        check_slots(engine, seen)
        step += 1
    return results, seen


def check_slots(engine, seen: Observed) -> None:
    """Invariant 1, and a record of who held which slot."""
    held = [(r.slot, r.req_id) for r in engine.requests.values() if r.holds_slot]
    slots = [s for s, _ in held]
    assert 0 not in slots, "slot 0 (padding) was handed out"
    assert len(slots) == len(set(slots)), f"two live requests share a slot: {held}"
    for slot, req_id in held:
        seen.slot_holders.setdefault(slot, set()).add(req_id)
        lease = engine.slots.lookup(req_id)
        assert lease is not None and (lease.slot, lease.epoch) == (slot, engine.requests[req_id].epoch)


@pytest.mark.parametrize("seed, rules, pipelined, budget", [
    (0, False, False, None), (1, False, False, None), (2, True, False, None), (0, False, True, None),
    (6, True, True, None), (3, True, False, 7), (1, False, True, 7), (4, False, False, "shared"),
    (5, True, True, "shared")])
def test_random_schedule_matches_solo_runs(tiny_models: TinyModels, seed, rules, pipelined, budget):
    """With ``rules`` requests also carry penalties, logit_bias, min_tokens, min_p and ask for logprobs.

    ``pipelined``: the engine drafts one half of the batch while it verifies
    the other (draft and target on threads of their own, as behind Ray), and
    every request must still produce what it produces alone in a sequential engine.
    ``budget``: a step feeds at most this many target tokens, so prompts and
    recomputes are prefilled in chunks whose boundaries depend on the crowd
    (aborts and preemptions then land mid-prefill too). "shared": prompts share
    prefixes, so the target's prefix cache maps blocks other requests
    computed, while they run and after they ended (the prefix cache is on in
    every case; solo runs start with an empty cache).
    """
    shared = budget == "shared"
    schedule = random_schedule(seed, rules, shared=shared)
    build = make_pipelined_engine if pipelined else make_engine
    config = {**CONFIG, "max_num_batched_tokens": budget} if isinstance(budget, int) else CONFIG
    if shared:
        config = {**CONFIG, "max_context": 64, "kv_pool_tokens": 70}
    engine = build(tiny_models.target, tiny_models.drafts["near"], **config)
    results, seen = drive(engine, schedule)
    if isinstance(budget, int):
        assert engine.counters.prefill_chunks > 0, "no prompt was chunked"
    if shared:
        assert engine.counters.prefix_cache_hit_tokens >= 3 * 16, "the prefix cache was hardly used"

    # The schedule really exercised what it claims to.
    assert engine.counters.preemptions > 0, "no preemption happened"
    assert seen.preempted_aborts == 1 and seen.waiting_aborts > 0
    assert seen.skipped > 0, "no running request was ever left out of a step"
    assert sum(len(rows) > 1 for rows in seen.rows.values()) >= 3, "batch rows never changed"
    assert engine.slots.counters().allocations > 2 * CONFIG["capacity"]
    assert any(len(holders) >= 3 for holders in seen.slot_holders.values()), "no slot was reused"
    sampled_with_drafts = [p for p in schedule if not p.params.greedy and p.req_id in results
                           and results[p.req_id].spec and results[p.req_id].spec.drafts > 0]
    assert sampled_with_drafts, "no sampled request speculated"

    compared = 0
    for p in schedule:
        got = results[p.req_id]
        assert got.finished and got.error is None
        alone = solo(tiny_models.target, tiny_models.drafts["near"], p.prompt, p.params, **config)
        if got.finish_reason == "abort":
            assert got.token_ids == alone.token_ids[: len(got.token_ids)], p.req_id
            assert got.text == alone.text[: len(got.text)]
        else:
            compared += 1
            assert got.token_ids == alone.token_ids, p.req_id
            assert (got.text, got.finish_reason, got.stop_reason) == (alone.text, alone.finish_reason,
                                                                      alone.stop_reason)
            # Speculation happened the same way too: same blocks, same acceptances.
            assert got.spec == alone.spec, p.req_id
            assert_same_logprobs(got, alone, p)
    assert compared >= NUM_REQUESTS // 2
    if rules:  # requests with rules and with log-probabilities ran to the end beside others
        done = [p for p in schedule if results[p.req_id].finish_reason != "abort"]
        assert sum(p.params.has_rules for p in done) >= 3 and sum(p.params.logprobs is not None for p in done) >= 3
    assert_drained(engine, NUM_REQUESTS)


def assert_same_logprobs(got: Collected, alone: Collected, p: Planned) -> None:
    """The log-probabilities a request got in the crowd are those of its solo run (float tolerance)."""
    if p.params.logprobs is not None:
        assert [lp.token_id for lp in got.logprobs] == got.token_ids
        assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in alone.logprobs], abs=1e-4)
    if p.params.prompt_logprobs is not None:
        assert len(got.prompt_logprobs) == len(p.prompt) and got.prompt_logprobs[0] is None
        assert [lp.logprob for lp in got.prompt_logprobs[1:]] == pytest.approx(
            [lp.logprob for lp in alone.prompt_logprobs[1:]], abs=1e-4)


def test_reused_slot_shows_nothing_of_its_previous_owner(tiny_models: TinyModels):
    """One slot, run back to back: the same prompt gives the same tokens after any predecessor."""
    config = dict(CONFIG, capacity=1, max_num_seqs=1)
    engine = make_engine(tiny_models.target, tiny_models.drafts["near"], **config)
    probe = ([11, 22, 33], SamplingParams(max_tokens=12, temperature=1.0, seed=5))
    first = solo(tiny_models.target, tiny_models.drafts["near"], *probe, **config)
    for i, other in enumerate([[7] * 30, [900, 901], [4000] * 40]):
        engine.add_request(other, SamplingParams(max_tokens=5))
        engine.add_request(*probe, req_id=f"probe{i}")
        results = {}
        while engine.has_unfinished():
            collect(engine, results, engine.step())
        assert results[f"probe{i}"].token_ids == first.token_ids
    assert engine.slots.counters().allocations == 6
    assert_drained(engine, 6)
