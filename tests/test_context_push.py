"""The DSpark context link (dspark_ray/runtime/context_push.py) over real sockets, without Ray: what
target rank 0 sends reaches the proposal that names it, waited for when it is still on the way;
what is not coming is not waited for; a slot's states never reach another request's proposal.

The served path end to end (rank 0 and the draft worker as Ray actors, a worker killed and its
link reopened) is in test_dspark_engine.py and test_faults.py.
"""

from __future__ import annotations

import pickle
import threading
import time
from multiprocessing.connection import Client, Listener

import torch

from dspark_ray.engine.interfaces import ContextStates, ProposeRow, SamplingRow, VerifyRow
from dspark_ray.runtime.channel import new_key, send_timeout
from dspark_ray.runtime.context_push import ContextInbox, ContextLink, LocalLink

GREEDY = SamplingRow(temperature=0.0, top_p=1.0, top_k=0, seed=0)
WIDTH = 6  # n_taps * hidden of these made-up states


def states(start: int, n: int) -> ContextStates:
    """Positions start .. start + n - 1, each row filled with its position (so a merge is readable)."""
    return ContextStates(start, torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, WIDTH).clone())


def positions(s: ContextStates | None) -> list[int]:
    return [] if s is None else s.states[:, 0].long().tolist()


def row(slot: int, epoch: int, push=None, context=None) -> ProposeRow:
    return ProposeRow(slot, epoch, 0, (7,), 4, GREEDY, context=context, context_push=push)


def linked(inbox: ContextInbox):
    """A link the inbox listens on, and rank 0's end of it."""
    key = new_key()
    address, link = inbox.listen("127.0.0.1", key)
    return Client(address, authkey=key), link


def test_a_proposal_waits_for_the_message_it_names():
    inbox = ContextInbox(window=None, wait_s=10.0)
    conn, link = linked(inbox)
    conn.send_bytes(pickle.dumps((1, [(3, 1, states(0, 5))])))

    def later() -> None:
        time.sleep(0.3)
        conn.send_bytes(pickle.dumps((2, [(3, 1, states(5, 2)), (4, 1, states(0, 1))])))

    sender = threading.Thread(target=later)
    sender.start()
    begin = time.monotonic()
    out = inbox.take([row(3, 1, (link, 2)), row(4, 1, (link, 2))])
    waited = time.monotonic() - begin
    sender.join()
    assert 0.2 < waited < 5.0
    assert positions(out[0].context) == list(range(7)) and positions(out[1].context) == [0]
    assert inbox.counts == {"messages": 2, "positions": 8, "waits": 1, "wait_expired": 0}
    # Taken once: the next proposal of the slot gets only what came after.
    assert inbox.take([row(3, 1, (link, 2))])[0].context is None
    conn.close()


def test_relayed_states_come_first_and_the_window_bounds_what_is_kept():
    inbox = ContextInbox(window=4)
    link = LocalLink(inbox)
    vrow = VerifyRow(2, 5, 0, (1,), (), GREEDY)
    push = link.send([vrow], [states(3, 3)])  # positions 3..5
    out = inbox.take([row(2, 5, push, context=states(0, 4))])  # 0..3 relayed; the link's 3 wins
    assert positions(out[0].context) == [2, 3, 4, 5]
    link.send([vrow], [states(6, 10)])
    assert positions(inbox.take([row(2, 5)])[0].context) == [12, 13, 14, 15]


def test_a_former_requests_states_never_reach_the_slots_next_request():
    inbox = ContextInbox(window=None)
    link = LocalLink(inbox)
    push = link.send([VerifyRow(1, 7, 0, (1,), (), GREEDY)], [states(0, 9)])  # epoch 7: a request that ended
    out = inbox.take([row(1, 8, push)])  # the slot's next request, epoch 8
    assert out[0].context is None
    push = link.send([VerifyRow(1, 8, 0, (1,), (), GREEDY)], [states(0, 2)])
    assert positions(inbox.take([row(1, 8, push)])[0].context) == [0, 1]


def test_what_is_not_coming_is_not_waited_for():
    inbox = ContextInbox(window=None, wait_s=10.0)
    begin = time.monotonic()
    # A link this inbox never issued (the previous draft worker's, before a restart).
    assert inbox.take([row(1, 1, ("a-former-workers-link", 40))])[0].context is None
    # A link that closed (rank 0 gone) before sending what a proposal names.
    conn, link = linked(inbox)
    conn.send_bytes(pickle.dumps((1, [(2, 1, states(0, 3))])))
    conn.close()
    out = inbox.take([row(2, 1, (link, 2))])
    assert positions(out[0].context) == [0, 1, 2]
    assert time.monotonic() - begin < 5.0
    assert inbox.counts["wait_expired"] == 0


def test_a_message_that_never_comes_ends_the_wait_after_wait_s():
    inbox = ContextInbox(window=None, wait_s=0.3)
    conn, link = linked(inbox)
    begin = time.monotonic()
    out = inbox.take([row(2, 1, (link, 1))])
    assert 0.25 < time.monotonic() - begin < 5.0
    assert out[0].context is None and inbox.counts["wait_expired"] == 1
    conn.close()


def test_a_draft_that_stopped_reading_never_holds_up_rank_0():
    """A draft worker's process stopped (SIGSTOP) reads nothing, and its socket buffer fills: rank
    0's send fails within ContextLink.SEND_TIMEOUT_S and the link is dropped (the states then go
    back through the replica), instead of the target's step blocking."""
    key = new_key()
    listener = Listener(("127.0.0.1", 0), authkey=key)
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept()))  # accepts, never reads
    thread.start()
    link = ContextLink(draft_worker=None, window=None)
    link._conn, link._link = Client(listener.address, authkey=key), "stuck"
    send_timeout(link._conn, 0.3)
    thread.join()
    vrows = [VerifyRow(slot, 1, 0, (1,), (), GREEDY) for slot in range(1, 9)]
    big = [states(0, 2048) for _ in vrows]  # 8 x 48 KB a message
    begin, sent = time.monotonic(), []
    while (pushed := link.send(vrows, big)) is not None and time.monotonic() - begin < 30:
        sent.append(pushed)
    assert pushed is None and link._conn is None  # dropped: the caller relays
    assert len(sent) >= 1 and time.monotonic() - begin < 10
    accepted[0].close()
    listener.close()
