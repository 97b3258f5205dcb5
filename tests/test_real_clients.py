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
transformers.
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

import openai
import pytest
import torch
import uvicorn

from dspark_ray.engine.local import LocalServices
from dspark_ray.serve.config import AppConfig
from dspark_ray.serve.server import DSparkServer
from serve_fixtures import serve_models  # noqa: F401 - fixture

CAPACITY = 8
MAX_CONTEXT = 256
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

    def take(self) -> list[Call]:
        with self.lock:
            calls, self.calls = self.calls, []
        return calls


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
    config = AppConfig(model=str(serve_models.target), draft=str(serve_models.draft), tensor_parallel_size=1,
                       capacity=CAPACITY, max_context=MAX_CONTEXT)
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
