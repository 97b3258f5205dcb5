"""The replica's own HTTP server (dspark_ray/openai/http.py) over real sockets, with real clients.

``DSparkServer`` with ``http_port`` serves its routes from a uvicorn server
on a thread of its own. Here its engine services are in process
(``LocalServices``), so no cluster is needed; the same server under a real
``serve run`` is exercised by test_serve_app.py and the other served tests
(the shipped YAML serves HTTP this way). Also: replicas sharing one port
(SO_REUSEPORT), a port held by another program, stopping with a stream in
flight, the autoscaling policy that counts what the replicas hold, and the
load board by which replicas sharing a port even out their connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

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
from dspark_ray.engine.outputs import SpecCounts
from dspark_ray.openai import balance
from dspark_ray.openai.balance import LoadBoard
from dspark_ray.serve.config import AppConfig
from dspark_ray.openai.http import APP_HEADER, HTTPAddressInUse, ReplicaHTTP, serving_app
from dspark_ray.serve.server import DSparkServer
from serve_fixtures import serve_models  # noqa: F401 - fixture
from serve_fixtures import spec_counters, wait_for

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


# -- balancing the replicas that share a port (dspark_ray/openai/balance.py) ---------------------------------------


def held_app(release: threading.Event) -> FastAPI:
    """A generation route whose streams stay open until ``release`` is set."""
    api = FastAPI()

    @api.post("/v1/completions")
    async def completions():
        async def gen():
            yield "data: started\n\n"
            while not release.is_set():
                await asyncio.sleep(0.01)
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    @api.get("/who")
    async def who():
        return {"name": "held"}

    return api


def test_a_crowded_replica_asks_its_clients_to_reconnect_and_a_balanced_one_does_not():
    release = threading.Event()
    http = ReplicaHTTP(held_app(release), "127.0.0.1", 0, balance=True)
    peer = LoadBoard(http.port)  # a second replica of the same port, holding nothing yet
    base = f"http://127.0.0.1:{http.port}"
    try:
        with contextlib.ExitStack() as stack:
            clients = [stack.enter_context(httpx.Client(base_url=base, timeout=10)) for _ in range(4)]
            opened = [stack.enter_context(c.stream("POST", "/v1/completions")) for c in clients[:3]]
            # 1 open against the peer's 0 is even; 2 and 3 against 0 are more than one ahead.
            assert [r.headers.get("connection") for r in opened] == [None, "close", "close"]
            assert (http.board.open, http.board.closed, peer.peer_counts()) == (3, 2, {http.board.name: 3})
            assert clients[3].get("/who").headers.get("connection") is None  # other routes neither count nor close
            for _ in range(2):
                peer.enter()  # the peer now holds 2: a fourth stream (4 against 2) is still two ahead
            fourth = stack.enter_context(clients[3].stream("POST", "/v1/completions"))
            assert fourth.headers.get("connection") == "close"
            peer.enter()
            release.set()
            assert all(list(r.iter_lines())[-2:] == ["data: [DONE]", ""] for r in [*opened, fourth])
        # Every response ran to its end and the board counts none open; with the peer at 3, a new
        # stream here (1 open) is not crowded.
        assert http.board.open == 0
        with httpx.Client(base_url=base, timeout=10) as client:
            assert client.post("/v1/completions").headers.get("connection") is None
        assert http.board.closed == 3
    finally:
        release.set()
        peer.close()
        http.stop()
    assert not any(http.board.dir.iterdir())  # both replicas left the board


def test_a_dead_replica_drops_off_the_board():
    board = LoadBoard(1, directory=Path(tempfile.mkdtemp()), refresh_s=0)
    code = ("import sys, time; from pathlib import Path; from dspark_ray.openai.balance import LoadBoard\n"
            f"b = LoadBoard(1, directory=Path({str(board.dir.parent)!r}))\n"
            "[b.enter() for _ in range(5)]\nprint(b.name, flush=True)\ntime.sleep(60)")
    other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        name = other.stdout.readline().strip()
        assert board.peer_counts() == {name: 5}
        for _ in range(2):
            board.enter()
        assert not board.crowded()  # 2 against 5
    finally:
        other.kill()
        other.wait()
    # The kernel dropped the dead replica's lock: the next look removes its file and stops counting it.
    assert board.peer_counts() == {} and not (board.dir / name).exists()
    assert not board.crowded()  # a lone replica never closes
    board.close()
    assert not any(board.dir.iterdir())


def test_the_replica_counts_the_connections_it_closed_in_stats(server, serve_models):
    peer = LoadBoard(server.http.port)  # a second replica of the port, holding nothing
    body = {"model": serve_models.name, "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "stream": True,
            "ignore_eos": True}
    before = httpx.get(f"{url(server)}/stats", timeout=10).json()["rebalanced"]
    try:
        with httpx.Client(timeout=60) as first, httpx.Client(timeout=60) as second:
            with first.stream("POST", f"{url(server)}/v1/completions", json=body) as one, \
                    second.stream("POST", f"{url(server)}/v1/completions", json=body) as two:
                assert (one.headers.get("connection"), two.headers.get("connection")) == (None, "close")
                lines = [[x for x in r.iter_lines() if x.startswith("data: ")] for r in (one, two)]
        texts = ["".join(json.loads(x[6:])["choices"][0]["text"] for x in got[:-1]) for got in lines]
        assert [got[-1] for got in lines] == ["data: [DONE]"] * 2  # the closed one streamed to its end too
        assert texts[0] == texts[1] and json.loads(lines[1][-2][6:])["choices"][0]["finish_reason"] == "length"
    finally:
        peer.close()
    assert httpx.get(f"{url(server)}/stats", timeout=10).json()["rebalanced"] == before + 1


def test_a_peer_reads_speculation_counters_whole_while_they_are_written():
    """A replica publishes its counters after each step; a peer reading at the same moment sees one
    step's counters or the next, never parts of two (the sequence number; balance.py)."""
    board = LoadBoard(1, directory=Path(tempfile.mkdtemp()), refresh_s=0)
    # The writer keeps the counters of 4-token drafts consistent: tokens = 4 * drafts, accepted = the sum
    # over positions; a torn read breaks one of those.
    code = ("import time; from pathlib import Path; from dspark_ray.openai.balance import LoadBoard\n"
            "from dspark_ray.engine.outputs import SpecCounts\n"
            f"b = LoadBoard(1, directory=Path({str(board.dir.parent)!r}))\n"
            "print(b.name, flush=True)\n"
            "for i in range(1, 10**9):\n"
            "    per_pos = [3 * i, 2 * i, i, i // 2]\n"
            "    b.publish_speculation(SpecCounts(i, 4 * i, sum(per_pos), per_pos))\n")
    writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        name = writer.stdout.readline().strip()
        seen = set()
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            t = board.peer_speculation()[name]
            assert (t.draft_tokens, t.accepted_tokens) == (4 * t.drafts, sum(t.accepted_per_position)), t
            assert t.accepted_per_position == [3 * t.drafts, 2 * t.drafts, t.drafts, t.drafts // 2]
            seen.add(t.drafts)
        assert len(seen) > 100  # the reads did overlap the writes
    finally:
        writer.kill()
        writer.wait()
    assert board.peer_speculation() == {}  # a dead replica's counters leave the port's sum
    board.close()


def test_a_peer_leaves_out_a_record_that_does_not_check_and_reads_the_next_whole():
    """A mixed read, as stores seen out of order would leave it (aarch64), fails the record's CRC:
    the peer reads again and, while it stays mixed, leaves that replica out; the next write is read
    whole. A replica that has not drafted yet reads as zeros from the start."""
    directory = Path(tempfile.mkdtemp())
    reader, writer = LoadBoard(1, directory=directory, refresh_s=0), LoadBoard(1, directory=directory)
    try:
        assert reader.peer_speculation() == {writer.name: SpecCounts(0, 0, 0, [])}
        writer.enter()
        writer.publish_speculation(SpecCounts(5, 20, 12, [5, 4, 2, 1]))
        assert reader.peer_counts() == {writer.name: 1}
        assert reader.peer_speculation() == {writer.name: SpecCounts(5, 20, 12, [5, 4, 2, 1])}
        at = balance._SPEC_AT + 8  # draft tokens: one counter of the next step, the others of this one
        writer._mine[at] = 24
        assert reader.peer_speculation() == {}
        writer.publish_speculation(SpecCounts(6, 24, 15, [6, 5, 3, 1]))
        assert reader.peer_speculation() == {writer.name: SpecCounts(6, 24, 15, [6, 5, 3, 1])}
    finally:
        writer.close()
        reader.close()


def test_metrics_on_a_shared_port_count_every_replica_behind_it(serve_models):
    """Two replicas share a port; each new connection reaches either. vLLM's `bench serve` reads GET /metrics
    once before its run and once after, so every answer must count both replicas: equal to the sums of the
    speculation every response reported, whichever replica answered."""
    config = {"model": str(serve_models.target), "draft": str(serve_models.draft), "capacity": 8,
              "max_context": 256}
    first = DSparkServer(AppConfig(**config, http_port=0), services=LocalServices.build)
    second = None
    try:
        second = DSparkServer(AppConfig(**config, http_port=first.http.port), services=LocalServices.build)
        base = url(first)
        before = spec_counters(httpx.get(f"{base}/metrics", timeout=10).text)
        assert before.get("num_drafts", 0) == 0
        body = {"model": serve_models.name, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        specs = []
        for i in range(64):  # each on a new connection, until both replicas have served (2 ** -15 to fail)
            r = httpx.post(f"{base}/v1/completions", json={**body, "prompt": f"{PROMPT} {i}"}, timeout=60)
            specs.append(r.json()["speculation"])
            if len(specs) >= 16 and all(s.loop.metrics.spec_totals().drafts for s in (first, second)):
                break
        assert all(s.loop.metrics.spec_totals().drafts for s in (first, second)), "one replica served all"
        expected = {f"num_{name}": sum(s[name] for s in specs) for name in ("drafts", "draft_tokens",
                                                                            "accepted_tokens")}
        expected |= {f"per_pos:{pos}": sum(s["accepted_per_position"][pos] for s in specs
                                           if pos < len(s["accepted_per_position"])) for pos in range(4)}
        assert expected["num_drafts"] > 0
        # The engine thread adds a step's counters just after it delivers the step's tokens.
        wait_for(lambda: spec_counters(httpx.get(f"{base}/metrics", timeout=10).text) == expected, 10)
        answers = [spec_counters(httpx.get(f"{base}/metrics", timeout=10).text) for _ in range(12)]
        assert answers == [expected] * 12
    finally:
        for srv in (second, first):
            if srv is not None:
                srv.shutdown()
