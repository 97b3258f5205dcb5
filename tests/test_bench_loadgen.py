"""bench/loadgen.py against real HTTP servers.

A scripted OpenAI-like server (FastAPI under uvicorn, in a thread) checks the
generator's own logic: closed-loop concurrency is what it says, open-loop
arrivals stop at the duration, latencies match the server's known delays,
errors are counted by status. The last test drives the real dspark Serve app
on the shipped pair (skipped while the pair is being trained).
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from serve_fixtures import serve_models, served  # noqa: F401 - fixtures

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from loadgen import LoadConfig, RemoteTargetRefused, run_load  # noqa: E402

FIRST_TOKEN_S = 0.05  # the scripted server's delay before the first chunk
NEXT_TOKEN_S = 0.01  # and between chunks


class ScriptedServer:
    """/v1/models and streaming /v1/completions; a prompt containing FAIL gets a 503, BREAK a mid-stream error."""

    def __init__(self) -> None:
        self.in_flight = self.max_in_flight = self.received = 0
        self.bodies: list[dict] = []
        app = FastAPI()
        app.get("/v1/models")(self.models)
        app.post("/v1/completions")(self.completions)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)

    def __enter__(self) -> ScriptedServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the scripted server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    async def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    async def completions(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        self.received += 1
        if "FAIL" in body["prompt"]:
            return JSONResponse({"error": {"message": "busy", "type": "server_error", "code": "overloaded"}},
                                status_code=503)
        return StreamingResponse(self._stream(body), media_type="text/event-stream")

    async def _stream(self, body: dict):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            n = body["max_tokens"]
            await asyncio.sleep(FIRST_TOKEN_S)
            for i in range(n):
                if i and "BREAK" in body["prompt"]:
                    yield f"data: {json.dumps({'error': {'message': 'engine failed', 'type': 'server_error'}})}\n\n"
                    break
                chunk = {"id": "c", "object": "text_completion", "created": 0, "model": "scripted",
                         "choices": [{"index": 0, "text": "x", "finish_reason": "length" if i == n - 1 else None}]}
                if i == n - 1:
                    chunk["speculation"] = {"drafts": 2, "accepted_tokens": 3}
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(NEXT_TOKEN_S)
            usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
            last = {"id": "c", "object": "text_completion", "created": 0, "model": "scripted", "choices": [],
                    "usage": usage}
            yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


@pytest.fixture
def server():
    with ScriptedServer() as s:
        yield s


def test_closed_loop_keeps_the_concurrency_and_measures_latencies(server):
    cfg = LoadConfig(base_url=server.url, concurrency=3, requests=9, max_tokens=5, progress=False)
    result = asyncio.run(run_load(cfg, ["a", "b", "c"]))
    s = result.summary
    assert (s.requests, s.completed, s.output_tokens, s.errors) == (9, 9, 45, {})
    assert server.max_in_flight == 3
    assert server.bodies[0]["ignore_eos"] is True and server.bodies[0]["temperature"] == 0.0
    assert server.bodies[0]["stream_options"] == {"include_usage": True}
    assert FIRST_TOKEN_S * 0.9 <= s.ttft_ms_p50 / 1e3 < FIRST_TOKEN_S + 1.0
    assert NEXT_TOKEN_S * 0.9 <= s.itl_ms_p50 / 1e3 < NEXT_TOKEN_S + 1.0
    assert s.mean_acceptance_length == pytest.approx(1 + 3 / 2)
    assert s.tokens_per_s == pytest.approx(45 / s.seconds)


def test_errors_are_counted_by_status_and_the_rest_still_measured(server):
    cfg = LoadConfig(base_url=server.url, concurrency=2, requests=6, max_tokens=3, progress=False)
    result = asyncio.run(run_load(cfg, ["ok", "FAIL", "BREAK"]))
    s = result.summary
    assert s.errors == {"503": 2, "stream_error": 2}
    assert (s.completed, s.output_tokens) == (2, 6)
    assert "busy" in result.error_examples["503"]


def test_open_loop_stops_sending_at_the_duration(server):
    cfg = LoadConfig(base_url=server.url, rate=20.0, requests=1000, duration_s=0.5, max_tokens=2, progress=False)
    start = time.perf_counter()
    result = asyncio.run(run_load(cfg, ["a"]))
    assert 1 <= server.received == result.summary.requests < 40
    assert result.summary.completed == result.summary.requests
    assert time.perf_counter() - start < 5


def test_only_localhost_unless_allowed():
    with pytest.raises(RemoteTargetRefused, match="allow-remote"):
        LoadConfig(base_url="http://10.1.2.3:8000/v1", concurrency=1)
    LoadConfig(base_url="http://10.1.2.3:8000/v1", concurrency=1, allow_remote=True)
    with pytest.raises(ValueError, match="exactly one"):
        LoadConfig(concurrency=2, rate=1.0)


@pytest.mark.ray
@pytest.mark.slow
def test_against_the_real_dspark_serve_app(served):
    """The shipped YAML's `serve run` (shared with the other modules that serve it)."""
    cfg = LoadConfig(base_url=f"{served.base_url}/v1", concurrency=2, requests=4, max_tokens=8, progress=False)
    s = asyncio.run(run_load(cfg)).summary
    assert (s.completed, s.output_tokens, s.errors) == (4, 32, {})
    assert s.ttft_ms_p50 > 0 and s.itl_ms_p50 > 0
    assert s.mean_acceptance_length is not None and 1.0 <= s.mean_acceptance_length <= 5.0
