"""Structured outputs under speculation: every output follows its grammar, speculation changes nothing.

The shipped pair (a Shakespeare model that has never seen JSON) is the hard
case: without the grammar it writes blank verse, so every valid output here
is the grammar's doing, at every verified position and in the drafts. The
checks are the issue's:

- every constrained output parses and validates against its schema (nesting,
  enums, arrays, required fields), greedy and sampled, speculation on and off,
  sequential and pipelined engines;
- greedy constrained output with speculation equals greedy constrained output
  without it, token for token;
- requests with different grammars and without any, run together, each equal
  their solo runs (grammar state is per request, never per batch row);
- the draft proposer masks its own proposals: constrained drafts are accepted
  far more often than drafts the grammar only cuts;
- roll-back after rejection restores the grammar state exactly (a matcher
  walked through drafts and rolled back gives the masks a fresh one gives).
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from dspark_ray.engine import SamplingParams
from dspark_ray.engine.structured import GrammarCompiler, StructuredOutput, allowed, fill_mask
from dspark_ray.tokenizer import Tokenizer
from engine_fixtures import make_engine, make_pipelined_engine, run_all
from serve_fixtures import serve_models  # noqa: F401 - fixture

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
                       "alive": {"type": "boolean"}},
        "required": ["name", "age", "alive"], "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "speaker": {"type": "object",
                        "properties": {"role": {"enum": ["king", "fool", "queen"]},
                                       "lines": {"type": "integer", "minimum": 0, "maximum": 99}},
                        "required": ["role", "lines"], "additionalProperties": False},
            "tags": {"type": "array", "items": {"enum": ["comedy", "tragedy"]}, "minItems": 1, "maxItems": 3},
        },
        "required": ["speaker", "tags"], "additionalProperties": False,
    },
    "array": {
        "type": "array",
        "items": {"type": "object", "properties": {"act": {"type": "integer", "minimum": 1, "maximum": 5},
                                                   "scene": {"type": "string", "maxLength": 8}},
                  "required": ["act", "scene"], "additionalProperties": False},
        "minItems": 1, "maxItems": 2,
    },
}
PROMPTS = ["KING:\nWhat say you?", "FOOL:\nNay, nuncle,", "ROMEO:\nBut soft!"]
MAX_TOKENS = 120


def constrained(schema: dict, **params) -> SamplingParams:
    params.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(structured=StructuredOutput.json_schema(schema), **params)


def run(engine, requests: list[tuple[str, SamplingParams]]) -> list:
    ids = [engine.add_request(p, sp) for p, sp in requests]
    results = run_all(engine)
    return [results[i] for i in ids]


@pytest.fixture(scope="module")
def engines(serve_models):
    """Sequential with and without speculation, and pipelined (the served engine's step)."""
    t, d = serve_models.target, serve_models.draft
    kw = dict(capacity=16, max_context=512, num_speculative_tokens=4)
    return {"spec": make_engine(t, d, **kw), "nospec": make_engine(t, None, **kw),
            "pipelined": make_pipelined_engine(t, d, **kw)}


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
@pytest.mark.parametrize("engine_name", ["spec", "nospec", "pipelined"])
def test_every_constrained_output_parses_and_validates(engines, engine_name, temperature):
    engine = engines[engine_name]
    requests = [(p, constrained(schema, temperature=temperature, seed=7 + i))
                for i, (p, schema) in enumerate((p, s) for s in SCHEMAS.values() for p in PROMPTS)]
    outs = run(engine, requests)
    for (prompt, params), out in zip(requests, outs):
        assert out.finish_reason == "stop", (prompt, out.text, out.error)
        value = json.loads(out.text)
        jsonschema.validate(value, json.loads(params.structured.spec))
    if engine_name != "nospec":  # the drafts really were exercised
        assert sum(o.spec.draft_tokens for o in outs) > 0


def test_greedy_constrained_output_is_the_same_with_and_without_speculation(engines):
    requests = [(p, constrained(s)) for s in SCHEMAS.values() for p in PROMPTS]
    spec = run(engines["spec"], requests)
    nospec = run(engines["nospec"], requests)
    piped = run(engines["pipelined"], requests)
    for a, b, c in zip(spec, nospec, piped):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.finish_reason == b.finish_reason == "stop"
    assert sum(o.spec.accepted_tokens for o in spec) > 0


def test_other_constraints_regex_choice_and_grammar(engines):
    engine = engines["spec"]
    cases = [
        (StructuredOutput("regex", r"(Yes|No), my (lord|liege)\."), r"(Yes|No), my (lord|liege)\."),
        (StructuredOutput.choice(["Romeo", "Juliet", "Mercutio"]), r"Romeo|Juliet|Mercutio"),
        (StructuredOutput("lark", 'start: "Act " DIGIT ", scene " DIGIT\nDIGIT: /[1-5]/'), r"Act [1-5], scene [1-5]"),
        (StructuredOutput("json_object"), None),
    ]
    import re

    for spec, pattern in cases:
        for temp in (0.0, 1.0):
            (out,) = run(engine, [(PROMPTS[0], SamplingParams(max_tokens=60, temperature=temp, seed=3,
                                                              structured=spec))])
            if pattern is None:
                if out.finish_reason == "stop":
                    assert isinstance(json.loads(out.text), dict)
                else:  # a free-form object may run to max_tokens; what there is is a JSON prefix
                    assert out.finish_reason == "length" and out.text.startswith("{")
            else:
                assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), (spec, out.text)


@pytest.mark.parametrize("pipelined", [False, True], ids=["sequential", "pipelined"])
def test_mixed_batch_equals_solo_runs(serve_models, pipelined):
    """Different grammars and none in one batch (sampled rows seeded): each equals its solo run. The
    pipelined engine computes a drafted half's masks a step before its verification."""
    engine = (make_pipelined_engine if pipelined else make_engine)(serve_models.target, serve_models.draft,
                                                                   capacity=16, max_context=512)
    schemas = list(SCHEMAS.values())
    requests = []
    for i, prompt in enumerate(PROMPTS * 2):
        temp = 0.0 if i % 2 == 0 else 0.8
        if i % 3 == 2:  # unconstrained rows in between
            requests.append((prompt, SamplingParams(max_tokens=40, temperature=temp, seed=i)))
        else:
            requests.append((prompt, constrained(schemas[i % len(schemas)], temperature=temp, seed=i)))
    together = run(engine, requests)
    for req, out in zip(requests, together):
        (solo,) = run(engine, [req])
        assert out.token_ids == solo.token_ids, req
        assert out.finish_reason == solo.finish_reason


def test_draft_masking_makes_constrained_drafts_acceptable(serve_models):
    """With the grammar in the draft proposer its proposals are valid JSON and get accepted; a draft
    proposer without it proposes verse, which the engine cuts at the first forbidden token."""
    masked = make_engine(serve_models.target, serve_models.draft, capacity=16, max_context=512)
    unmasked = make_engine(serve_models.target, serve_models.draft, capacity=16, max_context=512)
    unmasked.draft.grammars = None
    requests = [(p, constrained(s)) for s in SCHEMAS.values() for p in PROMPTS]
    a, b = run(masked, requests), run(unmasked, requests)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]  # lossless either way
    assert unmasked.counters.grammar_cut_drafts > 0 and masked.counters.grammar_cut_drafts == 0
    accepted = [sum(o.spec.accepted_tokens for o in outs) for outs in (a, b)]
    assert accepted[0] > 1.5 * accepted[1], accepted
    assert masked.counters.steps < 0.7 * unmasked.counters.steps, (masked.counters.steps, unmasked.counters.steps)


def test_rollback_restores_the_grammar_exactly(serve_models):
    """Walk a matcher through random draft runs and commits; its masks always equal a fresh
    matcher's fed the same committed prefix (EOS drafts included, whose consumption llguidance
    does not count in roll-back)."""
    tok = Tokenizer.from_path(serve_models.target)
    compiler = GrammarCompiler.of(tok)
    grammar = compiler.check(StructuredOutput.json_schema(SCHEMAS["nested"]))
    gen = torch.Generator().manual_seed(0)

    def pick(mask, any_token: bool) -> int:
        ids = [t for t in range(tok.vocab_size) if allowed(mask, t)]
        if any_token or not ids:
            return int(torch.randint(tok.vocab_size, (1,), generator=gen))
        return ids[int(torch.randint(len(ids), (1,), generator=gen))]

    for _ in range(20):
        g, history = compiler.matcher(grammar), []
        while not g.complete:
            probe = compiler.matcher(grammar)
            probe.matcher.consume_tokens(history) if history else None
            drafts = []
            for _ in range(4):  # a draft run: mostly allowed tokens, sometimes anything
                row = torch.empty(compiler.words, dtype=torch.int32)
                fill_mask(probe.matcher, row)
                drafts.append(pick(row, any_token=bool(torch.rand(1, generator=gen) < 0.15)))
                if drafts[-1] in tok.eos_token_ids or not probe.matcher.consume_token(drafts[-1]):
                    break
            masks, n = g.masks(drafts)
            for j in range(n + 1):
                if j and drafts[j - 1] in tok.eos_token_ids:
                    break  # nothing after an EOS is scored
                fresh = compiler.matcher(grammar)
                if history + drafts[:j]:
                    assert fresh.matcher.consume_tokens(history + drafts[:j])
                row = torch.empty(compiler.words, dtype=torch.int32)
                fill_mask(fresh.matcher, row)
                assert torch.equal(row, masks[j])
            accepted = int(torch.randint(n + 1, (1,), generator=gen))
            emitted = drafts[:accepted] + [pick(masks[accepted], any_token=False)]
            for t in emitted:
                g.accept(t)
                history.append(t)
                if t in tok.eos_token_ids or g.complete:
                    break
            if history[-1] in tok.eos_token_ids:
                break


def test_bad_grammars_are_refused_and_take_nothing(serve_models):
    engine = make_engine(serve_models.target, serve_models.draft)
    bad = [
        (StructuredOutput.json_schema({"type": "nonsense"}), "response_format"),
        (StructuredOutput("regex", "a(b", field="guided_regex"), "guided_regex"),
        (StructuredOutput("lark", "start: X\nX: /a/ & /b/", field="guided_grammar"), "guided_grammar"),
    ]
    for spec, field in bad:
        with pytest.raises(Exception) as err:
            engine.add_request("KING:", SamplingParams(structured=spec))
        assert getattr(err.value, "field", None) == field, err.value
    assert not engine.requests and not engine.has_unfinished()
    assert engine.slots.snapshot().live == ()
