"""The Ray actors behind one server replica, and the engine-side facades over them.

Per replica: one ``TargetShard`` actor per tensor-parallel rank (a
torch.distributed group among them: gloo on CPU, NCCL on CUDA) and one
``DraftWorker`` (or, with ``draft_placement="target"``, the draft proposer
inside rank 0's actor), their per-slot buffers sized for what this replica holds;
per application: the slot manager (``dspark_ray.slots``), whose slots every
replica leases, each lease mapped to a row of the replica's buffers
(``dspark_ray.slots.ReplicaSlots``).
The facades (``RayTarget``, ``RayDraft``, ``RaySlots``) give the engine the
same ``TargetService``/``DraftService``/``SlotService`` methods it uses in
process, so the engine does not know it is distributed. The workers
themselves are in ``workers.py``; per step, the facades talk to them through
``channel.py`` (one persistent connection each), not through Ray calls. What
fails, and how the engine and the front are told, is ``errors.py``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dspark_ray.engine.config import EngineConfig, is_ngram
from dspark_ray.engine.dspark_proposer import context_window
from dspark_ray.engine.interfaces import Proposal, ProposeRow, TargetStep, VerifyResult
from dspark_ray.engine.local import check_draft, uses_dspark
from dspark_ray.model.dspark import DSparkConfig
from dspark_ray.runtime.channel import Channel, ChannelError, ChannelTimeout, encode, gather, new_key
from dspark_ray.runtime.deadline import StepDeadline
from dspark_ray.runtime.errors import (
    DraftUnavailable,
    SlotServiceUnavailable,
    TensorParallelDivergence,
    WorkerTimeout,
)
from dspark_ray.runtime.timeline import StepTimeline
from dspark_ray.runtime.workers import DraftWorker, TargetShard
from dspark_ray.slots import (
    ReplicaSlots,
    SlotLease,
    SlotsExhausted,
    SlotsRecovering,
    SyncResult,
    start_slot_manager,
)
from dspark_ray.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class WorkerTimeouts:
    """Steps a worker let pass their deadline, per worker kind (``stats()``, ``dspark_worker_timeouts``)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._counter = None

    def add(self, worker: str) -> None:
        self.counts[worker] = self.counts.get(worker, 0) + 1
        try:
            if self._counter is None:
                from ray.util.metrics import Counter

                self._counter = Counter("dspark_worker_timeouts", "Per-step calls a worker did not answer "
                                        "within its deadline (then handled as a crash).", tag_keys=("worker",))
            self._counter.inc(tags={"worker": worker})
        except Exception:  # noqa: BLE001 - metrics must not fail the recovery
            log.debug("recording a worker timeout failed", exc_info=True)


def open_channel(actor, name: str, timeout_s: float) -> Channel:
    """Ask ``actor`` to listen (Ray call, once) and connect to it."""
    key = new_key()
    address = ray.get(actor.open_channel.remote(key), timeout=timeout_s)
    return Channel(address, key, name)


class Deferred:
    """A call already sent: ``result()`` waits for its reply (``Pending`` in engine/interfaces.py)."""

    def __init__(self, receive) -> None:
        self._receive = receive

    def result(self):
        return self._receive()


def _replies_pending(channels: list[Channel]) -> bool:
    """True if some reply has not arrived yet, so the wait for it measures the call's wall time.

    (A reply that already waits to be read, as when the engine first read the
    other service's reply, says nothing about transport: its time is not counted.)
    """
    return any(not ch.ready() for ch in channels)


class RayTarget:
    """TargetService over all ranks: each step is sent to every rank's channel at once.

    The step is pickled once and the same bytes go to every rank; replies are
    read as they arrive, and the first failure fails the step.
    """

    def __init__(self, kv_capacity: int, channels: list[Channel], call_timeout_s: float,
                 timeline: StepTimeline | None = None, deadline: StepDeadline | None = None,
                 timeouts: WorkerTimeouts | None = None, drafts: bool = False) -> None:
        """``drafts``: the one rank holds an independent draft's proposer, so a step may carry its
        proposal (``TargetStep.propose``) and the engine needs one call a step, not two."""
        self.channels = channels
        self.drafts = drafts
        self._kv_capacity = kv_capacity
        self.call_timeout_s = call_timeout_s
        self.timeline = timeline
        # A step's deadline follows the steps the shards answered lately (deadline.py); a rebuilt
        # target gets the same one, with its history.
        self.deadline = deadline or StepDeadline(call_timeout_s, floor_s=call_timeout_s)
        self.timeouts = timeouts or WorkerTimeouts()
        self._last_reply = 0.0  # when the last step's replies were read (a step sent before it waited its turn)
        # Positions of DSpark context states that came back through this replica (rank 0 had no link
        # to the draft up, or was told to relay: runtime/context_push.py).
        self.context_relayed = 0

    def kv_capacity(self) -> int:
        return self._kv_capacity

    def step(self, batch: TargetStep) -> VerifyResult:
        return self.step_async(batch).result()

    def step_async(self, batch: TargetStep) -> Deferred:
        """Send the step to every rank now; ``result()`` reads the replies."""
        start = time.perf_counter()
        payload = encode("step", batch)
        for channel in self.channels:
            channel.send_bytes(payload)
        return Deferred(lambda: self._step_result(start))

    def _step_result(self, start: float) -> VerifyResult:
        waited = _replies_pending(self.channels)
        # A step sent while the one before was still running (pipelined steps) starts when that
        # one's replies were read: its deadline and its transport count from then.
        begin = max(start, self._last_reply)
        limit = self.deadline.timeout_s()
        try:
            replies = gather(self.channels, max(0.0, limit - (time.perf_counter() - begin)))
        except ChannelTimeout as exc:
            self.timeouts.add("target")
            raise WorkerTimeout("target", limit) from exc
        self.deadline.observe(max(seconds for _, seconds in replies))
        now = self._last_reply = time.perf_counter()
        results = [result for (result, _), _ in replies]
        # Rank 0 alone returns a DSpark draft's context states, or where it sent them (TargetShard.step);
        # the rest must agree.
        first = dataclasses.replace(results[0], context=None, context_push=None, propose_s=0.0)
        if any(r != first for r in results[1:]):
            raise TensorParallelDivergence(f"ranks disagree on verification: {results}")
        if results[0].context is not None:
            self.context_relayed += sum(len(c) for c in results[0].context if c is not None)
        if self.timeline is not None:
            compute = max(seconds for _, seconds in replies)
            if results[0].propose_s:  # drafted in the same call (TargetStep.propose)
                self.timeline.add("draft.compute", results[0].propose_s)
            self.timeline.add("target.compute", compute - results[0].propose_s)
            self.timeline.add("target.collective", replies[0][0][1])
            if waited:
                self.timeline.add("target.transport", max(0.0, now - begin - compute))
        return results[0]

    def release(self, slots: list[int]) -> None:
        self._call_all(encode("release", slots))

    def _call_all(self, payload: bytes) -> list[tuple[object, float]]:
        for channel in self.channels:
            channel.send_bytes(payload)
        return gather(self.channels, self.call_timeout_s)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


class RayDraft:
    """DraftService over the draft worker's channel.

    When the worker dies (Ray restarts it: ``max_restarts=-1``), ``propose``
    raises ``DraftUnavailable`` at once and keeps raising, without blocking
    the step, until the restarted worker has answered a new ``open_channel``.
    """

    def __init__(self, worker, call_timeout_s: float, timeline: StepTimeline | None = None,
                 deadline: StepDeadline | None = None, timeouts: WorkerTimeouts | None = None,
                 context_window: int | None = None) -> None:
        """``context_window``: a DSpark draft's (``dspark_proposer.context_window``; the engine keeps no
        more of a request's context states than that); None for an independent draft."""
        self.worker = worker
        self.context_window = context_window
        self.call_timeout_s = call_timeout_s
        self.timeline = timeline
        self.deadline = deadline or StepDeadline(call_timeout_s, floor_s=call_timeout_s)
        self.timeouts = timeouts or WorkerTimeouts()
        self._key = new_key()
        self._channel: Channel | None = None
        self._opening = None  # ObjectRef of a pending open_channel call
        self._connect(block=True)

    def propose(self, rows: list[ProposeRow]) -> Proposal:
        return self.propose_async(rows).result()

    def propose_async(self, rows: list[ProposeRow]) -> Deferred:
        """Send the proposal call now; ``result()`` reads the reply."""
        if self._channel is None and not self._connect(block=False):
            raise DraftUnavailable("the draft worker is restarting")
        start = time.perf_counter()
        channel = self._channel
        try:
            channel.send("propose", rows)
        except ChannelError:
            self._drop(channel)
            raise
        return Deferred(lambda: self._proposal(channel, start))

    def _proposal(self, channel: Channel, start: float) -> Proposal:
        waited = _replies_pending([channel])
        limit = self.deadline.timeout_s()
        try:
            proposal, compute = channel.receive(max(0.0, limit - (time.perf_counter() - start)))
        except ChannelTimeout as exc:
            # A hung worker would hang every later call too: Ray restarts it (max_restarts=-1);
            # meanwhile the steps run without drafts. (A draft held by target rank 0, draft_placement
            # "target", goes with that rank: the target's next step fails and the target is rebuilt.)
            self._drop(channel)
            self.timeouts.add("draft")
            log.error("the draft worker did not answer within %.1f s; restarting it", limit)
            ray.kill(self.worker, no_restart=False)
            raise WorkerTimeout("draft", limit) from exc
        except ChannelError:
            self._drop(channel)
            raise
        self.deadline.observe(compute)
        if self.timeline is not None:
            self.timeline.add("draft.compute", compute)
            if waited:
                self.timeline.add("draft.transport", time.perf_counter() - start - compute)
        return proposal

    def _drop(self, channel: Channel) -> None:
        channel.close()
        if self._channel is channel:
            self._channel = None

    def rebind(self, worker) -> None:
        """Propose through ``worker`` from now on (a rebuilt target rank 0 that holds the draft)."""
        if self._channel is not None:
            self._drop(self._channel)
        self.worker, self._opening = worker, None
        self._connect(block=True)

    def _connect(self, block: bool) -> bool:
        """Open the channel; without ``block`` only if the worker already answered. True when open."""
        if self._opening is None:
            self._opening = self.worker.open_channel.remote(self._key)
        ready, _ = ray.wait([self._opening], timeout=self.call_timeout_s if block else 0)
        if not ready:
            return False
        opening, self._opening = self._opening, None
        try:
            address = ray.get(opening)
            self._channel = Channel(address, self._key, "draft worker")
        except (ray.exceptions.RayError, ChannelError) as exc:
            log.warning("draft worker not reachable yet: %r", exc)
            return False
        return True

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()


class RaySlots:
    """SlotService over the application's slot-manager actor.

    A slot manager that is restarting makes admissions wait (up to
    ``timeout_s``) rather than fail; ``SlotsExhausted`` passes through.
    """

    def __init__(self, manager, timeout_s: float) -> None:
        self.manager = manager
        self.timeout_s = timeout_s

    def allocate_many(self, req_ids, owner: str = "") -> list[SlotLease]:
        return self._call("allocate_many", list(req_ids), owner)

    def release_many(self, req_ids_with_epochs) -> list[bool]:
        return self._call("release_many", list(req_ids_with_epochs))

    def release_many_nowait(self, req_ids_with_epochs) -> None:
        """Send the releases and return without waiting for the manager's answer.

        Ray runs one caller's calls to an actor in the order they were sent,
        so this replica's next ``allocate_many`` (or ``sync``) finds these
        slots free. A release that fails (the manager restarting) is logged;
        its slot is reclaimed by the next heartbeat, which no longer reports
        the lease.
        """
        items = list(req_ids_with_epochs)
        try:
            ref = self.manager.release_many.remote(items)
        except Exception:  # noqa: BLE001 - the heartbeat reclaims what was not released
            log.warning("slot release not sent; the next heartbeat frees %d slot(s)", len(items), exc_info=True)
            return
        ref.future().add_done_callback(_log_failed_release)

    def set_draining(self, draining: bool) -> bool:
        return self._call("set_draining", draining)

    def keepalive(self, owner: str) -> None:
        """Tell the manager ``owner`` is alive; sent, not waited for. Safe from any thread."""
        self.manager.touch.remote(owner)

    def sync(self, owner: str, leases: list[SlotLease]) -> SyncResult:
        """One heartbeat, never retried: a missed beat is simply followed by the next."""
        return ray.get(self.manager.sync.remote(owner, leases), timeout=self.SYNC_TIMEOUT_S)

    SYNC_TIMEOUT_S = 2.0

    def _call(self, method: str, *args):
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return ray.get(getattr(self.manager, method).remote(*args), timeout=self.timeout_s)
            except SlotsExhausted:
                raise
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, SlotsRecovering) as exc:
                if time.monotonic() >= deadline:
                    raise SlotServiceUnavailable(f"slot manager unavailable for {self.timeout_s}s: {exc}") from exc
                time.sleep(0.2)


def _log_failed_release(done) -> None:
    error = done.exception()
    if error is not None:
        log.warning("slot release failed; the next heartbeat frees the slot(s): %r", error)


class ReplicaServices:
    """Everything one server replica runs on Ray: target shards, draft worker, slot manager.

    The target shards share one torch.distributed group, which cannot be
    rejoined by a single restarted rank, so when any shard dies
    ``rebuild_target`` replaces them all (in the same placement group). The
    draft worker restarts by itself (Ray ``max_restarts``); until it is back,
    the engine runs without speculation.

    ``config.capacity`` is what this replica holds at once: the rows of its
    workers' per-slot buffers. ``slot_capacity`` is the application's, the
    slot manager's (by default the same: one replica). ``slots`` hands the
    engine leases of the application's slots, each with a row of this
    replica's buffers (``dspark_ray.slots.ReplicaSlots``).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        app_name: str,
        replica: str,
        tensor_parallel_size: int,
        placement_strategy: str,
        cpus_per_shard: float,
        torch_threads: int,
        slot_timeout_s: float,
        call_timeout_s: float = 120.0,
        slot_capacity: int | None = None,
        spin_s: float = 0.0,
        single_thread_max_rows: int = 0,
        bind_cores: bool = False,
        step_timeout_floor_s: float = 5.0,
        step_timeout_factor: float = 10.0,
        draft_placement: str = "worker",
        context_path: str = "direct",
        worker_env_vars: dict[str, str] | None = None,
    ) -> None:
        if draft_placement not in ("worker", "target"):
            raise ValueError(f"draft_placement must be 'worker' or 'target', got {draft_placement!r}")
        if context_path not in ("direct", "replica"):
            raise ValueError(f"context_path must be 'direct' or 'replica', got {context_path!r}")
        slot_capacity = config.capacity if slot_capacity is None else slot_capacity
        if slot_capacity < config.capacity:
            raise ValueError(f"a replica holding {config.capacity} slots needs an application capacity of at "
                             f"least that, got {slot_capacity}")
        if config.draft and config.spec_tokens > 0:
            # A draft that cannot serve with this target (tokenizers differ, an MLA model as a draft, a
            # DSpark draft whose target layers, hidden size or vocabulary do not fit), from the config
            # files alone: refused here, before any worker starts or reads a weight.
            check_draft(config, Tokenizer.from_path(config.model))
        self.config, self.replica = config, replica
        self.call_timeout_s = call_timeout_s
        self.timeline = StepTimeline()  # transport vs compute of every step (GET /stats)
        # Per-step deadlines from the steps answered lately (deadline.py), one per kind of worker;
        # kept here, so that a rebuilt target starts from what the old one measured.
        floor = min(step_timeout_floor_s, call_timeout_s)
        self.target_deadline = StepDeadline(call_timeout_s, floor, step_timeout_factor)
        self.draft_deadline = StepDeadline(call_timeout_s, floor, step_timeout_factor)
        self.timeouts = WorkerTimeouts()
        self.tensor_parallel_size = tensor_parallel_size
        self.cpus_per_shard, self.torch_threads, self.spin_s = cpus_per_shard, torch_threads, spin_s
        self.single_thread_max_rows, self.bind_cores = single_thread_max_rows, bind_cores
        self.runtime_env = _worker_runtime_env(worker_env_vars, torch_threads)
        self._gpu = 1 if config.device == "cuda" else 0
        # Bundle 0 holds rank 0 and the draft worker (they share a GPU); one bundle per further rank.
        gpu = {"GPU": 1} if self._gpu else {}
        bundles = [{"CPU": 2 * cpus_per_shard, **gpu}] + [{"CPU": cpus_per_shard, **gpu}] * (tensor_parallel_size - 1)
        self.placement_group = placement_group(bundles, strategy=placement_strategy, name=f"dspark:{app_name}:{replica}")
        ray.get(self.placement_group.ready(), timeout=600)
        self.shards: list = []
        speculates = bool(config.draft) and config.spec_tokens > 0
        # The draft in target rank 0's process: that rank serves its proposals on a channel of its own.
        # Prompt lookup (draft ngram) always is: it costs microseconds a row, no worker of its own pays.
        self.draft_in_target = speculates and (draft_placement == "target" or is_ngram(config.draft))
        # A DSpark draft's context window; its states go from rank 0 to the draft directly
        # (runtime/context_push.py) unless context_path is "replica".
        self.context_window = None
        if speculates and uses_dspark(config):
            self.context_window = context_window(DSparkConfig.from_path(config.draft), config.max_context)
        self.context_direct = self.context_window is not None and context_path == "direct"
        self.target = self._start_target()
        self.draft_worker = self.draft = None
        if speculates:
            if not self.draft_in_target:
                self.draft_worker = ray.remote(DraftWorker).options(
                    **self._opts(0, f"dspark:proposer:{replica}", self._gpu * 0.5),
                    max_restarts=-1, max_task_retries=0,
                ).remote(config, torch_threads, spin_s, single_thread_max_rows, bind_cores)
                self._link_context()
            self.draft = RayDraft(self.draft_worker or self.shards[0], call_timeout_s, self.timeline,
                                  self.draft_deadline, self.timeouts, self.context_window)
        self.slot_manager = _slot_manager_with_capacity(slot_capacity, app_name)
        self.slots = ReplicaSlots(RaySlots(self.slot_manager, slot_timeout_s), rows=config.capacity,
                                  app_capacity=slot_capacity)

    def _opts(self, bundle: int, name: str, gpus: float) -> dict:
        runtime_env = {} if self.runtime_env is None else {"runtime_env": self.runtime_env}
        return dict(
            name=name, num_cpus=self.cpus_per_shard, num_gpus=gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=bundle),
            **runtime_env,
        )

    def _start_target(self) -> RayTarget:
        shard_cls = ray.remote(TargetShard)
        world = self.tensor_parallel_size
        self.shards = [
            shard_cls.options(**self._opts(r, f"dspark:target:{self.replica}:rank{r}",
                                           self._gpu * (0.5 if r == 0 else 1)))
            .remote(self.config, r, world, self.torch_threads, self.replica, self.spin_s,
                    self.single_thread_max_rows, self.bind_cores)
            for r in range(world)
        ]
        addr, port = ray.get(self.shards[0].address.remote())
        local_context = self.context_window if self.context_direct and self.draft_in_target else None
        capacities = ray.get([s.setup.remote(addr, port, self.draft_in_target and r == 0,
                                             local_context if r == 0 else None)
                              for r, s in enumerate(self.shards)])
        channels = [open_channel(s, f"target rank {r}", self.call_timeout_s) for r, s in enumerate(self.shards)]
        # An independent draft in the one rank drafts inside the step's call. (With more ranks the others
        # would need the drafts from rank 0, and a DSpark draft's context goes through its inbox: both
        # keep a proposal call of their own.)
        drafts = self.draft_in_target and world == 1 and self.context_window is None
        return RayTarget(min(capacities), channels, self.call_timeout_s, self.timeline, self.target_deadline,
                         self.timeouts, drafts=drafts)

    def rebuild_target(self) -> RayTarget:
        """Replace every target shard with a fresh one (empty KV, a new group)."""
        self.target.close()
        for shard in self.shards:
            ray.kill(shard, no_restart=True)
        self._wait_until_gone(self.shards)
        self.target = self._start_target()
        self._link_context()
        if self.draft_in_target and self.draft is not None:
            # The new rank 0 holds a fresh proposer (an empty window cache: the engine's next proposals
            # resend each request's tokens, as after a draft worker's restart).
            self.draft.rebind(self.shards[0])
        return self.target

    def _link_context(self) -> None:
        """Have target rank 0 send a DSpark draft's context states to the draft worker itself."""
        if self.context_direct and self.draft_worker is not None:
            linked = ray.get(self.shards[0].send_context_to.remote(self.draft_worker, self.context_window,
                                                                   self.call_timeout_s))
            if not linked:
                log.warning("target rank 0 has no context link to the draft worker yet; its context states go "
                            "through the replica until it has")

    @staticmethod
    def _wait_until_gone(actors: list, timeout_s: float = 30.0) -> None:
        """Actor names are reused by the new shards: wait for the old ones to release them."""
        deadline = time.monotonic() + timeout_s
        for actor in actors:
            while time.monotonic() < deadline:
                try:
                    ray.get(actor.kv_free.remote(), timeout=1)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    break
                time.sleep(0.1)

    def shutdown(self) -> None:
        self.target.close()
        if self.draft is not None:
            self.draft.close()
        for actor in [*self.shards, self.draft_worker]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        remove_placement_group(self.placement_group)


# The workers' environment where they run torch on more than one thread, unless the operator set the
# variable (worker_env_vars, the application's runtime_env, or the environment Ray's processes started
# in). NOTE: why. libgomp's threads spin for a while after each parallel region by default, on the cores
# the quantized kernels' own threads (dspark_kernels/csrc/quant_gemm.c) and the replica want next: served
# on the 2-core box, one replica on two threads ran 1.40x faster at one request and 1.27x at eight with
# them sleeping at once (bench/HISTORY.md, twenty-sixth session). libgomp reads it as torch loads, so it
# goes into the worker's environment before the process starts.
MULTI_THREAD_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def _worker_runtime_env(env_vars: dict[str, str] | None, torch_threads: int = 1) -> dict | None:
    """The workers' runtime_env: this process's (the replica's: its working_dir, pip, ...) with
    ``env_vars`` added to its env_vars, and MULTI_THREAD_ENV's defaults at ``torch_threads`` of 2 or
    more. None, when there is nothing to add, inherits it unchanged.

    Ray merges a child's env_vars with its parent's but takes every other field of a child's
    runtime_env as given, so the rest is copied from the parent here rather than dropped."""
    parent = dict(ray.get_runtime_context().runtime_env or {})
    inherited = {**(parent.get("env_vars") or {}), **(env_vars or {})}
    defaults = {name: value for name, value in MULTI_THREAD_ENV.items()
                if torch_threads >= 2 and name not in inherited and name not in os.environ}
    if not env_vars and not defaults:
        return None
    return {**parent, "env_vars": {**defaults, **inherited}}


class SlotCapacityMismatch(RuntimeError):
    """The application's running slot manager has another capacity and still holds leases."""


def _slot_manager_with_capacity(capacity: int, app_name: str):
    """The application's (detached) slot manager, replaced if idle with another capacity.

    A redeploy with a new ``capacity`` would otherwise keep the old manager
    and its old capacity; a manager that still holds leases is never replaced.
    """
    manager = start_slot_manager(capacity, app_name, detached=True)
    snap = ray.get(manager.snapshot.remote())
    if snap.capacity == capacity:
        return manager
    if snap.live:
        raise SlotCapacityMismatch(
            f"the running slot manager of app {app_name!r} has capacity {snap.capacity} and {len(snap.live)} "
            f"live leases; drain the application before changing capacity to {capacity} (runbooks/slots.md)"
        )
    log.warning("replacing the idle slot manager of %r: capacity %d -> %d", app_name, snap.capacity, capacity)
    ray.kill(manager, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        manager = start_slot_manager(capacity, app_name, detached=True)
        try:
            if ray.get(manager.snapshot.remote(), timeout=5).capacity == capacity:
                return manager
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.2)
    raise SlotCapacityMismatch(f"could not restart the slot manager of {app_name!r} with capacity {capacity}")


def start_replica_services(config: EngineConfig, **kwargs) -> ReplicaServices:
    """Start the target shards and draft worker of one replica, and find the slot manager.

    Keyword arguments are those of ``ReplicaServices``.
    """
    return ReplicaServices(config, **kwargs)


# ReplicaServices' keyword arguments that an AppConfig field of another name gives; every other one is
# the AppConfig field of its own name (ray_services).
SERVICE_FIELDS = {"slot_timeout_s": "slot_admission_timeout_s", "call_timeout_s": "worker_call_timeout_s",
                  "slot_capacity": "capacity", "spin_s": "worker_spin_s", "torch_threads": "worker_threads"}


def service_settings(config) -> dict:
    """ReplicaServices' settings from an ``AppConfig``: each keyword of its constructor (after the engine
    config, the application and the replica) from the field of its name or SERVICE_FIELDS', so a new
    setting cannot be left out (an AttributeError names it)."""
    params = list(inspect.signature(ReplicaServices.__init__).parameters)[2:]
    return {name: getattr(config, SERVICE_FIELDS.get(name, name)) for name in params
            if name not in ("app_name", "replica")}


def ray_services(config, app_name: str, replica: str) -> ReplicaServices:
    """The server's default services factory: from the deploy-level ``AppConfig``.

    The engine config holds this replica's share (``slots_per_replica``); the
    slot manager the application's ``capacity``.
    """
    return start_replica_services(config.engine_config(), app_name=app_name, replica=replica,
                                  **service_settings(config))
