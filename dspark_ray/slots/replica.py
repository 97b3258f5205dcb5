"""``ReplicaSlots``: one replica's view of the application's slots, each lease given a row of its own buffers.

NOTE: the capacity is *shared*, and rows are *per replica*. The application
has ``capacity`` slots, handed out by its one slot manager to whichever
replica admits a request: any replica may lease any slot, so replicas that
come and go (autoscaling, a crashed replica replaced under a new id) need no
range of slots assigned to them, and a slot freed by one replica is at once
free for all. A replica, though, only ever holds a few of them at a time
(``rows``), and its per-request buffers (the draft window cache, the target's
request-to-token table, the prefix cache's chains) are sized for that, not
for the whole application: ``rows + 1`` rows, row 0 still the padding row.

So each lease gets a *local row*, ``1..rows``, lowest free first, for the
whole life of the lease: the engine sees the row as its slot and indexes
every per-request buffer by it. The row is as stable as the slot (it changes
only when the lease does), never a batch row; the lease's epoch is the
manager's, unique across the application, so a row reused by the next lease
always sees a new epoch and starts empty, whichever replica held the global
slot before.

The slot manager stays off the per-token path: the mapping is a local lookup,
made when a lease is taken (one ``allocate_many`` per step's admissions, as
before) and dropped when it is released. A replica whose rows are all held
refuses further admissions itself (``SlotsExhausted``, no manager call), and
the engine waits for one of its own requests to end, exactly as when the
application's slots run out.

Not thread-safe: the engine calls it from its one thread, as it does any slot
service. Plain Python (no torch, no ray): ``slots`` is anything with the
``SlotService`` methods, the Ray facade over the manager or a ``SlotRegistry``.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .registry import SlotLease, SlotsExhausted, SyncResult

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Held:
    lease: SlotLease  # the application's lease: global slot, epoch, owner
    row: int  # this replica's buffer row for it

    @property
    def local(self) -> SlotLease:
        """The lease as the engine sees it: the row in place of the global slot."""
        return SlotLease(self.lease.req_id, self.row, self.lease.epoch, self.lease.owner)


class ReplicaSlots:
    """A ``SlotService`` whose leases carry a local buffer row in ``1..rows`` instead of the global slot.

    Args:
        slots: the application's slot service (``allocate_many``, ``release_many``, ``sync``).
        rows: leases this replica holds at most; its per-slot buffers have ``rows + 1`` rows.
    """

    def __init__(self, slots, rows: int, app_capacity: int | None = None) -> None:
        if rows < 1:
            raise ValueError(f"a replica needs at least one row, got {rows}")
        self.slots = slots
        self.rows = rows
        # A replica whose share is the whole application (one replica, the default) leaves refusals to
        # the slot manager: its rows run out exactly when the application's slots do, and the manager
        # counts every refusal (dspark_slot_exhausted, the Slots dashboard).
        self.whole_app = app_capacity is not None and rows >= app_capacity
        self._free = list(range(1, rows + 1))  # a heap; sorted is a valid heap
        self._held: dict[str, _Held] = {}

    def allocate_many(self, req_ids: Sequence[str], owner: str = "") -> list[SlotLease]:
        """Leases for ``req_ids`` (in order), all or nothing; an id already held gets its lease back.

        Raises ``SlotsExhausted`` (changing nothing) when this replica has too
        few free rows, without asking the slot manager, or when the
        application's slots run out.
        """
        new = list(dict.fromkeys(r for r in req_ids if r not in self._held))
        short = SlotsExhausted(
            f"need {len(new)} free row(s), {len(self._free)} of this replica's {self.rows} free; its "
            "requests wait for one of its own to end (raise replica_capacity to hold more at once)"
        )
        if len(new) > len(self._free) and not self.whole_app:
            raise short
        if new:
            leases = self.slots.allocate_many(new, owner)
            if len(leases) > len(self._free):  # the manager had slots this replica has no rows for
                self.slots.release_many([(lease.req_id, lease.epoch) for lease in leases])
                raise short
            for lease in leases:
                self._held[lease.req_id] = _Held(lease, heapq.heappop(self._free))
        return [self._held[r].local for r in req_ids]

    def release_many(self, req_ids_with_epochs: Iterable[tuple[str, int | None]]) -> list[bool]:
        """Frees the rows, then the application's slots; one bool per item, True when the slot was freed.

        The rows are freed first and whatever the slot manager answers: the
        engine has ended these requests. A slot whose release does not reach
        the manager is reclaimed by the next ``sync``, which no longer reports it.
        """
        items = list(req_ids_with_epochs)
        self._drop_rows(items)
        return self.slots.release_many(items)

    def _drop_rows(self, items: list[tuple[str, int | None]]) -> None:
        for req_id, epoch in items:
            held = self._held.get(req_id)
            if held is not None and epoch in (None, held.lease.epoch):
                self._drop(held)

    def release_many_nowait(self, req_ids_with_epochs: Iterable[tuple[str, int | None]]) -> None:
        """``release_many`` without waiting for the slot manager, where the service can send without
        waiting (``release_many_nowait``: the Ray facade); otherwise ``release_many``."""
        items = list(req_ids_with_epochs)
        nowait = getattr(self.slots, "release_many_nowait", None)
        if nowait is None:
            self.release_many(items)
            return
        self._drop_rows(items)
        nowait(items)

    def sync(self, owner: str, leases: list[SlotLease]) -> SyncResult:
        """The heartbeat, translated: ``leases`` (rows) are what the engine holds.

        Rows the engine no longer reports are freed (and returned as
        ``reclaimed``), and so are their slots, by the manager, which no
        longer hears of them. ``conflicts`` are the engine's leases it must
        end: those the manager gave to someone else meanwhile, and any this
        replica never handed out.
        """
        reported: dict[str, _Held] = {}
        conflicts: list[SlotLease] = []
        for lease in leases:
            held = self._held.get(lease.req_id)
            if held is not None and held.local == lease:
                reported[lease.req_id] = held
            else:
                conflicts.append(lease)
        if conflicts:
            log.error("the engine reports leases this replica did not hand out: %s", conflicts)
        dropped = [held for req_id, held in self._held.items() if req_id not in reported]
        for held in dropped:
            self._drop(held)
        result = self.slots.sync(owner, [held.lease for held in reported.values()])
        conflicts += [reported[lease.req_id].local for lease in result.conflicts if lease.req_id in reported]
        return SyncResult(reclaimed=[held.local for held in dropped], conflicts=conflicts, draining=result.draining)

    def keepalive(self, owner: str) -> None:
        """The application's slot service hears that ``owner`` is alive (if it keeps owners' clocks).
        The one method that may be called from another thread than the engine's: it reads no state."""
        keepalive = getattr(self.slots, "keepalive", None)
        if keepalive is not None:
            keepalive(owner)

    def set_draining(self, draining: bool) -> bool:
        """The application's drain switch, on the slot service."""
        return self.slots.set_draining(draining)

    def lookup(self, req_id: str) -> tuple[SlotLease, int] | None:
        """``req_id``'s application lease and its row here, or None."""
        held = self._held.get(req_id)
        return None if held is None else (held.lease, held.row)

    def in_use(self) -> int:
        """Rows held by live leases."""
        return len(self._held)

    def _drop(self, held: _Held) -> None:
        del self._held[held.lease.req_id]
        heapq.heappush(self._free, held.row)
