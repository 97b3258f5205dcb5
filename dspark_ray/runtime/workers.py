"""The worker actors of one replica: a ``TargetShard`` per tensor-parallel rank and a ``DraftWorker``.

Each is a plain class that Ray runs as a named actor in the replica's
placement group. Set-up goes through Ray method calls; the per-step path
(``step``, ``release``, ``propose``) goes through a ``Channel`` that the
replica opens with ``open_channel`` (``dspark_ray.runtime.channel`` says why).

All of a worker's torch work, from loading the model to every step, runs on
one thread of its own (``TorchThread``): Ray's method calls are handed to it,
and it reads the steps from its channels itself. Measured on the 2-core
development box with 2 torch threads: the same engine steps run 1.6-1.8x
slower when a second thread drives torch's OpenMP pool in a process whose
other thread already used it; one thread also serialises the calls.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from pathlib import Path

import ray
import torch

from dspark_ray.engine.config import EngineConfig
from dspark_ray.engine.interfaces import Proposal, ProposeRow, TargetStep, VerifyResult
from dspark_ray.model.parallel import CollectiveTimer
from dspark_ray.runtime.channel import ChannelServer, serve_call
from dspark_ray.runtime.cores import CoreClaim, claim_and_bind
from dspark_ray.runtime.context_push import ContextInbox, ContextLink, LocalLink
from dspark_ray.runtime.group import join_group, rendezvous_address
from dspark_ray.runtime.metrics import ShardMetrics
from dspark_ray.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class TorchThread:
    """The one thread that runs a worker's torch calls, one at a time, in arrival order.

    Its calls are the worker's Ray method calls (``run``) and the steps on its
    channels (``attach``): it reads a channel's call and runs it itself, so a
    step costs no hand-off between threads (on the 2-core development box a
    hand-off and the wake-up of a sleeping thread cost each step about a
    millisecond, and the step itself ran slower on a cold core). Between
    calls it waits ``spin_s`` polling (yielding the core to anyone who wants
    it) before it sleeps: a step that comes soon finds it awake. ``idle``,
    when set, is called on the thread whenever no call waits, before it
    polls or sleeps (the draft's ``draft_ahead``), with a function that
    tells it whether a call is waiting (it should then stop soon: the call
    waits for it); it returns whether it did anything.
    """

    def __init__(self, torch_threads: int, name: str = "dspark-torch", spin_s: float = 0.0) -> None:
        self.spin_s = spin_s
        self.idle: Callable[[Callable[[], bool]], bool] | None = None
        self._jobs: collections.deque = collections.deque()
        self._wake_read, self._wake_write = socket.socketpair()  # a job is waiting: one byte
        self._wake_read.setblocking(False)
        self._channels: dict[int, tuple[Connection, object]] = {}  # fileno -> (connection, handler)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        self.call(torch.set_num_threads, torch_threads)

    def run(self, fn: Callable, *args) -> tuple[object, float]:
        """``fn(*args)`` on the torch thread, and the seconds it took there (not counting the wait)."""
        done: Future = Future()
        self._jobs.append((fn, args, done))
        self._wake_write.send(b"\0")
        return done.result()

    def call(self, fn: Callable, *args):
        return self.run(fn, *args)[0]

    def attach(self, conn: Connection, handler: object) -> None:
        """Serve ``conn``'s calls to ``handler`` on the torch thread from now on (until it closes)."""
        self.call(self._channels.__setitem__, conn.fileno(), (conn, handler))

    def _loop(self) -> None:
        while True:
            for ready in self._wait():
                if ready is self._wake_read:
                    self._run_jobs()
                    continue
                conn, handler = self._channels[ready.fileno()]
                if not serve_call(conn, handler):
                    del self._channels[conn.fileno()]
                    conn.close()

    def _wait(self) -> list:
        waiting = [self._wake_read, *(conn for conn, _ in self._channels.values())]
        ready = wait(waiting, timeout=0)
        while not ready and self.idle is not None and self._run_idle(lambda: bool(wait(waiting, timeout=0))):
            ready = wait(waiting, timeout=0)
        deadline = time.perf_counter() + self.spin_s
        while not ready and time.perf_counter() < deadline:
            os.sched_yield()
            ready = wait(waiting, timeout=0)
        return ready or wait(waiting)

    def _run_idle(self, called: Callable[[], bool]) -> bool:
        try:
            return bool(self.idle(called))
        except Exception:  # noqa: BLE001 - idle work is optional; the calls go on without it
            log.exception("idle work failed; turned off")
            self.idle = None
            return False

    def _run_jobs(self) -> None:
        try:
            while self._wake_read.recv(4096):
                pass
        except BlockingIOError:
            pass
        while self._jobs:
            fn, args, done = self._jobs.popleft()
            start = time.perf_counter()
            try:
                value = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                done.set_exception(exc)
            else:
                done.set_result((value, time.perf_counter() - start))


class _ChannelWorker:
    """Opens channels for the replica (one per call of ``open_channel``); owns the torch thread."""

    def __init__(self, torch_threads: int, spin_s: float = 0.0, single_thread_max_rows: int = 0,
                 bind_cores: bool = False) -> None:
        self.torch = TorchThread(torch_threads, spin_s=spin_s)
        self.torch_threads, self.single_thread_max_rows = torch_threads, single_thread_max_rows
        self._threads = torch_threads  # what the torch thread runs on now
        # AppConfig.bind_cores: CPUs of this process's own, its torch thread bound to them (runtime/cores.py)
        # before any parallel region starts OpenMP's threads, which inherit the binding.
        self.cores = claim_and_bind(torch_threads, self.torch.call) if bind_cores else CoreClaim()

    def bound_cores(self) -> tuple[int, ...]:
        """The CPUs this worker claimed (AppConfig.bind_cores); empty: unbound."""
        return self.cores.cores

    def _threads_for(self, rows: int) -> int:
        """On the torch thread, before a step of ``rows`` rows: one torch thread for a step of at most
        ``single_thread_max_rows`` rows, else ``torch_threads`` (AppConfig.single_thread_max_rows).
        Returns the count the step runs on."""
        want = 1 if rows <= self.single_thread_max_rows else self.torch_threads
        if want != self._threads:
            torch.set_num_threads(want)
            self._threads = want
        return want

    def open_channel(self, authkey: bytes) -> tuple[str, int]:
        """Listen for one connection on this node's IP; returns the address to connect to."""
        return ChannelServer(self, ray.util.get_node_ip_address(), authkey, self.torch.attach).address


class TargetShard(_ChannelWorker):
    """Rank ``rank`` of the target: its shard of the weights, its KV pool, its table."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int, torch_threads: int,
                 replica: str = "", spin_s: float = 0.0, single_thread_max_rows: int = 0,
                 bind_cores: bool = False) -> None:
        super().__init__(torch_threads, spin_s, single_thread_max_rows, bind_cores)
        self.config, self.rank, self.world_size = config, rank, world_size
        self.runner = None
        self.proposer = None  # rank 0 with draft_placement "target"
        # Rank 0 with a DSpark draft: where its context states go (runtime/context_push.py); None: back
        # in the step's reply, through the replica.
        self.context_link: ContextLink | LocalLink | None = None
        self.inbox: ContextInbox | None = None  # the proposer's, when this rank holds it
        self.collectives = CollectiveTimer()
        self.metrics = ShardMetrics(Path(config.model).name, replica or "local", rank)

    def address(self) -> tuple[str, int]:
        """The group's rendezvous address (called on rank 0)."""
        return rendezvous_address()

    def setup(self, master_addr: str, master_port: int, with_draft: bool = False,
              context_window: int | None = None) -> int:
        """Join the tensor-parallel group, load this rank's shard; returns KV pool capacity.
        ``with_draft`` (rank 0 only): also hold the draft proposer, served as ``propose`` on a channel
        of its own (``draft_placement: target``, ``dspark_ray.runtime.actors``); ``context_window``
        (a DSpark draft's, sent directly): its context states go straight to it."""
        return self.torch.call(self._setup, master_addr, master_port, with_draft, context_window)

    def send_context_to(self, draft_worker, context_window: int | None, timeout_s: float) -> bool:
        """Rank 0: send a DSpark draft's context states to ``draft_worker`` directly
        (runtime/context_push.py) rather than in the step's reply. True if the link is up now (else
        it is opened by a later step, and meanwhile the states go back in the replies)."""
        if self.rank != 0:
            raise ValueError("only target rank 0 sends the context states")
        link = ContextLink(draft_worker, context_window)
        self.torch.call(setattr, self, "context_link", link)
        return self.torch.call(link.open, timeout_s)

    def _setup(self, master_addr: str, master_port: int, with_draft: bool, context_window: int | None) -> int:
        from dspark_ray.engine.local import make_draft_proposer, make_target_runner
        from dspark_ray.model.parallel import TensorParallel

        cfg = self.config
        tp = None
        if self.world_size > 1:
            join_group(cfg.device, master_addr, master_port, self.rank, self.world_size)
            tp = TensorParallel(self.rank, self.world_size, timer=self.collectives)
        vocab_size = Tokenizer.from_path(cfg.model).vocab_size
        self.runner = make_target_runner(cfg, vocab_size, tp)
        if with_draft:
            if self.rank != 0:
                raise ValueError("only target rank 0 holds the draft proposer")
            # A DSpark draft shares the target's embedding and LM head: this rank's, when it holds them whole.
            self.proposer = make_draft_proposer(cfg, vocab_size, self.runner.model if self.world_size == 1 else None)
            if context_window is not None:
                self.inbox = ContextInbox(context_window)
                self.context_link = LocalLink(self.inbox)
        return self.runner.kv_capacity()

    def propose(self, rows: list[ProposeRow]) -> Proposal:
        """The draft's proposal, when this rank holds the proposer (``setup(with_draft=True)``): a call of
        its own (rows with a grammar), on as many threads as a step of these rows."""
        self._threads_for(len(rows))
        return self._propose(rows)

    def _propose(self, rows: list[ProposeRow]) -> Proposal:
        if self.proposer is None:
            raise RuntimeError("this target shard holds no draft proposer")
        if self.inbox is not None:
            rows = self.inbox.take(rows)
        return self.proposer.propose(rows)

    def step(self, batch: TargetStep) -> tuple[VerifyResult, float]:
        """Verify one step; returns the result and the seconds this rank spent in all-reduces. A step
        with ``propose`` rows (this rank holds the proposer) is drafted here first (``_draft_into``)."""
        start = time.perf_counter()
        self._threads_for(len(batch.rows))
        drafted = None
        if batch.propose is not None:
            batch, drafted = self._draft_into(batch)
        result = self.runner.step(batch)
        if drafted is not None:
            result = dataclasses.replace(result, **drafted)
        if result.context is not None:
            # A DSpark draft's context states (the residual stream, the same on every rank): rank 0's
            # go to the draft, directly where it can (runtime/context_push.py), else in the reply.
            pushed = None if self.rank > 0 or self.context_link is None else \
                self.context_link.send(batch.rows, result.context)
            if self.rank > 0 or pushed is not None:
                result = dataclasses.replace(result, context=None, context_push=pushed)
        collective = self.collectives.take()
        # The target's own time (dspark_target_step_seconds): a proposal in the same call is the draft's.
        self.metrics.observe(time.perf_counter() - start - result.propose_s, collective)
        return result, collective

    def _draft_into(self, batch: TargetStep) -> tuple[TargetStep, dict]:
        """The step with its ``propose`` rows' drafts in the VerifyRows of their slots (and their q in
        ``draft_probs``), and what the result reports of it (VerifyResult.drafts, draft_error,
        propose_s). If the proposer fails the step verifies no drafts: speculation only speeds it up."""
        start = time.perf_counter()
        try:
            proposal = self._propose(batch.propose)  # on the step's threads
        except Exception as exc:  # noqa: BLE001 - reported to the engine, which resends the rows' tokens
            log.warning("the draft proposer failed; this step verifies no drafts: %r", exc)
            return dataclasses.replace(batch, propose=None), {"draft_error": f"{type(exc).__name__}: {exc}"}
        index = {r.slot: i for i, r in enumerate(batch.propose)}
        q = proposal.draft_probs  # [P, K, V] or None
        probs = None if q is None else torch.zeros((len(batch.rows), *q.shape[1:]), dtype=q.dtype, device=q.device)
        rows = []
        for b, row in enumerate(batch.rows):
            i = index.get(row.slot)
            if i is not None:
                row = dataclasses.replace(row, draft_token_ids=tuple(proposal.draft_token_ids[i]))
                if probs is not None:
                    probs[b] = q[i]
            rows.append(row)
        drafted = {"drafts": proposal.draft_token_ids, "propose_s": time.perf_counter() - start}
        return TargetStep(rows, probs, batch.release_slots), drafted

    def release(self, slots: list[int]) -> None:
        self.runner.release(slots)

    def kv_free(self) -> int:
        return self.torch.call(self.runner.kv_free)


class DraftWorker(_ChannelWorker):
    """The draft model, its window cache and kernels."""

    def __init__(self, config: EngineConfig, torch_threads: int, spin_s: float = 0.0,
                 single_thread_max_rows: int = 0, bind_cores: bool = False) -> None:
        from dspark_ray.engine.local import make_draft_proposer

        super().__init__(torch_threads, spin_s, single_thread_max_rows, bind_cores)
        self.proposer = self.torch.call(make_draft_proposer, config, Tokenizer.from_path(config.model).vocab_size)
        if config.draft_ahead and hasattr(self.proposer, "draft_ahead"):  # an independent draft
            self.torch.idle = self.proposer.draft_ahead
        # A DSpark draft: the context states target rank 0 sends here directly (runtime/context_push.py).
        window = getattr(self.proposer, "context_window", None)
        self.inbox = ContextInbox(window) if window is not None else None

    def open_context_link(self, authkey: bytes) -> tuple[tuple[str, int], str]:
        """Listen for target rank 0's context link (``ContextLink``): its address and id."""
        if self.inbox is None:
            raise RuntimeError("this draft worker holds no DSpark draft: it takes no context states")
        return self.inbox.listen(ray.util.get_node_ip_address(), authkey)

    def context_counts(self) -> dict[str, int]:
        """What the context inbox received: messages, positions, waits, wait_expired."""
        return dict(self.inbox.counts) if self.inbox is not None else {}

    def propose(self, rows: list[ProposeRow]) -> Proposal:
        self._threads_for(len(rows))
        if self.inbox is not None:
            rows = self.inbox.take(rows)
        return self.proposer.propose(rows)

    def ahead_counts(self) -> dict[str, int]:
        """What drafting ahead did (engine/draft_proposer.py): drafted, used, dropped."""
        counts = getattr(self.proposer, "ahead_counts", None)
        return self.torch.call(dataclasses.asdict, counts) if counts is not None else {}
