"""ReplicaHTTP: a replica serves its OpenAI routes itself, beside Serve's proxy.

Why: through Serve's proxy every streamed chunk crosses two processes (the
replica's ASGI send is queued, yielded as an item of a Ray streaming call,
deserialised in the proxy and written there). On the 2-core development
box that cost ~1.5 ms of CPU per chunk in a plain Serve app that streams
fixed text (0.85 ms in the proxy, 0.68 ms in the replica), about half a
core at ~300 chunks/s, the same order as the model itself. The same app
served by a uvicorn server inside the replica spent ~0.16 ms per chunk (a
probe at 620 chunks/s; README, Performance). Ray Serve's own answer is its
"direct ingress" (``RAY_SERVE_ENABLE_DIRECT_INGRESS``), a cluster-wide
environment flag that also moves the port; this module does the same for
this application alone, from its config: ``http_host``/``http_port``.

The server runs on a thread of its own with its own event loop (uvloop
where installed), so it never waits for Serve's loops; the engine loop
hands each stream its outputs on whichever loop is waiting for them. The
listening socket is bound with ``SO_REUSEPORT``: the replicas of one node
share the port and the kernel spreads new connections over them, a
restarted replica binds it again at once, and during a redeploy the old
replica stops accepting before it drains. Serve still manages the replicas
(start, health checks, restarts, handles); only the HTTP hop moves.

A response that starts before its request body has been read to the end (a
413 decided from the declared Content-Length, a 401 for a missing API key)
ends with a lingering close (``lingering``): uvicorn would otherwise close
the connection (``Connection: close``) while the client is still sending,
and a socket closed with unread data in its receive buffer is reset, not
shut down, so a client that sends its whole body before it reads (Python's
http.client: urllib, requests) sees a broken pipe instead of the answer.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
import time

import uvicorn

from dspark_ray.openai.balance import CLOSE, LoadBoard, balanced
from dspark_ray.openai.metrics import HTTPMetrics

log = logging.getLogger(__name__)


# The routes whose requests count toward a replica's load (dspark_ray/openai/balance.py).
GENERATION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})

# A lingering close reads and discards at most this much of a refused request's body, for at
# most this long, before it closes the connection (nginx's lingering_time, bounded in bytes too).
LINGER_BYTES = 8 * 2**20
LINGER_S = 2.0

# Every /health answer of a replica names its application, so that a replica about to share a
# port can tell whether the replicas already there are its own (shared_socket's probe).
APP_HEADER = "X-Dspark-App"


class HTTPAddressInUse(RuntimeError):
    """The replica's HTTP address is taken by a process that does not share it, or by the
    replicas of another application."""


def serving_app(host: str, port: int, timeout_s: float = 2.0) -> str | None:
    """The application whose replicas answer ``/health`` on ``host:port``: None if nothing listens,
    "" if something that is no dspark_ray replica does."""
    try:
        conn = socket.create_connection((host, port), timeout=timeout_s)
    except OSError:
        return None
    with conn:
        try:
            conn.sendall(f"GET /health HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 65536:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                head += chunk
        except OSError:
            return ""
    for line in head.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == APP_HEADER.lower():
            return value.strip()
    return ""


def shared_socket(host: str, port: int, app: str | None = None) -> socket.socket:
    """A TCP socket bound to ``host:port`` that the replicas of this node can all bind (SO_REUSEPORT).

    With ``app`` given, a port already served by the replicas of another application (or by
    another program that shares ports) is refused: sharing it would hand each application some
    of the other's connections."""
    if app is not None and port != 0 and (other := serving_app(host, port)) not in (None, app):
        raise HTTPAddressInUse(
            f"http_port {port} on {host} is already served by "
            f"{'application ' + repr(other) if other else 'another program'}; give application {app!r} "
            "an http_port of its own")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise HTTPAddressInUse(
                f"http_port {port} on {host} is in use by a process that does not share it (another server, "
                "or a Serve proxy on the same port: set proxy_location: Disabled or move http_options.port); "
                "free the port or choose another http_port") from exc
        raise HTTPAddressInUse(f"cannot listen on {host}:{port} (http_host/http_port): {exc}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _has_body(scope) -> bool:
    """Whether an HTTP request's headers announce a body (a length other than 0, or chunks)."""
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


def _expects_continue(scope) -> bool:
    return any(name == b"expect" and value.lower() == b"100-continue" for name, value in scope["headers"])


async def _discard_body(receive, max_bytes: int, max_s: float) -> bool:
    """Read and drop the rest of a request body: True if it ended within ``max_bytes`` and ``max_s``."""
    loop = asyncio.get_running_loop()
    deadline, read = loop.time() + max_s, 0
    while read <= max_bytes:
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
            return False
        if message["type"] == "http.disconnect":
            return False
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return True
    return False


def lingering(app, max_bytes: int = LINGER_BYTES, max_s: float = LINGER_S):
    """``app`` (ASGI) with a lingering close after each response that starts before its request
    body was read to the end.

    NOTE: uvicorn (httptools and h11 alike) closes a ``Connection: close`` connection as soon as its
    response ends, and a keep-alive one goes on discarding the body with no time limit. A socket
    closed with unread bytes in its receive buffer sends a reset (RFC 2525, 2.17): the client,
    still sending its body, gets a broken pipe or a reset and loses the response it has not read.
    So such a response gets ``Connection: close`` and its last body message is held back; once the
    app returns, the rest of the request body is read and dropped, up to ``max_bytes`` and
    ``max_s`` (a client that stalls or sends without end is cut off there), and then the held end
    of the response is sent, on which uvicorn closes the connection with nothing left unread. A
    client that sent ``Expect: 100-continue`` and was never asked for its body is closed at once:
    reading now would make uvicorn send its ``100 Continue`` after the final response."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        read_to_end, asked, held = not _has_body(scope), False, False

        async def receive_counted():
            nonlocal read_to_end, asked
            asked = True
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                read_to_end = True
            return message

        async def send_lingering(message):
            nonlocal held
            if message["type"] == "http.response.start" and not read_to_end:
                headers = list(message.get("headers", ()))
                message = {**message, "headers": headers if CLOSE in headers else [*headers, CLOSE]}
                held = True
            elif held and message["type"] == "http.response.body" and not message.get("more_body", False):
                message = {**message, "more_body": True}
            await send(message)

        await app(scope, receive_counted, send_lingering)
        if held:
            if (asked or not _expects_continue(scope)) and not await _discard_body(receive, max_bytes, max_s):
                log.debug("closing %s with its request body unread past the lingering bound", scope.get("path"))
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    return wrapped


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # uvloop is optional; asyncio's loop works, a little slower
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class ReplicaHTTP:
    """Serves ``app`` (an ASGI app) on ``host:port`` from a daemon thread of this process.

    The constructor returns once the server accepts connections; it raises
    ``HTTPAddressInUse`` if the address cannot be had (or, with ``app_name``, is
    served by another application: ``shared_socket``). ``stop`` closes the
    listening socket first (new connections go to the node's other
    replicas), then waits up to ``grace_s`` for open responses to finish.
    With ``balance``, the replicas sharing the port even out their open
    generation requests by asking clients to reconnect (``balance.py``).
    A response sent before its request body was read to the end closes
    its connection with a lingering close (``lingering``).
    """

    def __init__(self, app, host: str, port: int, metrics: HTTPMetrics | None = None,
                 startup_timeout_s: float = 30.0, app_name: str | None = None, balance: bool = False) -> None:
        self.host, self.port = host, port
        self._sock = shared_socket(host, port, app_name)
        self.port = self._sock.getsockname()[1]  # the port asked for, or the one given for 0
        try:
            # The replicas sharing the port publish their speculation counters here (GET /metrics counts
            # the port), and with ``balance`` their open requests too.
            self.board = LoadBoard(self.port)
        except OSError:
            self._sock.close()
            raise
        asgi = balanced(app, self.board, GENERATION_ROUTES) if balance else app
        asgi = lingering(metrics.wrap(asgi) if metrics is not None else asgi)
        self._server = uvicorn.Server(uvicorn.Config(
            asgi, log_config=None, access_log=False, lifespan="off", http="auto", ws="none",
            timeout_keep_alive=30, timeout_graceful_shutdown=None))
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dspark-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not self._server.started:
            if self._failed is not None or not self._thread.is_alive():
                raise RuntimeError(f"the replica's HTTP server on {host}:{port} did not start: {self._failed!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replica's HTTP server on {host}:{port} did not start in {startup_timeout_s}s")
            time.sleep(0.01)
        log.info("serving HTTP on %s:%d from this replica", host, self.port)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        loop = _new_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._server.serve(sockets=[self._sock]))
        except BaseException as exc:  # noqa: BLE001 - reported by the constructor or alive
            self._failed = exc
            log.exception("the replica's HTTP server stopped")
        finally:
            loop.close()

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop accepting, let open responses finish for up to ``grace_s``, then close them (idempotent)."""
        try:
            if not self._thread.is_alive():
                return
            self._server.should_exit = True
            self._thread.join(grace_s)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(5)
            try:
                self._sock.close()
            except OSError:
                pass
        finally:
            self.board.close()
