"""deploy/dspark.yaml served for real: ``serve run`` as a subprocess, then real clients.

- the official ``openai`` client: models, completions, chat, streaming (deltas
  concatenate to the non-streamed greedy result, usage with include_usage,
  the ``speculation`` extension field);
- a second Serve application whose deployment calls the first through
  ``serve.get_app_handle("dspark")`` (streaming ``generate`` and ``complete``);
- raw HTTP (httpx): the bad-input matrix (400, OpenAI error body naming the
  field, no slot taken), a client that disconnects mid-stream (its request is
  aborted and its slot freed), concurrent requests;
- a second application with a tiny queue: excess requests get 503 + Retry-After;
- at the end, the slot manager holds no slot and its counters balance.

The module's tests share one ``serve run`` and run in file order; the last one
checks the state everything before it left behind.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from ray import serve

from dspark_ray.ops.processes import free_port
from dspark_ray.serve.app import build_app
from serve_fixtures import (  # noqa: F401 - fixtures
    ServeRun, app_stats, serve_models, served, slot_snapshot, wait_for,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPTS = [
    "ROMEO:\nBut soft, what light",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "To be, or not",
    "KING HENRY:\nOnce more unto the breach, dear friends",
]
CHAT = [{"role": "user", "content": "Speak, good friend: who goes there?"}]
OVERLOAD_APP = "dspark-overload"


@pytest.fixture(scope="module")
def client(served: ServeRun):
    with openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(served: ServeRun):
    with httpx.Client(base_url=served.base_url, timeout=120) as c:
        yield c


def extension(obj, name: str):
    """An extension field of an openai response object (kept in ``model_extra``)."""
    return (obj.model_extra or {}).get(name)


def check_speculation(spec: dict | None, completion_tokens: int) -> None:
    assert spec is not None, "the speculation extension field is missing"
    assert set(spec) == {"drafts", "draft_tokens", "accepted_tokens", "accepted_per_position",
                         "mean_acceptance_length", "steps_by_k"}
    assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    assert sum(spec["accepted_per_position"]) == spec["accepted_tokens"]
    # Each step's k (adaptive or fixed; 0 included): steps_by_k accounts for every draft.
    by_k = spec["steps_by_k"]
    assert by_k and len(by_k) <= 5 and sum(by_k[1:]) == spec["drafts"]
    assert sum(k * n for k, n in enumerate(by_k)) == spec["draft_tokens"]
    assert sum(by_k) <= completion_tokens


# -- the openai client ---------------------------------------------------------------------------


def test_models_completions_and_chat(served, client):
    assert [m.id for m in client.models.list().data] == [served.model]

    c = client.completions.create(model=served.model, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert c.object == "text_completion" and c.model == served.model and len(c.choices) == 1
    choice = c.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert c.usage.prompt_tokens > 0 and 1 <= c.usage.completion_tokens <= 24
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    if choice.finish_reason == "length":
        assert c.usage.completion_tokens == 24
    check_speculation(extension(c, "speculation"), c.usage.completion_tokens)

    chat = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=16, temperature=0)
    assert chat.object == "chat.completion"
    msg = chat.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert 1 <= chat.usage.completion_tokens <= 16
    check_speculation(extension(chat, "speculation"), chat.usage.completion_tokens)


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_streaming_concatenates_to_the_greedy_result(served, client, kind):
    if kind == "chat":
        create, args = client.chat.completions.create, dict(messages=CHAT)
        text_of = lambda r: r.choices[0].message.content  # noqa: E731
        delta_of = lambda ch: ch.choices[0].delta.content or ""  # noqa: E731
    else:
        create, args = client.completions.create, dict(prompt=PROMPTS[1])
        text_of = lambda r: r.choices[0].text  # noqa: E731
        delta_of = lambda ch: ch.choices[0].text  # noqa: E731
    args.update(model=served.model, max_tokens=40, temperature=0)

    whole = create(**args)
    chunks = list(create(**args, stream=True, stream_options={"include_usage": True}))

    assert len({ch.id for ch in chunks}) == 1
    content = [ch for ch in chunks if ch.choices]
    assert "".join(delta_of(ch) for ch in content) == text_of(whole)
    assert content[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(ch.choices[0].finish_reason is None for ch in content[:-1])
    check_speculation(extension(content[-1], "speculation"), whole.usage.completion_tokens)
    # include_usage: one last chunk with no choices carries the usage.
    usage = [ch for ch in chunks if ch.usage is not None]
    assert len(usage) == 1 and usage[0] is chunks[-1] and chunks[-1].choices == []
    assert usage[0].usage == whole.usage
    if kind == "chat":
        assert chunks[0].choices[0].delta.role == "assistant"


# -- Ray handles from a second application -------------------------------------------------------


def handle_client_app():
    """A second Serve application whose deployment calls dspark through its handle, no HTTP.

    Defined inside a function so that Ray pickles it by value (the replica
    cannot import the test modules).
    """
    from dspark_ray.serve.protocol import GenerateChunk, GenerateRequest

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class HandleClient:
        def __init__(self) -> None:
            self.dspark = serve.get_app_handle("dspark")

        async def run(self, prompt: str, max_tokens: int) -> dict:
            req = GenerateRequest(prompt=prompt, max_tokens=max_tokens)  # temperature defaults to 0 here
            chunks = []
            async for chunk in self.dspark.options(stream=True).generate.remote(req):
                assert isinstance(chunk, GenerateChunk), type(chunk)
                chunks.append(chunk.model_dump())
            whole = await self.dspark.complete.remote(req)
            assert isinstance(whole, GenerateChunk), type(whole)
            return {"chunks": chunks, "complete": whole.model_dump()}

    return HandleClient.bind()


def test_logprobs_penalties_and_choices_over_the_served_transport(served, client):
    """Log-probabilities, penalties and n travel through the served step (actors) as in process."""
    args = dict(model=served.model, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    c = client.completions.create(logprobs=2, echo=True, **args).choices[0]
    n_prompt = len(c.logprobs.tokens) - 8
    assert c.logprobs.token_logprobs[0] is None and n_prompt > 1
    assert all(lp is not None and lp <= 0 for lp in c.logprobs.token_logprobs[1:])
    assert c.text == PROMPTS[0] + client.completions.create(**args).choices[0].text
    penalised = client.completions.create(frequency_penalty=1.5, extra_body={"repetition_penalty": 1.5}, **args)
    assert penalised.choices[0].text != c.text[len(PROMPTS[0]):]
    many = client.completions.create(model=served.model, prompt=PROMPTS[:2], n=2, max_tokens=4, temperature=1.0,
                                     seed=1)
    assert [ch.index for ch in many.choices] == [0, 1, 2, 3]
    chat = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=1)
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens


def test_structured_outputs_and_tools_over_the_served_transport(served, client):
    """Grammar rows travel through the actors: the draft worker keeps its own per-slot matchers, the
    target shards apply the masks the replica computed."""
    schema = {"type": "object", "properties": {"role": {"enum": ["king", "fool"]},
                                               "line": {"type": "string", "maxLength": 24}},
              "required": ["role", "line"], "additionalProperties": False}
    out = client.chat.completions.create(
        model=served.model, messages=CHAT, max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "speech", "schema": schema}},
        extra_body={"num_speculative_tokens": 4})  # a fixed k: this must speculate whatever the load
    value = json.loads(out.choices[0].message.content)
    assert value["role"] in ("king", "fool") and len(value["line"]) <= 24 and set(value) == {"role", "line"}
    assert out.model_extra["speculation"]["accepted_tokens"] > 0  # the draft worker masked its drafts
    tools = [{"type": "function", "function": {"name": "exit", "parameters": {
        "type": "object", "properties": {"who": {"enum": ["Hamlet", "Ghost"]}}, "required": ["who"]}}}]
    call = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=40, temperature=0,
                                          tools=tools, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert call.finish_reason == "tool_calls"
    assert json.loads(call.message.tool_calls[0].function.arguments)["who"] in ("Hamlet", "Ghost")
    # Parallel calls allowed: this model never stops calling; what max_tokens cut off is dropped and
    # the calls completed before it come back, each valid.
    many = client.chat.completions.create(model=served.model, messages=CHAT, max_tokens=40, temperature=0,
                                          tools=tools, tool_choice="required").choices[0]
    assert many.finish_reason == "length" and many.message.tool_calls
    assert all(json.loads(c.function.arguments)["who"] in ("Hamlet", "Ghost") for c in many.message.tool_calls)


def test_request_id_comes_back_once_and_names_the_response(served, http):
    """Under Serve the proxy echoes X-Request-Id (the client's, or one it made up); the response id
    is that same id, and the header is not doubled by the server's own echo."""
    body = {"model": served.model, "prompt": PROMPTS[0], "max_tokens": 2}
    given = http.post("/v1/completions", json=body, headers={"X-Request-Id": "trace-7"})
    assert given.status_code == 200, given.text
    assert given.headers.get_list("x-request-id") == ["trace-7"] and given.json()["id"] == "trace-7"
    made = http.post("/v1/chat/completions", json={"model": served.model, "max_tokens": 2,
                                                    "messages": [{"role": "user", "content": "Hi"}]})
    assert made.status_code == 200, made.text
    [rid] = made.headers.get_list("x-request-id")
    assert made.json()["id"] == rid


def test_handle_api_from_a_second_serve_app(served, client):
    prompt, max_tokens = PROMPTS[2], 20
    ref = client.completions.create(model=served.model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    handle = serve.run(handle_client_app(), name="handle-client", route_prefix=None)
    try:
        got = handle.run.remote(prompt, max_tokens).result(timeout_s=180)
    finally:
        serve.delete("handle-client")

    chunks, whole = got["chunks"], got["complete"]
    assert chunks and chunks[-1]["finished"] and not any(ch["finished"] for ch in chunks[:-1])
    assert len({ch["request_id"] for ch in chunks}) == 1
    assert "".join(ch["text"] for ch in chunks) == ref.choices[0].text
    assert chunks[-1]["finish_reason"] == ref.choices[0].finish_reason
    assert chunks[-1]["usage"]["completion_tokens"] == ref.usage.completion_tokens
    assert chunks[-1]["speculation"] is not None
    streamed_ids = [t for ch in chunks for t in ch["token_ids"]]
    assert len(streamed_ids) == ref.usage.completion_tokens
    assert whole["finished"] and whole["text"] == ref.choices[0].text and whole["token_ids"] == streamed_ids
    assert whole["usage"] == chunks[-1]["usage"]


# -- bad input -------------------------------------------------------------------------------------


def bad_inputs(model: str, max_context: int) -> list[tuple[str, str, object, str | None]]:
    """(label, route, body as dict or raw bytes, the `param` the error must name)."""
    cmpl = {"model": model, "prompt": "Hello", "max_tokens": 8}
    chat = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
    C, H = "/v1/completions", "/v1/chat/completions"

    def without(body, key):
        return {k: v for k, v in body.items() if k != key}

    long_ids = [11] * max_context
    long_text = "the king " * max_context
    return [
        ("invalid JSON", C, b'{"model": "x", "prompt": ', None),
        ("invalid JSON (chat)", H, b"not json at all", None),
        ("body not an object", C, b"[1, 2, 3]", None),
        ("missing prompt", C, without(cmpl, "prompt"), "prompt"),
        ("missing messages", H, without(chat, "messages"), "messages"),
        ("missing model", C, without(cmpl, "model"), "model"),
        ("empty messages", H, {**chat, "messages": []}, "messages"),
        ("message without content", H, {**chat, "messages": [{"role": "user"}]}, "messages.0.content"),
        ("unknown role", H, {**chat, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ("mistyped max_tokens", C, {**cmpl, "max_tokens": "ten"}, "max_tokens"),
        ("fractional max_tokens", C, {**cmpl, "max_tokens": 1.5}, "max_tokens"),
        ("mistyped temperature", H, {**chat, "temperature": "hot"}, "temperature"),
        ("mistyped prompt", C, {**cmpl, "prompt": 123}, "prompt"),
        ("mistyped messages", H, {**chat, "messages": "hello"}, "messages"),
        ("mistyped stop", C, {**cmpl, "stop": 5}, "stop"),
        ("max_tokens 0", C, {**cmpl, "max_tokens": 0}, "max_tokens"),
        ("max_tokens 0 (chat)", H, {**chat, "max_tokens": 0}, "max_tokens"),
        ("max_tokens negative", C, {**cmpl, "max_tokens": -3}, "max_tokens"),
        ("max_tokens beyond context", C, {**cmpl, "max_tokens": max_context}, "max_tokens"),
        ("max_tokens beyond context (chat)", H, {**chat, "max_tokens": max_context}, "max_tokens"),
        ("prompt ids longer than context", C, {**cmpl, "prompt": long_ids}, "prompt"),
        ("prompt text longer than context", C, {**cmpl, "prompt": long_text}, "prompt"),
        ("messages longer than context", H, {**chat, "messages": [{"role": "user", "content": long_text}]},
         "messages"),
        ("empty prompt", C, {**cmpl, "prompt": ""}, "prompt"),
        ("token id outside the vocabulary", C, {**cmpl, "prompt": [10**9]}, "prompt"),
        ("empty prompt list", C, {**cmpl, "prompt": []}, "prompt"),
        ("an empty prompt in a list", C, {**cmpl, "prompt": ["a", ""]}, "prompt"),
        ("unknown model", C, {**cmpl, "model": "gpt-4"}, "model"),
        ("unknown model (chat)", H, {**chat, "model": "gpt-4"}, "model"),
        ("temperature 5", C, {**cmpl, "temperature": 5}, "temperature"),
        ("temperature negative", H, {**chat, "temperature": -0.5}, "temperature"),
        ("top_p 0", C, {**cmpl, "top_p": 0}, "top_p"),
        ("top_p 1.5", H, {**chat, "top_p": 1.5}, "top_p"),
        ("n beyond the slot capacity", C, {**cmpl, "n": 10**4}, "n"),
        ("n beyond the slot capacity (chat)", H, {**chat, "n": 10**4}, "n"),
        ("logprobs beyond 20", C, {**cmpl, "logprobs": 21}, "logprobs"),
        ("top_logprobs beyond 20 (chat)", H, {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("suffix", C, {**cmpl, "suffix": "x"}, "suffix"),
        ("best_of below n", C, {**cmpl, "best_of": 1, "n": 2}, "best_of"),
        ("presence_penalty out of range", H, {**chat, "presence_penalty": 2.5}, "presence_penalty"),
        ("logit_bias key outside the vocabulary", C, {**cmpl, "logit_bias": {"99999999": 1}}, "logit_bias"),
        ("logit_bias value out of range", H, {**chat, "logit_bias": {"5": -101}}, "logit_bias"),
        ("min_tokens above max_tokens", C, {**cmpl, "min_tokens": 10**3}, "min_tokens"),
        ("tool_choice naming no tool", H, {**chat, "tools": [{"type": "function", "function": {"name": "f"}}],
                                           "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tool_choice"),
        ("a regex that does not compile", C, {**cmpl, "guided_regex": "a(b"}, "guided_regex"),
        ("unknown key", C, {**cmpl, "frobnicate": 1}, "frobnicate"),
        ("unknown key (chat)", H, {**chat, "frobnicate": 1}, "frobnicate"),
        ("unknown stream option", C, {**cmpl, "stream": True, "stream_options": {"include_usage": True, "x": 1}},
         "stream_options.x"),
        ("bad request while streaming", H, {**chat, "stream": True, "temperature": 9}, "temperature"),
    ]


def test_bad_inputs_get_400_naming_the_field_and_take_no_slot(served, http, client):
    before_slots, before_stats = slot_snapshot(served.app_name), app_stats(served)
    failures = []
    for label, route, body, param in bad_inputs(served.model, served.args["max_context"]):
        if isinstance(body, bytes):
            r = http.post(route, content=body, headers={"content-type": "application/json"})
        else:
            r = http.post(route, json=body)
        try:
            err = r.json()["error"]
            ok = (r.status_code == 400 and err["type"] == "invalid_request_error" and err["param"] == param
                  and isinstance(err["message"], str) and err["message"])
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            failures.append(f"{label}: {r.status_code} {r.text[:300]}")
    assert not failures, "\n".join(failures)

    # The official client sees the same errors as BadRequestError.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=served.model, prompt="Hello", max_tokens=8, temperature=5)
    assert info.value.body["param"] == "temperature"

    after_slots, after_stats = slot_snapshot(served.app_name), app_stats(served)
    assert after_slots.counters == before_slots.counters, "a bad request took (or freed) a slot"
    assert after_slots.live == ()
    assert after_stats["finished"] == before_stats["finished"], "a bad request reached the engine"


# -- disconnects and concurrency ---------------------------------------------------------------



def test_client_disconnect_mid_stream_aborts_and_frees_the_slot(served, client):
    """The stream's client goes away after one chunk: its request is aborted and its slot freed at
    once, while a request running beside it finishes exactly as it would alone."""
    bystander = dict(model=served.model, prompt=PROMPTS[3], max_tokens=32, temperature=0)
    alone = client.completions.create(**bystander).choices[0].text
    before = app_stats(served)["finished"]
    body = {"model": served.model, "prompt": PROMPTS[0], "max_tokens": served.args["max_context"] - 64,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with ThreadPoolExecutor(1) as pool:
        with httpx.Client(base_url=served.base_url, timeout=60) as c, \
                c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    first = json.loads(line.removeprefix("data: "))
                    break
            req_id = first["id"]
            assert req_id in {live.lease.req_id for live in slot_snapshot(served.app_name).live}
            beside = pool.submit(lambda: client.completions.create(**bystander).choices[0].text)
        closed = time.monotonic()  # the response and its connection are closed here

        def freed():
            return req_id not in {live.lease.req_id for live in slot_snapshot(served.app_name).live}

        assert wait_for(freed, timeout_s=10), "the disconnected request still holds its slot after 10 s"
        took = time.monotonic() - closed
        assert beside.result(timeout=120) == alone, "the disconnect disturbed a request running beside it"

    def both_finished():
        f = app_stats(served)["finished"]
        return f if sum(f.values()) == sum(before.values()) + 2 else None

    after = wait_for(both_finished, 10)
    assert after, f"expected 2 more finished requests: before {before}, now {app_stats(served)['finished']}"
    assert after.get("abort", 0) == before.get("abort", 0) + 1, f"not aborted: {before} -> {after}"
    assert took < 5, f"the slot was freed {took:.1f}s after the disconnect"


def test_concurrent_requests_all_succeed_and_match_solo_runs(served, client):
    args = dict(model=served.model, max_tokens=24, temperature=0)
    solo = [client.completions.create(prompt=p, **args).choices[0].text for p in PROMPTS]

    async def one(aclient: openai.AsyncOpenAI, i: int) -> str:
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            stream = await aclient.completions.create(prompt=prompt, stream=True, **args)
            return "".join([ch.choices[0].text async for ch in stream if ch.choices])
        return (await aclient.completions.create(prompt=prompt, **args)).choices[0].text

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0,
                                      timeout=180) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(16)))

    texts = asyncio.run(main())
    for i, text in enumerate(texts):
        assert text == solo[i % len(PROMPTS)], f"request {i} differs from its prompt's solo run"


# -- overload: a second application with a tiny queue --------------------------------------------


def test_overload_gets_503_with_retry_after(served, serve_models):
    """max_num_seqs 1, max_queued_requests 1: with one request running, of 7 more sent at once one
    queues and six are refused at once with 503 + Retry-After, rather than waiting in Serve."""
    port = free_port()  # its replica serves HTTP on a port of its own (the shipped YAML's way)
    args = dict(served.args, model=str(serve_models.target), draft=None, tensor_parallel_size=1,
                num_replicas=1, max_num_seqs=1, max_queued_requests=1, capacity=4, http_port=port,
                compile_model=False)  # eager: it starts sooner, and refusing is the same
    serve.run(build_app(args), name=OVERLOAD_APP, route_prefix="/overload")
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"model": served.model, "prompt": PROMPTS[0], "temperature": 0, "ignore_eos": True}
        handle = serve.get_app_handle(OVERLOAD_APP)

        async def main() -> tuple[httpx.Response, list[httpx.Response]]:
            async with httpx.AsyncClient(base_url=served.base_url, timeout=120) as c:
                # As long as the context allows: with 200 tokens it once ended before the whole burst was
                # admitted (CI), so the queued request ran and a second one queued.
                longest = served.args["max_context"] - 64
                running = asyncio.create_task(c.post(url, json={**body, "max_tokens": longest}))
                deadline = time.monotonic() + 30
                while (await handle.stats.remote())["running"] < 1:
                    assert time.monotonic() < deadline and not running.done(), "the first request never ran"
                    await asyncio.sleep(0.05)
                burst = await asyncio.gather(*(c.post(url, json={**body, "max_tokens": 8}) for _ in range(7)))
                return await running, burst

        first, burst = asyncio.run(main())
        assert first.status_code == 200, first.text
        codes = sorted(r.status_code for r in burst)
        assert codes == [200] + [503] * 6, codes
        for r in burst:
            if r.status_code == 503:
                assert int(r.headers["retry-after"]) >= 1
                err = r.json()["error"]
                assert err["code"] == "overloaded" and err["type"] == "server_error", err

        snap = wait_for(lambda: (s := slot_snapshot(OVERLOAD_APP)).live == () and s, 10)
        assert snap, f"the overload app still holds slots: {slot_snapshot(OVERLOAD_APP).live}"
        assert snap.counters.allocations == snap.counters.releases == 2, snap.counters
    finally:
        serve.delete(OVERLOAD_APP)


# -- afterwards ----------------------------------------------------------------------------------


def test_afterwards_no_live_slot_and_counters_balance(served):
    snap = wait_for(lambda: (s := slot_snapshot(served.app_name)).live == () and s, 10)
    assert snap, f"slots still held: {slot_snapshot(served.app_name).live}"
    c = snap.counters
    assert snap.free == snap.capacity == served.args["capacity"]
    assert c.allocations > 0 and c.allocations + c.restored == c.releases, c
    assert c.stale_releases == 0, c
    st = app_stats(served)
    assert st["running"] == 0 and st["waiting"] == 0, st
    assert "error" not in st["finished"], st
    assert sum(st["finished"].values()) == c.allocations, (st, c)
