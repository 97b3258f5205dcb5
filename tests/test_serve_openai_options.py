"""The OpenAI options real clients send, through the official ``openai`` client.

The server runs in this process (``LocalServices``, the shipped pair with
speculation on) and the client talks to its FastAPI app over httpx's ASGI
transport. Each option is checked against something independent: the
target's log-probabilities against transformers, choices and prompt lists
against the same requests sent one at a time, streamed responses against the
whole ones, and concurrent requests with different settings against their
solo runs.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch

from dspark_ray.engine.local import LocalServices
from dspark_ray.serve.config import AppConfig
from dspark_ray.serve.server import DSparkServer
from serve_fixtures import serve_models  # noqa: F401 - fixture

PROMPTS = ["ROMEO:\nBut soft, what light", "JULIET:\nO Romeo, Romeo", "HAMLET:\nTo be, or not"]
CAPACITY = 8


@pytest.fixture(scope="module")
def server(serve_models):
    config = AppConfig(model=str(serve_models.target), draft=str(serve_models.draft), tensor_parallel_size=1,
                       capacity=CAPACITY, max_context=256)
    srv = DSparkServer(config, services=LocalServices.build)
    yield srv
    srv.shutdown()


def run(server: DSparkServer, make_calls):
    """``make_calls(client)`` -> a coroutine, run against the server's ASGI app on a fresh event loop."""

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=server.build_api()), base_url="http://test")
        async with openai.AsyncOpenAI(api_key="-", base_url="http://test/v1", http_client=http,
                                      max_retries=0) as client:
            return await make_calls(client)

    return asyncio.run(go())


def complete(server, **kwargs):
    async def call(client):
        return await client.completions.create(model=server.config.model_name, **kwargs)
    return run(server, call)


def chat(server, **kwargs):
    async def call(client):
        return await client.chat.completions.create(model=server.config.model_name, **kwargs)
    return run(server, call)


def streamed(server, route: str, **kwargs) -> list:
    async def call(client):
        create = client.completions.create if route == "completions" else client.chat.completions.create
        stream = await create(model=server.config.model_name, stream=True, **kwargs)
        return [chunk async for chunk in stream]
    return run(server, call)


@pytest.fixture(scope="module")
def hf_target(serve_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(serve_models.target, dtype=torch.float32).eval()


def test_echo_logprobs_score_the_prompt_like_transformers(server, hf_target):
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 0, a list of token-id lists."""
    tok = server.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS[:2]]
    r = complete(server, prompt=prompts, max_tokens=0, echo=True, logprobs=1, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == sum(map(len, prompts))
    for ids, choice in zip(prompts, r.choices):
        lp = choice.logprobs
        assert choice.text == tok.decode(ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
        with torch.no_grad():
            ref = torch.log_softmax(hf_target(torch.tensor([ids])).logits[0].double(), -1)
        expected = [float(ref[i, t]) for i, t in enumerate(ids[1:])]
        assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
        assert abs(sum(lp.token_logprobs[1:]) - sum(expected)) < 1e-3
        assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]


def test_completion_logprobs_streamed_equal_whole(server):
    args = dict(prompt=PROMPTS[0], max_tokens=10, temperature=0, logprobs=3, echo=True)
    whole = complete(server, **args).choices[0]
    chunks = streamed(server, "completions", **args)
    got = {"tokens": [], "token_logprobs": [], "text_offset": [], "text": ""}
    for c in chunks:
        for ch in c.choices:
            got["text"] += ch.text
            if ch.logprobs:
                for key in ("tokens", "token_logprobs", "text_offset"):
                    got[key] += getattr(ch.logprobs, key)
    assert got["text"] == whole.text and whole.text.startswith(PROMPTS[0])
    assert got["tokens"] == whole.logprobs.tokens and got["text_offset"] == whole.logprobs.text_offset
    # Equal up to float32 rounding: adaptive speculation may verify the two runs with different k,
    # and a matmul over another number of positions rounds differently in the last bits.
    assert got["token_logprobs"][0] is None is whole.logprobs.token_logprobs[0]
    assert got["token_logprobs"][1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-5)
    n_prompt = len(server.tokenizer.encode(PROMPTS[0]))
    assert len(whole.logprobs.tokens) == n_prompt + 10
    assert all(len(t) <= 4 for t in whole.logprobs.top_logprobs[1:])  # top 3 plus the chosen token


def test_chat_logprobs_streamed_and_not(server):
    args = dict(messages=[{"role": "user", "content": "Speak."}], max_tokens=8, temperature=0, logprobs=True,
                top_logprobs=2)
    whole = chat(server, **args).choices[0]
    content = whole.logprobs.content
    assert len(content) == 8 and all(len(e.top_logprobs) == 2 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content)  # greedy: the top one is chosen
    assert "".join(e.token for e in content) == whole.message.content
    chunks = streamed(server, "chat", **args)
    entries = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.token for e in entries] == [e.token for e in content]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in content], abs=1e-5)  # see above
    plain = chat(server, messages=args["messages"], max_tokens=8, temperature=0).choices[0]
    assert plain.logprobs is None and plain.message.content == whole.message.content


def test_n_choices_are_seeded_per_choice_and_equal_single_requests(server):
    args = dict(max_tokens=8, temperature=1.0, seed=7)
    r = complete(server, prompt=PROMPTS[:2], n=3, **args)
    assert [c.index for c in r.choices] == list(range(6))
    texts = [c.text for c in r.choices]
    assert len(set(texts[:3])) > 1, "the choices of one prompt should differ"
    for i, c in enumerate(r.choices):
        alone = complete(server, prompt=PROMPTS[i // 3], max_tokens=8, temperature=1.0, seed=7 + i % 3)
        assert c.text == alone.choices[0].text
    assert r.usage.completion_tokens == sum(len(server.tokenizer.encode(t)) for t in texts) or \
        r.usage.completion_tokens <= 6 * 8
    streamed_texts = ["" for _ in range(6)]
    for chunk in streamed(server, "completions", prompt=PROMPTS[:2], n=3, **args):
        for ch in chunk.choices:
            streamed_texts[ch.index] += ch.text
    assert streamed_texts == texts
    chat_r = chat(server, messages=[{"role": "user", "content": "Hi"}], n=2, **args)
    assert [c.index for c in chat_r.choices] == [0, 1]


def test_best_of_returns_the_most_likely_choice(server):
    r = complete(server, prompt=PROMPTS[0], max_tokens=6, temperature=1.0, seed=3, best_of=3, logprobs=0)
    assert len(r.choices) == 1 and r.choices[0].index == 0
    singles = [complete(server, prompt=PROMPTS[0], max_tokens=6, temperature=1.0, seed=3 + i, logprobs=0).choices[0]
               for i in range(3)]
    best = max(singles, key=lambda c: sum(c.logprobs.token_logprobs))
    assert r.choices[0].text == best.text


def test_penalties_and_bias_through_http_equal_the_offline_engine(server):
    from dspark_ray.engine.local import build_local_engine
    from dspark_ray.engine.sampling_params import SamplingParams

    body = dict(prompt=PROMPTS[1], max_tokens=16, temperature=0, presence_penalty=0.5, frequency_penalty=0.3,
                extra_body=dict(repetition_penalty=1.2, min_tokens=4, ignore_eos=False, logit_bias={"11": 3.0}))
    r = complete(server, **body).choices[0]
    engine = build_local_engine(server.config.engine_config())
    engine.add_request(PROMPTS[1], SamplingParams(max_tokens=16, presence_penalty=0.5, frequency_penalty=0.3,
                                                  repetition_penalty=1.2, min_tokens=4, logit_bias={11: 3.0}))
    ids = []
    while engine.has_unfinished():
        for out in engine.step():
            ids += out.new_token_ids
    assert r.text == engine.tokenizer.decode(ids)
    assert r.text != complete(server, prompt=PROMPTS[1], max_tokens=16, temperature=0).choices[0].text


def test_concurrent_requests_with_different_settings_equal_their_solo_runs(server):
    """No contamination: penalties, logprobs and sampling settings stay with their own request."""
    settings = [
        dict(prompt=PROMPTS[0], temperature=0, extra_body=dict(repetition_penalty=1.5)),
        dict(prompt=PROMPTS[0], temperature=0, logprobs=2),
        dict(prompt=PROMPTS[1], temperature=0, frequency_penalty=1.0, logprobs=1),
        dict(prompt=PROMPTS[1], temperature=0.8, seed=5, presence_penalty=1.0, extra_body=dict(min_p=0.05)),
        dict(prompt=PROMPTS[2], temperature=0.8, seed=5, logit_bias={"203": -100}),
        dict(prompt=PROMPTS[2], temperature=0),
    ]

    def key(choice):
        lp = choice.logprobs
        return choice.text, None if lp is None else lp.token_logprobs

    solo = [key(complete(server, max_tokens=12, **s).choices[0]) for s in settings]

    async def together(client):
        calls = [client.completions.create(model=server.config.model_name, max_tokens=12, **s) for s in settings]
        return await asyncio.gather(*calls)

    both = [key(r.choices[0]) for r in run(server, together)]
    for (text, lps), (solo_text, solo_lps) in zip(both, solo):
        assert text == solo_text
        if lps is not None:
            assert lps == pytest.approx(solo_lps, abs=1e-4)
    assert len({t for t, _ in solo}) >= 4, "the settings should give different outputs"


NEUTRAL = [
    dict(repetition_penalty=1.0, logprobs=None, n=1, best_of=1, suffix=None, presence_penalty=0, frequency_penalty=0,
         min_p=0.0, top_k=-1, min_tokens=0, logit_bias={}, skip_special_tokens=True, spaces_between_special_tokens=True,
         include_stop_str_in_output=False, stream_options=None, user="u", echo=False),
]


def test_neutral_values_are_accepted(server):
    r = complete(server, prompt=PROMPTS[0], max_tokens=4, temperature=0, extra_body=NEUTRAL[0])
    assert r.choices[0].text == complete(server, prompt=PROMPTS[0], max_tokens=4, temperature=0).choices[0].text
    c = chat(server, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, logprobs=False,
             n=1, tools=None, tool_choice="none", response_format={"type": "text"}, presence_penalty=0.0)
    assert c.choices[0].finish_reason in ("length", "stop")


def bad_inputs(model: str):
    cmpl = {"model": model, "prompt": PROMPTS[0], "max_tokens": 4}
    msgs = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    C, H = "/v1/completions", "/v1/chat/completions"
    return [
        (C, {**cmpl, "logprobs": 21}, "logprobs"),
        (H, {**msgs, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (H, {**msgs, "top_logprobs": 2}, "top_logprobs"),
        (C, {**cmpl, "n": CAPACITY + 1}, "n"),
        (H, {**msgs, "n": CAPACITY + 1}, "n"),
        (C, {**cmpl, "best_of": CAPACITY + 1, "n": 1}, "best_of"),
        (C, {**cmpl, "best_of": 1, "n": 2}, "best_of"),
        (C, {**cmpl, "best_of": 3, "stream": True}, "best_of"),
        (C, {**cmpl, "logit_bias": {"999999": 1}}, "logit_bias"),
        (C, {**cmpl, "logit_bias": {"5": 200}}, "logit_bias"),
        (H, {**msgs, "logit_bias": {"abc": 1}}, "logit_bias"),
        (C, {**cmpl, "min_tokens": 5}, "min_tokens"),
        (C, {**cmpl, "prompt": []}, "prompt"),
        (C, {**cmpl, "prompt": ["fine", ""]}, "prompt"),
        (C, {**cmpl, "prompt": [[1, 2], [10**9]]}, "prompt"),
        (C, {**cmpl, "suffix": "end"}, "suffix"),
        (C, {**cmpl, "max_tokens": 0}, "max_tokens"),
        (C, {**cmpl, "presence_penalty": 3}, "presence_penalty"),
        (C, {**cmpl, "repetition_penalty": 0}, "repetition_penalty"),
        (C, {**cmpl, "spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
        # Structured outputs and tools: what cannot compile or does not exist is a 400 naming it.
        (H, {**msgs, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "nonsense"}}}}, "response_format"),
        (C, {**cmpl, "guided_regex": "a(b"}, "guided_regex"),
        (C, {**cmpl, "guided_json": "{not json"}, "guided_json"),
        (C, {**cmpl, "guided_choice": []}, "guided_choice"),
        (C, {**cmpl, "guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        (C, {**cmpl, "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        (H, {**msgs, "tools": [{"type": "function", "function": {"name": "f"}}],
             "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        (H, {**msgs, "tool_choice": "required"}, "tool_choice"),
        (H, {**msgs, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
             "tool_choice": "required"}, "tools"),
        (H, {**msgs, "tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
        (H, {**msgs, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
             "response_format": {"type": "json_object"}}, "tool_choice"),
        (H, {**msgs, "messages": [{"role": "tool", "content": None}]}, "messages.0.content"),
        (H, {**msgs, "messages": [{"role": "user", "content": "x", "tool_calls": []}, {"role": "user", "content": "y",
             "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages.1.tool_calls"),
        (C, {**cmpl, "frobnicate": 1}, "frobnicate"),
    ]


def test_bad_options_get_400_naming_the_field_and_change_nothing(server):
    before = server.services.slots.snapshot()
    steps = server.loop.engine.counters.steps

    async def send_all(_client):
        transport = httpx.ASGITransport(app=server.build_api())
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return [(param, await http.post(route, json=body))
                    for route, body, param in bad_inputs(server.config.model_name)]

    failures = []
    for param, r in run(server, send_all):
        err = r.json().get("error", {})
        if r.status_code != 400 or err.get("param") != param or param not in err.get("message", ""):
            failures.append(f"{param}: {r.status_code} {r.text[:200]}")
    assert not failures, "\n".join(failures)
    after = server.services.slots.snapshot()
    assert after.live == before.live == () and after.free == after.capacity
    assert server.loop.engine.counters.steps == steps, "a refused request ran a step"


def test_handle_api_and_offline_llm_take_the_same_options(server):
    """GenerateRequest (the Ray handle's type) and the offline LLM agree on penalties and log-probabilities."""
    from dspark_ray import LLM
    from dspark_ray.engine.sampling_params import SamplingParams
    from dspark_ray.serve.protocol import GenerateRequest

    options = dict(max_tokens=8, repetition_penalty=1.3, min_tokens=2, logprobs=2, prompt_logprobs=1)
    chunk = asyncio.run(server.complete(GenerateRequest(prompt=PROMPTS[2], **options)))
    cfg = server.config
    llm = LLM(cfg.model, cfg.draft, capacity=2, max_context=256, num_speculative_tokens=cfg.num_speculative_tokens)
    out = llm.generate(PROMPTS[2], SamplingParams(**options))[0]
    assert chunk.token_ids == out.token_ids and chunk.text == out.text
    assert len(chunk.logprobs) == len(out.logprobs) == 8
    assert [lp.token_id for lp in chunk.logprobs] == out.token_ids
    assert [lp.logprob for lp in chunk.logprobs] == pytest.approx([lp.logprob for lp in out.logprobs], abs=1e-5)
    assert chunk.prompt_logprobs[0] is None and len(chunk.prompt_logprobs) == len(out.prompt_logprobs)
    assert all(len(lp.top) == 2 for lp in chunk.logprobs)
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))
    scored = llm.generate(PROMPTS[2], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert scored.token_ids == [] and scored.finish_reason == "length"
    assert [lp.token_id for lp in scored.prompt_logprobs[1:]] == out.prompt_token_ids[1:]

    # structured outputs: the handle's guided_json and the offline StructuredOutput, same output
    from dspark_ray import StructuredOutput

    schema = {"type": "object", "properties": {"act": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["act"], "additionalProperties": False}
    chunk = asyncio.run(server.complete(GenerateRequest(prompt=PROMPTS[2], max_tokens=20, guided_json=schema)))
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=20, structured=StructuredOutput.json_schema(schema)))[0]
    assert chunk.token_ids == out.token_ids and chunk.finish_reason == out.finish_reason == "stop"
    assert 1 <= json.loads(chunk.text)["act"] <= 5
    with pytest.raises(Exception, match="guided_regex"):
        asyncio.run(server.complete(GenerateRequest(prompt=PROMPTS[2], guided_regex="a(b")))


def test_vllm_sampling_extensions(server):
    """include_stop_str_in_output, truncate_prompt_tokens, skip_special_tokens, top_k -1, with vLLM's meanings."""
    base = dict(prompt=PROMPTS[0], max_tokens=16, temperature=0)
    plain = complete(server, **base).choices[0].text
    stop = plain[6:9]
    assert plain.find(stop) == 6, "pick a stop string that first occurs where it is cut"
    cut = complete(server, stop=[stop], **base).choices[0]
    kept = complete(server, stop=[stop], extra_body=dict(include_stop_str_in_output=True), **base).choices[0]
    assert cut.text == plain[:6] and kept.text == plain[:9] and cut.finish_reason == kept.finish_reason == "stop"

    ids = server.tokenizer.encode(PROMPTS[0])
    short = complete(server, extra_body=dict(truncate_prompt_tokens=4), **base)
    assert short.usage.prompt_tokens == 4
    assert short.choices[0].text == complete(server, **{**base, "prompt": ids[-4:]}).choices[0].text

    same = complete(server, extra_body=dict(top_k=-1, skip_special_tokens=False), **base).choices[0].text
    assert same == plain


def test_n_samples_in_the_handle_api_and_the_offline_llm(server):
    from dspark_ray import LLM
    from dspark_ray.engine.sampling_params import SamplingParams
    from dspark_ray.serve.protocol import GenerateRequest

    async def stream():
        request = GenerateRequest(prompt=PROMPTS[1], max_tokens=6, temperature=1.0, seed=11, n=3)
        return [chunk async for chunk in server.generate(request)]

    texts = ["", "", ""]
    for chunk in asyncio.run(stream()):
        texts[chunk.index] += chunk.text
    cfg = server.config
    llm = LLM(cfg.model, cfg.draft, capacity=4, max_context=256, num_speculative_tokens=cfg.num_speculative_tokens)
    offline = llm.generate([PROMPTS[1], PROMPTS[2]], SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3))
    assert len(offline) == 6 and [o.text for o in offline[:3]] == texts
    assert offline[3].text == llm.generate(PROMPTS[2], SamplingParams(max_tokens=6, temperature=1.0, seed=11))[0].text
    assert len(set(texts)) > 1
