"""The replica's own HTTP server (dspark_ray/serve/http.py) over real sockets, with real clients.

``DSparkServer`` with ``http_port`` serves its routes from a uvicorn server
on a thread of its own. Here its engine services are in process
(``LocalServices``), so no cluster is needed; the same server under a real
``serve run`` is exercised by test_serve_app.py and the other served tests
(the shipped YAML serves HTTP this way). Also: replicas sharing one port
(SO_REUSEPORT), a port held by another program, stopping with a stream in
flight, and the autoscaling policy that counts what the replicas hold.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from dspark_ray.engine.local import LocalServices
from dspark_ray.serve.autoscaling import ONGOING_METRIC, POLICY_PATH, ongoing_requests_policy, with_policy
from dspark_ray.serve.config import AppConfig
from dspark_ray.serve.http import APP_HEADER, HTTPAddressInUse, ReplicaHTTP, serving_app
from dspark_ray.serve.server import DSparkServer
from serve_fixtures import serve_models  # noqa: F401 - fixture

PROMPT = "ROMEO:\nBut soft, what light"


@pytest.fixture(scope="module")
def server(serve_models):
    config = AppConfig(model=str(serve_models.target), draft=str(serve_models.draft), capacity=8, max_context=256,
                       http_port=0)  # 0: any free port
    srv = DSparkServer(config, services=LocalServices.build)
    yield srv
    srv.shutdown()


def url(server: DSparkServer) -> str:
    return f"http://127.0.0.1:{server.http.port}"


def test_the_replica_serves_completions_itself(server, serve_models):
    assert server.http is not None and server.http.alive
    body = {"model": serve_models.name, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    whole = httpx.post(f"{url(server)}/v1/completions", json=body, headers={"X-Request-Id": "direct-1"}, timeout=60)
    assert whole.status_code == 200, whole.text
    assert whole.headers["x-request-id"] == "direct-1" and whole.json()["id"] == "direct-1"
    assert len(whole.headers.get_list("x-request-id")) == 1
    # The same text streamed through the official client, over the real socket.
    client = openai.OpenAI(base_url=f"{url(server)}/v1", api_key="none")
    pieces = [c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices]
    assert "".join(pieces) == whole.json()["choices"][0]["text"]
    chat = client.chat.completions.create(model=serve_models.name, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "Who art thou?"}])
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens <= 8


def test_errors_over_the_replica_server_are_openai_bodies_and_take_no_slot(server, serve_models):
    bad = httpx.post(f"{url(server)}/v1/completions", timeout=30,
                     json={"model": serve_models.name, "prompt": PROMPT, "max_tokens": 10_000})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    missing = httpx.get(f"{url(server)}/nowhere", timeout=30)
    assert missing.status_code == 404
    assert server.loop.engine.slots.snapshot().live == ()


def test_a_closed_client_ends_its_request_and_frees_its_slot(server, serve_models):
    body = {"model": serve_models.name, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{url(server)}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break  # one token arrived: hang up mid-stream
    deadline = time.monotonic() + 20
    while server.loop.engine.requests or server.loop.engine.slots.snapshot().live:
        assert time.monotonic() < deadline, "the abandoned stream kept its request or slot"
        time.sleep(0.05)
    assert server.loop.engine.counters.finished.get("abort", 0) >= 1


def streaming_app(chunks: int, gap_s: float, name: str) -> FastAPI:
    api = FastAPI()

    @api.get("/who")
    async def who():
        return {"name": name}

    @api.get("/health")
    async def health():
        return JSONResponse({"status": "ok"}, headers={APP_HEADER: name} if name != "foreign" else {})

    @api.get("/stream")
    async def stream():
        async def gen():
            import asyncio

            for i in range(chunks):
                await asyncio.sleep(gap_s)
                yield f"data: {i}\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return api


def test_replicas_share_the_port_and_one_stopping_leaves_the_other_serving():
    a = ReplicaHTTP(streaming_app(1, 0, "a"), "127.0.0.1", 0)
    b = ReplicaHTTP(streaming_app(1, 0, "b"), "127.0.0.1", a.port)
    try:
        seen = set()
        for _ in range(200):  # the kernel spreads new connections over both listeners
            with httpx.Client() as c:  # a new connection each time
                seen.add(c.get(f"http://127.0.0.1:{a.port}/who", timeout=5).json()["name"])
            if seen == {"a", "b"}:
                break
        assert seen == {"a", "b"}
        a.stop()
        assert not a.alive
        for _ in range(20):
            with httpx.Client() as c:
                assert c.get(f"http://127.0.0.1:{b.port}/who", timeout=5).json()["name"] == "b"
    finally:
        a.stop()
        b.stop()


def test_a_port_held_by_another_program_is_a_clear_error():
    with socket.socket() as other:  # no SO_REUSEPORT: it does not share
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(HTTPAddressInUse, match=f"http_port {port} on 127.0.0.1 is in use"):
            ReplicaHTTP(streaming_app(1, 0, "x"), "127.0.0.1", port)


def test_a_port_served_by_another_application_is_refused_and_the_own_app_shares_it():
    a = ReplicaHTTP(streaming_app(1, 0, "app-a"), "127.0.0.1", 0, app_name="app-a")
    foreign = ReplicaHTTP(streaming_app(1, 0, "foreign"), "127.0.0.1", 0)  # shares ports, names no app
    try:
        assert serving_app("127.0.0.1", a.port) == "app-a" and serving_app("127.0.0.1", foreign.port) == ""
        with pytest.raises(HTTPAddressInUse, match=f"http_port {a.port} on 127.0.0.1 is already served by "
                                                   "application 'app-a'; give application 'app-b'"):
            ReplicaHTTP(streaming_app(1, 0, "app-b"), "127.0.0.1", a.port, app_name="app-b")
        with pytest.raises(HTTPAddressInUse, match="already served by another program"):
            ReplicaHTTP(streaming_app(1, 0, "app-b"), "127.0.0.1", foreign.port, app_name="app-b")
        again = ReplicaHTTP(streaming_app(1, 0, "app-a"), "127.0.0.1", a.port, app_name="app-a")
        again.stop()
        assert httpx.get(f"http://127.0.0.1:{a.port}/who", timeout=5).json()["name"] == "app-a"
    finally:
        a.stop()
        foreign.stop()
    assert serving_app("127.0.0.1", a.port) is None  # nothing left listening


def test_the_replica_names_its_application_on_health(server):
    r = httpx.get(f"{url(server)}/health", timeout=10)
    assert r.status_code == 200 and r.headers[APP_HEADER] == server.app_name == "dspark"


def test_stop_refuses_new_connections_and_lets_an_open_stream_finish():
    http = ReplicaHTTP(streaming_app(10, 0.05, "s"), "127.0.0.1", 0)
    got: list[str] = []

    def read() -> None:
        with httpx.stream("GET", f"http://127.0.0.1:{http.port}/stream", timeout=10) as r:
            got.extend(line for line in r.iter_lines() if line.startswith("data: "))

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.15)  # the stream is under way
    http.stop(grace_s=5)
    reader.join(10)
    assert got == [f"data: {i}" for i in range(10)]  # the open response ran to its end
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{http.port}/who", timeout=2)


def autoscaling_context(config: AutoscalingConfig, replicas: int, via_serve: float,
                        held: list[float] | None) -> AutoscalingContext:
    dep = DeploymentID(name="DSparkServer", app_name="dspark")
    ids = [ReplicaID(unique_id=f"r{i}", deployment_id=dep) for i in range(replicas)]
    metrics = None if held is None else {ONGOING_METRIC: dict(zip(ids, held))}
    return AutoscalingContext(
        deployment_id=dep, deployment_name=dep.name, app_name=dep.app_name, current_num_replicas=replicas,
        target_num_replicas=replicas, running_replicas=ids, total_num_requests=via_serve,
        total_queued_requests=0.0, aggregated_metrics=metrics, raw_metrics=None,
        capacity_adjusted_min_replicas=config.min_replicas, capacity_adjusted_max_replicas=config.max_replicas,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None, current_time=time.time(),
        config=config)


def test_autoscaling_counts_the_requests_the_replicas_hold():
    config = AutoscalingConfig(min_replicas=1, max_replicas=4, target_ongoing_requests=16, upscale_delay_s=0,
                               downscale_delay_s=0)
    # Serve sees nothing (the requests came straight to the replicas); the replicas hold 48.
    busy, _ = ongoing_requests_policy(autoscaling_context(config, 1, 0.0, [48.0]))
    idle, _ = ongoing_requests_policy(autoscaling_context(config, 2, 0.0, [0.0, 0.0]))
    unknown, _ = ongoing_requests_policy(autoscaling_context(config, 2, 48.0, None))  # no report yet
    assert (busy, idle, unknown) == (3, 0, 3)  # the raw decision; Serve then clamps to min/max_replicas
    # Serve's own policy on the same figures would see an idle deployment and never scale up.
    assert replica_queue_length_autoscaling_policy(autoscaling_context(config, 1, 0.0, [48.0]))[0] < 1
    # A request queued at a handle (Serve counts it, no replica holds it yet) is not lost.
    queued, _ = ongoing_requests_policy(autoscaling_context(config, 1, 64.0, [10.0]))
    assert queued == 4


def test_the_builder_puts_the_policy_in_and_pins_replicas_to_the_head_node(serve_models):
    from dspark_ray.serve.app import HEAD_NODE_RESOURCE, build_app

    args = dict(model=str(serve_models.target), draft=str(serve_models.draft), http_port=8000,
                autoscaling_config={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 16})
    deployment = build_app(args)._bound_deployment
    assert deployment._deployment_config.autoscaling_config.policy.policy_function == POLICY_PATH
    assert deployment.ray_actor_options["resources"] == {HEAD_NODE_RESOURCE: 0.001}
    proxied = build_app({**args, "http_port": None})._bound_deployment  # Serve's proxy sees the requests
    assert proxied._deployment_config.autoscaling_config.policy.policy_function != POLICY_PATH
    assert "resources" not in proxied.ray_actor_options
    own = {"policy_function": "my.module:policy"}
    assert with_policy({"max_replicas": 2, "policy": own})["policy"] == own


def test_the_replica_reports_what_its_engine_holds(server):
    assert server.record_autoscaling_stats() == {ONGOING_METRIC: 0.0}
