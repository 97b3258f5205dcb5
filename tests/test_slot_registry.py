"""SlotRegistry: examples, a hypothesis state machine against a model, and threads."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dspark_ray.slots import (
    PADDING_SLOT,
    SlotConflict,
    SlotCounters,
    SlotLease,
    SlotRegistry,
    SlotsExhausted,
    UnknownRequest,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def state(registry: SlotRegistry) -> tuple:
    """Everything a failed call must leave alone (the exhausted counter aside)."""
    snap = registry.snapshot()
    counters = (snap.counters.allocations, snap.counters.releases, snap.counters.restored)
    return snap.free, tuple(held.lease for held in snap.live), counters


# --- examples ---------------------------------------------------------------


def test_lowest_free_slot_first_and_epochs_strictly_increase():
    registry = SlotRegistry(4)
    a, b, c = (registry.allocate(r) for r in "abc")
    assert [a.slot, b.slot, c.slot] == [1, 2, 3]
    assert registry.release("b")
    assert registry.release("a")
    d = registry.allocate("d")
    assert d.slot == 1  # lowest free, not the last freed
    assert a.epoch < b.epoch < c.epoch < d.epoch


def test_the_drain_switch_is_reported_with_every_heartbeat_and_changes_no_lease():
    reg = SlotRegistry(4)
    lease = reg.allocate("a", "owner")
    assert reg.sync("owner", [lease]).draining is False
    assert reg.set_draining(True) is True and reg.draining
    result = reg.sync("owner", [lease])
    assert result.draining is True and result.reclaimed == [] and result.conflicts == []
    assert reg.allocate("b", "owner").slot == 2  # the registry still hands out slots; servers stop admitting
    assert reg.set_draining(False) is False and reg.sync("owner", [lease]).draining is False


def test_allocating_a_live_id_returns_its_lease_unchanged():
    registry = SlotRegistry(2)
    lease = registry.allocate("a", owner="x")
    assert registry.allocate("a", owner="y") == lease
    assert registry.allocate_many(["a", "b", "a"]) == [lease, registry.lookup("b"), lease]
    assert registry.counters().allocations == 2


def test_exhaustion_raises_and_changes_nothing():
    registry = SlotRegistry(2)
    registry.allocate_many(["a", "b"])
    before = state(registry)
    with pytest.raises(SlotsExhausted, match="raise the slot capacity"):
        registry.allocate("c")
    assert state(registry) == before
    assert registry.counters().exhausted == 1


def test_allocate_many_is_all_or_nothing():
    registry = SlotRegistry(3)
    registry.allocate("a")
    before = state(registry)
    with pytest.raises(SlotsExhausted):
        registry.allocate_many(["a", "b", "c", "d"])  # 3 new ids, 2 free slots
    assert state(registry) == before
    assert [lease.slot for lease in registry.allocate_many(["a", "b", "c"])] == [1, 2, 3]


def test_stale_and_unknown_releases_change_nothing_and_are_counted():
    registry = SlotRegistry(2)
    old = registry.allocate("a")
    assert registry.release("a", old.epoch)
    new = registry.allocate("a")  # same id and slot, new epoch
    assert (new.slot, new.epoch > old.epoch) == (old.slot, True)
    assert not registry.release("a", old.epoch)  # a late retry of the first release
    assert not registry.release("nobody")
    assert registry.lookup("a") == new
    assert registry.counters() == SlotCounters(allocations=2, releases=1, stale_releases=2)


def test_release_many_reports_each_item():
    registry = SlotRegistry(3)
    a, b = registry.allocate_many(["a", "b"])
    assert registry.release_many([("a", a.epoch), ("b", b.epoch + 1), ("zz", None), ("b", None)]) == [
        True,
        False,
        False,
        True,
    ]
    assert registry.snapshot().free == 3


def test_row_to_slot_maps_padding_to_slot_zero_and_rejects_unknown_ids():
    registry = SlotRegistry(4)
    registry.allocate_many(["a", "b", "c"])
    registry.release("a")
    assert registry.row_to_slot(["c", None, "b", None]) == [3, PADDING_SLOT, 2, PADDING_SLOT]
    with pytest.raises(UnknownRequest, match="'a'"):
        registry.row_to_slot(["b", "a"])


def test_reconcile_frees_only_the_owners_dead_requests():
    registry = SlotRegistry(5)
    registry.allocate_many(["a1", "a2", "a3"], owner="A")
    b1 = registry.allocate("b1", owner="B")
    freed = registry.reconcile("A", live_req_ids={"a2"})
    assert [(lease.req_id, lease.slot) for lease in freed] == [("a1", 1), ("a3", 3)]
    assert {held.lease.req_id for held in registry.snapshot().live} == {"a2", "b1"}
    assert registry.lookup("b1") == b1
    assert registry.reconcile("A", ["a2"]) == []


def test_snapshot_reports_hold_times_and_the_hook_sees_every_release():
    clock = FakeClock()
    released: list[tuple[SlotLease, float]] = []
    registry = SlotRegistry(4, clock=clock, on_release=lambda lease, held: released.append((lease, held)))
    a = registry.allocate("a", owner="o")
    clock.now += 2.0
    b = registry.allocate("b", owner="o")
    clock.now += 3.0
    snap = registry.snapshot()
    assert [(h.lease, h.held_s) for h in snap.live] == [(a, 5.0), (b, 3.0)]
    assert (snap.capacity, snap.free, snap.in_use) == (4, 2, 2)
    registry.release("a")
    clock.now += 1.0
    registry.reconcile("o", [])
    assert released == [(a, 5.0), (b, 4.0)]


def test_restore_reinstalls_leases_and_epochs_continue_above_them():
    registry = SlotRegistry(4)
    leases = [SlotLease("x", 3, 900, "A"), SlotLease("y", 1, 700, "A")]
    registry.restore("A", leases)
    registry.restore("A", leases[:1])  # already installed unchanged: a no-op
    assert registry.row_to_slot(["x", "y"]) == [3, 1]
    fresh = registry.allocate("z", owner="B")
    assert (fresh.slot, fresh.epoch) == (2, 901)
    counters = registry.counters()
    assert (counters.allocations, counters.restored, registry.in_use()) == (1, 2, 3)


@pytest.mark.parametrize(
    "lease, error",
    [
        (SlotLease("new", 1, 50, "A"), SlotConflict),  # slot 1 held by "held"
        (SlotLease("held", 2, 50, "A"), SlotConflict),  # the id holds slot 1
        (SlotLease("new", 9, 50, "A"), SlotConflict),  # beyond capacity
        (SlotLease("new", 2, 50, "B"), ValueError),  # another owner's lease
    ],
)
def test_restore_refuses_conflicts_and_changes_nothing(lease, error):
    registry = SlotRegistry(4)
    registry.restore("A", [SlotLease("held", 1, 10, "A")])
    before = state(registry)
    with pytest.raises(error):
        registry.restore("A", [SlotLease("ok", 3, 60, "A"), lease])
    assert state(registry) == before


def test_restore_refuses_two_leases_on_one_slot():
    registry = SlotRegistry(4)
    with pytest.raises(SlotConflict):
        registry.restore("A", [SlotLease("p", 2, 5, "A"), SlotLease("q", 2, 6, "A")])
    assert registry.snapshot().free == 4


def test_invalid_capacity_is_refused():
    with pytest.raises(ValueError):
        SlotRegistry(0)


def test_importing_the_registry_loads_neither_torch_nor_ray():
    code = (
        "import sys; from dspark_ray.slots import SlotRegistry; SlotRegistry(1).allocate('a'); "
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- a state machine against a model ----------------------------------------

REQ_IDS = st.sampled_from([f"r{i}" for i in range(10)])
OWNERS = st.sampled_from(["A", "B"])
CAPACITY = 5


class RegistryMachine(RuleBasedStateMachine):
    """Random allocate / release / reconcile / restore against a dict-and-set model."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.hooked: list[tuple[SlotLease, float]] = []
        self.registry = SlotRegistry(
            CAPACITY, clock=self.clock, on_release=lambda lease, held: self.hooked.append((lease, held))
        )
        self.live: dict[str, SlotLease] = {}
        self.since: dict[str, float] = {}
        self.dead: list[SlotLease] = []  # released leases: stale epochs, restore candidates
        self.max_epoch = 0
        self.counters = dict(allocations=0, releases=0, stale_releases=0, exhausted=0, restored=0)

    # model helpers
    def free_slots(self) -> list[int]:
        taken = {lease.slot for lease in self.live.values()}
        return [s for s in range(1, CAPACITY + 1) if s not in taken]

    def expect_allocated(self, lease: SlotLease, req_id: str, owner: str) -> None:
        assert lease.slot == min(self.free_slots()), "lowest free slot first"
        assert lease.epoch > self.max_epoch, "epochs only grow"
        assert (lease.req_id, lease.owner) == (req_id, owner)
        self.max_epoch = lease.epoch
        self.live[req_id] = lease
        self.since[req_id] = self.clock.now
        self.counters["allocations"] += 1

    def expect_freed(self, req_id: str) -> None:
        lease = self.live.pop(req_id)
        assert self.hooked.pop(0) == (lease, self.clock.now - self.since.pop(req_id))
        self.dead.append(lease)
        self.counters["releases"] += 1

    def expect_exhausted(self, call) -> None:
        before = state(self.registry)
        with pytest.raises(SlotsExhausted):
            call()
        assert state(self.registry) == before, "a failed call changed nothing"
        self.counters["exhausted"] += 1

    # rules
    @rule(seconds=st.sampled_from([0.0, 0.5, 3.0]))
    def tick(self, seconds):
        self.clock.now += seconds

    @rule(req_id=REQ_IDS, owner=OWNERS)
    def allocate(self, req_id, owner):
        if req_id in self.live:
            assert self.registry.allocate(req_id, owner) == self.live[req_id]
        elif self.free_slots():
            self.expect_allocated(self.registry.allocate(req_id, owner), req_id, owner)
        else:
            self.expect_exhausted(lambda: self.registry.allocate(req_id, owner))

    @rule(req_ids=st.lists(REQ_IDS, max_size=4), owner=OWNERS)
    def allocate_many(self, req_ids, owner):
        new = set(req_ids) - set(self.live)
        if len(new) > len(self.free_slots()):
            self.expect_exhausted(lambda: self.registry.allocate_many(req_ids, owner))
            return
        leases = self.registry.allocate_many(req_ids, owner)
        for req_id, lease in zip(req_ids, leases):
            if req_id in self.live:
                assert lease == self.live[req_id]
            else:
                self.expect_allocated(lease, req_id, owner)

    @rule(req_id=REQ_IDS, kind=st.sampled_from(["right", "none", "stale", "unknown"]))
    def release(self, req_id, kind):
        lease = self.live.get(req_id)
        # Registry epochs start at 1, so 0 is never the live one.
        epoch = {"right": lease.epoch if lease else None, "none": None, "stale": 0, "unknown": None}[kind]
        if kind == "unknown":
            req_id = "never-allocated"
        expect = req_id in self.live and kind in ("right", "none")
        before = state(self.registry)
        assert self.registry.release(req_id, epoch) == expect
        if expect:
            self.expect_freed(req_id)
        else:
            assert state(self.registry) == before
            self.counters["stale_releases"] += 1

    @precondition(lambda self: self.dead)
    @rule(data=st.data())
    def release_a_dead_lease(self, data):
        """A late retry with the epoch of a hold that already ended never frees the new one."""
        old = data.draw(st.sampled_from(self.dead))
        before = state(self.registry)
        assert self.registry.release_many([(old.req_id, old.epoch)]) == [False]
        assert state(self.registry) == before
        self.counters["stale_releases"] += 1

    @rule(owner=OWNERS, keep=st.sets(REQ_IDS))
    def reconcile(self, owner, keep):
        doomed = sorted(
            (lease for lease in self.live.values() if lease.owner == owner and lease.req_id not in keep),
            key=lambda lease: lease.slot,
        )
        assert self.registry.reconcile(owner, keep) == doomed
        self.hooked.sort(key=lambda item: item[0].slot)
        for lease in doomed:
            self.expect_freed(lease.req_id)

    @precondition(lambda self: self.dead)
    @rule(data=st.data())
    def restore(self, data):
        lease = data.draw(st.sampled_from(self.dead))
        taken = {held.slot for held in self.live.values()}
        if lease.req_id in self.live or lease.slot in taken:
            before = state(self.registry)
            with pytest.raises(SlotConflict):
                self.registry.restore(lease.owner, [lease])
            assert state(self.registry) == before
            return
        self.registry.restore(lease.owner, [lease])
        self.dead.remove(lease)
        self.expect_restored(lease)

    @rule(req_id=REQ_IDS, owner=OWNERS, slot=st.integers(1, CAPACITY), jump=st.integers(1, 1000))
    def restore_from_a_previous_life(self, req_id, owner, slot, jump):
        """An owner re-registers a lease issued by an earlier registry, with a higher epoch."""
        lease = SlotLease(req_id, slot, self.max_epoch + jump, owner)
        if req_id in self.live or slot not in self.free_slots():
            before = state(self.registry)
            with pytest.raises(SlotConflict):
                self.registry.restore(owner, [lease])
            assert state(self.registry) == before
            return
        self.registry.restore(owner, [lease])
        self.expect_restored(lease)

    def expect_restored(self, lease: SlotLease) -> None:
        self.live[lease.req_id] = lease
        self.since[lease.req_id] = self.clock.now
        self.max_epoch = max(self.max_epoch, lease.epoch)
        self.counters["restored"] += 1

    @rule(rows=st.lists(st.one_of(st.none(), REQ_IDS), max_size=6))
    def row_to_slot(self, rows):
        if all(r is None or r in self.live for r in rows):
            expect = [0 if r is None else self.live[r].slot for r in rows]
            assert self.registry.row_to_slot(rows) == expect
        else:
            with pytest.raises(UnknownRequest):
                self.registry.row_to_slot(rows)

    # invariants, checked after every step
    @invariant()
    def matches_the_model(self):
        snap = self.registry.snapshot()
        assert {held.lease.req_id: held.lease for held in snap.live} == self.live
        assert all(held.held_s == self.clock.now - self.since[held.lease.req_id] for held in snap.live)
        assert snap.free == len(self.free_slots())
        assert snap.counters == SlotCounters(**self.counters)

    @invariant()
    def slots_are_unique_and_never_padding(self):
        slots = [held.lease.slot for held in self.registry.snapshot().live]
        assert len(slots) == len(set(slots)), "two live requests share a slot"
        assert all(1 <= s <= CAPACITY for s in slots), "slot 0 or out of range is live"

    @invariant()
    def counters_balance(self):
        c = self.registry.counters()
        assert c.allocations + c.restored - c.releases == self.registry.in_use()
        assert not self.hooked, "every freed lease was reported exactly once"


RegistryMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestRegistryMachine = RegistryMachine.TestCase


# --- threads ----------------------------------------------------------------


def test_many_threads_never_share_a_slot_and_lose_nothing():
    capacity, threads, rounds = 12, 8, 400
    registry = SlotRegistry(capacity)
    holders: list[str | None] = [None] * (capacity + 1)
    check = threading.Lock()
    tallies = [dict(allocations=0, exhausted=0) for _ in range(threads)]
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(rounds):
                ids = [f"t{t}-{i}-{j}" for j in range(1 + i % 3)]
                try:
                    leases = registry.allocate_many(ids, owner=f"t{t}")
                except SlotsExhausted:
                    tallies[t]["exhausted"] += 1
                    continue
                tallies[t]["allocations"] += len(leases)
                with check:
                    for lease in leases:
                        assert holders[lease.slot] is None, f"slot {lease.slot} handed out twice"
                        holders[lease.slot] = lease.req_id
                with check:
                    for lease in leases:
                        holders[lease.slot] = None
                assert registry.release_many([(lease.req_id, lease.epoch) for lease in leases]) == [True] * len(leases)
        except BaseException as e:  # surfaced in the main thread below
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[0]
    snap = registry.snapshot()
    allocations = sum(t["allocations"] for t in tallies)
    assert (snap.free, snap.live) == (capacity, ())
    assert snap.counters == SlotCounters(
        allocations=allocations, releases=allocations, exhausted=sum(t["exhausted"] for t in tallies)
    )
