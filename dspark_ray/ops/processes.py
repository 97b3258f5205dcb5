"""Local ports and process groups: what the benchmarks and the tests use to start and stop servers.

Every server they start listens on 127.0.0.1 and runs in its own session
(``start_new_session=True``), so that stopping it stops everything it spawned.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

LOOPBACK = "127.0.0.1"


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """Whether a server could listen on ``port`` now. Bound as servers bind (``SO_REUSEADDR``: uvicorn,
    vLLM and the replicas' own sockets all set it), so connections a stopped server left in TIME_WAIT
    do not count, and a socket still listening does."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_port_free(port: int, timeout_s: float = 15, host: str = LOOPBACK) -> bool:
    """Poll until ``port`` can be bound again (a stopped server released it); False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not port_is_free(port, host):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def stop_process(proc: subprocess.Popen, grace_s: float = 5) -> None:
    """SIGINT to a process started with ``start_new_session=True`` and its whole group, then SIGKILL."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def stop_serve_run(proc: subprocess.Popen | None, port: int, grace_s: float = 5, wait_port: bool = True) -> None:
    """Tear down a ``serve run`` started against a Ray head this process owns.

    Deletes the applications (``serve.shutdown``, bounded to 60 s so a stuck
    controller cannot hang the teardown), stops ``serve run``, shuts down the
    Ray head (and with it every worker), then waits for the HTTP port (unless
    ``wait_port`` is false: nobody will ask for that port again).
    """
    import ray
    from ray import serve

    def shutdown() -> None:
        try:
            serve.shutdown()
        except Exception as exc:  # noqa: BLE001 - teardown goes on regardless
            print(f"serve.shutdown failed: {exc!r}", file=sys.stderr)

    try:
        if ray.is_initialized():
            t = threading.Thread(target=shutdown, daemon=True)
            t.start()
            t.join(60)
    finally:
        if proc is not None:
            stop_process(proc, grace_s)
        ray.shutdown()
        if wait_port:
            wait_port_free(port)
