"""Issue 9 over real HTTP: overload, untrusted input, a dying server replica, exposure.

The engine- and actor-level faults (draft worker, target shard, slot manager)
are in test_faults.py; this module drives a real ``serve run`` of
deploy/dspark.yaml (serve_fixtures) plus one small second application, with
real clients and no mocks:

- exposure: the shipped YAML binds 127.0.0.1, the running proxy cannot be
  reached on the machine's other address, runbooks/security.md documents
  ``api_key``;
- untrusted input: bodies over ``max_request_bytes`` get 413 (declared or
  chunked), token ids outside the vocabulary get 400, neither takes a slot;
  with ``api_key`` set a missing or wrong bearer token gets 401;
- overload: a few hundred concurrent streaming requests against 4 slots and
  a queue of 4: each one completes (well-formed SSE, the solo run's text) or
  is refused with 429/503 + Retry-After and an OpenAI error body; the
  replica's memory stays bounded; no slot is left and counters balance;
- a server replica is SIGKILLed while its streams hold every slot: the
  clients see an error or a closed stream, Serve starts a new replica, the
  slot manager reclaims the dead owner's leases within ``owner_timeout_s``,
  and the new replica takes all the slots at once.

The small application (``APP``) is shared by the tests in file order; the
replica-kill test runs last because it replaces the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time
from dataclasses import dataclass, field

import httpx
import openai
import pytest
import ray
import yaml
from ray import serve

from conftest import REPO
from dspark_ray.serve.app import build_app
from dspark_ray.ops.processes import free_port
from dspark_ray.slots.manager import SlotManager, start_slot_manager
from dspark_ray.tokenizer import Tokenizer
from serve_fixtures import (  # noqa: F401 - serve_models, served are fixtures
    DEPLOY_YAML,
    ServeReplica,
    ServeRun,
    app_stats,
    serve_models,
    served,
    serve_replicas,
    slot_snapshot,
    wait_for,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP, PREFIX = "dspark-rel", "/rel"
API_KEY = "sk-reliability-test-3f9c1e"
AUTH = {"authorization": f"Bearer {API_KEY}"}
CAPACITY = 4          # slots of APP, all of them in one engine step
MAX_QUEUED = 4        # requests waiting per replica before 503
MAX_CONTEXT = 128
BURST = 240           # concurrent streaming requests in the overload test
BURST_TOKENS = 8
OWNER_TIMEOUT_S = 15.0  # SlotManager's default, which the replicas' slot manager runs with
PROMPTS = ["ROMEO:\nBut soft, what light", "To be, or not"]


# -- fixtures and helpers ------------------------------------------------------------------------


@contextlib.contextmanager
def small_app(served: ServeRun, serve_models, name: str, prefix: str, **extra):
    """A second application beside the shipped one: tensor-parallel 1 with the draft, CAPACITY slots,
    an API key, one replica (whatever the shipped YAML runs) serving HTTP on a port of its own (the
    shipped YAML's way), its model eager (compiling is not what these tests are about, and a start
    takes seconds less); its URL."""
    port = free_port()
    args = dict(served.args, model=str(serve_models.target), draft=str(serve_models.draft),
                tensor_parallel_size=1, num_replicas=1, capacity=CAPACITY, max_num_seqs=CAPACITY,
                max_context=MAX_CONTEXT, api_key=API_KEY, http_port=port, compile_model=False, **extra)
    serve.run(build_app(args), name=name, route_prefix=prefix)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.delete(name)


@pytest.fixture(scope="module")
def app(served: ServeRun, serve_models):
    """The small application with a queue of MAX_QUEUED."""
    with small_app(served, serve_models, APP, PREFIX, max_queued_requests=MAX_QUEUED) as url:
        yield url


def stats(app_name: str) -> dict:
    return serve.get_app_handle(app_name).stats.remote().result(timeout_s=60)


def the_replica(app_name: str) -> ServeReplica:
    found = serve_replicas(app_name)
    assert len(found) == 1, found
    return found[0]


def leftovers_of(owner: str) -> list[str]:
    """Live actors and placement groups named after a replica (its shards, draft worker, group)."""
    from ray._private import state

    actors = [a["Name"] for a in state.actors().values() if a["State"] != "DEAD" and owner in (a["Name"] or "")]
    groups = [g["name"] for g in ray.util.placement_group_table().values()
              if owner in g["name"] and g["state"] != "REMOVED"]
    return actors + groups


def rss_mb(pid: int) -> float:
    """Resident memory of a process on this machine, in MiB (Linux /proc; psutil is no dependency)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def check_error_body(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), err
    if code is not None:
        assert err["code"] == code, err
    return err


def body(model: str, prompt, max_tokens: int, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}


# -- SSE ---------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One streaming request as its client saw it."""

    status: int | None = None          # None: no response at all
    headers: dict = field(default_factory=dict)
    raw: bytes = b""                   # the body of a refusal
    lines: list[str] = field(default_factory=list)
    error: str | None = None           # a transport error or the client's timeout
    first_chunk_at: float | None = None


def data_lines(lines: list[str]) -> list[str]:
    """The ``data:`` payloads of an SSE stream, checking that nothing else is in it."""
    out = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        out.append(line.removeprefix("data: "))
    return out


def completed_text(o: Outcome, max_tokens: int) -> str:
    """The text of a well-formed completed stream (asserts it is one): JSON chunks of one id, one
    finish_reason on the last content chunk, a usage chunk, then ``[DONE]`` last."""
    assert o.status == 200 and o.error is None, o
    data = data_lines(o.lines)
    assert data and data[-1] == "[DONE]" and "[DONE]" not in data[:-1], data[-3:]
    chunks = [json.loads(d) for d in data[:-1]]
    assert all("error" not in ch for ch in chunks), chunks
    assert len({ch["id"] for ch in chunks}) == 1 and all(ch["object"] == "text_completion" for ch in chunks)
    content, usage = chunks[:-1], chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == max_tokens, usage
    assert [ch["choices"][0]["finish_reason"] for ch in content] == [None] * (len(content) - 1) + ["length"]
    return "".join(ch["choices"][0]["text"] for ch in content)


async def stream(c: httpx.AsyncClient, url: str, payload: dict, timeout_s: float,
                 first: asyncio.Event | None = None) -> Outcome:
    """POST a streaming request and read it to the end, within ``timeout_s`` in all."""
    o = Outcome()

    async def run() -> None:
        async with c.stream("POST", url, json=payload, headers=AUTH) as r:
            o.status, o.headers = r.status_code, dict(r.headers)
            if r.status_code != 200:
                o.raw = await r.aread()
                return
            async for line in r.aiter_lines():
                o.lines.append(line)
                if first is not None and line.startswith("data: {") and o.first_chunk_at is None:
                    o.first_chunk_at = time.monotonic()
                    first.set()

    try:
        await asyncio.wait_for(run(), timeout_s)
    except asyncio.TimeoutError:
        o.error = f"timeout: no end after {timeout_s}s"
    except httpx.HTTPError as exc:
        o.error = f"{type(exc).__name__}: {exc}"
    return o


def reference_texts(base_url: str, model: str, max_tokens: int) -> dict[str, str]:
    """Each prompt's text when run alone (non-streamed, greedy)."""
    out = {}
    with httpx.Client(base_url=base_url, timeout=120, headers=AUTH) as c:
        for p in PROMPTS:
            r = c.post("/v1/completions", json=body(model, p, max_tokens))
            assert r.status_code == 200, r.text
            out[p] = r.json()["choices"][0]["text"]
    return out


def test_owner_timeout_constant_matches_the_slot_manager_default():
    """The replicas start their slot manager with start_slot_manager's defaults."""
    import inspect

    for fn in (SlotManager.__init__, start_slot_manager):
        assert inspect.signature(fn).parameters["owner_timeout_s"].default == OWNER_TIMEOUT_S, fn


# -- exposure ------------------------------------------------------------------------------------


def test_shipped_yaml_binds_loopback_and_the_runbook_documents_api_key():
    config = yaml.safe_load(DEPLOY_YAML.read_text())
    # The replicas serve HTTP themselves, on loopback; Serve starts no proxy that could listen elsewhere.
    assert config["applications"][0]["args"]["http_host"] == "127.0.0.1", config["applications"][0]["args"]
    assert config["proxy_location"] == "Disabled", config
    security = (REPO / "runbooks" / "security.md").read_text()
    assert "api_key" in security and "Authorization: Bearer" in security and "401" in security
    # ... and which of Ray's ports must never face an untrusted network.
    assert "never face an untrusted network" in security
    for port in ("6379", "8265", "10001", "8080"):
        assert f"| {port} |" in security, port


def non_loopback_address() -> str | None:
    """This machine's address on its default route, if it has one other than loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))  # no packet is sent for a UDP connect
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def test_the_running_server_is_unreachable_off_loopback(served):
    assert httpx.get(f"{served.base_url}/health", timeout=10).status_code == 200
    addr = non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no address besides loopback")
    with socket.socket() as s:
        s.settimeout(3)
        with pytest.raises(OSError):  # refused: nothing listens on that address
            s.connect((addr, served.port))


# -- untrusted input -------------------------------------------------------------------------------


def test_oversized_bodies_get_413_and_take_no_slot(served):
    limit = 1_000_000  # AppConfig.max_request_bytes, which the shipped YAML leaves at its default
    assert "max_request_bytes" not in served.args
    before = slot_snapshot(served.app_name)
    before_finished = app_stats(served)["finished"]
    big = json.dumps(body(served.model, "x " * (limit // 2 + 10), 8)).encode()
    assert len(big) > limit

    def chunked():  # no Content-Length: the server must count while it reads
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    with httpx.Client(base_url=served.base_url, timeout=60) as c:
        for route in ("/v1/completions", "/v1/chat/completions"):
            r = c.post(route, content=big, headers={"content-type": "application/json"})
            check_error_body(r, 413, "request_too_large")
            r = c.post(route, content=chunked(), headers={"content-type": "application/json"})
            assert "content-length" not in r.request.headers
            check_error_body(r, 413, "request_too_large")
        # The boundary: one byte over is refused for its size, the limit itself is read (and
        # then refused as the truncated JSON it is).
        r = c.post("/v1/completions", content=big[:limit + 1], headers={"content-type": "application/json"})
        check_error_body(r, 413, "request_too_large")
        r = c.post("/v1/completions", content=big[:limit], headers={"content-type": "application/json"})
        assert "not valid JSON" in check_error_body(r, 400)["message"]
        # The server still serves.
        ok = c.post("/v1/completions", json=body(served.model, PROMPTS[0], 4))
        assert ok.status_code == 200, ok.text

    after = slot_snapshot(served.app_name)
    assert after.live == ()
    assert after.counters.allocations == before.counters.allocations + 1, "an oversized body took a slot"
    finished = app_stats(served)["finished"]  # summed over the shipped YAML's replicas
    assert sum(finished.values()) == sum(before_finished.values()) + 1, (before_finished, finished)


def test_token_ids_outside_the_vocabulary_get_400_and_take_no_slot(served, serve_models):
    vocab = Tokenizer.from_path(str(serve_models.target)).vocab_size
    before = slot_snapshot(served.app_name)
    cases = {
        "negative": [-1],
        "one past the last id": [vocab],
        "valid ids then one out of range": [11, 12, vocab + 7, 13],
        "2**63": [2**63],
        "far beyond int64": [10**30],
    }
    failures = []
    with httpx.Client(base_url=served.base_url, timeout=60) as c:
        for label, ids in cases.items():
            for streamed in (False, True):
                r = c.post("/v1/completions", json=body(served.model, ids, 4, stream=streamed))
                try:
                    err = check_error_body(r, 400)
                    assert err["param"] == "prompt" and err["type"] == "invalid_request_error", err
                except (AssertionError, KeyError, ValueError) as exc:
                    failures.append(f"{label} (stream={streamed}): {exc}")
        # The boundary on the other side: the last id is a valid prompt.
        r = c.post("/v1/completions", json=body(served.model, [vocab - 1, 11], 4))
        assert r.status_code == 200, r.text
    assert not failures, "\n".join(failures)
    after = slot_snapshot(served.app_name)
    assert after.live == () and after.counters.allocations == before.counters.allocations + 1


def test_api_key_required_on_openai_routes(app, served):
    cmpl = body(served.model, PROMPTS[0], 4)
    wrong = [None, "Bearer wrong-key", f"Bearer {API_KEY}x", f"Bearer {API_KEY[:-1]}", f"Basic {API_KEY}",
             API_KEY, f"bearer {API_KEY}", f"Bearer  {API_KEY}", "Bearer",
             f"Bearer {API_KEY[:-1]}\u00e9".encode("latin-1")]  # a non-ASCII byte: 401, not 500
    with httpx.Client(base_url=app, timeout=60) as c:
        for auth in wrong:
            headers = {} if auth is None else {"authorization": auth}
            for method, route, payload in (("GET", "/v1/models", None), ("POST", "/v1/completions", cmpl),
                                           ("POST", "/v1/chat/completions",
                                            {"model": served.model, "max_tokens": 4,
                                             "messages": [{"role": "user", "content": "hi"}]})):
                r = c.request(method, route, json=payload, headers=headers)
                check_error_body(r, 401, "invalid_api_key")
        # Unauthenticated, an oversized body is refused for the key before it is read.
        r = c.post("/v1/completions", content=b"x" * 2_000_000, headers={"content-type": "application/json"})
        check_error_body(r, 401, "invalid_api_key")
        assert c.get("/health").status_code == 200  # load-balancer checks stay open
        assert c.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == served.model
        r = c.post("/v1/completions", json=cmpl, headers=AUTH)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text

    with openai.OpenAI(base_url=f"{app}/v1", api_key="not-the-key", max_retries=0, timeout=60) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=served.model, prompt="Hi", max_tokens=2)
    with openai.OpenAI(base_url=f"{app}/v1", api_key=API_KEY, max_retries=0, timeout=60) as good:
        chat = good.chat.completions.create(model=served.model, max_tokens=4,
                                            messages=[{"role": "user", "content": "Speak."}])
        assert chat.choices[0].finish_reason in ("length", "stop")
    snap = slot_snapshot(APP)
    assert snap.live == () and snap.counters.allocations == 2, snap.counters  # the two authorised ones


# -- overload --------------------------------------------------------------------------------------


def test_overload_every_stream_completes_or_is_refused_with_retry_after(app, served):
    model = served.model
    refs = reference_texts(app, model, BURST_TOKENS)  # also warms the replica up
    replica = the_replica(APP)
    rss_before = rss_mb(replica.pid)
    snap0, finished0 = slot_snapshot(APP), stats(APP)["finished"]

    async def main() -> tuple[list[Outcome], float]:
        limits = httpx.Limits(max_connections=BURST + 10, max_keepalive_connections=BURST + 10)
        async with httpx.AsyncClient(base_url=app, timeout=httpx.Timeout(60, connect=30), limits=limits) as c:
            start = time.monotonic()
            outs = await asyncio.gather(*(
                stream(c, "/v1/completions",
                       body(model, PROMPTS[i % len(PROMPTS)], BURST_TOKENS, stream=True,
                            stream_options={"include_usage": True}), timeout_s=90)
                for i in range(BURST)))
            return outs, time.monotonic() - start

    outcomes, took = asyncio.run(main())

    completed, refused, bad = 0, {}, []
    for i, o in enumerate(outcomes):
        try:
            if o.status == 200:
                assert completed_text(o, BURST_TOKENS) == refs[PROMPTS[i % len(PROMPTS)]], "text differs from solo"
                completed += 1
                continue
            assert o.error is None, o.error
            assert o.status in (429, 503), o.status
            assert int(o.headers["retry-after"]) >= 1, o.headers
            assert o.headers["content-type"].startswith("application/json"), o.headers
            err = json.loads(o.raw)["error"]
            assert err["message"] and err["type"] == "server_error" and err["code"], err
            refused[(o.status, err["code"])] = refused.get((o.status, err["code"]), 0) + 1
        except (AssertionError, KeyError, ValueError) as exc:
            bad.append(f"request {i}: {exc!r} status={o.status} error={o.error} "
                       f"body={o.raw[:200]!r} last lines={o.lines[-3:]}")
    print(f"\noverload: {BURST} streams in {took:.1f}s: {completed} completed, refused {refused}")
    assert not bad, f"{len(bad)} of {BURST} neither completed nor were refused properly:\n" + "\n".join(bad[:10])
    assert completed >= CAPACITY and sum(refused.values()) > 0, (completed, refused)

    # Nothing left behind: no slot, nothing running or waiting; each completed stream took
    # exactly one slot and was finished by the engine once; no refused one reached it.
    snap = wait_for(lambda: (s := slot_snapshot(APP)).live == () and s, 10)
    assert snap, f"slots still held: {slot_snapshot(APP).live}"
    c, c0 = snap.counters, snap0.counters
    assert c.allocations + c.restored == c.releases and c.stale_releases == 0, c
    assert c.allocations - c0.allocations == completed, (c0, c, completed)
    st = stats(APP)
    assert st["running"] == 0 and st["waiting"] == 0, st
    assert sum(st["finished"].values()) - sum(finished0.values()) == completed, (finished0, st)
    assert set(st["finished"]) <= {"length", "stop"}, st

    rss_after = rss_mb(replica.pid)
    print(f"replica RSS {rss_before:.0f} MB -> {rss_after:.0f} MB")
    assert the_replica(APP) == replica, "the replica was replaced during the burst"
    assert rss_after < rss_before + 200, f"replica RSS grew {rss_before:.0f} -> {rss_after:.0f} MB"


# -- a server replica dies -------------------------------------------------------------------------


HANG_APP, HANG_PREFIX = "dspark-hang", "/hang"


@pytest.fixture(scope="module")
def hang_app(served: ServeRun, serve_models):
    """The small application with a step deadline that is short once measured (1 s floor)."""
    with small_app(served, serve_models, HANG_APP, HANG_PREFIX, step_timeout_floor_s=1.0,
                   step_timeout_factor=10.0) as url:
        yield url


def target_shard_pid(replica: ServeReplica) -> int:
    from ray._private import state

    (pid,) = [a["Pid"] for a in state.actors().values()
              if a["State"] == "ALIVE" and a["Name"] == f"dspark:target:{replica.owner}:rank0"]
    return pid


def test_a_hung_target_shard_is_caught_by_its_step_deadline_and_no_stream_is_lost(hang_app, served):
    """The target shard's process is stopped (SIGSTOP: alive, never answering) while CAPACITY streams
    run: the step deadline fires within seconds, /health names the stall while the target is rebuilt,
    and every stream completes, token for token its solo run's text."""
    model, tokens = served.model, 64
    reference = reference_texts(hang_app, model, tokens)  # also gives the deadline its measured steps
    pid = target_shard_pid(the_replica(HANG_APP))

    async def stall_mid_stream() -> tuple[list[Outcome], float | None, float]:
        async with httpx.AsyncClient(base_url=hang_app, timeout=httpx.Timeout(60, connect=30)) as c:
            firsts = [asyncio.Event() for _ in range(CAPACITY)]
            tasks = [asyncio.create_task(stream(c, "/v1/completions",
                                                body(model, PROMPTS[i % len(PROMPTS)], tokens, stream=True,
                                                     speculative=False, stream_options={"include_usage": True}),
                                                timeout_s=120, first=firsts[i])) for i in range(CAPACITY)]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 60)
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            reported = None
            while reported is None and time.monotonic() - stopped < 60 and not all(t.done() for t in tasks):
                r = await c.get("/health")
                if r.status_code == 503 and "did not answer" in r.json().get("error", ""):
                    reported = time.monotonic() - stopped
                await asyncio.sleep(0.05)
            outs = await asyncio.gather(*tasks)
            return outs, reported, time.monotonic() - stopped

    try:
        outcomes, reported_s, done_s = asyncio.run(stall_mid_stream())
    finally:
        with contextlib.suppress(ProcessLookupError):  # the rebuild SIGKILLs it; never leave it stopped
            os.kill(pid, signal.SIGCONT)
    print(f"\ntarget shard stopped: /health named the stall after {reported_s} s, "
          f"all {CAPACITY} streams done {done_s:.1f} s after the stop")
    assert reported_s is not None and reported_s < 15, "the stall was not caught within its step deadline"
    for i, o in enumerate(outcomes):
        assert completed_text(o, tokens) == reference[PROMPTS[i % len(PROMPTS)]], f"stream {i} differs"
    s = stats(HANG_APP)
    assert s["worker_timeouts"] == {"target": 1} and s["target_failures"] == 1, s
    assert wait_for(lambda: httpx.get(f"{hang_app}/health", timeout=5).status_code == 200, 30)
    assert wait_for(lambda: slot_snapshot(HANG_APP).live == (), 15), slot_snapshot(HANG_APP).live


def test_a_killed_replica_loses_its_streams_cleanly_and_its_leases_are_reclaimed(app, served):
    model = served.model
    old = the_replica(APP)
    assert slot_snapshot(APP).live == ()
    # Long streams, one token a step (no speculation), so that they are mid-stream when it dies.
    long_tokens = MAX_CONTEXT - 24

    async def hold_all_slots(c: httpx.AsyncClient) -> list[asyncio.Task]:
        """CAPACITY streams at once; returns when each has had its first chunk (so holds a slot)."""
        firsts = [asyncio.Event() for _ in range(CAPACITY)]
        tasks = [asyncio.create_task(stream(c, "/v1/completions",
                                            body(model, PROMPTS[i % len(PROMPTS)], long_tokens, stream=True,
                                                 speculative=False, stream_options={"include_usage": True}),
                                            timeout_s=120, first=firsts[i]))
                 for i in range(CAPACITY)]
        deadline = time.monotonic() + 60
        while not all(f.is_set() for f in firsts):
            ended = [t.result() for t in tasks if t.done()]
            assert not ended and time.monotonic() < deadline, f"a stream ended before all began: {ended}"
            await asyncio.sleep(0.01)
        return tasks

    async def kill_mid_stream() -> tuple[list[Outcome], object, float]:
        async with httpx.AsyncClient(base_url=app, timeout=httpx.Timeout(60, connect=30)) as c:
            tasks = await hold_all_slots(c)
            held = await asyncio.to_thread(slot_snapshot, APP)
            os.kill(old.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            outs = await asyncio.gather(*tasks)
            return outs, held, killed_at

    outcomes, held, killed_at = asyncio.run(kill_mid_stream())
    ended_s = time.monotonic() - killed_at
    # Every slot was the killed replica's when it died.
    assert len(held.live) == CAPACITY and {h.lease.owner for h in held.live} == {old.owner}, held.live

    # The clients: an error or a closed stream, promptly; none hangs and none looks complete.
    for o in outcomes:
        assert o.status == 200 and not (o.error or "").startswith("timeout"), o
        data = data_lines(o.lines)
        finished_ok = data and data[-1] == "[DONE]" and not any('"error"' in d for d in data)
        assert not finished_ok, f"a stream of the killed replica ended as if complete: {data[-3:]}"
    print(f"\nreplica killed: client streams ended {ended_s:.1f}s later: {[o.error or 'closed' for o in outcomes]}")
    assert ended_s < 30

    # The slot manager reclaims the dead owner's leases once it has been silent owner_timeout_s.
    def dead_owner_leases() -> list:
        return [h for h in slot_snapshot(APP).live if h.lease.owner == old.owner]

    assert dead_owner_leases(), "the dead replica's leases vanished before the owner timeout"
    assert wait_for(lambda: not dead_owner_leases(), OWNER_TIMEOUT_S + 15, 0.5) is True, \
        f"the dead replica's leases are still held {time.monotonic() - killed_at:.0f}s after it died"
    reclaimed_s = time.monotonic() - killed_at
    print(f"dead owner's {CAPACITY} leases reclaimed {reclaimed_s:.1f}s after the kill")
    assert reclaimed_s >= OWNER_TIMEOUT_S - 2, "reclaimed before the owner timeout (by whom?)"

    # Serve has started a new replica; it takes every slot at once (no capacity lost).
    def new_replica():
        found = [r for r in serve_replicas(APP) if r.name != old.name]
        if not found:
            return None
        try:
            h = httpx.get(f"{app}/health", timeout=5)
        except httpx.HTTPError:
            return None
        return found[0] if h.status_code == 200 else None

    new = wait_for(new_replica, 120, 0.5)
    assert new, f"no new replica of {APP} after the kill: {serve_replicas(APP)}"
    assert new.owner != old.owner
    # Nothing of the dead replica lives on: its target shard, draft worker and placement group
    # went with it (they are owned by it), so their CPUs are free again.
    gone = wait_for(lambda: not leftovers_of(old.owner), 30, 0.5)
    assert gone, f"the dead replica left behind: {leftovers_of(old.owner)}"

    async def refill() -> tuple[list[Outcome], object]:
        async with httpx.AsyncClient(base_url=app, timeout=httpx.Timeout(60, connect=30)) as c:
            tasks = await hold_all_slots(c)
            snap = await asyncio.to_thread(slot_snapshot, APP)
            return await asyncio.gather(*tasks), snap

    outcomes, full = asyncio.run(refill())
    assert len(full.live) == CAPACITY and {h.lease.owner for h in full.live} == {new.owner}, full.live
    for o in outcomes:
        completed_text(o, long_tokens)

    snap = wait_for(lambda: (s := slot_snapshot(APP)).live == () and s, 10)
    assert snap and snap.free == CAPACITY, slot_snapshot(APP)
    c = snap.counters
    assert c.allocations + c.restored == c.releases and c.stale_releases == 0, c
