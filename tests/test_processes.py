"""dspark_ray.ops.processes: whether a port is free, as a server binding it would find it."""

from __future__ import annotations

import socket

import pytest

from dspark_ray.ops.processes import free_port, port_is_free, wait_port_free


def listen(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_a_listening_port_is_taken_and_freed_when_it_closes():
    port = free_port()
    server = listen(port)
    try:
        assert not port_is_free(port)
        assert not wait_port_free(port, timeout_s=0.5)
    finally:
        server.close()
    assert port_is_free(port) and wait_port_free(port, timeout_s=0.5)


def test_connections_a_closed_server_left_in_time_wait_do_not_hold_its_port():
    """The server closes its side first (as a replica cutting a stream does), so the port keeps a
    connection in TIME_WAIT for a minute after the server is gone. A server binding it again
    (SO_REUSEADDR, as uvicorn and the replicas do) can; so the port is free."""
    port = free_port()
    server = listen(port)
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server's side closes first: TIME_WAIT is on the server's port
    client.recv(1)
    client.close()
    server.close()
    with socket.socket() as plain, pytest.raises(OSError):  # the TIME_WAIT is there
        plain.bind(("127.0.0.1", port))
    assert port_is_free(port)
    listen(port).close()
