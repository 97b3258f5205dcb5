"""The Ray actors behind one server replica, and the engine-side facades over them.

Per replica: one ``TargetShard`` actor per tensor-parallel rank (a
torch.distributed group among them: gloo on CPU, NCCL on CUDA) and one
``DraftWorker``; per application: the slot manager (``dspark_ray.slots``).
The facades (``RayTarget``, ``RayDraft``, ``RaySlots``) give the engine the
same ``TargetService``/``DraftService``/``SlotService`` methods it uses in
process, so the engine does not know it is distributed.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dspark_ray.engine.config import EngineConfig
from dspark_ray.engine.interfaces import Proposal, ProposeRow, TargetStep, VerifyResult
from dspark_ray.model.tp import CollectiveTimer
from dspark_ray.serve.group import join_group, rendezvous_address
from dspark_ray.serve.metrics import ShardMetrics
from dspark_ray.slots import SlotLease, SlotsExhausted, SlotsRecovering, SyncResult, start_slot_manager
from dspark_ray.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class TensorParallelDivergence(RuntimeError):
    """Two tensor-parallel ranks verified differently: their KV is no longer consistent."""


class SlotServiceUnavailable(RuntimeError):
    """The slot manager did not answer within the admission timeout."""


class TargetShard:
    """Rank ``rank`` of the target: its shard of the weights, its KV pool, its table."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int, torch_threads: int,
                 replica: str = "") -> None:
        torch.set_num_threads(torch_threads)
        self.config, self.rank, self.world_size = config, rank, world_size
        self.runner = None
        self.collectives = CollectiveTimer()
        self.metrics = ShardMetrics(Path(config.model).name, replica or "local", rank)

    def address(self) -> tuple[str, int]:
        """The group's rendezvous address (called on rank 0)."""
        return rendezvous_address()

    def setup(self, master_addr: str, master_port: int) -> int:
        """Join the tensor-parallel group, load this rank's shard; returns KV pool capacity."""
        from dspark_ray.engine.local import make_target_runner
        from dspark_ray.model.tp import TensorParallel

        cfg = self.config
        tp = None
        if self.world_size > 1:
            join_group(cfg.device, master_addr, master_port, self.rank, self.world_size)
            tp = TensorParallel(self.rank, self.world_size, timer=self.collectives)
        self.runner = make_target_runner(cfg, Tokenizer.from_path(cfg.model).vocab_size, tp)
        return self.runner.kv_capacity()

    def step(self, batch: TargetStep) -> VerifyResult:
        start = time.perf_counter()
        result = self.runner.step(batch)
        self.metrics.observe(time.perf_counter() - start, self.collectives.take())
        return result

    def release(self, slots: list[int]) -> None:
        self.runner.release(slots)

    def kv_free(self) -> int:
        return self.runner.kv_free()


class DraftWorker:
    """The draft model, its window cache and kernels."""

    def __init__(self, config: EngineConfig, torch_threads: int) -> None:
        from dspark_ray.engine.local import make_draft_proposer

        torch.set_num_threads(torch_threads)
        self.proposer = make_draft_proposer(config, Tokenizer.from_path(config.model).vocab_size)

    def propose(self, rows: list[ProposeRow]) -> Proposal:
        return self.proposer.propose(rows)


class RayTarget:
    """TargetService over all ranks: one step goes to every rank at once."""

    def __init__(self, shards: list, kv_capacity: int) -> None:
        self.shards = shards
        self._kv_capacity = kv_capacity

    def kv_capacity(self) -> int:
        return self._kv_capacity

    def step(self, batch: TargetStep) -> VerifyResult:
        ref = ray.put(batch)
        results = ray.get([s.step.remote(ref) for s in self.shards])
        if any(r != results[0] for r in results[1:]):
            raise TensorParallelDivergence(f"ranks disagree on verification: {results}")
        return results[0]

    def release(self, slots: list[int]) -> None:
        ray.get([s.release.remote(slots) for s in self.shards])


class RayDraft:
    def __init__(self, worker) -> None:
        self.worker = worker

    def propose(self, rows: list[ProposeRow]) -> Proposal:
        return ray.get(self.worker.propose.remote(rows))


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


class ReplicaServices:
    """Everything one server replica runs on Ray: target shards, draft worker, slot manager.

    The target shards share one torch.distributed group, which cannot be
    rejoined by a single restarted rank, so when any shard dies
    ``rebuild_target`` replaces them all (in the same placement group). The
    draft worker restarts by itself (Ray ``max_restarts``); until it is back,
    the engine runs without speculation.
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
    ) -> None:
        self.config, self.replica = config, replica
        self.tensor_parallel_size = tensor_parallel_size
        self.cpus_per_shard, self.torch_threads = cpus_per_shard, torch_threads
        self._gpu = 1 if config.device == "cuda" else 0
        # Bundle 0 holds rank 0 and the draft worker (they share a GPU); one bundle per further rank.
        gpu = {"GPU": 1} if self._gpu else {}
        bundles = [{"CPU": 2 * cpus_per_shard, **gpu}] + [{"CPU": cpus_per_shard, **gpu}] * (tensor_parallel_size - 1)
        self.placement_group = placement_group(bundles, strategy=placement_strategy, name=f"dspark:{app_name}:{replica}")
        ray.get(self.placement_group.ready(), timeout=600)
        self.shards: list = []
        self.target = self._start_target()
        self.draft_worker = self.draft = None
        if config.draft and config.spec_tokens > 0:
            self.draft_worker = ray.remote(DraftWorker).options(
                **self._opts(0, f"dspark:proposer:{replica}", self._gpu * 0.5),
                max_restarts=-1, max_task_retries=0,
            ).remote(config, torch_threads)
            self.draft = RayDraft(self.draft_worker)
        self.slot_manager = _slot_manager_with_capacity(config.capacity, app_name)
        self.slots = RaySlots(self.slot_manager, slot_timeout_s)

    def _opts(self, bundle: int, name: str, gpus: float) -> dict:
        return dict(
            name=name, num_cpus=self.cpus_per_shard, num_gpus=gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=bundle),
        )

    def _start_target(self) -> RayTarget:
        shard_cls = ray.remote(TargetShard)
        world = self.tensor_parallel_size
        self.shards = [
            shard_cls.options(**self._opts(r, f"dspark:target:{self.replica}:rank{r}",
                                           self._gpu * (0.5 if r == 0 else 1)))
            .remote(self.config, r, world, self.torch_threads, self.replica)
            for r in range(world)
        ]
        addr, port = ray.get(self.shards[0].address.remote())
        capacities = ray.get([s.setup.remote(addr, port) for s in self.shards])
        return RayTarget(self.shards, min(capacities))

    def rebuild_target(self) -> RayTarget:
        """Replace every target shard with a fresh one (empty KV, a new group)."""
        for shard in self.shards:
            ray.kill(shard, no_restart=True)
        self._wait_until_gone(self.shards)
        self.target = self._start_target()
        return self.target

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
        for actor in [*self.shards, self.draft_worker]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        remove_placement_group(self.placement_group)


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
