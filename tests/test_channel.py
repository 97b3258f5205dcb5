"""The per-step channel between a replica and its workers (dspark_ray.runtime.channel).

Real sockets and real processes: a worker that raises, hangs, dies, or is
reached with the wrong key.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from dspark_ray.runtime.channel import (
    Channel,
    ChannelClosed,
    ChannelServer,
    ChannelTimeout,
    RemoteError,
    encode,
    gather,
    new_key,
    serve_call,
)


class Handler:
    def __init__(self) -> None:
        self.calls = 0

    def add(self, a: int, b: int) -> int:
        self.calls += 1
        return a + b

    def fail(self) -> None:
        raise ValueError("bad slot 7")

    def sleep(self, seconds: float) -> str:
        time.sleep(seconds)
        return "woke"

    def pid(self) -> int:
        return os.getpid()


@pytest.fixture
def served():
    key = new_key()
    server = ChannelServer(Handler(), "127.0.0.1", key)
    yield server, key
    server.close()


def test_call_returns_the_value_and_the_time_inside(served):
    server, key = served
    ch = Channel(server.address, key, "w")
    value, seconds = ch.call("add", 2, 3, timeout_s=5)
    assert value == 5 and 0 <= seconds < 1
    value, seconds = ch.call("sleep", 0.05, timeout_s=5)
    assert value == "woke" and seconds >= 0.05
    ch.close()


def test_a_remote_exception_is_raised_with_its_message_and_the_worker_keeps_serving(served):
    server, key = served
    ch = Channel(server.address, key, "w")
    with pytest.raises(RemoteError, match="ValueError: bad slot 7") as info:
        ch.call("fail", timeout_s=5)
    assert "Traceback" in info.value.remote_traceback
    assert ch.call("add", 1, 1, timeout_s=5)[0] == 2
    ch.close()


def test_wrong_key_is_refused_and_the_right_client_still_connects(served):
    server, key = served
    with pytest.raises(Exception):  # noqa: B017 - AuthenticationError or a closed connection
        Channel(server.address, new_key(), "intruder").call("add", 1, 2, timeout_s=2)
    ch = Channel(server.address, key, "w")
    assert ch.call("add", 20, 22, timeout_s=5)[0] == 42
    assert server.handler.calls == 1  # the intruder's call never ran
    ch.close()


def test_a_hung_worker_times_out(served):
    server, key = served
    ch = Channel(server.address, key, "w")
    start = time.monotonic()
    with pytest.raises(ChannelTimeout, match="no reply within 0.2s"):
        ch.call("sleep", 2.0, timeout_s=0.2)
    assert time.monotonic() - start < 1.5
    ch.close()


def _worker(key: bytes, queue) -> None:
    server = ChannelServer(Handler(), "127.0.0.1", key)
    queue.put(server.address)
    threading.Event().wait()


def _start_worker(key: bytes):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(key, queue), daemon=True)
    proc.start()
    return proc, queue.get(timeout=60)


def test_a_killed_worker_fails_the_gather_at_once_while_another_hangs():
    """Tensor parallel: one rank dies, the other is stuck (in a collective); the step fails now."""
    key = new_key()
    dying, address = _start_worker(key)
    hung = ChannelServer(Handler(), "127.0.0.1", key)
    try:
        a, b = Channel(address, key, "rank 1"), Channel(hung.address, key, "rank 0")
        assert a.call("pid", timeout_s=5)[0] == dying.pid
        b.send_bytes(encode("sleep", 3.0))
        a.send_bytes(encode("sleep", 3.0))
        time.sleep(0.2)
        os.kill(dying.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(ChannelClosed, match="rank 1"):
            gather([b, a], timeout_s=10)
        assert time.monotonic() - start < 1.5
    finally:
        hung.close()
        dying.kill()


@pytest.mark.parametrize("spin_s", [0.0, 0.05])
def test_the_torch_thread_serves_its_channels_and_jobs_on_one_thread(spin_s):
    """A worker's TorchThread reads its channels' calls itself (no hand-off) and runs Ray's method calls
    in between, all on the one thread; a closed channel is dropped and the rest keep serving."""
    from dspark_ray.runtime.workers import TorchThread

    class Where(Handler):
        def thread(self) -> int:
            return threading.get_ident()

    torch_thread = TorchThread(1, spin_s=spin_s)
    key = new_key()
    handler = Where()
    servers = [ChannelServer(handler, "127.0.0.1", key, attach=torch_thread.attach) for _ in range(2)]
    a, b = (Channel(s.address, key, f"w{i}") for i, s in enumerate(servers))
    assert a.call("add", 2, 3, timeout_s=5)[0] == 5
    ident = a.call("thread", timeout_s=5)[0]
    assert b.call("thread", timeout_s=5)[0] == ident == torch_thread.call(threading.get_ident)
    b.send("sleep", 0.2)  # a job submitted while the call runs waits for it, on the same thread
    time.sleep(0.05)
    start = time.monotonic()
    assert torch_thread.call(threading.get_ident) == ident
    assert time.monotonic() - start >= 0.1 and b.receive(5)[0] == "woke"
    a.close()
    time.sleep(0.1 + spin_s)
    assert b.call("add", 1, 1, timeout_s=5)[0] == 2  # the closed channel went, the other serves on
    with pytest.raises(RemoteError, match="ValueError: bad slot 7"):
        b.call("fail", timeout_s=5)
    assert torch_thread.call(lambda: 7) == 7
    b.close()


_TENSOR_WORKER = """
import sys, time, torch
from dspark_ray.runtime.channel import ChannelServer

class Tensors:
    def probs(self, rows):
        return {"probs": torch.arange(rows * 6, dtype=torch.float32).view(rows, 2, 3), "ids": [[1, 2]] * rows}

    def twice(self, x):
        return x * 2

server = ChannelServer(Tensors(), "127.0.0.1", bytes.fromhex(sys.argv[1]))
print(server.address[1], flush=True)
time.sleep(120)
"""


def test_tensors_cross_between_unrelated_processes():
    """A reply holding tensors (the draft's probabilities) reaches the replica, which is not the worker's
    parent: each message is plain pickle, not multiprocessing's ForkingPickler, in which torch sends a
    storage as a file descriptor only a child of the sender may fetch (every such reply used to fail,
    and every sampled request ran without speculation)."""
    import subprocess
    import sys

    import torch

    key = new_key()
    proc = subprocess.Popen([sys.executable, "-c", _TENSOR_WORKER, key.hex()], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        ch = Channel(("127.0.0.1", port), key, "draft")
        value, _ = ch.call("probs", 4, timeout_s=30)
        assert torch.equal(value["probs"], torch.arange(24, dtype=torch.float32).view(4, 2, 3))
        assert value["ids"] == [[1, 2]] * 4
        x = torch.randn(3, 5)
        doubled, _ = ch.call("twice", x, timeout_s=30)
        assert torch.equal(doubled, x * 2)
    finally:
        proc.kill()


def test_both_ends_send_without_nagle_delay():
    """A message over 16 KiB leaves ``send_bytes`` as two writes (length, then payload); with
    Nagle's algorithm on, the payload waited for the peer's delayed ACK (10-20 ms a DSpark draft
    call). Both ends' sockets have TCP_NODELAY, and a large message crosses intact."""
    import socket

    def nodelay(conn) -> int:
        with socket.socket(fileno=conn.fileno()) as sock:
            try:
                return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            finally:
                sock.detach()

    seen = []

    def attach(conn, handler) -> None:
        seen.append(nodelay(conn))
        threading.Thread(target=lambda: [None for _ in iter(lambda: serve_call(conn, handler), False)],
                         daemon=True).start()

    key = new_key()
    server = ChannelServer(Handler(), "127.0.0.1", key, attach=attach)
    try:
        ch = Channel(server.address, key, "w")
        big = list(range(20_000))  # ~100 KB pickled
        value, _ = ch.call("add", big, [1], timeout_s=5)
        assert value == big + [1]
        assert seen == [1] and nodelay(ch._conn) == 1
        ch.close()
    finally:
        server.close()
