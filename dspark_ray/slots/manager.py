"""``SlotManager``: the application's one slot registry, as a named Ray actor.

A thin shim: every method is one batched ``SlotRegistry`` call (a step's
admissions are one ``allocate_many``, its releases one ``release_many``)
followed by a metrics update. The per-token path never calls it; the
row-to-slot mapping of a step is a local lookup on the leases it returned.

Recovery: the actor restarts with an empty registry. Each owner (a server
replica) then calls ``restore`` with the leases it still holds and
``reconcile`` with the request ids it still runs. Epochs of the new registry
start from the wall clock in microseconds, above anything the previous
incarnation could have issued (unless it allocated more than a million slots
per second), so a consumer holding per-slot state from before the crash never
mistakes a new hold for an old one.

Owner liveness: every owner calls ``sync`` about once a second with the
leases it holds (a heartbeat that also restores and reconciles). Leases of an
owner silent for ``owner_timeout_s`` are reclaimed: a crashed server replica
loses no capacity. After a restart the manager refuses allocations for
``recovery_grace_s`` (``SlotsRecovering``, retryable) so that every live
owner has re-registered its leases before any slot is handed out again.

Retrying a call is safe (allocate of a live id returns its lease, releases
carry epochs, restore of an installed lease is a no-op), but the actor is
started without automatic task retries: an allocation replayed on a fresh
registry before the owners restored could take a slot that one of them still
holds, and ``restore`` would then raise ``SlotConflict``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

import ray
from ray.actor import ActorHandle
from ray.util.metrics import Counter, Gauge, Histogram

from .registry import SlotCounters, SlotError, SlotLease, SlotRegistry, SlotSnapshot, SyncResult

log = logging.getLogger(__name__)


class SlotsRecovering(SlotError):
    """The slot manager just restarted and waits for owners to re-register; retry shortly."""

_HOLD_TIME_BOUNDARIES_S = [0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600]


def slot_manager_name(app_name: str = "") -> str:
    """The Ray actor name of an application's slot manager."""
    return f"dspark:{app_name}:slot-manager" if app_name else "dspark:slot-manager"


class _SlotMetrics:
    """The slot manager's Prometheus metrics, exported through Ray (names gain a ``ray_`` prefix)."""

    def __init__(self, app_name: str, capacity: int) -> None:
        self.in_use = Gauge("dspark_slot_in_use", "Slots held by live requests.", tag_keys=("app",))
        self.capacity = Gauge("dspark_slot_capacity", "Usable slots (1..capacity).", tag_keys=("app",))
        self.allocations = Counter("dspark_slot_allocations", "Slots handed out.", tag_keys=("app",))
        self.releases = Counter("dspark_slot_releases", "Slots freed.", tag_keys=("app",))
        self.stale_releases = Counter(
            "dspark_slot_stale_releases",
            "Releases of unknown ids or old epochs (retries, late messages); nothing freed.",
            tag_keys=("app",),
        )
        self.exhausted = Counter(
            "dspark_slot_exhausted", "Allocation calls refused for lack of slots.", tag_keys=("app",)
        )
        self.hold_time = Histogram(
            "dspark_slot_hold_time_seconds",
            "Seconds from allocation (or restore) to release of a slot.",
            boundaries=_HOLD_TIME_BOUNDARIES_S,
            tag_keys=("app",),
        )
        tags = {"app": app_name or "default"}
        for metric in (
            self.in_use,
            self.capacity,
            self.allocations,
            self.releases,
            self.stale_releases,
            self.exhausted,
            self.hold_time,
        ):
            metric.set_default_tags(tags)
        self._capacity = capacity
        self.capacity.set(capacity)
        self._published = SlotCounters()

    def refresh_gauges(self, in_use: int) -> None:
        """Set both gauges again. Ray (2.60) exports a gauge only when it was set since the last
        export, and its metrics agent drops a series not exported for two report intervals (20 s
        by default), so a gauge left alone vanishes from Prometheus: this runs every second."""
        self.in_use.set(in_use)
        self.capacity.set(self._capacity)

    def observe_release(self, lease: SlotLease, held_s: float) -> None:
        self.hold_time.observe(held_s)

    def publish(self, in_use: int, counters: SlotCounters) -> None:
        """Sets the gauge and advances each counter by what happened since the last call."""
        self.in_use.set(in_use)
        last = self._published
        for counter, delta in (
            (self.allocations, counters.allocations - last.allocations),
            (self.releases, counters.releases - last.releases),
            (self.stale_releases, counters.stale_releases - last.stale_releases),
            (self.exhausted, counters.exhausted - last.exhausted),
        ):
            if delta:
                counter.inc(delta)
        self._published = counters


class SlotManager:
    """The slot registry of one application, with metrics; run it as a Ray actor.

    Args:
        capacity: usable slots ``1..capacity``.
        app_name: tags the metrics; also part of the actor name.
        first_epoch: first epoch to issue; by default the wall clock in
            microseconds, so epochs keep growing across actor restarts.
    """

    def __init__(
        self,
        capacity: int,
        app_name: str = "",
        first_epoch: int | None = None,
        owner_timeout_s: float = 15.0,
        recovery_grace_s: float = 3.0,
    ) -> None:
        if first_epoch is None:
            first_epoch = time.time_ns() // 1000
        self._metrics = _SlotMetrics(app_name, capacity)
        self._registry = SlotRegistry(
            capacity,
            first_epoch=first_epoch,
            on_release=self._metrics.observe_release,
        )
        self._owner_timeout_s = owner_timeout_s
        self._last_seen: dict[str, float] = {}
        restarted = _was_restarted()
        self._accepting_at = time.monotonic() + (recovery_grace_s if restarted else 0.0)
        self._reaper = threading.Thread(target=self._reap_forever, name="slot-owner-reaper", daemon=True)
        self._reaper.start()

    def allocate_many(self, req_ids: list[str], owner: str = "") -> list[SlotLease]:
        """``SlotRegistry.allocate_many``: all or nothing, raises ``SlotsExhausted``.

        Raises ``SlotsRecovering`` during the grace period after a restart.
        """
        self._seen(owner)
        wait = self._accepting_at - time.monotonic()
        if wait > 0:
            raise SlotsRecovering(f"slot manager restarted; owners are re-registering, retry in {wait:.1f}s")
        try:
            return self._registry.allocate_many(req_ids, owner)
        finally:
            self._publish()

    def release_many(self, req_ids_with_epochs: list[tuple[str, int | None]]) -> list[bool]:
        """``SlotRegistry.release_many``: one bool per ``(req_id, epoch)``, True when freed."""
        try:
            return self._registry.release_many(req_ids_with_epochs)
        finally:
            self._publish()

    def reconcile(self, owner: str, live_req_ids: Iterable[str]) -> list[SlotLease]:
        """``SlotRegistry.reconcile``: frees ``owner``'s leases not in ``live_req_ids``."""
        try:
            return self._registry.reconcile(owner, live_req_ids)
        finally:
            self._publish()

    def restore(self, owner: str, leases: list[SlotLease]) -> None:
        """``SlotRegistry.restore``: re-installs ``owner``'s leases after a restart."""
        try:
            self._registry.restore(owner, leases)
        finally:
            self._publish()

    def sync(self, owner: str, leases: list[SlotLease]) -> SyncResult:
        """The owner's heartbeat: ``SlotRegistry.sync`` of the leases it holds."""
        self._seen(owner)
        try:
            result = self._registry.sync(owner, leases)
        finally:
            self._publish()
        if result.reclaimed or result.conflicts:
            log.warning("sync from %s: reclaimed %d, conflicts %d", owner, len(result.reclaimed),
                        len(result.conflicts))
        return result

    def snapshot(self) -> SlotSnapshot:
        return self._registry.snapshot()

    def set_draining(self, draining: bool) -> bool:
        """``SlotRegistry.set_draining``: the application's drain switch (kept in memory: a
        restarted manager starts with it off)."""
        log.warning("drain switch %s", "on: servers admit no new requests" if draining else "off")
        return self._registry.set_draining(draining)

    def draining(self) -> bool:
        return self._registry.draining

    def touch(self, owner: str) -> None:
        """``owner`` is alive (between its heartbeats, while one of its steps runs long)."""
        self._seen(owner)

    def _seen(self, owner: str) -> None:
        if owner:
            self._last_seen[owner] = time.monotonic()

    def reap_silent_owners(self) -> list[SlotLease]:
        """Reclaim the leases of owners not heard from for ``owner_timeout_s``."""
        now = time.monotonic()
        owners = {live.lease.owner for live in self._registry.snapshot().live if live.lease.owner}
        freed = []
        for owner in owners:
            last = self._last_seen.setdefault(owner, now)  # restored before any call: start its clock
            if now - last > self._owner_timeout_s:
                freed += self._registry.reconcile(owner, [])
                self._last_seen.pop(owner, None)
                log.warning("owner %s silent for %.0fs: reclaimed its leases", owner, now - last)
        if freed:
            self._publish()
        return freed

    def _reap_forever(self) -> None:
        while True:
            time.sleep(min(1.0, self._owner_timeout_s / 4))
            try:
                self.reap_silent_owners()
                self._metrics.refresh_gauges(self._registry.in_use())
            except Exception:  # noqa: BLE001 - the reaper must survive to try again
                log.exception("slot owner reaper failed")

    def _publish(self) -> None:
        self._metrics.publish(self._registry.in_use(), self._registry.counters())


def _was_restarted() -> bool:
    try:
        return ray.get_runtime_context().was_current_actor_reconstructed
    except Exception:  # noqa: BLE001 - not running as an actor (tests, in-process use)
        return False


def start_slot_manager(
    capacity: int,
    app_name: str = "",
    *,
    namespace: str | None = None,
    detached: bool = False,
    owner_timeout_s: float = 15.0,
    recovery_grace_s: float = 3.0,
) -> ActorHandle:
    """Starts the application's slot-manager actor, or returns the running one.

    The actor is named (see ``slot_manager_name``) so the Ray dashboard shows
    it, needs no CPU, restarts without limit and serves one call at a time.
    A running actor is returned as is, whatever ``capacity`` it was started with.
    ``detached`` keeps it alive after the creating process exits.
    """
    return (
        ray.remote(SlotManager)
        .options(
            name=slot_manager_name(app_name),
            namespace=namespace,
            get_if_exists=True,
            lifetime="detached" if detached else None,
            max_restarts=-1,
            max_concurrency=1,
            num_cpus=0,
        )
        .remote(capacity, app_name, None, owner_timeout_s, recovery_grace_s)
    )


def get_slot_manager(app_name: str = "", namespace: str | None = None) -> ActorHandle:
    """The running slot-manager actor of ``app_name``; raises ``ValueError`` if there is none."""
    return ray.get_actor(slot_manager_name(app_name), namespace=namespace)
