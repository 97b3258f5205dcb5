"""Connection balancing between the replicas that share one HTTP port on a machine.

NOTE: why. The replicas of a node share their listening port (SO_REUSEPORT,
``dspark_ray/openai/http.py``) and the kernel deals each new connection to one
of them by a hash of its addresses. Clients keep their connections alive
(vLLM's benchmark client, the openai client, httpx and aiohttp pools), so a
replica keeps every later request of each connection it was dealt. With 8
connections over 2 replicas, one replica is dealt 5 or more of them 73% of
the time (binomial), and its streams run slower for the whole run while the
other replica idles: a served run at concurrency 8 had one replica finish 86
requests and the other 42 (bench/HISTORY.md, sixteenth session).

How: each replica publishes its count of open completion requests in a file of
its own under a directory per port (``board_dir``), which it holds under an
exclusive ``flock`` for its life; its peers read the count through ``mmap``
(no system call per request). A replica that starts a response while it holds
more than one request more than its least loaded live peer answers with
``Connection: close``: the response completes as usual, and the client's next
request opens a new connection, which the kernel deals afresh. Nothing is
refused or moved, a balanced set of replicas closes nothing, and a lone
replica never closes. The kernel drops a dead replica's lock; the next peer
to look removes its file.

The same file carries the replica's speculation counters (``publish_speculation``),
written by its engine thread after each step that drafted, so that ``GET /metrics``
on the shared port counts every replica behind it (``port_speculation``). Without
that a client's two reads of ``/metrics`` (vLLM's ``bench serve`` reads one before
and one after its run, to report acceptance length) could reach two replicas, and
their difference meant nothing: a CI run had the client report no acceptance length
at all. The counters are written under a sequence number (odd while a write is in
progress) and read until two reads of it agree, so a reader never mixes two steps.
The sequence number and the open count are native 8-byte words, each stored and
loaded by one instruction (``_load``, ``_store``): ``struct`` reads a field byte by
byte and zeroes it before it writes it, so a reader could see a sequence number of
0, even, in the middle of a write. That happened once in a CI-sized run: a snapshot
with the first two draft positions of a step and zeros after them. The record also
carries a CRC-32 of the sequence number and the counters, which catches a mixed
read where stores may become visible out of order (aarch64: the DGX Spark).
When a replica dies its counts leave the sum: the port's counters drop, which
Prometheus and rate() treat as a counter reset.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import struct
import tempfile
import threading
import time
import zlib
from pathlib import Path

from dspark_ray.engine.outputs import SpecCounts

log = logging.getLogger(__name__)

CLOSE = (b"connection", b"close")
# At offset 0, a word: open requests. At 8, a word: the sequence number. Then drafts, draft tokens,
# accepted tokens, the number of draft positions counted and the accepted count of each
# (num_speculative_tokens is at most 16), and the CRC-32 of the sequence number and those.
_COUNT_AT = 0
_SEQ_AT = 8
SPEC_POSITIONS = 16
_SPEC = struct.Struct(f"<qqqq{SPEC_POSITIONS}q")
_CHECK = struct.Struct("<Q")
_SPEC_AT = _SEQ_AT + 8
RECORD_SIZE = _SPEC_AT + _SPEC.size + _CHECK.size


def _store(buf, at: int, value: int) -> None:
    """Store the native 8-byte word at ``at`` (8-aligned in a mapping) with one instruction."""
    with memoryview(buf) as whole, whole[at:at + 8] as part, part.cast("q") as word:
        word[0] = value


def _load(buf, at: int) -> int:
    """Load the native 8-byte word at ``at`` with one instruction (``struct`` reads byte by byte)."""
    with memoryview(buf) as whole, whole[at:at + 8] as part, part.cast("q") as word:
        return word[0]


def _check(seq: int, body: bytes) -> bytes:
    return _CHECK.pack(zlib.crc32(body, zlib.crc32(seq.to_bytes(8, "little"))))


def board_dir() -> Path:
    """This machine's directory of load boards (one per user; a subdirectory per port)."""
    return Path(tempfile.gettempdir()) / f"dspark-load-{os.getuid()}"


class LoadBoard:
    """This replica's count of open requests, published to the replicas that share ``port``, and theirs.

    Used from one thread (the replica's HTTP event loop). ``refresh_s``: how often the set of peers
    is looked up again (a new replica is seen, a dead one dropped, within that long)."""

    def __init__(self, port: int, directory: Path | None = None, refresh_s: float = 1.0) -> None:
        self.dir = (directory or board_dir()) / str(port)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.refresh_s = refresh_s
        self.name = f"{os.getpid()}-{secrets.token_hex(4)}"
        # Locked before it gets its name: a peer never sees it unlocked and takes it for dead.
        tmp = self.dir / f".{self.name}.new"
        self._fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.ftruncate(self._fd, RECORD_SIZE)
        self._mine = mmap.mmap(self._fd, RECORD_SIZE)
        self._seq = 0
        self.publish_speculation(SpecCounts(0, 0, 0, []))  # a whole record (with its check) from the start
        os.rename(tmp, self.dir / self.name)
        self.open = 0  # open requests here
        self.closed = 0  # responses that asked the client to reconnect (Connection: close)
        self._peers: dict[str, mmap.mmap] = {}
        self._looked = float("-inf")
        # The peers are read from the HTTP server's thread and, for GET /metrics through Serve's proxy,
        # from Serve's: one at a time.
        self._peers_lock = threading.Lock()

    def enter(self) -> None:
        self.open += 1
        self._publish()

    def leave(self) -> None:
        self.open -= 1
        self._publish()

    def _publish(self) -> None:
        if self._fd >= 0:  # after close (a response cut at shutdown ends late) there is no one to tell
            _store(self._mine, _COUNT_AT, self.open)

    def publish_speculation(self, totals: SpecCounts) -> None:
        """This replica's speculation counters since it started (one writer thread: the engine's)."""
        per_pos = list(totals.accepted_per_position[:SPEC_POSITIONS])
        positions = len(per_pos)
        per_pos += [0] * (SPEC_POSITIONS - positions)
        body = _SPEC.pack(totals.drafts, totals.draft_tokens, totals.accepted_tokens, positions, *per_pos)
        try:
            _store(self._mine, _SEQ_AT, self._seq + 1)  # odd: a write in progress
            self._mine[_SPEC_AT:RECORD_SIZE] = body + _check(self._seq + 2, body)  # one copy, no zeroing
            _store(self._mine, _SEQ_AT, self._seq + 2)
            self._seq += 2
        except ValueError:  # closed (the replica is stopping): there is no one to tell
            pass

    def peer_speculation(self) -> dict[str, SpecCounts]:
        """Every live peer's speculation counters. A peer in the middle of a write is read again; one that
        stays there (it died mid-write) or that publishes none (an older version's shorter file) is left
        out."""
        with self._peers_lock:
            return self._read_speculation() if self._fd >= 0 else {}

    def _read_speculation(self) -> dict[str, SpecCounts]:
        if time.monotonic() - self._looked >= self.refresh_s:
            self._look()
        out = {}
        for name, view in self._peers.items():
            if len(view) < RECORD_SIZE:
                continue
            for _ in range(10_000):  # a replica writes once per step, in a microsecond
                seq = _load(view, _SEQ_AT)
                record = view[_SPEC_AT:RECORD_SIZE]  # one copy
                body = record[:_SPEC.size]
                if seq % 2 == 0 and _load(view, _SEQ_AT) == seq and record[_SPEC.size:] == _check(seq, body):
                    values = _SPEC.unpack(body)
                    out[name] = SpecCounts(*values[:3], list(values[4:4 + min(values[3], SPEC_POSITIONS)]))
                    break
        return out

    def peer_counts(self) -> dict[str, int]:
        """The open-request count of every live peer (not this replica)."""
        with self._peers_lock:
            if time.monotonic() - self._looked >= self.refresh_s:
                self._look()
            return {name: _load(view, _COUNT_AT) for name, view in self._peers.items()}

    def crowded(self) -> bool:
        """This replica holds more than one open request more than its least loaded peer."""
        if self._fd < 0:
            return False
        counts = self.peer_counts()
        return bool(counts) and self.open > min(counts.values()) + 1

    def _look(self) -> None:
        """Map every live peer's file; remove the files of dead ones (no lock held on them)."""
        self._looked = time.monotonic()
        try:
            names = {p.name for p in self.dir.iterdir() if not p.name.startswith(".") and p.name != self.name}
        except OSError:
            names = set()
        for gone in set(self._peers) - names:
            self._peers.pop(gone).close()
        for name in names:
            path = self.dir / name
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:  # removed meanwhile
                self._drop(name)
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # its replica holds it: alive
                    size = os.fstat(fd).st_size
                    if name not in self._peers and size >= _SEQ_AT:
                        self._peers[name] = mmap.mmap(fd, min(size, RECORD_SIZE), access=mmap.ACCESS_READ)
                    continue
                self._drop(name)  # nobody holds it: its replica died
                with contextlib.suppress(OSError):
                    path.unlink()
            finally:
                os.close(fd)

    def _drop(self, name: str) -> None:
        view = self._peers.pop(name, None)
        if view is not None:
            view.close()

    def close(self) -> None:
        """Leave the board (idempotent): peers stop counting this replica."""
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            (self.dir / self.name).unlink()
        with self._peers_lock:
            for view in self._peers.values():
                view.close()
            self._peers.clear()
        self._mine.close()
        os.close(self._fd)
        self._fd = -1


def balanced(app, board: LoadBoard, routes: frozenset[str]):
    """``app`` (ASGI) with the requests to ``routes`` counted on ``board``, and ``Connection: close``
    on a response started while this replica is crowded (``LoadBoard.crowded``)."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "http" or scope.get("path") not in routes:
            return await app(scope, receive, send)

        async def send_balanced(message):
            if message["type"] == "http.response.start" and board.crowded():
                headers = list(message.get("headers", ()))
                if CLOSE not in headers:
                    message = {**message, "headers": [*headers, CLOSE]}
                board.closed += 1
            await send(message)

        board.enter()
        try:
            await app(scope, receive, send_balanced)
        finally:
            board.leave()

    return wrapped
