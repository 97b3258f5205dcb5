"""ReplicaSlots: the application's slots shared by replicas, each lease on a row of its replica's buffers.

Examples and a hypothesis state machine on plain registries (no Ray, no
torch), then two in-process engines leasing from one registry: each engine's
buffers have rows for its own share only, so a lease of a global slot beyond
that share would index past them if the engine saw global slots; the output
of every request is the solo run's.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from dspark_ray.engine import Engine, EngineConfig, SamplingParams
from dspark_ray.engine.local import make_draft_proposer, make_target_runner
from dspark_ray.slots import ReplicaSlots, SlotLease, SlotRegistry, SlotsExhausted
from dspark_ray.tokenizer import Tokenizer
from engine_fixtures import TinyModels, collect, make_engine, tiny_models  # noqa: F401 - fixture


def held_globally(registry: SlotRegistry, owner: str) -> dict[str, SlotLease]:
    return {h.lease.req_id: h.lease for h in registry.snapshot().live if h.lease.owner == owner}


def state(registry: SlotRegistry) -> tuple:
    """The registry's leases and counters (not the hold times, which move on)."""
    snap = registry.snapshot()
    return tuple(h.lease for h in snap.live), snap.counters


# --- examples ---------------------------------------------------------------


def test_each_lease_gets_a_local_row_and_keeps_the_managers_slot_and_epoch():
    registry = SlotRegistry(4)
    a, b = ReplicaSlots(registry, rows=2), ReplicaSlots(registry, rows=2)
    a_leases = a.allocate_many(["a1", "a2"], "A")
    b_leases = b.allocate_many(["b1", "b2"], "B")
    assert [lease.slot for lease in a_leases] == [1, 2] and [lease.slot for lease in b_leases] == [1, 2]
    glob = {h.lease.req_id: h.lease for h in registry.snapshot().live}
    assert sorted(lease.slot for lease in glob.values()) == [1, 2, 3, 4]  # never the same slot twice
    for lease in a_leases + b_leases:
        g = glob[lease.req_id]
        assert (lease.epoch, lease.owner) == (g.epoch, g.owner)
        replica = a if lease.owner == "A" else b
        assert replica.lookup(lease.req_id) == (g, lease.slot)
    assert {glob["b1"].slot, glob["b2"].slot} == {3, 4}  # beyond b's two rows: b's buffers never see them


def test_a_full_replica_refuses_without_asking_the_manager_and_changes_nothing():
    registry = SlotRegistry(8)
    a = ReplicaSlots(registry, rows=2)
    a.allocate_many(["a1"], "A")
    before = state(registry)
    with pytest.raises(SlotsExhausted, match="replica_capacity"):
        a.allocate_many(["a2", "a3"], "A")
    assert state(registry) == before  # not even counted as the application's exhaustion
    assert a.in_use() == 1 and a.lookup("a2") is None
    assert [lease.slot for lease in a.allocate_many(["a2"], "A")] == [2]


def test_a_replica_holding_the_whole_application_leaves_refusals_to_the_manager():
    """One replica (the default): its rows run out with the application's slots, and the manager
    counts the refusal (the Slots dashboard's exhaustion panel)."""
    registry = SlotRegistry(2)
    a = ReplicaSlots(registry, rows=2, app_capacity=2)
    a.allocate_many(["a1", "a2"], "A")
    exhausted = registry.snapshot().counters.exhausted
    with pytest.raises(SlotsExhausted):
        a.allocate_many(["a3"], "A")
    assert registry.snapshot().counters.exhausted == exhausted + 1
    assert a.in_use() == 2 and len(registry.snapshot().live) == 2


def test_slots_granted_beyond_the_rows_go_back():
    """Rows said to cover the application but fewer than its slots (a misconfiguration): what the
    manager grants beyond the free rows is released, and the admission refused."""
    registry = SlotRegistry(4)
    a = ReplicaSlots(registry, rows=2, app_capacity=2)
    a.allocate_many(["a1"], "A")
    with pytest.raises(SlotsExhausted, match="replica_capacity"):
        a.allocate_many(["a2", "a3"], "A")
    assert a.in_use() == 1 and sorted(h.lease.req_id for h in registry.snapshot().live) == ["a1"]


def test_the_applications_exhaustion_passes_through_and_changes_nothing():
    registry = SlotRegistry(3)
    a, b = ReplicaSlots(registry, rows=2), ReplicaSlots(registry, rows=2)
    a.allocate_many(["a1", "a2"], "A")
    b.allocate_many(["b1"], "B")
    with pytest.raises(SlotsExhausted, match="raise the slot capacity"):
        b.allocate_many(["b2"], "B")
    assert b.in_use() == 1 and b.lookup("b2") is None
    assert registry.snapshot().counters.exhausted == 1


def test_ids_already_held_get_their_lease_back_and_duplicates_take_one_row():
    registry = SlotRegistry(4)
    a = ReplicaSlots(registry, rows=2)
    first = a.allocate_many(["x"], "A")[0]
    leases = a.allocate_many(["x", "y", "y"], "A")
    assert leases[0] == first and leases[1] == leases[2] and leases[1].slot == 2
    assert registry.counters().allocations == 2


def test_release_frees_row_and_slot_and_a_reused_row_sees_a_new_epoch():
    registry = SlotRegistry(4)
    a = ReplicaSlots(registry, rows=2)
    old = a.allocate_many(["x"], "A")[0]
    assert a.release_many([("x", old.epoch - 1)]) == [False]  # a stale epoch frees nothing
    assert a.in_use() == 1
    assert a.release_many([("x", old.epoch)]) == [True]
    assert a.in_use() == 0 and registry.in_use() == 0
    new = a.allocate_many(["y"], "A")[0]
    assert new.slot == old.slot and new.epoch > old.epoch  # the row's buffers start empty for y


class FailingReleases:
    """A slot service whose releases fail (the manager unreachable), the rest passed through."""

    def __init__(self, inner: SlotRegistry) -> None:
        self.inner = inner

    def allocate_many(self, req_ids, owner=""):
        return self.inner.allocate_many(req_ids, owner)

    def release_many(self, items):
        raise RuntimeError("slot manager unreachable")

    def sync(self, owner, leases):
        return self.inner.sync(owner, leases)


def test_a_release_that_fails_frees_the_row_and_the_next_heartbeat_frees_the_slot():
    registry = SlotRegistry(4)
    a = ReplicaSlots(FailingReleases(registry), rows=2)
    x, y = a.allocate_many(["x", "y"], "A")
    with pytest.raises(RuntimeError):
        a.release_many([("x", x.epoch)])
    assert a.in_use() == 1 and registry.in_use() == 2  # the engine ended x: its row is free already
    result = a.sync("A", [y])
    assert result.conflicts == [] and result.reclaimed == []
    assert set(held_globally(registry, "A")) == {"y"}  # the manager freed x, which A no longer reports


def test_heartbeat_restores_global_leases_after_a_manager_restart():
    registry = SlotRegistry(4)
    a, b = ReplicaSlots(registry, rows=2), ReplicaSlots(registry, rows=2)
    a.allocate_many(["a1"], "A")
    b_leases = b.allocate_many(["b1", "b2"], "B")
    before = held_globally(registry, "B")
    fresh = SlotRegistry(4)  # the manager restarted empty
    a.slots = b.slots = fresh
    assert b.sync("B", b_leases).conflicts == []
    assert held_globally(fresh, "B") == before  # same global slots and epochs, not the rows


def test_heartbeat_conflicts_come_back_as_the_engines_leases_and_abort_frees_them():
    registry = SlotRegistry(2)
    a, b = ReplicaSlots(registry, rows=2), ReplicaSlots(registry, rows=2)
    a_lease = a.allocate_many(["a1"], "A")[0]
    b.allocate_many(["b1"], "B")
    fresh = SlotRegistry(2)  # restarted; B re-registers late, after A's slot went to someone else
    a.slots = b.slots = fresh
    fresh.allocate_many(["intruder"], "C")  # takes slot 1, A's global slot
    result = a.sync("A", [a_lease])
    assert result.conflicts == [a_lease]  # in the engine's terms: its row, not the global slot
    assert a.in_use() == 1  # the engine ends that request, which releases it
    assert a.release_many([("a1", a_lease.epoch)]) == [False]  # stale for the manager
    assert a.in_use() == 0 and set(held_globally(fresh, "C")) == {"intruder"}


def test_heartbeat_frees_rows_the_engine_no_longer_reports_and_flags_leases_it_never_had():
    registry = SlotRegistry(4)
    a = ReplicaSlots(registry, rows=3)
    x, y = a.allocate_many(["x", "y"], "A")
    stranger = SlotLease("z", 3, 1, "A")
    result = a.sync("A", [y, stranger])
    assert result.reclaimed == [x] and result.conflicts == [stranger]
    assert a.lookup("x") is None and set(held_globally(registry, "A")) == {"y"}


def test_a_replica_needs_a_row():
    with pytest.raises(ValueError, match="at least one row"):
        ReplicaSlots(SlotRegistry(2), rows=0)


# --- a state machine: two replicas, one registry ----------------------------


class TwoReplicas(RuleBasedStateMachine):
    """Two replicas (3 rows each) lease from 5 shared slots: random admissions, releases, heartbeats."""

    CAPACITY, ROWS = 5, 3

    def __init__(self) -> None:
        super().__init__()
        self.registry = SlotRegistry(self.CAPACITY)
        self.replicas = {"A": ReplicaSlots(self.registry, self.ROWS), "B": ReplicaSlots(self.registry, self.ROWS)}
        self.model: dict[str, dict[str, SlotLease]] = {"A": {}, "B": {}}  # what each engine holds
        self.next_id = 0

    owners = st.sampled_from(["A", "B"])

    @rule(owner=owners, n=st.integers(1, 4))
    def admit(self, owner: str, n: int) -> None:
        ids = [f"{owner}{self.next_id + i}" for i in range(n)]
        self.next_id += n
        free_rows = self.ROWS - len(self.model[owner])
        free_slots = self.CAPACITY - sum(len(m) for m in self.model.values())
        before = state(self.registry)[0]
        try:
            leases = self.replicas[owner].allocate_many(ids, owner)
        except SlotsExhausted:
            assert n > min(free_rows, free_slots)
            assert state(self.registry)[0] == before
            return
        assert n <= min(free_rows, free_slots)
        self.model[owner].update({lease.req_id: lease for lease in leases})

    @rule(owner=owners, data=st.data())
    def release(self, owner: str, data) -> None:
        if not self.model[owner]:
            return
        req_id = data.draw(st.sampled_from(sorted(self.model[owner])))
        lease = self.model[owner].pop(req_id)
        assert self.replicas[owner].release_many([(req_id, lease.epoch)]) == [True]

    @rule(owner=owners, data=st.data())
    def heartbeat(self, owner: str, data) -> None:
        """The engine reports what it holds; sometimes it lost track of one (freed by the heartbeat)."""
        held = self.model[owner]
        lost = data.draw(st.sets(st.sampled_from(sorted(held)), max_size=1)) if held else set()
        for req_id in lost:
            held.pop(req_id)
        result = self.replicas[owner].sync(owner, list(held.values()))
        assert result.conflicts == [] and {lease.req_id for lease in result.reclaimed} == lost

    @invariant()
    def rows_and_slots_are_consistent(self) -> None:
        live = self.registry.snapshot().live
        assert len({h.lease.slot for h in live}) == len(live)  # no global slot held twice
        for owner, replica in self.replicas.items():
            held = self.model[owner]
            rows = [lease.slot for lease in held.values()]
            assert len(set(rows)) == len(rows) and all(1 <= r <= self.ROWS for r in rows)
            assert set(held_globally(self.registry, owner)) == set(held) and replica.in_use() == len(held)
            for req_id, lease in held.items():
                glob, row = replica.lookup(req_id)
                assert row == lease.slot and glob.epoch == lease.epoch
        c = self.registry.counters()
        assert c.allocations - c.releases == len(live)


TwoReplicas.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestTwoReplicas = TwoReplicas.TestCase


# --- two in-process engines, one registry -----------------------------------

PROMPTS = ["ROMEO:\nBut soft", "To be, or not", "KING:\nOnce more", "First Citizen:\nBefore we",
           "VIOLA:\nI thank", "MARIA:\nAy, he"]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def replica_engine(models: TinyModels, registry: SlotRegistry, owner: str, rows: int) -> Engine:
    """An engine whose buffers have ``rows`` rows, leasing from the application's ``registry``."""
    config = EngineConfig(model=str(models.target), draft=str(models.drafts["near"]), capacity=rows,
                          max_context=64, max_num_seqs=rows)
    tokenizer = Tokenizer.from_path(config.model)
    target = make_target_runner(config, tokenizer.vocab_size)
    draft = make_draft_proposer(config, tokenizer.vocab_size)
    assert target.table.table.shape[0] == draft.cache.k[0].shape[0] == rows + 1
    return Engine(config, tokenizer, ReplicaSlots(registry, rows), target, draft, owner=owner)


def test_two_engines_share_the_slots_with_buffers_for_their_own_rows(tiny_models: TinyModels):
    registry = SlotRegistry(4)
    engines = {"A": replica_engine(tiny_models, registry, "A", 2), "B": replica_engine(tiny_models, registry, "B", 2)}
    ids = {}
    for i, prompt in enumerate(PROMPTS):  # three each: one of them waits for a row of its own replica
        owner = "AB"[i % 2]
        ids[engines[owner].add_request(prompt, GREEDY, f"{owner}{i}")] = prompt
    results, beyond_rows = {}, set()
    for _ in range(500):
        if not any(e.has_unfinished() for e in engines.values()):
            break
        for owner, engine in engines.items():
            collect(engine, results, engine.step())
            live = registry.snapshot().live
            assert len({h.lease.slot for h in live}) == len(live)
            beyond_rows |= {h.lease.owner for h in live if h.lease.slot > 2}
            assert engine.slots.in_use() <= 2
            engine.sync_slots()
    assert not any(e.has_unfinished() for e in engines.values())
    assert beyond_rows, "no engine ever held a global slot beyond its rows: the test proved nothing"

    reference = make_engine(tiny_models.target, tiny_models.drafts["near"], max_context=64)
    for req_id, prompt in ids.items():
        solo_id = reference.add_request(prompt, GREEDY)
        alone: dict = {}
        while reference.has_unfinished():
            collect(reference, alone, reference.step())
        assert results[req_id].token_ids == alone[solo_id].token_ids, f"{req_id} differs from its solo run"

    snap = registry.snapshot()
    assert snap.live == () and snap.counters.allocations == snap.counters.releases == len(PROMPTS)
    assert snap.counters.stale_releases == 0
    for engine in engines.values():
        assert engine.slots.in_use() == 0
        assert engine.target.kv_free() == engine.target.kv_capacity()
