"""TokenKVAllocator and ReqToTokenTable: examples and a state machine checking that no KV token is lost or shared."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from dspark_ray.slots import KVPoolExhausted, ReqToTokenTable, TokenKVAllocator


def test_allocator_never_hands_out_the_padding_token():
    allocator = TokenKVAllocator(6)
    assert allocator.allocate(5).tolist() == [1, 2, 3, 4, 5]
    assert allocator.available() == 0


def test_allocator_exhaustion_raises_and_changes_nothing():
    allocator = TokenKVAllocator(5)
    first = allocator.allocate(2)
    with pytest.raises(KVPoolExhausted, match="enlarge the KV pool"):
        allocator.allocate(3)
    assert allocator.available() == 2
    assert sorted(allocator.allocate(2).tolist() + first.tolist()) == [1, 2, 3, 4]


def test_freed_tokens_are_reused():
    allocator = TokenKVAllocator(8)
    tokens = allocator.allocate(4)
    allocator.free(tokens[1:3])
    assert allocator.available() == 5
    assert allocator.allocate(2).tolist() == tokens[1:3].tolist()


@pytest.mark.parametrize("bad", [[2], [3, 3], [0], [9]], ids=["double", "duplicate", "padding", "outside"])
def test_allocator_refuses_a_bad_free_and_changes_nothing(bad):
    allocator = TokenKVAllocator(9)
    allocator.allocate(4)  # 1..4 in use
    allocator.free(torch.tensor([2]))
    with pytest.raises(ValueError):
        allocator.free(torch.tensor(bad))
    assert allocator.available() == 5
    assert sorted(allocator.allocate(5).tolist()) == [2, 5, 6, 7, 8]


def test_table_has_a_padding_row_and_int32_entries():
    table = ReqToTokenTable(capacity=3, max_context=16, kv_pool_size=32)
    assert table.table.shape == (4, 16) and table.table.dtype == torch.int32
    assert table.lengths.shape == (4,)
    with pytest.raises(ValueError, match="0 is padding"):
        table.append([0], [1])


def test_append_writes_each_slots_new_positions_in_order():
    table = ReqToTokenTable(capacity=3, max_context=8, kv_pool_size=32)
    first = table.append([2, 1], [3, 2])
    assert first.tolist() == [1, 2, 3, 4, 5]
    second = table.append([2], [1])
    assert table.tokens(2).tolist() == first[:3].tolist() + second.tolist()
    assert table.tokens(1).tolist() == first[3:].tolist()
    assert table.lengths.tolist() == [0, 2, 4, 0]
    assert not table.table[0].any() and not table.table[3].any()


def test_truncate_frees_the_tail_and_keeps_the_head():
    table = ReqToTokenTable(capacity=2, max_context=8, kv_pool_size=16)
    tokens = table.append([1], [6])
    available = table.available()
    table.truncate([1], [2])  # 4 provisional tokens rejected
    assert table.tokens(1).tolist() == tokens[:2].tolist()
    assert table.available() == available + 4
    assert not table.table[1, 2:].any(), "positions past the length point at the padding token"
    table.release([1])
    assert table.available() == 15 and int(table.lengths[1]) == 0


def test_append_is_all_or_nothing():
    table = ReqToTokenTable(capacity=2, max_context=4, kv_pool_size=6)
    table.append([1], [2])
    before = (table.table.clone(), table.lengths.clone(), table.available())
    with pytest.raises(ValueError, match="max_context"):
        table.append([2, 1], [1, 3])
    with pytest.raises(KVPoolExhausted):
        table.append([2, 1], [2, 2])  # 4 tokens, 3 free
    assert torch.equal(table.table, before[0]) and torch.equal(table.lengths, before[1])
    assert table.available() == before[2]


def test_truncate_refuses_to_lengthen():
    table = ReqToTokenTable(capacity=2, max_context=4, kv_pool_size=6)
    table.append([1], [2])
    with pytest.raises(ValueError):
        table.truncate([1], [3])
    with pytest.raises(ValueError, match="once per call"):
        table.truncate([1, 1], [1, 1])


CAPACITY, MAX_CONTEXT, POOL = 3, 6, 12
SLOTS = st.integers(1, CAPACITY)


class TableMachine(RuleBasedStateMachine):
    """Random appends, rollbacks and releases; every KV token is either free or in exactly one place."""

    def __init__(self) -> None:
        super().__init__()
        self.table = ReqToTokenTable(CAPACITY, MAX_CONTEXT, POOL)
        self.model: dict[int, list[int]] = {s: [] for s in range(1, CAPACITY + 1)}

    @rule(slots=st.lists(SLOTS, min_size=1, max_size=CAPACITY, unique=True), data=st.data())
    def append(self, slots, data):
        counts = [data.draw(st.integers(0, 4)) for _ in slots]
        fits = all(len(self.model[s]) + n <= MAX_CONTEXT for s, n in zip(slots, counts))
        if not fits or sum(counts) > self.table.available():
            with pytest.raises((ValueError, KVPoolExhausted)):
                self.table.append(slots, counts)
            return
        tokens = self.table.append(slots, counts).tolist()
        for s, n in zip(slots, counts):
            self.model[s] += tokens[:n]
            tokens = tokens[n:]

    @rule(slot=SLOTS, data=st.data())
    def roll_back(self, slot, data):
        length = data.draw(st.integers(0, len(self.model[slot])))
        self.table.truncate([slot], [length])
        del self.model[slot][length:]

    @rule(slot=SLOTS)
    def release(self, slot):
        self.table.release([slot])
        self.model[slot] = []

    @invariant()
    def table_matches_the_model(self):
        for slot, tokens in self.model.items():
            assert self.table.tokens(slot).tolist() == tokens
            assert not self.table.table[slot, len(tokens) :].any()
        assert not self.table.table[0].any()

    @invariant()
    def every_token_is_free_or_held_once(self):
        held = [t for tokens in self.model.values() for t in tokens]
        assert len(held) == len(set(held)) and 0 not in held
        assert len(held) + self.table.available() == POOL - 1

    def teardown(self) -> None:
        held = {t for tokens in self.model.values() for t in tokens}
        rest = set(self.table.allocator.allocate(self.table.available()).tolist())
        assert held | rest == set(range(1, POOL)) and not held & rest


TableMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
TestTableMachine = TableMachine.TestCase
