"""``draft_placement: target``: the draft proposer inside target rank 0's actor, on a real Ray cluster.

The replica's services are started as a Serve replica starts them
(``start_replica_services``) and driven by the engine through the same
facades, with ``worker_env_vars`` in the shards' processes (merged with the
app's own runtime_env). With the draft in rank 0's process there is no proposer actor, the
proposals travel on a second channel to rank 0, and greedy output is token
for token the in-process engine's. When the target is rebuilt (rank 0
killed mid-generation), the new rank 0 holds a fresh proposer with an empty
window cache: the requests resume and resend their tokens to it from the
first (``Engine.reset_target``) and draft again at once; greedy output is
unchanged. With one rank
and an independent draft, each step is one call: rank 0 drafts the step's
rows and verifies them (``TargetStep.propose``), and the drafts' q never
leaves its process.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import ray

from dspark_ray.engine import Engine, EngineConfig, SamplingParams
from dspark_ray.engine.local import build_local_engine
from dspark_ray.runtime.actors import start_replica_services
from dspark_ray.serve.config import AppConfig
from dspark_ray.tokenizer import Tokenizer
from serve_fixtures import OBJECT_STORE_BYTES, serve_models  # noqa: F401 - fixture

pytestmark = [pytest.mark.ray]

PROMPTS = [
    "ROMEO:\nBut soft, what light",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "To be",
]
MAX_TOKENS = 40


WORKER_ENV = {"GOMP_SPINCOUNT": "30000000", "DSPARK_TEST_WORKER_ENV": "rank0"}


def worker_env(actor) -> dict[str, str]:
    """The variables of ``WORKER_ENV`` and the app's own as the actor's process sees them."""
    names = [*WORKER_ENV, "DSPARK_TEST_FROM_THE_APP"]
    return ray.get(actor.__ray_call__.remote(lambda self: {n: os.environ.get(n) for n in names}))


def engine_config(models, **overrides) -> EngineConfig:
    base = EngineConfig(model=str(models.target), draft=str(models.draft), num_speculative_tokens=4,
                        adaptive_speculation=False, draft_window=32, capacity=8, max_context=128, max_num_seqs=8,
                        pipeline=False)
    return dataclasses.replace(base, **overrides)


def add_all(engine: Engine) -> dict[str, list[int]]:
    """The prompts, greedy but for the last, which samples with a seed (its drafts' q must reach the
    verification as they would through the replica)."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=7, ignore_eos=True)
    return {engine.add_request(p, sampled if i == len(PROMPTS) - 1 else greedy, f"r{i}"): []
            for i, p in enumerate(PROMPTS)}


SAMPLED = f"r{len(PROMPTS) - 1}"  # add_all's sampled request


def reference(config: EngineConfig) -> dict[str, list[int]]:
    """``add_all``'s requests run to the end by the in-process engine."""
    local = build_local_engine(config)
    expected = add_all(local)
    run(local, expected)
    return expected


def assert_greedy_unchanged(tokens: dict[str, list[int]], expected: dict[str, list[int]]) -> None:
    """The greedy requests token for token; the sampled one to its length only (after a step that lost
    its drafts its tokens part from the reference: they depend on its drafts, its distribution not)."""
    assert {r: t for r, t in tokens.items() if r != SAMPLED} == {r: t for r, t in expected.items() if r != SAMPLED}
    assert len(tokens[SAMPLED]) == MAX_TOKENS


def run(engine: Engine, tokens: dict[str, list[int]], steps: int | None = None) -> None:
    """Step until done (or ``steps`` times), appending each request's new tokens."""
    n = 0
    while engine.has_unfinished() and (steps is None or n < steps):
        for out in engine.step():
            tokens[out.req_id] += out.new_token_ids
        n += 1


@pytest.fixture(scope="module")
def cluster():
    assert not ray.is_initialized(), "another test left Ray initialised in this process"
    ray.init(num_cpus=2, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False,
             namespace="dspark-placement-tests", log_to_driver=False,
             runtime_env={"env_vars": {"DSPARK_TEST_FROM_THE_APP": "kept"}})
    yield
    ray.shutdown()


def test_app_config_turns_the_pipeline_off_with_the_draft_in_the_target(serve_models):
    args = dict(model=str(serve_models.target), draft=str(serve_models.draft), http_port=None)
    assert AppConfig(**args).engine_config().pipeline
    assert not AppConfig(**args, draft_placement="target").engine_config().pipeline
    with pytest.raises(ValueError, match="draft_placement"):
        AppConfig(**args, draft_placement="elsewhere")


def test_worker_env_vars_are_strings_as_a_process_sees_them(serve_models):
    """YAML writes ``GOMP_SPINCOUNT: 30000000`` and ``OMP_PROC_BIND: true``: the values a process gets."""
    args = dict(model=str(serve_models.target), draft=str(serve_models.draft), http_port=None)
    config = AppConfig(**args, worker_env_vars={"GOMP_SPINCOUNT": 30000000, "OMP_PROC_BIND": True, "A": "x y"})
    assert config.worker_env_vars == {"GOMP_SPINCOUNT": "30000000", "OMP_PROC_BIND": "true", "A": "x y"}
    assert AppConfig(**args).worker_env_vars == {}
    for bad in ({"A=B": "1"}, {"": "1"}, {"A": [1]}, {"A": None}):
        with pytest.raises(ValueError, match="worker_env_vars"):
            AppConfig(**args, worker_env_vars=bad)


def test_draft_in_target_rank0_serves_the_same_tokens_and_survives_a_rebuild(cluster, serve_models):
    config = engine_config(serve_models)
    expected = reference(config)

    # As deploy/dspark.yaml runs it: rank 0's OpenMP threads spinning between steps, set by worker_env_vars.
    services = start_replica_services(config, app_name="placement", replica="p0", tensor_parallel_size=1,
                                      placement_strategy="PACK", cpus_per_shard=0.25, torch_threads=1,
                                      slot_timeout_s=30, draft_placement="target",
                                      worker_env_vars=dict(WORKER_ENV))
    try:
        assert services.draft_worker is None and services.draft.worker == services.shards[0]
        assert worker_env(services.shards[0]) == {**WORKER_ENV, "DSPARK_TEST_FROM_THE_APP": "kept"}
        ray.get_actor("dspark:target:p0:rank0")
        with pytest.raises(ValueError):  # no proposer actor was started
            ray.get_actor("dspark:proposer:p0")
        engine = Engine(config, Tokenizer.from_path(config.model), services.slots, services.target,
                        services.draft, owner="p0")
        assert services.target.drafts  # an independent draft in the one rank: drafted inside the step's call
        tokens = add_all(engine)
        run(engine, tokens, steps=4)  # every request drafted for and verified a few times
        assert engine.has_unfinished()
        timeline = services.timeline.snapshot()
        # The proposals ran in rank 0 within the steps' calls: no call of their own, so no transport.
        assert timeline["draft.compute"]["count"] >= 3 and "draft.transport" not in timeline
        assert engine.counters.draft_failures == 0
        assert all(r.spec.accepted_tokens > 0 for r in engine.requests.values())  # drafts were verified
        for req_id, got in tokens.items():  # every request so far, the sampled one too, as in process
            assert got and got == expected[req_id][:len(got)], req_id

        ray.kill(services.shards[0], no_restart=True)  # the target, and the draft with it, are gone
        while engine.target_error is None and engine.has_unfinished():
            for out in engine.step():
                tokens[out.req_id] += out.new_token_ids
        assert engine.target_error is not None
        engine.reset_target(services.rebuild_target())
        assert services.draft.worker == services.shards[0]
        assert worker_env(services.shards[0]) == {**WORKER_ENV, "DSPARK_TEST_FROM_THE_APP": "kept"}
        proposals = services.timeline.snapshot()["draft.compute"]["count"]
        run(engine, tokens)
        assert not engine.has_unfinished()
        # Greedy output is unchanged by the rebuild. (A sampled request's tokens may part from the
        # reference late on: the recomputed KV and the draft's rebuilt window differ from the incremental
        # ones in the last bits, which can tip an acceptance test; its distribution is the same.)
        assert_greedy_unchanged(tokens, expected)
        # Drafting went on after the rebuild, on the new rank 0's fresh proposer: reset_target had every
        # request resend its tokens to the draft, so no proposal found the empty window cache behind
        # (which would have failed it: DraftCacheBehind, and that step verified without drafts).
        assert services.timeline.snapshot()["draft.compute"]["count"] > proposals + 1
        assert engine.counters.draft_failures == 0
    finally:
        services.shutdown()


def test_workers_on_two_threads_start_with_openmp_threads_that_sleep_at_once(cluster, serve_models):
    """torch_threads 2: the target shard's and the draft worker's processes start with
    OMP_WAIT_POLICY=PASSIVE (libgomp reads it as torch loads), beside the app's own variables; an
    operator's value (worker_env_vars, the app's runtime_env) is kept; one thread adds nothing."""
    from dspark_ray.runtime.actors import _worker_runtime_env

    names = ("OMP_WAIT_POLICY", "DSPARK_TEST_FROM_THE_APP")
    config = engine_config(serve_models)
    services = start_replica_services(config, app_name="threads", replica="t0", tensor_parallel_size=1,
                                      placement_strategy="PACK", cpus_per_shard=0.25, torch_threads=2,
                                      slot_timeout_s=30)
    try:
        for actor in (services.shards[0], services.draft_worker):
            seen = ray.get(actor.__ray_call__.remote(
                lambda self: ({n: os.environ.get(n) for n in names}, __import__("torch").get_num_threads())))
            assert seen == ({"OMP_WAIT_POLICY": "PASSIVE", "DSPARK_TEST_FROM_THE_APP": "kept"}, 2)
    finally:
        services.shutdown()
    assert _worker_runtime_env({"OMP_WAIT_POLICY": "ACTIVE"}, 2)["env_vars"]["OMP_WAIT_POLICY"] == "ACTIVE"
    assert _worker_runtime_env(None, 1) is None and _worker_runtime_env({}, 1) is None
    assert _worker_runtime_env({"A": "b"}, 1)["env_vars"] == {"DSPARK_TEST_FROM_THE_APP": "kept", "A": "b"}


def test_a_failing_proposal_in_the_steps_call_verifies_without_drafts(cluster, serve_models):
    """The proposer in rank 0 raises inside a one-call step: that step verifies no drafts, the engine
    counts a draft failure and resends the rows' tokens, the next steps draft again, greedy output is
    unchanged."""
    config = engine_config(serve_models)
    expected = reference(config)
    services = start_replica_services(config, app_name="placement-fail", replica="f0", tensor_parallel_size=1,
                                      placement_strategy="PACK", cpus_per_shard=0.25, torch_threads=1,
                                      slot_timeout_s=30, draft_placement="target")
    try:
        engine = Engine(config, Tokenizer.from_path(config.model), services.slots, services.target,
                        services.draft, owner="f0")
        tokens = add_all(engine)
        run(engine, tokens, steps=3)

        def fail_next_proposal(shard) -> None:
            propose = shard.proposer.propose

            def once(rows):
                shard.proposer.propose = propose
                raise RuntimeError("injected proposer failure")
            shard.proposer.propose = once

        ray.get(services.shards[0].__ray_call__.remote(fail_next_proposal))
        before = services.timeline.snapshot()["draft.compute"]["count"]
        run(engine, tokens, steps=1)
        assert engine.counters.draft_failures == 1
        assert all(r.draft_len == 0 for r in engine.requests.values())  # caught up from scratch next time
        assert services.timeline.snapshot()["draft.compute"]["count"] == before  # that step drafted nothing
        run(engine, tokens)
        assert_greedy_unchanged(tokens, expected)
        assert services.timeline.snapshot()["draft.compute"]["count"] > before + 3
        assert engine.counters.draft_failures == 1 and engine.target_error is None
    finally:
        services.shutdown()
