"""Real third-party clients, unmodified, against the server: LangChain's ``ChatOpenAI`` and lm-eval.

The server runs in this process (``LocalServices``, the shipped pair with
speculation on) behind uvicorn on a free 127.0.0.1 port, because both
clients want a real URL (lm-eval posts with ``requests``/``aiohttp``). A thin
ASGI recorder in front of the app keeps each request's path, JSON body and
status, so the tests can say exactly which fields a client sent and that
none was refused; it changes nothing in either direction.

What each client returns is checked against something independent: LangChain
against the official ``openai`` client's direct greedy chat completion, and
lm-eval's log-likelihoods against the target's own log-probabilities from
transformers. Tool calls and structured outputs, through both clients as
agent frameworks use them, are checked against their JSON schemas with
``jsonschema``: the shipped model has never seen JSON, so every valid answer
is the grammar's doing.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # no internet here: everything loads from local folders
os.environ["HF_DATASETS_OFFLINE"] = "1"

import json
import socket
import threading
import time
from dataclasses import dataclass

import jsonschema
import openai
import pytest
import torch
import uvicorn

from dspark_ray.engine.local import LocalServices
from dspark_ray.serve.config import AppConfig
from dspark_ray.serve.server import DSparkServer
from serve_fixtures import serve_models  # noqa: F401 - fixture

CAPACITY = 8
MAX_CONTEXT = 1024  # a prompt with two tools in it runs to ~400 tokens of this small vocabulary
MAX_TOKENS = 16
CHAT_PROMPTS = ["Speak, Romeo.", "What light through yonder window breaks?", "To be, or not to be."]


@dataclass
class Call:
    path: str
    body: dict | None
    status: int | None


class Recorder:
    """ASGI middleware that records each HTTP request's path, JSON body and response status, passing all through."""

    def __init__(self, app) -> None:
        self.app = app
        self.calls: list[Call] = []
        self.active = 0  # requests whose handling has not returned yet
        self.lock = threading.Lock()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        parts: list[bytes] = []
        status: dict[str, int] = {}

        async def recv():
            message = await receive()
            if message["type"] == "http.request":
                parts.append(message.get("body", b""))
            return message

        async def snd(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        with self.lock:
            self.active += 1
        try:
            await self.app(scope, recv, snd)
        finally:
            raw = b"".join(parts)
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = {"<raw>": raw.decode(errors="replace")}
            with self.lock:
                self.calls.append(Call(scope["path"], body, status.get("code")))
                self.active -= 1

    def take(self, wait_s: float = 10.0) -> list[Call]:
        """The requests recorded since the last take. A client can read a stream's last chunk before
        the server's handler has returned (and been recorded): wait for those first."""
        deadline = time.monotonic() + wait_s
        while True:
            with self.lock:
                if not self.active or time.monotonic() > deadline:
                    calls, self.calls = self.calls, []
                    return calls
            time.sleep(0.01)


@dataclass
class Served:
    server: DSparkServer
    recorder: Recorder
    url: str  # http://127.0.0.1:<port>

    @property
    def model(self) -> str:
        return self.server.config.model_name


@pytest.fixture(scope="module")
def served(serve_models):
    # reasoning_parser: the shipped model never opens with <think>, so only the test that makes it
    # (by grammar) gets reasoning_content; every other answer is content, unchanged.
    config = AppConfig(model=str(serve_models.target), draft=str(serve_models.draft), tensor_parallel_size=1,
                       capacity=CAPACITY, max_context=MAX_CONTEXT, tool_call_parser="hermes",
                       reasoning_parser="think")
    srv = DSparkServer(config, services=LocalServices.build)
    recorder = Recorder(srv.build_api())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    http = uvicorn.Server(uvicorn.Config(recorder, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not http.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        yield Served(srv, recorder, f"http://127.0.0.1:{port}")
    finally:
        http.should_exit = True
        thread.join(timeout=15)
        sock.close()
        srv.shutdown()


def direct_chat(served: Served, prompt: str) -> openai.types.chat.ChatCompletion:
    """The official client's greedy chat completion: the reference LangChain's answers must equal."""
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0) as client:
        return client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": prompt}],
                                              temperature=0, max_tokens=MAX_TOKENS)


def assert_all_accepted(calls: list[Call], path: str) -> None:
    assert calls, "the client sent nothing"
    refused = [(c.path, c.status, c.body) for c in calls if c.status != 200 or c.path != path]
    assert not refused, f"requests refused or misrouted: {refused}"


# -- LangChain ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(served):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=f"{served.url}/v1", api_key="unused", model=served.model, temperature=0,
                      max_tokens=MAX_TOKENS, max_retries=0, timeout=60)


def test_langchain_invoke_equals_direct_greedy_chat(served, chat_model):
    ref = direct_chat(served, CHAT_PROMPTS[0])
    served.recorder.take()
    msg = chat_model.invoke(CHAT_PROMPTS[0])
    calls = served.recorder.take()
    assert_all_accepted(calls, "/v1/chat/completions")
    body = calls[0].body
    assert body["model"] == served.model and body["temperature"] == 0 and not body.get("stream")
    assert body["messages"] == [{"role": "user", "content": CHAT_PROMPTS[0]}]
    # langchain-openai 1.7 sends max_tokens=16 as max_completion_tokens (older versions: max_tokens).
    assert MAX_TOKENS in (body.get("max_tokens"), body.get("max_completion_tokens"))

    assert msg.content == ref.choices[0].message.content and msg.content
    assert msg.response_metadata["finish_reason"] == ref.choices[0].finish_reason
    assert msg.response_metadata["model_name"] == served.model
    assert msg.usage_metadata["input_tokens"] == ref.usage.prompt_tokens
    assert msg.usage_metadata["output_tokens"] == ref.usage.completion_tokens
    # the cap bit (so a max_completion_tokens the server ignored would have shown as a longer answer)
    assert ref.choices[0].finish_reason == "length" and ref.usage.completion_tokens == MAX_TOKENS


def test_langchain_stream_chunks_concatenate_to_invoke(served, chat_model):
    ref = direct_chat(served, CHAT_PROMPTS[1])
    served.recorder.take()
    chunks = list(chat_model.stream(CHAT_PROMPTS[1]))
    calls = served.recorder.take()
    assert_all_accepted(calls, "/v1/chat/completions")
    body = calls[0].body
    assert body["stream"] is True

    assert len(chunks) > 1
    assert "".join(c.content for c in chunks) == ref.choices[0].message.content
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert merged.content == ref.choices[0].message.content
    assert merged.response_metadata.get("finish_reason") == ref.choices[0].finish_reason
    assert merged.usage_metadata is None or merged.usage_metadata["output_tokens"] == ref.usage.completion_tokens


def test_langchain_stream_usage(served, chat_model):
    """stream_usage=True (LangChain's default against api.openai.com) sends stream_options.include_usage."""
    ref = direct_chat(served, CHAT_PROMPTS[1])
    served.recorder.take()
    chunks = list(chat_model.stream(CHAT_PROMPTS[1], stream_usage=True))
    calls = served.recorder.take()
    assert_all_accepted(calls, "/v1/chat/completions")
    assert calls[0].body["stream_options"] == {"include_usage": True}
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert merged.content == ref.choices[0].message.content
    assert merged.usage_metadata["input_tokens"] == ref.usage.prompt_tokens
    assert merged.usage_metadata["output_tokens"] == ref.usage.completion_tokens
    assert merged.usage_metadata["total_tokens"] == ref.usage.total_tokens


def test_langchain_batch_equals_one_at_a_time(served, chat_model):
    refs = [direct_chat(served, p).choices[0].message.content for p in CHAT_PROMPTS]
    served.recorder.take()
    got = chat_model.batch(CHAT_PROMPTS)
    calls = served.recorder.take()
    assert_all_accepted(calls, "/v1/chat/completions")
    assert len(calls) == len(CHAT_PROMPTS)
    assert [m.content for m in got] == refs


def test_langchain_default_extras_accepted(served, chat_model):
    """Everything LangChain sends by default (stream_options, n, ... whatever the version adds) gets a 200."""
    served.recorder.take()
    chat_model.invoke([("system", "You are a player."), ("human", CHAT_PROMPTS[2])])
    list(chat_model.stream(CHAT_PROMPTS[2]))
    calls = served.recorder.take()
    assert_all_accepted(calls, "/v1/chat/completions")
    sent = set().union(*(c.body.keys() for c in calls))
    assert {"model", "messages", "temperature", "stream"} <= sent, sent
    assert calls[0].body["messages"][0] == {"role": "system", "content": "You are a player."}


# -- lm-evaluation-harness ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_target(serve_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(serve_models.target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(serve_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(serve_models.target)


@pytest.fixture(scope="module")
def lm(served, serve_models):
    from lm_eval.api.registry import get_model

    cls = get_model("local-completions")
    return cls(base_url=f"{served.url}/v1/completions", model=served.model, tokenizer_backend="huggingface",
               tokenizer=str(serve_models.target), max_length=MAX_CONTEXT, max_retries=1, timeout=120)


def target_logprobs(hf_target, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_target(torch.tensor([ids])).logits[0].double(), -1)


def greedy_ids(hf_target, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(target_logprobs(hf_target, out)[-1].argmax()))
    return out[len(ids):]


def test_lm_eval_loglikelihood_matches_transformers(served, lm, hf_target, hf_tokenizer):
    from lm_eval.api.instance import Instance

    greedy_ctx = "ROMEO:\nBut soft, what light"
    greedy_cont_ids = greedy_ids(hf_target, hf_tokenizer.encode(greedy_ctx), 4)
    pairs = [
        ("JULIET:\nO Romeo, Romeo,", " wherefore art thou Romeo?"),
        ("HAMLET:\nTo be, or not", " to be"),
        (greedy_ctx, hf_tokenizer.decode(greedy_cont_ids)),
    ]
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
                for i, pair in enumerate(pairs)]
    served.recorder.take()
    results = lm.loglikelihood(requests, disable_tqdm=True)
    calls = served.recorder.take()
    assert_all_accepted(calls, "/v1/completions")
    for c in calls:
        assert c.body["echo"] is True and c.body["logprobs"] == 1 and c.body["max_tokens"] == 1
        assert isinstance(c.body["prompt"][0], list)  # token ids, as lm-eval sends them

    assert len(results) == len(pairs)
    for (context, continuation), (ll, is_greedy) in zip(pairs, results):
        ctx = hf_tokenizer.encode(context)
        whole = hf_tokenizer.encode(context + continuation)
        assert whole[:len(ctx)] == ctx and len(whole) > len(ctx)  # the split lm-eval makes too
        ref = target_logprobs(hf_target, whole)
        expected = sum(float(ref[i - 1, whole[i]]) for i in range(len(ctx), len(whole)))
        expected_greedy = all(int(ref[i - 1].argmax()) == whole[i] for i in range(len(ctx), len(whole)))
        assert ll == pytest.approx(expected, abs=1e-3), (context, continuation)
        assert is_greedy == expected_greedy, (context, continuation)
    assert results[2][1] is True and hf_tokenizer.encode(pairs[2][0] + pairs[2][1])[-4:] == greedy_cont_ids
    assert not all(g for _, g in results)  # the Juliet line is not this model's greedy choice


def test_lm_eval_generate_until_equals_direct_completion(served, lm, hf_target, hf_tokenizer):
    from lm_eval.api.instance import Instance

    context = "ROMEO:\nBut soft, what light"
    gen_kwargs = {"until": ["\n\n"], "max_gen_toks": 12}
    served.recorder.take()
    [text] = lm.generate_until([Instance(request_type="generate_until", doc={}, arguments=(context, gen_kwargs),
                                         idx=0)], disable_tqdm=True)
    calls = served.recorder.take()
    assert_all_accepted(calls, "/v1/completions")
    body = calls[0].body
    assert body["max_tokens"] == 12 and body["temperature"] == 0 and "\n\n" in body["stop"]

    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0) as client:
        ref = client.completions.create(model=served.model, prompt=context, max_tokens=12, temperature=0,
                                        stop=body["stop"])
    assert text == ref.choices[0].text
    # and the target's own greedy continuation starts with it
    greedy_text = hf_tokenizer.decode(greedy_ids(hf_target, hf_tokenizer.encode(context), 12))
    assert greedy_text.startswith(text) and text


# -- tools and structured outputs -----------------------------------------------------------------

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "EST"]}}, "required": ["tz"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": TIME}}]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": TIME}
TOOL_MESSAGES = [{"role": "developer", "content": "Answer with a tool call."},
                 {"role": "user", "content": "Will it rain in Verona this week?"}]


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


def streamed_calls(stream) -> tuple[list[dict], str | None, str]:
    """OpenAI tool-call deltas put together as a client does: per index, id and name once, arguments
    concatenated. Returns (calls, finish_reason, content)."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert call["id"] is None, "a call's id came twice"
                    call["id"] = d.id
                if d.function and d.function.name:
                    call["name"] = d.function.name
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_openai_client_forced_tool_calls_are_valid(served, tool_choice):
    args = dict(model=served.model, messages=TOOL_MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                parallel_tool_calls=False, temperature=0, max_tokens=120)
    with client(served) as c:
        whole = c.chat.completions.create(**args)
        streamed, finish, content = streamed_calls(c.chat.completions.create(**args, stream=True))
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert len(calls) == 1 and calls[0].id.startswith("call_") and calls[0].type == "function"
    if isinstance(tool_choice, dict):
        assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMA_OF[calls[0].function.name])
    # streamed: the same call (greedy), put together from OpenAI's deltas
    assert finish == "tool_calls" and content == ""
    assert [(k["name"], json.loads(k["arguments"])) for k in streamed] == \
        [(calls[0].function.name, json.loads(calls[0].function.arguments))]
    assert streamed[0]["id"].startswith("call_")


def test_openai_client_multi_turn_with_tool_results(served):
    """The conversation continues after a call: assistant tool_calls (null content) and a tool message."""
    with client(served) as c:
        first = c.chat.completions.create(model=served.model, messages=TOOL_MESSAGES, tools=TOOLS,
                                          tool_choice="required", temperature=0, max_tokens=120)
        call = first.choices[0].message.tool_calls[0]
        messages = TOOL_MESSAGES + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "rain on Tuesday"}]
        second = c.chat.completions.create(model=served.model, messages=messages, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           temperature=0, max_tokens=60)
    call2 = second.choices[0].message.tool_calls[0]
    assert call2.function.name == "get_time"
    jsonschema.validate(json.loads(call2.function.arguments), TIME)


def test_openai_client_structured_outputs(served):
    from typing import Annotated

    from pydantic import BaseModel, Field

    class Scene(BaseModel):
        act: int = Field(ge=1, le=5)
        place: str = Field(max_length=16)
        speakers: list[Annotated[str, Field(max_length=12)]] = Field(max_length=2)

    with client(served) as c:
        # the client's own structured-output helper: a strict json_schema response_format
        parsed = c.chat.completions.parse(model=served.model, temperature=0, max_tokens=150, response_format=Scene,
                                          messages=[{"role": "user", "content": "Describe a scene."}])
        assert isinstance(parsed.choices[0].message.parsed, Scene), parsed.choices[0].message.content
        obj = c.chat.completions.create(model=served.model, temperature=0.9, seed=5, max_tokens=150,
                                        response_format={"type": "json_object"},
                                        messages=[{"role": "user", "content": "A scene, as JSON."}])
        if obj.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(obj.choices[0].message.content), dict)
        # vLLM's request fields through extra_body, on the completions API
        choice = c.completions.create(model=served.model, prompt="Who loves Juliet?", max_tokens=10,
                                      extra_body={"guided_choice": ["Romeo", "Paris", "Tybalt"]}).choices[0]
        assert choice.text in ("Romeo", "Paris", "Tybalt") and choice.finish_reason == "stop"
        regex = c.completions.create(model=served.model, prompt="KING:", max_tokens=20, temperature=1.0,
                                     extra_body={"structured_outputs": {"regex": r"Act [IV]{1,3}, scene [1-5]"}})
        import re

        assert re.fullmatch(r"Act [IV]{1,3}, scene [1-5]", regex.choices[0].text)


def test_auto_tool_calls_and_reasoning_are_parsed_from_the_output(served):
    """tool_choice auto reads the model's own <tool_call> blocks (hermes), and the reasoning parser
    splits <think>...</think> off as reasoning_content, streamed and not. The shipped model writes
    neither on its own, so a regex makes it (the parsers see what a model that does would write)."""
    pattern = (r'<think>[a-z ]{4,24}</think>\n<tool_call>\n\{"name": "get_time", "arguments": '
               r'\{"tz": "(UTC|CET)"\}\}\n</tool_call>')
    args = dict(model=served.model, messages=TOOL_MESSAGES, tools=TOOLS, temperature=0, max_tokens=120,
                extra_body={"guided_regex": pattern})
    with client(served) as c:
        whole = c.chat.completions.create(**args)
        stream = list(c.chat.completions.create(**args, stream=True))
    choice = whole.choices[0]
    message = choice.message.model_dump()
    assert choice.finish_reason == "tool_calls"
    assert message["reasoning_content"] and "<think>" not in message["reasoning_content"]
    assert message["content"] is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["tz"] in ("UTC", "CET")
    reasoning = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in stream if ch.choices)
    assert reasoning == message["reasoning_content"]
    calls, finish, content = streamed_calls(stream)
    assert finish == "tool_calls" and content.strip() == ""
    assert [(k["name"], json.loads(k["arguments"])) for k in calls] == [("get_time", json.loads(call.function.arguments))]


def test_langchain_bind_tools_and_structured_output(served):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        """Weather forecast for a city."""

        city: str = Field(max_length=12)
        days: int = Field(ge=1, le=7)

    model = ChatOpenAI(base_url=f"{served.url}/v1", api_key="unused", model=served.model, temperature=0,
                       max_tokens=120, max_retries=0, timeout=60)
    for tool_choice in ("required", "GetWeather"):
        bound = model.bind_tools([GetWeather], tool_choice=tool_choice, parallel_tool_calls=False)
        msg = bound.invoke("Will it rain in Verona?")
        [call] = msg.tool_calls
        assert call["name"] == "GetWeather" and call["id"]
        GetWeather.model_validate(call["args"])
        merged = None
        for chunk in bound.stream("Will it rain in Verona?"):
            merged = chunk if merged is None else merged + chunk
        assert [(k["name"], k["args"]) for k in merged.tool_calls] == [(call["name"], call["args"])]
    for method in ("json_schema", "function_calling"):
        structured = model.with_structured_output(GetWeather, method=method)
        assert isinstance(structured.invoke("Weather in Padua?"), GetWeather)
