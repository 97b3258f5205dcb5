"""Channel: the per-step path between a replica's engine and one worker actor.

Why not a Ray actor call per step: a plain call goes through task
submission, the raylet-free direct-call gRPC path and several thread hops in
both processes, ~1 ms idle and far more when the replica, the proxy, the
draft worker and the shards share a few cores (5-7 ms per call beyond the
worker's own time on the 2-core development box; ~1 ms over a channel). The
workers stay Ray actors
(placed by the replica's placement group, named, restarted, killed by Ray);
only the hot path moves: after start-up the replica opens one persistent
connection to each worker, and each step is one pickled message each way.
vLLM's Ray executor does the same (a persistent loop per worker fed through
shared memory or ZMQ); here it is ``multiprocessing.connection`` over TCP on
the worker node's IP, which works within a box and across boxes alike.

Security: the worker listens only on its node's IP and accepts a
connection only after an HMAC challenge with a per-connection random key that
the replica handed over through Ray (so nobody else can push pickles into a
worker). Keep the cluster network private all the same (runbooks/security.md).

Worker side: ``ChannelServer(handler)`` serves ``handler.<method>(*args)``
on a background thread, one call at a time, replying
``(ok, value, seconds_inside)``; or, given ``attach``, hands the accepted
connection to a thread of the worker's own that serves it (``serve_call``):
the workers' torch thread does, so a step runs where it is read. Client side: ``Channel.call`` or
``send`` + ``receive``; every wait has a deadline. A worker that died shows
up as ``ChannelClosed`` at once (its socket closes); one that hangs as
``ChannelTimeout``. Both are ``ChannelError``: the caller treats them as a
failed worker.

Both ends set TCP_NODELAY (``no_delay``): ``send_bytes`` writes a message
over 16 KiB as two writes (its 4-byte length, then the payload), and with
Nagle's algorithm the payload waited for the peer's delayed ACK of the
length: a DSpark draft's context states (~4 KB a position for the shipped
target) made each such call 10-20 ms slower on one box (one stream through
the Ray workers: 49 -> 101 tok/s once both ends set it), while smaller
messages, sent in one write, never waited.

Both ways a message is plain ``pickle`` bytes (``encode``, ``send_bytes``).
Not ``Connection.send``: that pickles with multiprocessing's ForkingPickler,
in which ``import torch`` registers reductions that send a tensor's storage
as a shared-memory file descriptor for the receiving process to fetch from
the sender's resource sharer, which only a child of the sender may do; the
replica (not the workers' parent) was refused ("digest sent was rejected")
for every reply that held a tensor, so until this was found every sampled
request (its draft probabilities are a tensor) ran without speculation.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import secrets
import socket
import struct
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Client, Connection, Listener, wait

log = logging.getLogger(__name__)

_OK, _ERROR = 0, 1


class ChannelError(RuntimeError):
    """The worker behind a channel is gone or not answering: treat it as failed."""


class ChannelClosed(ChannelError):
    """The connection broke (the worker process died or closed it)."""


class ChannelTimeout(ChannelError):
    """No reply within the deadline (a hung worker, a wedged collective, an unreachable box)."""


class RemoteError(RuntimeError):
    """The worker's method raised; ``remote_traceback`` is its traceback text (logged, not shown to clients)."""

    def __init__(self, message: str, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.remote_traceback = remote_traceback


def new_key() -> bytes:
    return secrets.token_bytes(32)


class ChannelServer:
    """Serves calls to ``handler`` over one connection, on a daemon thread.

    It listens until one client passes the key challenge, stops listening,
    and serves that connection until it closes: on this server's thread
    under a lock of its own, or, with ``attach``, by handing the connection to
    ``attach(conn, handler)`` (a worker's ``TorchThread.attach``: calls from
    several connections and the worker's Ray method calls then run one at a
    time on its torch thread, which reads each step itself). A worker opens
    one server per connection it is asked for.
    """

    def __init__(self, handler: object, host: str, authkey: bytes,
                 attach: Callable[[Connection, object], None] | None = None) -> None:
        self.handler = handler
        self._lock = threading.Lock()
        self._attach = attach
        self._closed = False
        self._listener = Listener((host, 0), authkey=authkey, backlog=4)
        self.address: tuple[str, int] = self._listener.address
        self._thread = threading.Thread(target=self._serve, name="dspark-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except Exception as exc:  # noqa: BLE001 - closed, or a client failed the challenge
                if not self._closed:
                    log.warning("channel: refused a connection: %r", exc)
                continue
            self.close()
            no_delay(conn)
            if self._attach is not None:
                self._attach(conn, self.handler)
                return
            with conn:
                while serve_call(conn, self.handler, self._lock):
                    pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()


def set_socket_option(conn: Connection, level: int, option: int, value: int | bytes) -> None:
    """``setsockopt`` on a connection's own socket."""
    with socket.socket(fileno=conn.fileno()) as sock:  # the same socket, not a copy
        try:
            sock.setsockopt(level, option, value)
        finally:
            sock.detach()  # the Connection still owns the descriptor


def no_delay(conn: Connection) -> None:
    """TCP_NODELAY on a connection's socket (module docstring: a message over 16 KiB is two writes)."""
    set_socket_option(conn, socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def send_timeout(conn: Connection, seconds: float) -> None:
    """SO_SNDTIMEO on a connection's socket: a write blocked that long fails (OSError)."""
    set_socket_option(conn, socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                      struct.pack("ll", int(seconds), int(seconds % 1 * 1e6)))


def serve_call(conn: Connection, handler: object, lock: threading.Lock | None = None) -> bool:
    """Read one call from ``conn``, run ``handler.<method>(*args)``, reply ``(ok, value, seconds)``.

    False once the connection is closed (the caller drops it). ``lock``: held
    around the call, outside the seconds reported.
    """
    try:
        method, args = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return False
    try:
        with lock or contextlib.nullcontext():
            start = time.perf_counter()
            value = getattr(handler, method)(*args)
            reply = (_OK, value, time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - sent to the caller, which decides
        reply = (_ERROR, (f"{type(exc).__name__}: {exc}", traceback.format_exc()), 0.0)
    try:
        conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))  # module docstring: not send()
    except (OSError, pickle.PicklingError) as exc:
        log.warning("channel reply failed: %r", exc)
        return False
    return True


class Channel:
    """The client end: one worker, one call in flight at a time."""

    def __init__(self, address: tuple[str, int], authkey: bytes, name: str) -> None:
        self.name = name
        try:
            self._conn = Client(address, authkey=authkey)
        except (OSError, EOFError) as exc:
            raise ChannelClosed(f"{name}: cannot connect to {address}: {exc}") from exc
        no_delay(self._conn)

    def send_bytes(self, payload: bytes) -> None:
        """Send an already pickled ``(method, args)`` (``encode``): one pickling for many ranks."""
        try:
            self._conn.send_bytes(payload)
        except OSError as exc:
            raise ChannelClosed(f"{self.name}: send failed: {exc}") from exc

    def send(self, method: str, *args) -> None:
        self.send_bytes(encode(method, *args))

    def receive(self, timeout_s: float):
        """The reply to the last send: ``(value, seconds the worker spent)``. Raises ChannelError or RemoteError."""
        try:
            if not self._conn.poll(timeout_s):
                raise ChannelTimeout(f"{self.name}: no reply within {timeout_s:.1f}s")
            tag, value, seconds = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise ChannelClosed(f"{self.name}: connection lost: {exc!r}") from exc
        if tag == _ERROR:
            message, remote_tb = value
            raise RemoteError(f"{self.name}: {message}", remote_tb)
        return value, seconds

    def call(self, method: str, *args, timeout_s: float):
        self.send(method, *args)
        return self.receive(timeout_s)

    def ready(self) -> bool:
        """A reply (or the end of the connection) is waiting to be read."""
        try:
            return self._conn.poll(0)
        except (EOFError, OSError):
            return True

    def fileno(self) -> int:
        """So that ``multiprocessing.connection.wait`` can wait on channels directly."""
        return self._conn.fileno()

    def close(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass


def encode(method: str, *args) -> bytes:
    return pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)


def gather(channels: Sequence[Channel], timeout_s: float) -> list[tuple[object, float]]:
    """Replies from every channel, in order; fails as soon as any one fails (never waits on the rest).

    Under tensor parallelism a dead rank leaves the others blocked in a
    collective; reading whichever reply arrives first means the failure is
    seen at once rather than after the survivors' collective times out.
    """
    deadline = time.monotonic() + timeout_s
    replies: dict[int, tuple[object, float]] = {}
    index = {id(ch): i for i, ch in enumerate(channels)}
    pending = list(channels)
    while pending:
        ready = wait(pending, timeout=max(0.0, deadline - time.monotonic()))  # Channels have fileno()
        if not ready:
            raise ChannelTimeout(f"no reply within {timeout_s:.1f}s from {', '.join(ch.name for ch in pending)}")
        for ch in ready:
            replies[index[id(ch)]] = ch.receive(0)
            pending.remove(ch)
    return [replies[i] for i in range(len(channels))]
