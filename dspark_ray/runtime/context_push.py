"""A DSpark draft's context states, from target rank 0 straight to the draft proposer.

NOTE: why. A DSpark draft builds its context from the target's hidden states
at a few layers (engine/dspark_proposer.py): ``n_taps x hidden`` numbers per
committed position (3 KB for the shipped target in float32; 24 KB for a
4096-wide target with 3 taps in bfloat16, so about 3 MB a step at 32 rows of
4 committed positions). Relayed through the replica they would be pickled by
rank 0, unpickled by the replica, kept there by request, pickled again into
the next proposal and unpickled by the draft worker: the bytes cross the
wire twice, and both (de)serialisations run on the replica's one engine
thread, the thread that also schedules, commits and streams. So rank 0 sends
them itself, one message a step on a connection of its own to the draft
worker (the two share bundle 0 of the placement group, so it stays on the
node), and its reply to the step says only which message held them:
``VerifyResult.context_push = (link, seq)``. The engine hands that marker to
the row's next proposal (``ProposeRow.context_push``), and the draft worker
reads its states out of its ``ContextInbox`` instead of the proposal.

Order without a shared connection: rank 0 sends message ``seq`` before it
replies to the step, and the engine sends a proposal only after it read that
reply, so the message is on its way before the proposal exists. A receiver
thread in the draft worker reads the link all the time (rank 0 never blocks
on a draft that is busy drafting the other half of the batch), and ``take``
waits until it has read up to the ``seq`` its rows name (``wait_s`` at most).

Failures cost acceptance, never output (a row whose ring lacks part of its
window still drafts, dspark_proposer.py):

- the draft worker restarts: rank 0's send fails or its link closes; rank 0
  returns the states in its reply (``VerifyResult.context``, the relay path,
  which the in-process engine always uses) until a new link is up (opened
  without blocking a step, as ``RayDraft`` reopens its channel). A proposal
  naming a link the new worker never issued waits for nothing; what the old
  worker held is gone, as it is for the relay path;
- a message that never comes (a link closed mid-message): the wait ends when
  the link closes, or after ``wait_s``, counted (``ContextInbox.counts``);
- the target is rebuilt: every request is recomputed from position 0 on the
  new rank 0, whose new link resends the states.

``draft_placement: target`` (the proposer inside rank 0): ``LocalLink`` puts
the states into the inbox in the same process; nothing is pickled at all.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import threading
import time
import uuid
from collections.abc import Sequence
from multiprocessing.connection import Client, Connection

import ray

from dspark_ray.engine.interfaces import ContextStates, ProposeRow, VerifyRow
from dspark_ray.runtime.channel import ChannelServer, new_key, no_delay, send_timeout

log = logging.getLogger(__name__)

# (slot, epoch, the states of the positions rank 0 committed for that row this step)
Item = tuple[int, int, ContextStates]


class ContextInbox:
    """The draft side: the context states rank 0 sent, per slot, until the slot's next proposal.

    ``window``: a block reads no further back than this (``dspark_proposer.context_window``), so
    no more is kept per slot. Thread-safe: links are read on their own threads, ``take`` runs on
    the proposer's.
    """

    def __init__(self, window: int | None, wait_s: float = 1.0) -> None:
        self.window, self.wait_s = window, wait_s
        self._cond = threading.Condition()
        self._states: dict[int, tuple[int, ContextStates]] = {}  # slot -> (epoch, states)
        self._issued: set[str] = set()  # links this inbox opened (or was given)
        self._read: dict[str, int] = {}  # link -> the last seq read
        self._closed: set[str] = set()
        self.counts = {"messages": 0, "positions": 0, "waits": 0, "wait_expired": 0}

    def issue(self) -> str:
        """A new link's id (its messages are waited for by the proposals that name it)."""
        link = uuid.uuid4().hex
        with self._cond:
            self._issued.add(link)
        return link

    def put(self, link: str, seq: int, items: Sequence[Item]) -> None:
        """Message ``seq`` of ``link``: keep each row's states (a slot's new epoch replaces the old)."""
        with self._cond:
            for slot, epoch, states in items:
                self.counts["positions"] += len(states)
                held = self._states.get(slot)
                if held is not None and held[0] == epoch:
                    states = held[1].then(states, self.window)
                self._states[slot] = (epoch, states.last(self.window))
            self._read[link] = max(seq, self._read.get(link, 0))
            self.counts["messages"] += 1
            self._cond.notify_all()

    def receive(self, conn: Connection, link: str) -> None:
        """Read ``link``'s messages from ``conn`` until it closes (a link's own thread)."""
        try:
            with conn:
                while True:
                    try:
                        seq, items = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError, pickle.UnpicklingError):  # closed, or cut mid-message
                        return
                    self.put(link, seq, items)
        finally:
            with self._cond:
                self._closed.add(link)
                self._cond.notify_all()

    def listen(self, host: str, authkey: bytes) -> tuple[tuple[str, int], str]:
        """Accept one link on ``host`` (its first client to pass the key challenge): the address to
        connect to and the link's id."""
        link = self.issue()
        server = ChannelServer(self, host, authkey, attach=lambda conn, _: self.receive(conn, link))
        return server.address, link

    def take(self, rows: list[ProposeRow]) -> list[ProposeRow]:
        """``rows`` with each one's states: what the relay brought (``row.context``) followed by what
        its link brought, read up to the message the row names (waiting for it if need be)."""
        self._wait_for(rows)
        out = []
        with self._cond:
            for row in rows:
                held = self._states.pop(row.slot, None)
                if held is None or held[0] != row.epoch:  # nothing, or a former request's (dropped)
                    out.append(row)
                    continue
                states = held[1] if row.context is None else row.context.then(held[1], self.window)
                out.append(dataclasses.replace(row, context=states))
        return out

    def _wait_for(self, rows: list[ProposeRow]) -> None:
        wanted: dict[str, int] = {}
        for row in rows:
            if row.context_push is not None:
                link, seq = row.context_push
                wanted[link] = max(seq, wanted.get(link, 0))
        with self._cond:
            def missing() -> list[str]:
                return [link for link, seq in wanted.items()
                        if link in self._issued and link not in self._closed and self._read.get(link, 0) < seq]

            if not missing():
                return
            self.counts["waits"] += 1
            if not self._cond.wait_for(lambda: not missing(), timeout=self.wait_s):
                self.counts["wait_expired"] += 1
                log.warning("context states of link(s) %s did not arrive within %.1f s; drafting without them",
                            missing(), self.wait_s)


def push_items(rows: Sequence[VerifyRow], context: Sequence[ContextStates | None],
               window: int | None) -> list[Item]:
    """A step's states as a message's items: by slot and epoch, at most ``window`` positions each."""
    return [(row.slot, row.epoch, states.last(window)) for row, states in zip(rows, context) if states is not None]


class LocalLink:
    """Rank 0 and the proposer in one process (``draft_placement: target``): into the inbox directly."""

    def __init__(self, inbox: ContextInbox) -> None:
        self.inbox = inbox
        self.link = inbox.issue()
        self._seq = 0

    def send(self, rows: Sequence[VerifyRow], context: Sequence[ContextStates | None]) -> tuple[str, int] | None:
        self._seq += 1
        self.inbox.put(self.link, self._seq, push_items(rows, context, self.inbox.window))
        return self.link, self._seq


class ContextLink:
    """Rank 0's side: sends each step's states to the draft worker (``DraftWorker.open_context_link``).

    ``send`` returns the ``(link, seq)`` the states went out in, or None when there is no link up
    (then the caller returns them through the replica). The link is opened, and after a failure
    reopened, without blocking a step: the worker's answer is picked up by a later ``send``.
    """

    # A send that cannot complete this long (the worker's process stopped and its socket buffer
    # full) fails, and the link is dropped: a stuck draft must never hold up the target's step.
    SEND_TIMEOUT_S = 2.0

    def __init__(self, draft_worker, window: int | None) -> None:
        self.worker, self.window = draft_worker, window
        self._conn: Connection | None = None
        self._link = ""
        self._seq = 0
        self._key = new_key()
        self._opening = None  # ObjectRef of a pending open_context_link call
        self._retry_at = 0.0

    def open(self, timeout_s: float) -> bool:
        """Open the link now, waiting up to ``timeout_s`` for the worker (at start-up: the first
        steps' states then go directly too). False if it did not answer in time."""
        if self._opening is None:
            self._opening = self.worker.open_context_link.remote(self._key)
        ray.wait([self._opening], timeout=timeout_s)
        return self._connect()

    def send(self, rows: Sequence[VerifyRow], context: Sequence[ContextStates | None]) -> tuple[str, int] | None:
        if self._conn is None and not self._connect():
            return None
        self._seq += 1
        payload = pickle.dumps((self._seq, push_items(rows, context, self.window)), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._conn.send_bytes(payload)
        except OSError as exc:
            log.warning("context link to the draft worker broke (%r); relaying through the replica until it is "
                        "reopened", exc)
            self.close()
            return None
        return self._link, self._seq

    def _connect(self) -> bool:
        if self._opening is None:
            if time.monotonic() < self._retry_at:
                return False
            self._opening = self.worker.open_context_link.remote(self._key)
        ready, _ = ray.wait([self._opening], timeout=0)
        if not ready:
            return False
        opening, self._opening = self._opening, None
        try:
            address, self._link = ray.get(opening)
            self._conn = Client(address, authkey=self._key)
        except (ray.exceptions.RayError, OSError, EOFError) as exc:
            log.warning("draft worker's context link not reachable yet: %r", exc)
            self._retry_at = time.monotonic() + 0.5
            return False
        no_delay(self._conn)
        send_timeout(self._conn, self.SEND_TIMEOUT_S)
        self._seq = 0
        return True

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
        self._conn = None
