"""DraftWindowCache: rollback, epoch reuse over poisoned rows, the padding row, and a state machine."""

from __future__ import annotations

import itertools

import pytest
import torch
from dspark_kernels.ops import window_attention
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from dspark_ray.slots import DraftWindowCache

LAYERS, CAPACITY, WINDOW, MAX_SPEC, HEADS, DIM = 2, 3, 6, 3, 2, 4


def make_cache(max_spec: int = MAX_SPEC) -> DraftWindowCache:
    return DraftWindowCache(LAYERS, CAPACITY, WINDOW, max_spec, HEADS, DIM)


def kv_value(slot: int, position: int, tag: float = 0.0) -> torch.Tensor:  # [HEADS, DIM]
    """A K value that names its slot, position and tag (0 for accepted tokens)."""
    return torch.arange(HEADS * DIM, dtype=torch.float32).reshape(HEADS, DIM) / 64 + position * 100 + slot * 10 + tag


def write(cache: DraftWindowCache, rows: dict[int, list[int]], tag: float = 0.0) -> None:
    """One batched step: each slot's positions (ragged, padded with -1) plus a padding row on slot 0."""
    slots = list(rows) + [0]
    T = max(len(p) for p in rows.values())
    positions = torch.full((len(slots), T), -1, dtype=torch.int64)  # [B, T]
    positions[-1] = torch.arange(T) + 1000  # the padding row writes real positions into row 0
    k = torch.full((len(slots), T, HEADS, DIM), 7.0)  # [B, T, H, D]
    for b, slot in enumerate(slots[:-1]):
        for t, p in enumerate(rows[slot]):
            positions[b, t] = p
            k[b, t] = kv_value(slot, p, tag)
    for layer in range(LAYERS):
        cache.append(layer, torch.tensor(slots), positions, k + layer, -(k + layer))


def write_history(cache: DraftWindowCache, lengths: dict[int, int], chunk: int = 4) -> None:
    """Positions 0..length-1 of each slot, ``chunk`` tokens per step."""
    for start in range(0, max(lengths.values()), chunk):
        rows = {s: list(range(start, min(n, start + chunk))) for s, n in lengths.items() if start < n}
        write(cache, rows)


def views(cache: DraftWindowCache, slot: int, queries) -> list[tuple[torch.Tensor, ...]]:
    return [cache.gather(layer, slot, p) for layer in range(LAYERS) for p in queries]


def assert_same_views(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for tx, ty in zip(x, y):
            assert torch.equal(tx, ty)


def test_every_per_slot_buffer_has_capacity_plus_one_rows():
    cache = make_cache()
    assert cache.ring == WINDOW + MAX_SPEC
    assert len(cache.k) == len(cache.v) == LAYERS
    for buffer in cache.k + cache.v:
        assert buffer.shape == (CAPACITY + 1, WINDOW + MAX_SPEC, HEADS, DIM)
    assert cache.epoch.shape == cache.length.shape == (CAPACITY + 1,)
    assert cache.epoch.dtype == cache.length.dtype == torch.int64


def test_gather_returns_the_valid_window_in_position_order():
    cache = make_cache()
    cache.bind(torch.tensor([1, 2]), torch.tensor([4, 5]))
    write_history(cache, {2: 14, 1: 3}, chunk=3)  # slot 2 wraps the ring of 9
    k, v, key_positions = cache.gather(1, 2, 13)
    assert key_positions.tolist() == [8, 9, 10, 11, 12, 13]
    assert torch.equal(k, torch.stack([kv_value(2, p) + 1 for p in range(8, 14)]))
    assert torch.equal(v, -k)
    assert cache.gather(0, 1, 2)[2].tolist() == [0, 1, 2]  # clipped at position 0
    assert cache.gather(0, 2, 15)[2].tolist() == [10, 11, 12, 13]  # only positions < length
    assert cache.gather(0, 2, 6)[2].tolist() == [5, 6]  # 1..4 were overwritten by 10..13
    assert int(cache.length[2]) == 14


@pytest.mark.parametrize("history", [4, 9, 23])
@pytest.mark.parametrize("rejected", [1, MAX_SPEC])
def test_rollback_equals_a_cache_that_never_saw_the_rejected_tokens(history, rejected):
    lengths = {1: history, 3: history + 2}
    speculated, clean = make_cache(), make_cache()
    for cache in (speculated, clean):
        cache.bind(torch.tensor([1, 3]), torch.tensor([11, 12]))
        write_history(cache, lengths)

    write(speculated, {s: list(range(n, n + rejected)) for s, n in lengths.items()}, tag=0.5)
    speculated.set_length(torch.tensor([1, 3]), torch.tensor(list(lengths.values())))
    for slot, n in lengths.items():
        # The next query (at n) and all later ones: what a decode step can still ask for.
        queries = range(n - 1, n + WINDOW)
        assert_same_views(views(speculated, slot, queries), views(clean, slot, queries))

    for cache in (speculated, clean):  # the step after: one recovered token each
        write(cache, {s: [n] for s, n in lengths.items()})
    for slot, n in lengths.items():
        queries = range(n, n + WINDOW)
        assert_same_views(views(speculated, slot, queries), views(clean, slot, queries))


def test_a_ring_of_the_window_alone_loses_history_on_rollback():
    """The anchor bug: with no ring space for provisional tokens, rolling back corrupts the window."""
    speculated, clean = make_cache(max_spec=0), make_cache(max_spec=0)
    for cache in (speculated, clean):
        cache.bind(torch.tensor([1]), torch.tensor([1]))
        write_history(cache, {1: 10})
    for p in range(10, 13):
        write(speculated, {1: [p]}, tag=0.5)
    speculated.set_length(torch.tensor([1]), torch.tensor([10]))
    assert not torch.equal(speculated.gather(0, 1, 10)[0], clean.gather(0, 1, 10)[0])


def test_a_slot_rebound_over_poisoned_rows_gathers_like_a_fresh_cache():
    reused, fresh = make_cache(), make_cache()
    reused.bind(torch.tensor([2]), torch.tensor([4]))
    write_history(reused, {2: 20})
    for buffer in reused.k + reused.v:
        buffer[2] = float("nan")  # whatever the previous holder left, even NaN

    for cache in (reused, fresh):
        cache.bind(torch.tensor([2]), torch.tensor([9]))
        assert int(cache.length[2]) == 0
        write_history(cache, {2: 5}, chunk=2)  # leaves most of the poisoned ring untouched
    queries = range(0, 8)
    assert_same_views(views(reused, 2, queries), views(fresh, 2, queries))
    for layer in range(LAYERS):
        view = reused.window_view(layer, torch.tensor([2, 2]), torch.tensor([4, 7]))
        assert not view.k.isnan().any() and not view.v.isnan().any()


def test_binding_the_same_epoch_keeps_the_slot():
    cache = make_cache()
    cache.bind(torch.tensor([1, 2]), torch.tensor([3, 4]))
    write_history(cache, {1: 5, 2: 2})
    cache.bind(torch.tensor([1, 2]), torch.tensor([3, 8]))
    assert cache.length.tolist() == [cache.length[0].item(), 5, 0, 0]


def test_writes_to_the_padding_row_never_change_a_live_row():
    cache = make_cache()
    cache.bind(torch.arange(1, CAPACITY + 1), torch.tensor([1, 2, 3]))
    write_history(cache, {1: 7, 2: 12, 3: 3})
    live = [t[1:].clone() for t in cache.k + cache.v + [cache.epoch, cache.length]]

    positions = torch.tensor([[5, 6, -1], [0, 1, 2], [100, 101, 102]])  # [3, 3]
    noise = torch.randn(3, 3, HEADS, DIM)
    for layer in range(LAYERS):
        cache.append(layer, torch.zeros(3, dtype=torch.int64), positions, noise, noise)
    cache.bind(torch.tensor([0]), torch.tensor([77]))
    cache.set_length(torch.tensor([0]), torch.tensor([0]))

    after = [t[1:] for t in cache.k + cache.v + [cache.epoch, cache.length]]
    assert all(torch.equal(a, b) for a, b in zip(live, after))


def test_set_length_never_exposes_unwritten_positions():
    cache = make_cache()
    cache.bind(torch.tensor([1]), torch.tensor([1]))
    write_history(cache, {1: 3})
    cache.set_length(torch.tensor([1]), torch.tensor([8]))
    assert int(cache.length[1]) == 3


def test_attention_kernel_reads_the_same_window_as_gather():
    """The raw tensors follow the kernels' convention: attention over them equals attention over gather."""
    cache = make_cache()
    cache.bind(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3]))
    write_history(cache, {1: 17, 2: 4, 3: 9})
    slots, positions = torch.tensor([1, 2, 3, 0]), torch.tensor([[16], [3], [8], [-1]])  # [B], [B, 1]
    q = torch.randn(4, 1, HEADS * 2, DIM, generator=torch.Generator().manual_seed(0))  # [B, 1, num_heads, D], 2 per KV head
    scale = DIM**-0.5
    for layer in range(LAYERS):
        out = window_attention(q, cache.k[layer], cache.v[layer], slots, positions, cache.length, WINDOW, scale)
        for b in range(3):
            k, v, _ = cache.gather(layer, int(slots[b]), int(positions[b, 0]))  # [W, H, D]
            k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
            weights = torch.einsum("hd,whd->hw", q[b, 0], k).mul(scale).softmax(-1)
            # The cached values are in the thousands and the two sum in different orders: float32's
            # rounding is a few ulps of them (one failure at 1.39e-6 relative with the default 1.3e-6).
            torch.testing.assert_close(out[b, 0], torch.einsum("hw,whd->hd", weights, v), rtol=1e-5, atol=1e-5)


class CacheMachine(RuleBasedStateMachine):
    """Random rebinds, prefills and speculate-then-roll-back steps against a list-per-slot model."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = make_cache()
        self.history: dict[int, list[float]] = {s: [] for s in range(1, CAPACITY + 1)}
        self.epochs = itertools.count(1)
        self.tags = itertools.count(1)

    def append(self, slot: int, count: int, chunk: int) -> list[float]:
        """Writes ``count`` new positions after the slot's length; returns the tags written."""
        start = int(self.cache.length[slot])
        tags = [float(next(self.tags)) for _ in range(count)]
        for i in range(0, count, chunk):
            positions = torch.tensor([list(range(start + i, start + min(count, i + chunk)))])  # [1, T]
            values = torch.tensor(tags[i : i + chunk])[None, :, None, None].expand(1, -1, HEADS, DIM).contiguous()
            for layer in range(LAYERS):
                self.cache.append(layer, torch.tensor([slot]), positions, values + layer, values)
        return tags

    @rule(slot=st.integers(1, CAPACITY))
    def rebind(self, slot):
        self.cache.bind(torch.tensor([slot]), torch.tensor([next(self.epochs)]))
        self.history[slot] = []

    @rule(slot=st.integers(1, CAPACITY), count=st.integers(1, 12), chunk=st.integers(1, WINDOW + MAX_SPEC))
    def prefill(self, slot, count, chunk):
        self.history[slot] += self.append(slot, count, chunk)

    @rule(slot=st.integers(1, CAPACITY), data=st.data())
    def speculate(self, slot, data):
        proposed = data.draw(st.integers(1, MAX_SPEC))
        accepted = data.draw(st.integers(0, proposed))
        tags = self.append(slot, proposed, chunk=data.draw(st.integers(1, proposed)))
        self.history[slot] += tags[:accepted]
        self.cache.set_length(torch.tensor([slot]), torch.tensor([len(self.history[slot])]))

    @invariant()
    def every_reachable_window_matches_the_model(self):
        for slot, history in self.history.items():
            assert int(self.cache.length[slot]) == len(history)
            for p in range(max(0, len(history) - 1), len(history) + 2):
                keys = list(range(max(0, p - WINDOW + 1), min(p + 1, len(history))))
                for layer in range(LAYERS):
                    k, v, key_positions = self.cache.gather(layer, slot, p)
                    assert key_positions.tolist() == keys
                    assert v[:, 0, 0].tolist() == [history[i] for i in keys]
                    assert torch.equal(k, v + layer)


CacheMachine.TestCase.settings = settings(max_examples=35, stateful_step_count=20, deadline=None)
TestCacheMachine = CacheMachine.TestCase
