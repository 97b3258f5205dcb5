"""Issue 47: an oversized request gets its 413 from every client, every time, and holds nothing.

A response that starts before its request body has been read to the end
ends with a lingering close (``dspark_ray.openai.http.lingering``): the rest of
the body is read and dropped, up to ``LINGER_BYTES`` and ``LINGER_S``, and
only then is the connection closed. Without it uvicorn closed a
``Connection: close`` connection (every urllib request) while the client was
still sending, the kernel reset it, and the client saw a broken pipe.

- Over bare uvicorn, both HTTP implementations (httptools, which the replica
  runs, and h11), no cluster: urllib in a loop, a client that stops midway,
  a client that never stops.
- Over a real ``serve run deploy/dspark.yaml`` (serve_fixtures), with real
  clients in loops of ``LOOPS``: urllib, requests, httpx, the official openai
  client and curl, bodies with a declared length and chunked ones; the same
  request under the bound is served; raw sockets that stop midway are closed
  within the bound, and no slot or request is left behind.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
import requests
import uvicorn
from fastapi.responses import JSONResponse

from dspark_ray.openai.http import LINGER_BYTES, LINGER_S, lingering
from serve_fixtures import app_stats, serve_models, served, slot_snapshot  # noqa: F401 - fixtures

LIMIT = 1_000_000  # AppConfig.max_request_bytes, which the shipped YAML leaves at its default
LOOPS = 50
CLOSE_MARGIN_S = 2.0  # scheduling slack on a busy 2-core machine, on top of LINGER_S
PIECE = 65536
JSON = {"content-type": "application/json"}
TOO_LARGE = "413 request_too_large"


def padded(model: str, size: int) -> bytes:
    """A valid completions request of exactly ``size`` bytes (JSON allows trailing blanks)."""
    head = json.dumps({"model": model, "prompt": "ROMEO:\nBut soft", "max_tokens": 4, "temperature": 0,
                       "ignore_eos": True}).encode()
    assert len(head) <= size
    return head + b" " * (size - len(head))


def pieces(data: bytes) -> Iterator[bytes]:
    """``data`` as an iterable: the clients send it chunked, with no Content-Length."""
    for i in range(0, len(data), PIECE):
        yield data[i:i + PIECE]


def outcome(status: int, payload: dict) -> str:
    """'<status> <error code>' of an error body, '<status> <completion tokens>' of a completion."""
    if "error" in payload:
        return f"{status} {payload['error']['code']}"
    return f"{status} {payload['usage']['completion_tokens']} tokens"


def tally(send: Callable[[], str], times: int = LOOPS) -> Counter:
    """What ``times`` calls of ``send`` saw: outcomes, or the exceptions raised (a broken pipe...)."""
    seen: Counter = Counter()
    for _ in range(times):
        try:
            seen[send()] += 1
        except Exception as exc:  # noqa: BLE001 - counted: the assertion shows what the clients saw
            seen[f"{type(exc).__name__}: {exc}"[:120]] += 1
    return seen


# -- the clients ---------------------------------------------------------------------------------


def via_urllib(url: str, data) -> str:
    req = urllib.request.Request(url, data=data, headers=JSON)  # urllib sends Connection: close
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return outcome(r.status, json.load(r))
    except urllib.error.HTTPError as err:
        return outcome(err.code, json.loads(err.read()))


def via_requests(session: requests.Session, url: str, data) -> str:
    r = session.post(url, data=data, headers=JSON, timeout=30)
    return outcome(r.status_code, r.json())


def via_httpx(client: httpx.Client, url: str, data) -> str:
    r = client.post(url, content=data, headers=JSON)
    return outcome(r.status_code, r.json())


def via_openai(client: openai.OpenAI, model: str, prompt: str) -> str:
    try:
        done = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True})
    except openai.APIStatusError as err:
        return f"{err.status_code} {err.code}"
    return f"200 {done.usage.completion_tokens} tokens"


def via_curl(url: str, path: str) -> str:
    """curl sends ``Expect: 100-continue`` with a body this large and waits for the go-ahead."""
    run = subprocess.run(["curl", "-sS", "--max-time", "30", "-H", "content-type: application/json",
                          "--data-binary", f"@{path}", "-w", "\n%{http_code}", url],
                         check=False, capture_output=True, text=True, timeout=60)
    if run.returncode != 0:
        raise RuntimeError(f"curl exited {run.returncode}: {run.stderr.strip()}")
    text, _, status = run.stdout.rpartition("\n")
    return outcome(int(status), json.loads(text))


# -- raw sockets: clients that stop midway or never stop ------------------------------------------


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response with a Content-Length: (status, headers, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers["content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed in the middle of the response body"
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:length]


def seconds_to_close(sock: socket.socket, timeout_s: float) -> float | None:
    """How long until the server closes (or resets) ``sock``; None if it still holds it after ``timeout_s``."""
    start = time.monotonic()
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return None
    return time.monotonic() - start


def stalled(host: str, port: int, head: bytes, sent: bytes) -> tuple[int, dict, bytes, float | None]:
    """Send ``head`` and part of a body, then stop (the socket stays open): the response, and how long
    after the last byte the server closed the connection."""
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(head + sent)
        last_byte = time.monotonic()
        status, headers, body = read_response(sock)
        waited = seconds_to_close(sock, LINGER_S + 10)
        return status, headers, body, None if waited is None else time.monotonic() - last_byte


def endless_chunks(host: str, port: int, path: str) -> tuple[int, bytes, float | None, int]:
    """A chunked body that never ends, sent while the response is read: (status, body, seconds from the
    response to the close, bytes sent)."""
    sock = socket.create_connection((host, port), timeout=30)
    sent = [0]

    def send_forever() -> None:
        piece = b"%x\r\n%s\r\n" % (PIECE, b" " * PIECE)
        with contextlib.suppress(OSError):
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         "Transfer-Encoding: chunked\r\n\r\n".encode())
            while True:
                sock.sendall(piece)
                sent[0] += PIECE

    sender = threading.Thread(target=send_forever, daemon=True)
    sender.start()
    try:
        status, _, body = read_response(sock)
        answered = time.monotonic()
        waited = seconds_to_close(sock, LINGER_S + 10)
        closed = None if waited is None else time.monotonic() - answered
    finally:
        sock.close()
        sender.join(10)
    return status, body, closed, sent[0]


# -- over bare uvicorn: the lingering close itself, on both HTTP implementations -----------------


async def refusing_app(scope, receive, send) -> None:
    """Refuses a declared length over LIMIT at once, a chunked body once LIMIT is passed; else 200."""
    declared = dict(scope["headers"]).get(b"content-length")
    refusal = JSONResponse({"error": {"code": "request_too_large"}}, status_code=413)
    if declared is not None and int(declared) > LIMIT:
        return await refusal(scope, receive, send)
    read, more = 0, True
    while more:
        message = await receive()
        read += len(message.get("body", b""))
        more = message.get("more_body", False)
        if read > LIMIT:
            return await refusal(scope, receive, send)
    await JSONResponse({"usage": {"completion_tokens": 0}})(scope, receive, send)


@contextlib.contextmanager
def bare_uvicorn(http: str, **linger) -> Iterator[int]:
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(lingering(refusing_app, **linger), http=http, log_config=None,
                                           lifespan="off", ws="none"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_lingering_close_gives_urllib_its_413_every_time(http):
    with bare_uvicorn(http) as port:
        url = f"http://127.0.0.1:{port}/v1/completions"
        big = b"x" * (LIMIT + 100)
        assert tally(lambda: via_urllib(url, big)) == {TOO_LARGE: LOOPS}
        assert tally(lambda: via_urllib(url, pieces(big))) == {TOO_LARGE: LOOPS}
        assert tally(lambda: via_urllib(url, big[:LIMIT]), 5) == {"200 0 tokens": 5}


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_client_that_stops_midway_is_closed_within_the_bound(http):
    with bare_uvicorn(http) as port:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (2 * LIMIT)
        status, headers, body, closed = stalled("127.0.0.1", port, head, b"x" * LIMIT)
        assert status == 413 and headers["connection"] == "close", (status, headers)
        assert json.loads(body)["error"]["code"] == "request_too_large"
        assert closed is not None and closed < LINGER_S + CLOSE_MARGIN_S, closed


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_client_that_never_stops_is_cut_off_at_the_bound(http):
    with bare_uvicorn(http, max_bytes=4 * PIECE, max_s=10.0) as port:  # the byte bound ends it
        status, body, closed, sent = endless_chunks("127.0.0.1", port, "/v1/completions")
        assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
        assert closed is not None and closed < CLOSE_MARGIN_S, closed
        assert sent < LIMIT + 4 * PIECE + 16 * 2**20, sent  # plus what the socket buffers hold
    with bare_uvicorn(http, max_bytes=2**40, max_s=1.0) as port:  # the time bound ends it
        status, body, closed, _ = endless_chunks("127.0.0.1", port, "/v1/completions")
        assert status == 413 and closed is not None and closed < 1.0 + CLOSE_MARGIN_S, closed


# -- over a real `serve run deploy/dspark.yaml` ----------------------------------------------------


# The request (~1 MB) and a larger one: without the lingering close urllib lost ~1 in 5 of
# the first to a broken pipe on this machine, and nearly every one of the second.
OVER_SIZES = {"1.05 MB": LIMIT + 50_000, "4 MB": 4 * LIMIT}


@pytest.fixture(scope="module")
def bodies(served, tmp_path_factory) -> dict[str, bytes]:
    """The same completions request at the bound, one byte over it, and at each of OVER_SIZES."""
    sizes = {"at": LIMIT, "over": LIMIT + 1, **OVER_SIZES}
    return {name: padded(served.model, size) for name, size in sizes.items()}


@contextlib.contextmanager
def no_slot_taken(served) -> Iterator[None]:
    """Asserts that what runs inside allocates no slot, finishes no request and leaves none open."""
    before, stats = slot_snapshot(served.app_name), app_stats(served)
    yield
    after, now = slot_snapshot(served.app_name), app_stats(served)
    assert after.live == () and after.counters.allocations == before.counters.allocations
    assert now["running"] == 0 and now["waiting"] == 0 and now["finished"] == stats["finished"], (stats, now)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("size", OVER_SIZES)
def test_every_client_gets_its_413_every_time(served, bodies, size, tmp_path):
    url = f"{served.base_url}/v1/completions"
    big, prompt = bodies[size], "x " * (OVER_SIZES[size] // 2)
    path = tmp_path / "big.json"
    path.write_bytes(big)
    seen = {}
    with no_slot_taken(served), requests.Session() as session, \
            httpx.Client(timeout=30) as client, \
            openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="none", max_retries=0, timeout=30) as oai:
        seen["urllib"] = tally(lambda: via_urllib(url, big))
        seen["urllib chunked"] = tally(lambda: via_urllib(url, pieces(big)))
        seen["requests"] = tally(lambda: via_requests(session, url, big))
        seen["requests chunked"] = tally(lambda: via_requests(session, url, pieces(big)))
        seen["httpx"] = tally(lambda: via_httpx(client, url, big))
        seen["httpx chunked"] = tally(lambda: via_httpx(client, url, pieces(big)))
        seen["openai"] = tally(lambda: via_openai(oai, served.model, prompt))
        if shutil.which("curl"):
            seen["curl"] = tally(lambda: via_curl(url, str(path)))
    wrong = {name: dict(s) for name, s in seen.items() if s != {TOO_LARGE: LOOPS}}
    assert not wrong, wrong


@pytest.mark.ray
@pytest.mark.slow
def test_the_same_request_under_the_bound_is_served_as_before(served, bodies):
    """At the bound a request is served, one byte over it is refused, and a client whose request was
    refused goes on to be served on its next one (on a new connection: the refusal closed the old)."""
    url = f"{served.base_url}/v1/completions"
    at, over = bodies["at"], bodies["over"]
    served_ok = "200 4 tokens"
    with requests.Session() as session, httpx.Client(timeout=30) as client, \
            openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="none", max_retries=0, timeout=30) as oai:
        sends = {
            "urllib": (lambda: via_urllib(url, at), lambda: via_urllib(url, over)),
            "requests": (lambda: via_requests(session, url, at), lambda: via_requests(session, url, over)),
            "httpx": (lambda: via_httpx(client, url, at), lambda: via_httpx(client, url, over)),
            "httpx chunked": (lambda: via_httpx(client, url, pieces(at)), lambda: via_httpx(client, url, pieces(over))),
            "openai": (lambda: via_openai(oai, served.model, "ROMEO:\nBut soft"),
                       lambda: via_openai(oai, served.model, "x " * (LIMIT // 2 + 10))),
        }
        for name, (under, beyond) in sends.items():
            pair = tally(lambda under=under, beyond=beyond: f"{under()} / {beyond()}", 5)
            assert pair == {f"{served_ok} / {TOO_LARGE}": 5}, (name, pair)
    after = slot_snapshot(served.app_name)
    assert after.live == ()


@pytest.mark.ray
@pytest.mark.slow
def test_a_client_that_stops_midway_holds_no_connection_and_no_slot(served):
    host, port = "127.0.0.1", served.port
    declared = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
               b"Content-Length: %d\r\n\r\n" % (2 * LIMIT)
    chunked = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
              b"Transfer-Encoding: chunked\r\n\r\n"
    over_the_limit = b"".join(b"%x\r\n%s\r\n" % (PIECE, b" " * PIECE) for _ in range(LIMIT // PIECE + 2))
    with no_slot_taken(served):
        for head, sent in ((declared, b" " * LIMIT), (chunked, over_the_limit)):
            status, headers, body, closed = stalled(host, port, head, sent)
            assert status == 413 and headers["connection"] == "close", (status, headers)
            assert json.loads(body)["error"]["code"] == "request_too_large"
            assert closed is not None and closed < LINGER_S + CLOSE_MARGIN_S, closed
        # A chunked body that never ends: answered once it passes the limit, cut off at the bound.
        status, body, closed, sent = endless_chunks(host, port, "/v1/completions")
        assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
        assert closed is not None and closed < LINGER_S + CLOSE_MARGIN_S, closed
        assert sent < LIMIT + LINGER_BYTES + 16 * 2**20, sent
