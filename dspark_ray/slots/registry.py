"""The slot registry: request id -> (slot, epoch), the bookkeeping behind every per-slot buffer.

NOTE: every request owns one *slot* in ``1..capacity`` from admission to its
end, and every per-request buffer (the draft window cache, the target's
request-to-token table) is indexed by that slot, never by the request's row in
the current batch. Row 0 of those buffers is the padding row
(``PADDING_SLOT``), so a padded batch entry writes somewhere harmless; the
registry never hands slot 0 out.

Each allocation also gets an *epoch*, strictly increasing across the registry.
A consumer that sees a new epoch for a slot treats that slot's state as empty,
so a reused slot never shows its previous owner's data, and a release carrying
an old epoch (a retry, a late message) can never free the slot's new holder.

Plain Python on purpose: no torch, no ray. ``SlotManager`` is the Ray actor
around it. All public methods are thread-safe (one lock).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

PADDING_SLOT = 0


class SlotError(Exception):
    """Base class of the slot registry's errors."""


class SlotsExhausted(SlotError):
    """No free slot for an allocation; the registry was left unchanged."""


class UnknownRequest(SlotError, LookupError):
    """A request id that holds no slot was used where a live one is required."""


class SlotConflict(SlotError):
    """A restored lease collides with a slot or request id already held."""


@dataclass(frozen=True, slots=True)
class SlotLease:
    """One request's hold on one slot. ``epoch`` identifies this particular hold."""

    req_id: str
    slot: int
    epoch: int
    owner: str = ""


@dataclass(frozen=True, slots=True)
class LiveLease:
    """A live lease and how long it has been held, as reported by ``snapshot``."""

    lease: SlotLease
    held_s: float


@dataclass(frozen=True, slots=True)
class SlotCounters:
    """Monotonic event counts. Balance: allocations + restored - releases == slots in use."""

    allocations: int = 0
    releases: int = 0
    stale_releases: int = 0
    exhausted: int = 0
    restored: int = 0


@dataclass(frozen=True, slots=True)
class SlotSnapshot:
    """A consistent view of the registry at one instant."""

    capacity: int
    free: int
    live: tuple[LiveLease, ...]  # ordered by slot
    counters: SlotCounters

    @property
    def in_use(self) -> int:
        return self.capacity - self.free


# Called once per freed lease with the seconds it was held (outside the lock).
ReleaseHook = Callable[[SlotLease, float], None]


@dataclass(frozen=True)
class SyncResult:
    """What ``SlotRegistry.sync`` changed for an owner."""

    reclaimed: list[SlotLease]  # leases the owner no longer reported: freed
    conflicts: list[SlotLease]  # leases the owner reported that someone else now holds
    draining: bool = False  # the application is draining: its servers admit no new requests


class SlotRegistry:
    """Hands out slots ``1..capacity``, lowest free first, each with a fresh epoch.

    Args:
        capacity: number of usable slots; per-slot buffers need ``capacity + 1`` rows.
        first_epoch: epoch of the first allocation. A registry rebuilt after a
            crash should start above every epoch the old one issued (see
            ``SlotManager``), or consumers could mistake a new hold for an old one.
        on_release: optional hook, called for every freed lease with its hold time.
        clock: monotonic seconds, injectable for tests.
    """

    def __init__(
        self,
        capacity: int,
        *,
        first_epoch: int = 1,
        on_release: ReleaseHook | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        if first_epoch < 1:
            raise ValueError(f"first_epoch must be at least 1, got {first_epoch}")
        self._capacity = capacity
        self._free = list(range(1, capacity + 1))  # a heap; sorted is a valid heap
        self._live: dict[str, tuple[SlotLease, float]] = {}  # req_id -> (lease, since)
        self._next_epoch = first_epoch
        self._on_release = on_release
        self._clock = clock
        self._lock = threading.Lock()
        self._allocations = 0
        self._releases = 0
        self._stale_releases = 0
        self._exhausted = 0
        self._draining = False
        self._restored = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    # --- allocation -------------------------------------------------------

    def allocate(self, req_id: str, owner: str = "") -> SlotLease:
        """Returns ``req_id``'s lease, taking the lowest free slot if it holds none.

        A request id that is already live gets its existing lease back unchanged.
        Raises ``SlotsExhausted`` (and changes nothing) when no slot is free.
        """
        return self.allocate_many([req_id], owner)[0]

    def allocate_many(self, req_ids: Iterable[str], owner: str = "") -> list[SlotLease]:
        """``allocate`` for a batch, all or nothing: leases in the order of ``req_ids``.

        Raises ``SlotsExhausted`` (and changes nothing) unless every id that is
        not yet live can get a slot.
        """
        req_ids = list(req_ids)
        with self._lock:
            new = {r for r in req_ids if r not in self._live}
            if len(new) > len(self._free):
                self._exhausted += 1
                raise SlotsExhausted(
                    f"need {len(new)} free slot(s), {len(self._free)} of {self._capacity} free; "
                    "admit fewer requests or raise the slot capacity"
                )
            now = self._clock()
            return [
                self._live[r][0] if r in self._live else self._take(r, owner, now)
                for r in req_ids
            ]

    def _take(self, req_id: str, owner: str, now: float) -> SlotLease:
        lease = SlotLease(req_id, heapq.heappop(self._free), self._next_epoch, owner)
        self._next_epoch += 1
        self._live[req_id] = (lease, now)
        self._allocations += 1
        return lease

    # --- release ----------------------------------------------------------

    def release(self, req_id: str, epoch: int | None = None) -> bool:
        """Frees ``req_id``'s slot; True when a slot was freed.

        With ``epoch`` given, only the hold with that epoch is freed. An unknown
        id or an epoch that is not the live one returns False, changes nothing
        and counts as a stale release.
        """
        return self.release_many([(req_id, epoch)])[0]

    def release_many(self, req_ids_with_epochs: Iterable[tuple[str, int | None]]) -> list[bool]:
        """``release`` for a batch of ``(req_id, epoch or None)``; one bool per item."""
        items = list(req_ids_with_epochs)
        freed: list[tuple[SlotLease, float]] = []
        results = []
        with self._lock:
            now = self._clock()
            for req_id, epoch in items:
                held = self._live.get(req_id)
                if held is None or (epoch is not None and held[0].epoch != epoch):
                    self._stale_releases += 1
                    results.append(False)
                    continue
                self._free_locked(held[0])
                freed.append((held[0], now - held[1]))
                results.append(True)
        self._notify(freed)
        return results

    def reconcile(self, owner: str, live_req_ids: Iterable[str]) -> list[SlotLease]:
        """Frees ``owner``'s leases whose ids are not in ``live_req_ids``; returns them by slot.

        The recovery path after an owner (a server replica) crashed or lost
        track of requests: it reports what it still runs, the rest is reclaimed.
        """
        live = set(live_req_ids)
        freed: list[tuple[SlotLease, float]] = []
        with self._lock:
            now = self._clock()
            for lease, since in list(self._live.values()):
                if lease.owner == owner and lease.req_id not in live:
                    self._free_locked(lease)
                    freed.append((lease, now - since))
        self._notify(freed)
        return sorted((lease for lease, _ in freed), key=lambda lease: lease.slot)

    def _free_locked(self, lease: SlotLease) -> None:
        del self._live[lease.req_id]
        heapq.heappush(self._free, lease.slot)
        self._releases += 1

    def _notify(self, freed: list[tuple[SlotLease, float]]) -> None:
        if self._on_release is not None:
            for lease, held_s in freed:
                self._on_release(lease, held_s)

    # --- recovery ---------------------------------------------------------

    def restore(self, owner: str, leases: Iterable[SlotLease]) -> None:
        """Re-installs ``owner``'s leases as they were (same slot, same epoch), all or nothing.

        Used after the registry was rebuilt empty (an actor restart): each owner
        re-registers the leases it still holds. Later epochs continue above the
        highest restored one. Restoring a lease that is already installed
        unchanged is a no-op. Raises ``SlotConflict`` (and changes nothing) when
        a slot or request id is held differently, and ``ValueError`` when a
        lease names another owner.
        """
        leases = list(leases)
        with self._lock:
            new = self._check_restorable(owner, leases)
            now = self._clock()
            for lease in new:
                self._live[lease.req_id] = (lease, now)
                self._next_epoch = max(self._next_epoch, lease.epoch + 1)
            self._restored += len(new)
            taken = {lease.slot for lease in new}
            self._free = [s for s in self._free if s not in taken]
            heapq.heapify(self._free)

    def sync(self, owner: str, leases: Iterable[SlotLease]) -> SyncResult:
        """Makes ``owner``'s leases exactly ``leases``: restores missing ones, frees the rest.

        The owner's periodic statement of what it holds, which both heals a
        registry rebuilt after a crash and reclaims leases the owner lost
        track of. A lease that cannot be restored because its slot or id is
        now held differently is reported in ``conflicts`` (the owner must end
        that request) and not kept.
        """
        leases = list(leases)
        conflicts = []
        for lease in leases:
            try:
                self.restore(owner, [lease])
            except SlotConflict:
                conflicts.append(lease)
        bad = {lease.req_id for lease in conflicts}
        reclaimed = self.reconcile(owner, [lease.req_id for lease in leases if lease.req_id not in bad])
        return SyncResult(reclaimed=reclaimed, conflicts=conflicts, draining=self._draining)

    # --- draining -----------------------------------------------------------

    @property
    def draining(self) -> bool:
        """The application's drain switch (``set_draining``)."""
        return self._draining

    def set_draining(self, draining: bool) -> bool:
        """Turn the application's drain switch on or off; returns it.

        The registry only keeps the switch: it hands out slots as before (requests
        admitted just before the switch still get theirs). Every owner hears of it
        with its next heartbeat (``sync``) and its server stops admitting requests.
        """
        self._draining = bool(draining)
        return self._draining

    def _check_restorable(self, owner: str, leases: list[SlotLease]) -> list[SlotLease]:
        """Returns the leases not yet installed; raises if any cannot be."""
        by_slot = {lease.slot: lease for lease, _ in self._live.values()}
        new: dict[str, SlotLease] = {}
        for lease in leases:
            if lease.owner != owner:
                raise ValueError(f"lease {lease} belongs to {lease.owner!r}, not {owner!r}")
            if not 1 <= lease.slot <= self._capacity:
                raise SlotConflict(f"{lease} is outside slots 1..{self._capacity}")
            live = self._live.get(lease.req_id)
            held = live[0] if live is not None else new.get(lease.req_id)
            if held == lease:
                continue
            holder = held or by_slot.get(lease.slot)
            if holder is not None:
                raise SlotConflict(f"cannot restore {lease}: already held as {holder}")
            new[lease.req_id] = by_slot[lease.slot] = lease
        return list(new.values())

    # --- queries ----------------------------------------------------------

    def lookup(self, req_id: str) -> SlotLease | None:
        """``req_id``'s live lease, or None."""
        with self._lock:
            held = self._live.get(req_id)
            return None if held is None else held[0]

    def row_to_slot(self, req_ids: Iterable[str | None]) -> list[int]:
        """The slot of each batch row, in batch order; ``None`` (padding) maps to slot 0.

        Raises ``UnknownRequest`` for an id that holds no slot.
        """
        with self._lock:
            live = self._live
            try:
                return [PADDING_SLOT if r is None else live[r][0].slot for r in req_ids]
            except KeyError as e:
                raise UnknownRequest(f"request {e.args[0]!r} holds no slot") from None

    def in_use(self) -> int:
        """Number of slots held by live requests."""
        with self._lock:
            return len(self._live)

    def counters(self) -> SlotCounters:
        with self._lock:
            return self._counters_locked()

    def _counters_locked(self) -> SlotCounters:
        return SlotCounters(
            allocations=self._allocations,
            releases=self._releases,
            stale_releases=self._stale_releases,
            exhausted=self._exhausted,
            restored=self._restored,
        )

    def snapshot(self) -> SlotSnapshot:
        """Capacity, free count, live leases with hold times, and counters, taken atomically."""
        with self._lock:
            now = self._clock()
            live = sorted(
                (LiveLease(lease, now - since) for lease, since in self._live.values()),
                key=lambda held: held.lease.slot,
            )
            return SlotSnapshot(
                capacity=self._capacity,
                free=len(self._free),
                live=tuple(live),
                counters=self._counters_locked(),
            )
