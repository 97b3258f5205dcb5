"""The HTTP layer against an in-process engine: no Ray cluster, no Serve.

``DSparkServer`` takes its engine services by injection; here they are
``LocalServices`` (slot registry, target runner and draft proposer in this
process) and the FastAPI app from ``build_api`` is driven through httpx's ASGI
transport. The same routes run under real Serve in ``test_serve_app.py``;
these tests check the HTTP contract quickly and must agree with the offline
engine token for token.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from dspark_ray.engine.local import LocalServices, build_local_engine
from dspark_ray.engine.sampling_params import SamplingParams
from dspark_ray.serve.config import AppConfig
from dspark_ray.serve.server import DSparkServer
from serve_fixtures import serve_models  # noqa: F401 - fixture
from serve_fixtures import spec_counters

PROMPT = "ROMEO:\nBut soft, what light"


@pytest.fixture(scope="module")
def server(serve_models):
    config = AppConfig(model=str(serve_models.target), draft=str(serve_models.draft), tensor_parallel_size=1,
                       capacity=8, max_context=256)
    srv = DSparkServer(config, services=LocalServices.build)
    yield srv
    srv.shutdown()


def call(server: DSparkServer, method: str, path: str, body: dict | None = None) -> httpx.Response:
    """One request through the server's ASGI app, on a fresh event loop."""

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=server.build_api())
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, json=body)

    return asyncio.run(go())


def test_the_drain_switch_refuses_new_requests_and_takes_no_slot(server, serve_models):
    """POST /admin/drain: new requests get 503 ``draining`` with Retry-After and take no slot, /health
    says ``draining``; /admin/resume undoes it. (httpx's ASGI transport hands over a response only
    once it is complete, so the streams that run on through a drain are checked under real Serve,
    test_serve_replicas.py.)"""
    body = {"model": serve_models.name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    try:
        r = call(server, "POST", "/admin/drain")
        assert r.status_code == 200 and r.json() == {"draining": True, "requests_in_flight": 0}, r.text
        allocations = server.services.slots.snapshot().counters.allocations
        for path in ("/v1/completions", "/v1/chat/completions"):
            payload = body if path == "/v1/completions" else {
                "model": serve_models.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
            refused = call(server, "POST", path, payload)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining", refused.text
            assert int(refused.headers["retry-after"]) > 0
        assert server.services.slots.snapshot().counters.allocations == allocations  # no slot taken
        health = call(server, "GET", "/health")
        assert health.status_code == 503 and health.json()["status"] == "draining", health.text
        assert call(server, "GET", "/admin/drain").json()["draining"] is True
    finally:
        r = call(server, "POST", "/admin/resume")
    assert r.json() == {"draining": False, "requests_in_flight": 0}
    assert call(server, "POST", "/v1/completions", body).status_code == 200
    assert call(server, "GET", "/health").json()["status"] == "ok"


def test_stats_shows_what_adaptive_speculation_chose_and_measured(server, serve_models):
    """GET /stats carries the steps adaptive speculation ran at each k and its step-time table per
    batch bucket (what it decides by), so an operator can see why it drafts what it does."""
    body = {"model": serve_models.name, "prompt": PROMPT, "max_tokens": 32, "temperature": 0}
    before = call(server, "GET", "/stats").json()
    assert call(server, "POST", "/v1/completions", body).status_code == 200
    stats = call(server, "GET", "/stats").json()
    controller = server.loop.engine.spec_controller
    chosen = {str(k): n for k, n in controller.chosen.items()}
    assert stats["spec_k_steps"] == chosen
    ran = sum(stats["spec_k_steps"].values()) - sum(before["spec_k_steps"].values())
    assert 0 < ran <= stats["steps"] - before["steps"]  # a step that chose a k is a step
    table = stats["adaptive_ms"]
    assert table and set(table) == {str(b) for b in controller.table}
    k_max = server.config.num_speculative_tokens
    for b, row in table.items():
        assert len(row["measured"]) == len(row["n"]) == len(row["fitted"]) == k_max + 1
        for measured, n in zip(row["measured"], row["n"]):
            assert (measured is None) == (n == 0) and (measured is None or measured > 0)
        assert row["n"] == [c.n for c in controller.table[int(b)]]
    assert any(n for row in table.values() for n in row["n"])


def test_completion_equals_the_offline_engine(server, serve_models):
    body = {"model": serve_models.name, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    r = call(server, "POST", "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    engine = build_local_engine(server.config.engine_config())
    req_id = engine.add_request(PROMPT, SamplingParams(max_tokens=24))
    ids = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.req_id == req_id
            ids += out.new_token_ids
    assert choice["text"] == engine.tokenizer.decode(ids)
    assert r.json()["usage"]["completion_tokens"] == 24


def test_streamed_deltas_concatenate_to_the_whole(server, serve_models):
    body = {"model": serve_models.name, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    whole = call(server, "POST", "/v1/completions", body).json()["choices"][0]["text"]
    r = call(server, "POST", "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole
    assert chunks[-1]["usage"]["completion_tokens"] == 24


def test_vllm_benchmark_client_neutral_fields_are_accepted(server, serve_models):
    """vLLM's `bench serve` sends these in every completions request."""
    body = {"model": serve_models.name, "prompt": PROMPT, "max_tokens": 8, "repetition_penalty": 1.0,
            "logprobs": None, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    r = call(server, "POST", "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.text.rstrip().endswith("data: [DONE]")


def test_bad_input_is_a_400_and_takes_no_slot(server, serve_models):
    before = server.services.slots.snapshot()
    r = call(server, "POST", "/v1/completions", {"model": serve_models.name, "prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
    after = server.services.slots.snapshot()
    assert after.live == before.live == ()
    assert after.free == after.capacity
    assert call(server, "GET", "/health").json() == {"status": "ok"}


def test_metrics_count_speculation_under_vllm_names(server, serve_models):
    """GET /metrics: what vLLM's `bench serve` reads to report acceptance length, equal to the responses' sums."""
    before = spec_counters(call(server, "GET", "/metrics").text)
    body = {"model": serve_models.name, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    specs = [call(server, "POST", "/v1/completions", {**body, "prompt": p}).json()["speculation"]
             for p in (PROMPT, "To be, or not")]
    expected = {name: sum(s[name] for s in specs) for name in ("drafts", "draft_tokens", "accepted_tokens")}
    expected = {f"num_{name}": n for name, n in expected.items()}
    expected |= {f"per_pos:{pos}": sum(s["accepted_per_position"][pos] for s in specs
                                       if pos < len(s["accepted_per_position"])) for pos in range(4)}
    assert expected["num_drafts"] > 0
    r = wait_for_metrics(server, before, expected)
    assert r.headers["content-type"].startswith("text/plain")
    after = spec_counters(r.text)
    assert {k: after.get(k, 0) - before.get(k, 0) for k in expected} == expected


def wait_for_metrics(server: DSparkServer, before: dict, expected: dict, timeout_s: float = 10) -> httpx.Response:
    """The engine thread adds a step's counters just after it delivers the step's tokens: poll until
    every counter in ``expected`` has grown by at least that much (or ``timeout_s``), then the caller
    checks they grew by exactly that much."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = call(server, "GET", "/metrics")
        now = spec_counters(r.text)
        if all(now.get(k, 0) - before.get(k, 0) >= n for k, n in expected.items()) or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


class FailingTargetServices(LocalServices):
    """The real in-process services; the target's first step raises an error full of internals.
    With ``rebuildable=False`` every rebuild fails too (the target never comes back)."""

    LEAK = "ActorID: 9f3c2a pid=4242 /srv/dspark/secret/worker.py"

    def __init__(self, config, rebuildable: bool = True) -> None:
        super().__init__(config)
        self.rebuildable = rebuildable
        real, fired = self.target.step, []

        def step(batch):
            if not fired:
                fired.append(True)
                raise RuntimeError(f"shard died ({self.LEAK})")
            return real(batch)

        self.target.step = step

    def rebuild_target(self):
        if not self.rebuildable:
            raise RuntimeError(f"cannot place the shards ({self.LEAK})")
        return super().rebuild_target()


def failing_server(serve_models, **kwargs) -> DSparkServer:
    config = AppConfig(model=str(serve_models.target), draft=str(serve_models.draft), tensor_parallel_size=1,
                       capacity=4, max_context=256, target_recovery_timeout_s=1.5)
    return DSparkServer(config, services=lambda cfg, app, replica: FailingTargetServices(cfg.engine_config(),
                                                                                         **kwargs))


def test_a_target_failure_mid_request_is_invisible_to_the_client(server, serve_models):
    """The target fails during a request: the request waits for the rebuilt target and completes
    with exactly the text of an undisturbed run; /stats counts the recovery."""
    body = {"model": serve_models.name, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    expected = call(server, "POST", "/v1/completions", body).json()["choices"][0]["text"]
    srv = failing_server(serve_models)
    try:
        r = call(srv, "POST", "/v1/completions", body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        streamed = call(srv, "POST", "/v1/completions", {**body, "stream": True})
        assert streamed.status_code == 200
        stats = call(srv, "GET", "/stats").json()
        assert stats["target_failures"] == 1 and stats["resumed_after_target_failure"] == 1
    finally:
        srv.shutdown()


def test_a_target_that_never_comes_back_ends_requests_with_a_short_error(serve_models, caplog):
    """Past target_recovery_timeout_s the waiting request ends: a 503 OpenAI error body that says
    what happened and to retry, with no actor id, pid, path or traceback (those go to the log)."""
    srv = failing_server(serve_models, rebuildable=False)
    try:
        body = {"model": serve_models.name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        with caplog.at_level("ERROR"):
            r = call(srv, "POST", "/v1/completions", body)
            s = call(srv, "POST", "/v1/completions", {**body, "stream": True})
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("server_error", "engine_error")
        assert "target failed" in err["message"] and "retry" in err["message"]
        assert s.status_code == 200 and '"code": "engine_error"' in s.text  # the stream's error event
        for text in (r.text, s.text):
            for internal in ("ActorID", "pid=", "/srv/dspark", "Traceback", "RuntimeError"):
                assert internal not in text
        assert FailingTargetServices.LEAK in caplog.text  # the details are in the log
        health = call(srv, "GET", "/health")
        assert health.status_code == 503 and "rebuilt" in health.json()["error"]
    finally:
        srv.shutdown()


def test_request_id_header_is_echoed_and_used(server, serve_models):
    """X-Request-Id: the client's id names the request (response id, header, engine, log lines);
    a malformed one is a 400 that takes no slot; without it the server makes one up."""

    async def go(headers: dict, body: dict) -> httpx.Response:
        transport = httpx.ASGITransport(app=server.build_api())
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/completions", json=body, headers=headers)

    body = {"model": serve_models.name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    r = asyncio.run(go({"X-Request-Id": "trace-42.a:b"}, body))
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42.a:b" and r.json()["id"] == "trace-42.a:b"
    s = asyncio.run(go({"X-Request-Id": "trace-43"}, {**body, "stream": True}))
    assert s.status_code == 200 and s.headers["x-request-id"] == "trace-43" and '"id": "trace-43"' in s.text
    before = server.loop.engine.slots.snapshot().counters.allocations
    bad = asyncio.run(go({"X-Request-Id": "no spaces allowed"}, body))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"
    assert server.loop.engine.slots.snapshot().counters.allocations == before
    plain = asyncio.run(go({}, body))
    assert plain.headers["x-request-id"] == plain.json()["id"] and plain.json()["id"].startswith("cmpl-")


def test_prefix_cache_over_http(server, serve_models):
    """A repeated long prefix is served from the target's prefix cache: usage says how much
    (OpenAI's prompt_tokens_details.cached_tokens), the text is what it is without the cache."""
    system = "SYSTEM: Speak in verse. " * 12
    body = {"model": serve_models.name, "max_tokens": 8, "temperature": 0}
    first = call(server, "POST", "/v1/completions", {**body, "prompt": system + "ROMEO:"}).json()
    again = call(server, "POST", "/v1/completions", {**body, "prompt": system + "JULIET:"}).json()
    alone = call(server, "POST", "/v1/completions", {**body, "prompt": system + "JULIET:", "prefix_cache": False})
    assert alone.status_code == 200, alone.text
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    assert alone.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    assert first["usage"]["prompt_tokens"] > again["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_request_past_its_timeout_ends_with_a_504_and_frees_its_slot(server, serve_models):
    """timeout_s (or the server's request_timeout_s): a request still running then ends; the client
    gets an OpenAI error body (504 request_timeout) or, streaming, the tokens so far and an error
    event; a request beside it is untouched, and no slot is left held."""
    body = {"model": serve_models.name, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    short = {"model": serve_models.name, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    expected = call(server, "POST", "/v1/completions", short).json()["choices"][0]["text"]

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=server.build_api())
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
            return await asyncio.gather(
                c.post("/v1/completions", json={**body, "timeout_s": 0.3}),
                c.post("/v1/completions", json={**body, "timeout_s": 0.3, "stream": True}),
                c.post("/v1/completions", json={**short, "timeout_s": 60}))

    start = time.monotonic()
    plain, streamed, beside = asyncio.run(go())
    assert time.monotonic() - start < 30
    assert plain.status_code == 504, plain.text
    err = plain.json()["error"]
    assert (err["type"], err["code"]) == ("timeout_error", "request_timeout") and "timeout" in err["message"]
    assert streamed.status_code == 200
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert any(e.get("choices") and e["choices"][0]["text"] for e in events), "no tokens before the timeout"
    assert events[-1]["error"]["code"] == "request_timeout"
    assert beside.status_code == 200 and beside.json()["choices"][0]["text"] == expected
    snap = server.services.slots.snapshot()
    assert snap.live == () and snap.free == snap.capacity
    bad = call(server, "POST", "/v1/completions", {**short, "timeout_s": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "timeout_s"
