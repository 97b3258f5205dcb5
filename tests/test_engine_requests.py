"""Requests end the way they were asked to, bad requests change nothing, failures stay contained.

Stop conditions (EOS, ignore_eos, stop token ids, stop strings, max_tokens),
streamed deltas, validation errors (invariant 6: an InvalidRequest naming the
field, and the engine exactly as it was), aborts, and fault injection: a draft
service that raises (output must not change) and a target that raises once
(the requests holding KV end with an error, the rest run, nothing leaks).
Stop conditions are checked with and without speculation: a request must end
at the same token either way.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dspark_ray import LLM
from dspark_ray.engine import InvalidRequest, SamplingParams
from dspark_ray.engine.interfaces import Proposal, ProposeRow, TargetStep, VerifyResult
from dspark_ray.slots import SlotRegistry
from engine_fixtures import (  # noqa: F401 - fixtures
    Collected,
    TinyModels,
    assert_drained,
    collect,
    engine_state,
    generate,
    make_engine,
    run_all,
    tiny_models,
    tiny_vocab_models,
)

PROMPT = [100, 200, 300, 400]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def greedy_ref(tiny_models: TinyModels) -> Collected:
    """The target's greedy continuation of PROMPT (validated against transformers elsewhere)."""
    ref = generate(make_engine(tiny_models.target), [PROMPT], SamplingParams(max_tokens=MAX_TOKENS))[0]
    assert ref.finish_reason == "length" and len(set(ref.token_ids)) > 10
    return ref


def engines(tiny_models: TinyModels, target: Path | None = None):
    """The same checkpoint without speculation, with a partly right draft, and with an always right one.

    The always-right draft (the target itself, seeing the whole context)
    emits k + 1 = 5 tokens a step, so most stops fall inside a block.
    """
    target = target or tiny_models.target
    return {
        "plain": make_engine(target),
        "spec": make_engine(target, tiny_models.drafts["near"], num_speculative_tokens=4),
        "spec-exact": make_engine(target, target, num_speculative_tokens=4, draft_window=128),
    }


def first_new_token(tokens: list[int], after: int) -> tuple[int, int]:
    """(index, token) of the first token at or after ``after`` that did not occur before it."""
    for i in range(after, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return i, tokens[i]
    raise AssertionError("no fresh token to stop on")


# -- stop conditions ---------------------------------------------------------------------------


def test_stop_token_ids(tiny_models, greedy_ref):
    ref = greedy_ref.token_ids
    i, tok = first_new_token(ref, 9)
    for name, engine in engines(tiny_models).items():
        res = generate(engine, [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=[tok, 4095]))[0]
        assert res.token_ids == ref[: i + 1], name
        assert (res.finish_reason, res.stop_reason) == ("stop", tok), name
        assert_drained(engine, 1)


def with_eos(tiny_models: TinyModels, folder: Path, eos) -> Path:
    """The tiny target with ``eos`` as its generation_config EOS (weights linked, not copied)."""
    folder.mkdir()
    for f in tiny_models.target.iterdir():
        if f.name != "generation_config.json":
            (folder / f.name).symlink_to(f)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder


def test_eos_and_ignore_eos(tiny_models, greedy_ref, tmp_path):
    ref = greedy_ref.token_ids
    i, tok = first_new_token(ref, 6)
    j, other = first_new_token(ref, i + 3)
    target = with_eos(tiny_models, tmp_path / "eos", [other, tok])
    for name, engine in engines(tiny_models, target).items():
        assert engine.tokenizer.eos_token_ids == {tok, other}
        res = generate(engine, [PROMPT], SamplingParams(max_tokens=MAX_TOKENS))[0]
        assert res.token_ids == ref[: i + 1], name
        assert (res.finish_reason, res.stop_reason) == ("stop", tok), name
        res = generate(engine, [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0]
        assert res.token_ids == ref and res.finish_reason == "length" and res.stop_reason is None, name
        assert_drained(engine, 2)


def test_max_tokens_ends_with_length(tiny_models, greedy_ref):
    for name, engine in engines(tiny_models).items():
        for n in (1, 2, 5, 17):
            res = generate(engine, [PROMPT], SamplingParams(max_tokens=n))[0]
            assert res.token_ids == greedy_ref.token_ids[:n], (name, n)
            assert (res.finish_reason, res.stop_reason) == ("length", None)
            assert res.text == engine.tokenizer.decode(res.token_ids)


def stop_string_case(engine, ref_ids: list[int]) -> tuple[str, str, int]:
    """A stop string from the middle of the reference text: (stop, text before it, tokens to produce it)."""
    decode = engine.tokenizer.decode
    text = decode(ref_ids)
    for start in range(len(text) // 3, len(text) - 4):
        stop = text[start:start + 4]
        if stop.strip() == stop and text.find(stop) == start:
            break
    else:
        raise AssertionError(f"no usable stop string in {text!r}")
    n = next(n for n in range(1, len(ref_ids) + 1) if stop in decode(ref_ids[:n]))
    return stop, text[:start], n


def test_stop_strings(tiny_models, greedy_ref):
    """Text is cut before the stop string; the tokens end at the one that completed it."""
    ref = greedy_ref.token_ids
    for name, engine in engines(tiny_models).items():
        stop, before, n = stop_string_case(engine, ref)
        params = SamplingParams(max_tokens=MAX_TOKENS, stop=[stop, "never-there"])
        res = generate(engine, [PROMPT], params)[0]
        assert res.text == before, name  # the streamed deltas, concatenated
        assert (res.finish_reason, res.stop_reason) == ("stop", stop), name
        assert res.token_ids == ref[:n], f"{name}: the request ran past the token that completed {stop!r}"
        # Two stop strings: the one that appears first in the text wins.
        later = engine.tokenizer.decode(ref)[len(before) + 2:len(before) + 6]
        res = generate(engine, [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, stop=[later, stop]))[0]
        assert (res.text, res.stop_reason) == (before, stop)
        # A stop string that never appears changes nothing.
        res = generate(engine, [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, stop="never-there"))[0]
        assert res.token_ids == ref and res.text == greedy_ref.text and res.finish_reason == "length"
        assert_drained(engine, 3)


def test_streaming_deltas_concatenate_to_the_final_text(tiny_models):
    """Offline API text == concatenated step deltas == decode(token ids), for several requests at once."""
    llm = LLM(tiny_models.target, tiny_models.drafts["near"], num_speculative_tokens=3, capacity=4)
    prompts = ["ROMEO: hello", "Now is the winter of our discontent", "A", "KING: what ho"]
    params = [SamplingParams(max_tokens=25), SamplingParams(max_tokens=30, temperature=1.0, seed=3),
              SamplingParams(max_tokens=12, temperature=0.5, seed=4), SamplingParams(max_tokens=9)]
    final = llm.generate(prompts, params)
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    deltas: dict[str, list[str]] = {i: [] for i in ids}
    results: dict[str, Collected] = {}
    while engine.has_unfinished():
        outputs = engine.step()
        for out in outputs:
            deltas[out.req_id].append(out.new_text)
        collect(engine, results, outputs)
    for req_id, done in zip(ids, final):
        streamed = "".join(deltas[req_id])
        assert streamed == done.text == llm.tokenizer.decode(done.token_ids)
        assert results[req_id].token_ids == done.token_ids
        assert len(deltas[req_id]) > 1
    assert_drained(engine)


# -- bad requests ------------------------------------------------------------------------------


BAD_PARAMS = [
    ("max_tokens", dict(max_tokens=-3)), ("max_tokens", dict(max_tokens=2.5)),
    ("max_tokens", dict(max_tokens=True)), ("max_tokens", dict(max_tokens="5")),
    ("temperature", dict(temperature=-0.5)), ("temperature", dict(temperature=2.5)),
    ("temperature", dict(temperature=math.nan)), ("temperature", dict(temperature="hot")),
    ("temperature", dict(temperature=None)),
    ("top_p", dict(top_p=0.0)), ("top_p", dict(top_p=1.5)), ("top_p", dict(top_p=math.nan)),
    ("top_p", dict(top_p="x")),
    ("top_k", dict(top_k=-1)), ("top_k", dict(top_k=1.5)), ("top_k", dict(top_k=True)),
    ("seed", dict(seed=-1)), ("seed", dict(seed=2**63)), ("seed", dict(seed=1.5)),
    ("stop", dict(stop=[""])), ("stop", dict(stop=[3])), ("stop", dict(stop=[f"s{i}" for i in range(17)])),
    ("stop_token_ids", dict(stop_token_ids=[-1])), ("stop_token_ids", dict(stop_token_ids=["a"])),
    ("num_speculative_tokens", dict(num_speculative_tokens=-1)),
    ("num_speculative_tokens", dict(num_speculative_tokens=1.5)),
    ("logprobs", dict(logprobs=21)), ("logprobs", dict(logprobs=-1)), ("prompt_logprobs", dict(prompt_logprobs=99)),
    ("logit_bias", dict(logit_bias={5: 101})), ("logit_bias", dict(logit_bias={-1: 1})),
    ("logit_bias", dict(logit_bias={"x": 1})),
    ("min_tokens", dict(min_tokens=5, max_tokens=4)), ("min_tokens", dict(min_tokens=-1)),
    ("presence_penalty", dict(presence_penalty=2.5)), ("frequency_penalty", dict(frequency_penalty=-3)),
    ("repetition_penalty", dict(repetition_penalty=0)), ("min_p", dict(min_p=1.5)),
    ("truncate_prompt_tokens", dict(truncate_prompt_tokens=0)), ("n", dict(n=0)),
]


@pytest.mark.parametrize("field, kwargs", BAD_PARAMS, ids=[f"{f}={list(k.values())[0]!r}"[:40] for f, k in BAD_PARAMS])
def test_bad_sampling_params(field, kwargs):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")


def test_bad_requests_change_nothing(tiny_models):
    engine = make_engine(tiny_models.target, tiny_models.drafts["near"], max_context=64)
    running = engine.add_request(PROMPT, SamplingParams(max_tokens=20), req_id="busy")
    engine.add_request([5, 6], SamplingParams(max_tokens=20), req_id="queued")
    results: dict[str, Collected] = {}
    collect(engine, results, engine.step())  # "busy" and "queued" now hold slots and KV
    engine.add_request([7], SamplingParams(max_tokens=5), req_id="waiting")
    before = engine_state(engine)
    cases = [
        ("prompt", [1] * 64, SamplingParams(max_tokens=1)),  # the context holds no output token
        ("prompt", [1] * 200, SamplingParams(max_tokens=1)),
        ("max_tokens", [1] * 40, SamplingParams(max_tokens=25)),  # 40 + 25 > 64
        ("prompt", [], SamplingParams()),
        ("prompt", "", SamplingParams()),
        ("prompt", [1, 4096], SamplingParams()),
        ("prompt", [-1], SamplingParams()),
        ("prompt", [1, 2.0], SamplingParams()),
        ("prompt", [True], SamplingParams()),
    ]
    for field, prompt, params in cases:
        with pytest.raises(InvalidRequest) as err:
            engine.add_request(prompt, params)
        assert err.value.field == field, (prompt, params)
        assert engine_state(engine) == before, f"rejected {field} changed the engine"
    with pytest.raises(InvalidRequest) as err:
        engine.add_request([9, 9], SamplingParams(), req_id=running)
    assert err.value.field == "request_id" and running in str(err.value)
    assert engine_state(engine) == before
    run_all(engine, results=results)
    assert {r: results[r].finish_reason for r in results} == {"busy": "length", "queued": "length",
                                                             "waiting": "length"}
    # The longest valid request still fits: prompt + max_tokens == max_context.
    res = generate(engine, [[1] * 40], SamplingParams(max_tokens=24))[0]
    assert len(res.token_ids) == 24
    assert_drained(engine, 4)


def test_offline_api_rejects_a_bad_prompt_and_queues_nothing(tiny_models):
    llm = LLM(tiny_models.target, tiny_models.drafts["near"], max_context=64, capacity=4)
    with pytest.raises(InvalidRequest) as err:
        llm.generate([[1, 2], [3] * 70, [4]], SamplingParams(max_tokens=4))
    assert err.value.field == "prompt"
    assert_drained(llm.engine)
    with pytest.raises(ValueError):
        llm.generate([[1, 2], [3]], [SamplingParams()])
    assert_drained(llm.engine)
    assert [len(o.token_ids) for o in llm.generate([[1, 2], [3]], SamplingParams(max_tokens=4))] == [4, 4]


def test_chat(tiny_models):
    """``LLM.chat`` renders the checkpoint's template and generates from it (no BOS added twice)."""
    llm = LLM(tiny_models.target, tiny_models.drafts["near"], capacity=4)
    conv = [{"role": "user", "content": "Who is there?"}]
    params = SamplingParams(max_tokens=12)
    out = llm.chat(conv, params)[0]
    rendered = llm.tokenizer.apply_chat_template(conv)
    assert rendered.endswith("<|assistant|>\n")
    ids = llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert out.prompt_token_ids == ids
    assert out.token_ids == llm.generate([ids], params)[0].token_ids
    assert len(llm.chat([conv, conv], params)) == 2


@pytest.mark.parametrize("bad", [dict(num_speculative_tokens=17), dict(num_speculative_tokens=-1),
                                 dict(capacity=0), dict(max_context=1), dict(max_num_seqs=0),
                                 dict(kv_pool_tokens=100, max_context=128), dict(draft_window=0)])
def test_bad_engine_config(tiny_models, bad):
    from dspark_ray.engine import ConfigError

    with pytest.raises(ConfigError):
        LLM(tiny_models.target, tiny_models.drafts["near"], **bad)


def test_draft_with_another_tokenizer_is_refused(tiny_models, tiny_vocab_models):
    from dspark_ray.tokenizer import TokenizerMismatch

    with pytest.raises(TokenizerMismatch, match="must share the target's tokenizer"):
        LLM(tiny_models.target, tiny_vocab_models.draft)


# -- aborts ------------------------------------------------------------------------------------


def test_abort(tiny_models):
    engine = make_engine(tiny_models.target, tiny_models.drafts["near"], capacity=2)
    a = engine.add_request(PROMPT, SamplingParams(max_tokens=30))
    b = engine.add_request([7, 8], SamplingParams(max_tokens=30))
    c = engine.add_request([9], SamplingParams(max_tokens=30))  # waits: two slots
    results: dict[str, Collected] = {}
    collect(engine, results, engine.step())
    assert engine.abort(a) and engine.abort(c)
    assert not engine.abort(a) and not engine.abort("nobody")
    collect(engine, results, engine.step())
    assert results[a].finish_reason == "abort" and results[c].finish_reason == "abort"
    assert results[c].token_ids == []
    assert engine.abort(b)
    assert engine.has_unfinished(), "the abort's output has not been delivered yet"
    collect(engine, results, engine.step())
    assert results[b].finished and results[b].finish_reason == "abort"
    assert_drained(engine, 3)


class ReleaseLog(SlotRegistry):
    """The real registry, also offering the release the slot manager's Ray facade sends without
    waiting (``release_many_nowait``); records which way each release went."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.released: list[tuple[str, list[str]]] = []

    def release_many(self, req_ids_with_epochs):
        items = list(req_ids_with_epochs)
        self.released.append(("waited", [r for r, _ in items]))
        return super().release_many(items)

    def release_many_nowait(self, req_ids_with_epochs) -> None:
        items = list(req_ids_with_epochs)
        self.released.append(("sent", [r for r, _ in items]))
        super().release_many(items)


def test_releases_are_not_waited_for_while_other_requests_run(tiny_models):
    """A request that ends beside others has its slot released without a wait on the step path;
    the last release before the engine idles is waited for, so an idle engine holds nothing."""
    params = [SamplingParams(max_tokens=4, ignore_eos=True), SamplingParams(max_tokens=30, ignore_eos=True)]
    expected = generate(make_engine(tiny_models.target, tiny_models.drafts["near"], capacity=4),
                        [PROMPT, [7, 8]], params)
    engine = make_engine(tiny_models.target, tiny_models.drafts["near"], capacity=4)
    engine.slots = log = ReleaseLog(4)
    short, long = (engine.add_request(p, sp) for p, sp in zip([PROMPT, [7, 8]], params))
    results = run_all(engine)
    assert [results[short].token_ids, results[long].token_ids] == [c.token_ids for c in expected]
    assert log.released == [("sent", [short]), ("waited", [long])]
    assert log.snapshot().live == ()
    assert_drained(engine, 2)


# -- fault injection ---------------------------------------------------------------------------


class FailingDraft:
    """The real draft proposer behind a switch: calls whose number is in ``fail`` raise."""

    def __init__(self, inner, fail) -> None:
        self.inner, self.fail, self.calls, self.raised = inner, fail, 0, 0

    def propose(self, rows: list[ProposeRow]) -> Proposal:
        self.calls += 1
        if self.fail(self.calls):
            self.raised += 1
            raise RuntimeError("draft worker died")
        return self.inner.propose(rows)


@pytest.mark.parametrize("pattern", ["every third", "always"])
def test_draft_failure_changes_no_output(tiny_models, pattern):
    fail = {"every third": lambda n: n % 3 == 2, "always": lambda n: True}[pattern]
    prompts = [PROMPT, [5] * 30, [7, 8, 9]]
    params = [SamplingParams(max_tokens=30), SamplingParams(max_tokens=24), SamplingParams(max_tokens=17)]
    expected = generate(make_engine(tiny_models.target), prompts, params)
    engine = make_engine(tiny_models.target, tiny_models.drafts["near"], num_speculative_tokens=3, draft_window=8)
    engine.draft = FailingDraft(engine.draft, fail)
    results = generate(engine, prompts, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert engine.counters.draft_failures == engine.draft.raised > 0
    drafts = sum(r.spec.drafts for r in results)
    assert drafts == 0 if pattern == "always" else drafts > 0
    # Sampled requests still complete (their exact tokens may differ: blocks change).
    res = generate(engine, [PROMPT], SamplingParams(max_tokens=20, temperature=1.0, seed=1))[0]
    assert len(res.token_ids) == 20 and res.error is None
    assert_drained(engine, 4)


def test_draft_restart_mid_run(tiny_models):
    """A fresh draft proposer (a restarted worker: empty caches) takes over mid-run.

    Its first call finds the requests' caches missing (DraftCacheBehind), that
    step runs without drafts, the next one catches up from position 0, and
    speculation resumes with output unchanged.
    """
    from dspark_ray.engine.draft_proposer import DraftProposer
    from dspark_ray.model import load

    prompts = [PROMPT, [5] * 30, [7, 8, 9]]
    params = [SamplingParams(max_tokens=30), SamplingParams(max_tokens=24), SamplingParams(max_tokens=17)]
    expected = generate(make_engine(tiny_models.target), prompts, params)
    engine = make_engine(tiny_models.target, tiny_models.drafts["near"], num_speculative_tokens=3, draft_window=8)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    results: dict[str, Collected] = {}
    for _ in range(3):
        collect(engine, results, engine.step())
    old = engine.draft
    engine.draft = DraftProposer(load(tiny_models.drafts["near"]), old.cache.capacity, old.cache.window,
                                 old.max_spec_tokens)
    run_all(engine, results=results)
    assert [results[i].token_ids for i in ids] == [r.token_ids for r in expected]
    assert engine.counters.draft_failures == 1
    assert sum(results[i].spec.drafts for i in ids) > 3 * 3, "speculation did not resume after the restart"
    assert_drained(engine, 3)


class FailingTarget:
    """The real target runner, whose ``step`` raises on the call numbers in ``fail``."""

    def __init__(self, inner, fail: set[int]) -> None:
        self.inner, self.fail, self.calls = inner, fail, 0

    def step(self, batch: TargetStep) -> VerifyResult:
        self.calls += 1
        if self.calls in self.fail:
            raise RuntimeError("target shard died")
        return self.inner.step(batch)

    def release(self, slots: list[int]) -> None:
        self.inner.release(slots)

    def kv_capacity(self) -> int:
        return self.inner.kv_capacity()

    def kv_free(self) -> int:
        return self.inner.kv_free()

    @property
    def table(self):
        return self.inner.table


def test_target_failure_loses_no_request_and_leaks_nothing(tiny_models):
    """A finished request's KV release is pending when the target fails; it must still happen.
    The running request waits (``step`` refuses to run until ``reset_target``), then resumes by
    recompute and produces exactly its undisturbed tokens."""
    from dspark_ray.engine.engine import TargetUnavailable

    alone = generate(make_engine(tiny_models.target, None, capacity=2), [[5, 6, 7]],
                     SamplingParams(max_tokens=20))[0]
    engine = make_engine(tiny_models.target, None, capacity=2)
    engine.target = FailingTarget(engine.target, fail={3})
    short = engine.add_request(PROMPT, SamplingParams(max_tokens=2))  # ends at step 2: release pending
    long = engine.add_request([5, 6, 7], SamplingParams(max_tokens=20))
    results = {}
    while engine.target_error is None:
        collect(engine, results, engine.step())
    assert results[short].finish_reason == "length" and len(results[short].token_ids) == 2
    assert not results[long].finished and engine.requests[long].holds_slot
    with pytest.raises(TargetUnavailable, match="target shard died"):
        engine.step()
    engine.reset_target(engine.target)
    run_all(engine, results=results)
    assert results[long].token_ids == alone.token_ids and results[long].finish_reason == "length"
    assert engine.counters.target_failures == 1 and engine.counters.resumed_after_target_failure == 1
    assert_drained(engine, 2)
    # The same engine keeps serving.
    res = generate(engine, [PROMPT], SamplingParams(max_tokens=5))[0]
    assert res.finish_reason == "length" and len(res.token_ids) == 5
    assert_drained(engine, 3)


def test_deadlines_end_waiting_and_running_requests_and_free_everything(tiny_models: TinyModels, greedy_ref):
    """A request past its deadline ends with ErrorCode.TIMEOUT whether it runs or still waits for
    a slot; it frees what it held, and the request beside it is untouched."""
    import time

    engine = make_engine(tiny_models.target, tiny_models.drafts["near"], num_speculative_tokens=3, capacity=2,
                         max_num_seqs=2)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    keep = engine.add_request(PROMPT, SamplingParams(max_tokens=MAX_TOKENS))
    running = engine.add_request([7, 8, 9], params, deadline=time.monotonic() + 3600)
    waiting = engine.add_request([5, 6], params, deadline=time.monotonic() + 3600)  # no slot: capacity 2
    results = {}
    for _ in range(3):
        collect(engine, results, engine.step())
    assert engine.requests[running].holds_slot and not engine.requests[waiting].holds_slot
    assert engine.expire(time.monotonic() + 3601) == 2
    results = run_all(engine, results=results)
    for req_id in (running, waiting):
        r = results[req_id]
        assert (r.finish_reason, r.error_code) == ("error", "request_timeout") and "timeout" in r.error
    assert 0 < len(results[running].token_ids) < MAX_TOKENS and results[waiting].token_ids == []
    assert results[keep].token_ids == greedy_ref.token_ids
    assert_drained(engine, 3)
