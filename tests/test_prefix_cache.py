"""Automatic prefix caching: the block cache as a state machine, then the engine end to end.

The state machine drives ``CachedTable`` (the request-to-token table with the
prefix cache in front) as the target runner does — requests begin in a slot,
map cached blocks, prefill the rest, decode with drafts that are partly
rolled back, end — under a pool small enough that blocks are evicted. The
pool's content is simulated: the "KV" written at a pool index is a digest of
the whole token prefix up to that position (what a transformer's K/V depends
on), so a mapped block is correct exactly when it holds the digests of the
new request's own prefix. Invariants: every slot's positions hold its own
prefix's KV; the pool's indices are partitioned between the allocator's free
list, the slots' private positions and the cache's blocks (no leak, no index
owned twice); reference counts equal the slots that hold each block and a
referenced block is never in the eviction list; when everything has ended
every index is free or evictable.

End to end (tiny models, greedy): with the cache on, requests that share
prefixes produce exactly what they produce with it off (and what
transformers produces), with speculation and chunked prefill; salts keep
requests apart; a request can opt out; a small pool evicts and stays correct.
"""

from __future__ import annotations

import hashlib
import random

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dspark_ray.engine import SamplingParams
from dspark_ray.slots import ReqToTokenTable
from dspark_ray.slots.prefix_cache import CachedTable, PrefixCache
from dspark_ray.slots.req_to_token import KVPoolExhausted
from engine_fixtures import assert_drained, generate, make_engine, tiny_models  # noqa: F401 - fixture
from test_engine_greedy import hf_greedy

BLOCK = 4
SLOTS = 4
MAX_CONTEXT = 40


def kv_of(tokens: list[int]) -> int:
    """The simulated K/V at the last of ``tokens``: a digest of the whole prefix."""
    return int.from_bytes(hashlib.blake2b(repr(tokens).encode(), digest_size=6).digest(), "little")


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv: CachedTable
        self.tokens: dict[int, list[int]] = {}  # slot -> its tokens (positions 0..)
        self.content: dict[int, int] = {}  # pool index -> simulated K/V
        self.hits = 0

    @initialize(pool=st.integers(2 * MAX_CONTEXT, 5 * MAX_CONTEXT))
    def configure(self, pool):
        self.table = ReqToTokenTable(SLOTS, MAX_CONTEXT, pool)
        self.kv = CachedTable(self.table, PrefixCache(BLOCK, SLOTS))
        self.prefixes = [[7] * 9, [7] * 5 + [8] * 6, list(range(1, 14))]

    def _write(self, slot: int, start: int, indices: torch.Tensor) -> None:
        toks = self.tokens[slot]
        for j, index in enumerate(indices.tolist()):
            self.content[index] = kv_of(toks[:start + j + 1])

    @rule(slot=st.integers(1, SLOTS), which=st.integers(0, 2), extra=st.lists(st.integers(1, 9), max_size=6),
          salt=st.sampled_from([None, None, "tenant-b"]))
    def begin(self, slot, which, extra, salt):
        if slot in self.tokens:
            return
        prompt = self.prefixes[which] + extra
        self.kv.begin(slot, salt)
        mapped = self.kv.map_prefix(slot, 0, prompt, len(prompt) - 1)
        self.hits += mapped
        self.tokens[slot] = list(prompt)
        for p in range(mapped):  # mapped blocks hold this prompt's own KV
            assert self.content[int(self.table.table[slot, p])] == kv_of(prompt[:p + 1])
        try:
            indices = self.kv.append([slot], [len(prompt) - mapped])
        except KVPoolExhausted:
            self.kv.release([slot])
            del self.tokens[slot]
            return
        self._write(slot, mapped, indices)
        self.kv.commit(slot, prompt[mapped:])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), drafts=st.lists(st.integers(1, 9), min_size=1, max_size=4))
    def decode(self, data, drafts):
        slot = data.draw(st.sampled_from(sorted(self.tokens)))
        toks = self.tokens[slot]
        if len(toks) + len(drafts) > MAX_CONTEXT:
            return
        start = len(toks)
        toks += drafts
        try:
            indices = self.kv.append([slot], [len(drafts)])
        except KVPoolExhausted:
            del toks[start:]
            return
        self._write(slot, start, indices)
        kept = data.draw(st.integers(1, len(drafts)))  # the accepted prefix stays
        self.kv.truncate([slot], [start + kept])
        del toks[start + kept:]
        self.kv.commit(slot, toks[start:])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def end(self, data):
        slot = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.release([slot, slot])  # a release may name a slot twice
        del self.tokens[slot]

    @invariant()
    def every_slot_holds_its_own_prefix(self):
        for slot, toks in self.tokens.items():
            assert int(self.table.lengths[slot]) == len(toks)
            for p in range(len(toks)):
                assert self.content[int(self.table.table[slot, p])] == kv_of(toks[:p + 1]), (slot, p)

    @invariant()
    def indices_are_partitioned(self):
        cache = self.kv.cache
        free = set(self.table.allocator._stack[:self.table.allocator._top].tolist())
        cached = [i for b in cache.blocks.values() for i in b.indices.tolist()]
        private = []
        for slot, toks in self.tokens.items():
            chain = cache.slots[slot]
            for p in range(len(toks)):
                block = p // BLOCK
                if not (block < len(chain.registered) and chain.registered[block]):
                    private.append(int(self.table.table[slot, p]))
        everything = list(free) + cached + private
        assert len(everything) == len(set(everything)), "a pool index is owned twice"
        assert set(everything) == set(range(1, self.table.allocator.size)), "a pool index leaked"

    @invariant()
    def references_match_holders(self):
        cache = self.kv.cache
        holders: dict[bytes, int] = {}
        for slot in self.tokens:
            chain = cache.slots[slot]
            for key, reg in zip(chain.keys, chain.registered):
                if reg:
                    holders[key] = holders.get(key, 0) + 1
        for key, block in cache.blocks.items():
            assert block.refs == holders.get(key, 0) >= 0
            assert (block.refs == 0) == (key in cache.unreferenced), "a referenced block is evictable"

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        self.kv.release(list(self.tokens))
        self.tokens.clear()
        assert self.kv.cache.referenced_blocks() == 0
        assert self.kv.available() == self.table.allocator.size - 1


CacheMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None, derandomize=True)
TestPrefixCacheMachine = CacheMachine.TestCase


# -- the engine -------------------------------------------------------------------------------------

SYSTEM = [random.Random(5).randrange(1, 4096) for _ in range(37)]  # 2 blocks of 16 and then some


def shared_prompts() -> list[list[int]]:
    rng = random.Random(6)
    return [SYSTEM + [rng.randrange(1, 4096) for _ in range(n)] for n in (1, 5, 12, 3)]


@pytest.mark.parametrize("draft, budget", [(None, 4096), ("near", 4096), ("near", 7)])
def test_cached_prefixes_change_no_token(tiny_models, draft, budget):
    """One after another (so later requests find the earlier ones' blocks) and all at once (blocks
    registered while their owner still runs): cache on == cache off == transformers."""
    prompts = shared_prompts()
    ref = [hf_greedy(tiny_models.hf_target, p, 12) for p in prompts]
    kw = dict(num_speculative_tokens=3, draft_window=8, capacity=4, max_context=96, max_num_batched_tokens=budget)
    d = tiny_models.drafts[draft] if draft else None
    cached, plain = make_engine(tiny_models.target, d, **kw), make_engine(tiny_models.target, d, **kw,
                                                                          enable_prefix_caching=False)
    params = SamplingParams(max_tokens=12)
    one_by_one = [generate(cached, [p], params)[0] for p in prompts]
    assert [r.token_ids for r in one_by_one] == ref
    assert cached.counters.prefix_cache_hit_tokens >= 3 * 32, "later requests did not map the system prompt"
    together = generate(cached, prompts + prompts, params)
    assert [r.token_ids for r in together] == ref + ref
    assert [r.token_ids for r in generate(plain, prompts, params)] == ref
    assert plain.counters.prefix_cache_hit_tokens == 0
    assert_drained(cached)
    assert cached.target.prefix_cache.referenced_blocks() == 0


def test_salts_keep_requests_apart_and_a_request_can_opt_out(tiny_models):
    engine = make_engine(tiny_models.target, None, capacity=4, max_context=96)
    prompt = shared_prompts()[0]
    runs = [("a", True), ("b", True), ("a", True), (None, False), (None, True), (None, True)]
    hits = []
    for salt, use in runs:
        before = engine.counters.prefix_cache_hit_tokens
        generate(engine, [prompt], SamplingParams(max_tokens=4, cache_salt=salt, prefix_cache=use))
        hits.append(engine.counters.prefix_cache_hit_tokens - before)
    # a's first run fills the cache, b finds nothing of a's, a finds its own; the opted-out request
    # neither finds nor leaves anything, so the next unsalted one finds nothing and the last finds it
    assert hits[0] == 0 and hits[1] == 0 and hits[2] == 32
    assert hits[3] == 0 and hits[4] == 0 and hits[5] == 32
    assert_drained(engine)


def test_a_small_pool_evicts_and_stays_correct(tiny_models):
    """More distinct prefixes than the pool holds: unreferenced blocks are evicted, least recently
    used first, and every output is still transformers'."""
    rng = random.Random(9)
    systems = [[rng.randrange(1, 4096) for _ in range(33)] for _ in range(6)]
    prompts = [s + [rng.randrange(1, 4096)] for s in systems for _ in range(2)]
    engine = make_engine(tiny_models.target, tiny_models.drafts["near"], num_speculative_tokens=3, draft_window=8,
                         capacity=2, max_context=64, kv_pool_tokens=100)
    got = [generate(engine, [p], SamplingParams(max_tokens=8))[0].token_ids for p in prompts]
    assert got == [hf_greedy(tiny_models.hf_target, p, 8) for p in prompts]
    assert engine.target.prefix_cache.counters.evicted_blocks > 0
    assert engine.counters.prefix_cache_hit_tokens >= 6 * 32  # each system prompt's second request
    assert_drained(engine)
