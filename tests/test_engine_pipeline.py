"""Pipelined steps: one half of the batch drafted while the other is verified (Engine docstring).

The draft and the target run on threads of their own (``ThreadedService``),
as the Ray facades run them in other processes, so the calls really overlap.
Output must be exactly the sequential engine's; failures of either service
mid-pipeline must end or degrade requests as they do in the sequential engine.
(The random schedule with aborts, preemption and slot reuse runs pipelined in
test_engine_contamination.py; the Ray path in test_faults.py and test_serve_cluster.py.)
"""

from __future__ import annotations

import pytest

from dspark_kernels import ops
from dspark_ray.engine import SamplingParams
from engine_fixtures import (  # noqa: F401 - fixtures
    TinyModels,
    assert_drained,
    collect,
    generate,
    make_engine,
    make_pipelined_engine,
    run_all,
    tiny_models,
)

CONFIG = dict(num_speculative_tokens=3, draft_window=16, capacity=8, max_context=96, max_num_seqs=8)
PROMPTS = [[(37 * i + 11 * j) % 4000 + 1 for j in range(3 + i % 5)] for i in range(6)]
PARAMS = [SamplingParams(max_tokens=24, ignore_eos=True) if i % 2 == 0 else
          SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.9, seed=100 + i) for i in range(6)]


def overlapped(calls: list[tuple[str, float, float]], others: list[tuple[str, float, float]]) -> int:
    """How many calls of one service ran at the same time as some call of the other."""
    return sum(any(s < oe and os_ < e for _, os_, oe in others) for _, s, e in calls)


@pytest.fixture
def sequential_outputs(tiny_models: TinyModels):
    engine = make_engine(tiny_models.target, tiny_models.drafts["near"], **CONFIG)
    return generate(engine, PROMPTS, PARAMS)


def test_pipelined_equals_sequential_and_really_overlaps(tiny_models: TinyModels, sequential_outputs):
    engine = make_pipelined_engine(tiny_models.target, tiny_models.drafts["near"], **CONFIG)
    # Attention through torch, not the CPU kernels: the tiny models' calls then last long enough that a
    # thread's wake-up on a loaded 2-core box does not decide whether two of them overlap (with the
    # kernels a full-suite run saw 13 of 30 drafting calls overlap; alone, every run passed).
    with ops.use_backend("reference"):
        got = generate(engine, PROMPTS, PARAMS)
    for g, s in zip(got, sequential_outputs):
        assert (g.token_ids, g.text, g.finish_reason) == (s.token_ids, s.text, s.finish_reason)
        assert g.spec == s.spec  # the same drafts were proposed and accepted
    assert any(g.spec.accepted_tokens > 0 for g in got), "nothing was accepted: speculation did not run"
    proposes, steps = engine.draft.calls, engine.target.calls
    assert overlapped(proposes, steps) >= len(proposes) // 2, "drafting and verification did not overlap"
    assert_drained(engine, len(PROMPTS))


def test_one_request_alternates_drafting_and_verifying(tiny_models: TinyModels, sequential_outputs):
    engine = make_pipelined_engine(tiny_models.target, tiny_models.drafts["near"], **CONFIG)
    (got,) = generate(engine, PROMPTS[:1], PARAMS[:1])
    assert got.token_ids == sequential_outputs[0].token_ids and got.spec == sequential_outputs[0].spec
    assert overlapped(engine.draft.calls, engine.target.calls) == 0  # nothing to overlap with
    # A step either drafts the request or verifies it: one target call per engine step at most.
    assert len(engine.target.calls) + len(engine.draft.calls) <= engine.counters.steps + 1
    assert_drained(engine, 1)


def test_halves_stay_balanced(tiny_models: TinyModels):
    """Eight requests admitted at once run as two halves of four, not as one batch of eight."""
    engine = make_pipelined_engine(tiny_models.target, tiny_models.drafts["near"], **CONFIG)
    for p in PROMPTS[:4] + PROMPTS[:4]:
        engine.add_request(p, SamplingParams(max_tokens=16, ignore_eos=True))
    sizes = []
    results = run_all(engine, after_step=lambda e: sizes.append(e.timings.rows))
    assert len(results) == 8
    assert max(len(r.token_ids) for r in results.values()) == 16
    steady = sizes[2:8]
    assert steady and all(s == 8 for s in steady), sizes  # 4 verified + 4 drafted in each step


def test_draft_failure_mid_pipeline_changes_no_output(tiny_models: TinyModels, sequential_outputs):
    engine = make_pipelined_engine(tiny_models.target, tiny_models.drafts["near"],
                                   fail_on={"propose": {3, 4, 9}}, **CONFIG)
    got = generate(engine, PROMPTS, PARAMS)
    # Greedy output is the target's whatever the drafts; a sampled request whose step ran
    # without drafts drew other (equally distributed) tokens, so only its length is fixed.
    for i, (g, s) in enumerate(zip(got, sequential_outputs)):
        assert g.token_ids == s.token_ids if PARAMS[i].greedy else len(g.token_ids) == len(s.token_ids)
    assert engine.counters.draft_failures == 3
    assert_drained(engine, len(PROMPTS))


class FailingTarget:
    """The real target runner; its step calls numbered in ``fail_on`` (1-based) raise."""

    def __init__(self, inner, fail_on: set[int]) -> None:
        self.inner, self.fail_on, self.calls = inner, fail_on, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self, batch):
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError(f"injected failure of step call {self.calls}")
        return self.inner.step(batch)


@pytest.mark.parametrize("pipelined", [False, True])
def test_target_failure_loses_no_request(tiny_models: TinyModels, sequential_outputs, pipelined):
    """A target step fails mid-generation: no request ends; each waits (step() refuses to run),
    resumes on the replacement target by recomputing its KV, and produces exactly the tokens
    of an undisturbed run, greedy and sampled alike; nothing leaks."""
    from dspark_ray.engine.engine import TargetUnavailable

    if pipelined:
        engine = make_pipelined_engine(tiny_models.target, tiny_models.drafts["near"], fail_on={"step": {5}},
                                       **CONFIG)
    else:
        engine = make_engine(tiny_models.target, tiny_models.drafts["near"], **CONFIG)
        engine.target = FailingTarget(engine.target, {3})
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    results: dict = {}
    while engine.target_error is None:
        collect(engine, results, engine.step())
    assert not any(r.finished for r in results.values()), "a request ended with the target"
    assert any(r.token_ids for r in results.values()), "the failure came before any output: resuming proves little"
    assert engine.counters.target_failures == 1 and engine.counters.resumed_after_target_failure > 0
    with pytest.raises(TargetUnavailable):
        engine.step()
    engine.reset_target(engine.target)  # the runner itself is fine: only the call failed
    run_all(engine, results=results)
    for i, expected in zip(ids, sequential_outputs):
        got = results[i]
        assert (got.token_ids, got.text, got.finish_reason) == (expected.token_ids, expected.text,
                                                                expected.finish_reason), i
    assert_drained(engine, len(PROMPTS))
