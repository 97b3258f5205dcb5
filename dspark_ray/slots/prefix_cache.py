"""Automatic prefix caching for the target's KV pool: content-addressed blocks of committed tokens.

The target's KV lives token by token in a pool, reached through the
request-to-token table (``req_to_token.py``). A block is ``block_size``
consecutive positions of one slot whose tokens are committed (accepted:
prompt or output). Once full, a block is registered under a chained hash —
of the previous block's hash, its own token ids and the request's cache salt
— so equal hashes mean equal token prefixes, hence equal KV. A request whose
first blocks hash to registered ones maps their pool indices into its table
row instead of computing them (the target then feeds only the rest).

Ownership: the pool indices of a registered block belong to the cache, not to
the slot that computed them. Each slot mapping a block holds a reference;
when the last reference goes the block stays, unreferenced, in least-recently
used order, and is only given back to the allocator (evicted) when the pool
runs short. So:

- a block referenced by a live request is never evicted or written: requests
  append after their mapped prefix, and roll-back after rejected drafts never
  reaches a registered block (it only cuts what the last step added);
- a reused slot sees nothing of its previous owner: release dereferences its
  blocks and resets its chain;
- the engine's accounting stays valid: it counts every request's positions as
  if private, which is at least what the pool really holds referenced, and
  unreferenced blocks can always be evicted.

Hashes are BLAKE2b digests, the same in every process, so all tensor-parallel
ranks (which see the same steps) keep identical caches without talking.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dspark_ray.slots.req_to_token import ReqToTokenTable


@dataclass
class Block:
    key: bytes
    indices: torch.Tensor  # [block_size] int64 pool indices (on the pool's device)
    refs: int = 0


@dataclass
class SlotChain:
    """What the cache knows of one slot: its committed tokens and the blocks over them."""

    salt: bytes = b""
    tokens: list[int] = field(default_factory=list)  # committed token ids, positions 0..
    keys: list[bytes] = field(default_factory=list)  # chained hash of each full block
    registered: list[bool] = field(default_factory=list)  # per full block: the slot references a cache block


@dataclass
class CacheCounters:
    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of them, found cached (not computed)
    evicted_blocks: int = 0


class PrefixCache:
    def __init__(self, block_size: int, capacity: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.blocks: dict[bytes, Block] = {}
        self.unreferenced: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self.slots = [SlotChain() for _ in range(capacity + 1)]
        self.counters = CacheCounters()

    # -- reading -------------------------------------------------------------

    def evictable_tokens(self) -> int:
        return len(self.unreferenced) * self.block_size

    def referenced_blocks(self) -> int:
        return len(self.blocks) - len(self.unreferenced)

    def key(self, previous: bytes, tokens: Sequence[int], salt: bytes) -> bytes:
        h = hashlib.blake2b(previous, digest_size=16)
        h.update(salt)
        h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in tokens))
        return h.digest()

    # -- a step ----------------------------------------------------------------

    def start(self, slot: int, salt: str | None) -> None:
        """A slot begins a request (its chain is empty)."""
        chain = self.slots[slot]
        assert not chain.tokens, f"slot {slot} starts with a chain left"
        chain.salt = (salt or "").encode()

    def match(self, slot: int, start: int, tokens: Sequence[int], limit: int) -> list[Block]:
        """Registered blocks that continue ``slot``'s chain over ``tokens`` (fed from ``start``),
        covering at most ``limit`` of them; each gets a reference for the slot."""
        chain, B = self.slots[slot], self.block_size
        if start != len(chain.keys) * B or start != len(chain.tokens):
            return []
        found: list[Block] = []
        previous = chain.keys[-1] if chain.keys else b""
        while (len(found) + 1) * B <= limit:
            piece = tokens[len(found) * B:(len(found) + 1) * B]
            key = self.key(previous, piece, chain.salt)
            block = self.blocks.get(key)
            if block is None:
                break
            self._ref(block)
            chain.tokens += piece
            chain.keys.append(key)
            chain.registered.append(True)
            found.append(block)
            previous = key
        self.counters.queried_tokens += len(tokens)
        self.counters.hit_tokens += len(found) * B
        return found

    def commit(self, slot: int, tokens: Sequence[int], row_indices: torch.Tensor) -> None:
        """``tokens`` were committed at the end of ``slot``; register its blocks that became full.

        ``row_indices``: the slot's whole table row (pool index per position). A
        block whose key is registered already (another request computed the
        same prefix meanwhile) stays the slot's own."""
        chain, B = self.slots[slot], self.block_size
        chain.tokens += tokens
        while (len(chain.keys) + 1) * B <= len(chain.tokens):
            i = len(chain.keys)
            previous = chain.keys[-1] if chain.keys else b""
            key = self.key(previous, chain.tokens[i * B:(i + 1) * B], chain.salt)
            chain.keys.append(key)
            if key in self.blocks:
                chain.registered.append(False)
                continue
            block = Block(key, row_indices[i * B:(i + 1) * B].to(torch.int64).clone())
            self.blocks[key] = block
            self._ref(block)
            chain.registered.append(True)

    def truncate(self, slot: int, length: int, held: int) -> torch.Tensor:
        """``slot`` (holding ``held`` positions) keeps ``0..length-1``; returns a [held - length]
        bool mask over the cut positions: True where a cache block owns the pool index (the table
        must not free those). The slot's references to the cut blocks go."""
        chain, B = self.slots[slot], self.block_size
        keep_blocks = length // B
        owned = torch.zeros(held - length, dtype=torch.bool)
        for i in range(len(chain.keys) - 1, keep_blocks - 1, -1):
            if chain.registered[i]:
                self._unref(self.blocks[chain.keys[i]])
                lo, hi = max(i * B, length), (i + 1) * B
                owned[lo - length:hi - length] = True
            chain.keys.pop()
            chain.registered.pop()
        del chain.tokens[length:]
        if length == 0:
            chain.salt = b""
        return owned

    def evict(self, tokens: int) -> torch.Tensor:
        """Drop unreferenced blocks, least recently used first, until ``tokens`` pool indices are
        freed (or none is left); returns those indices (the allocator takes them back)."""
        freed = []
        while self.unreferenced and len(freed) * self.block_size < tokens:
            key, block = self.unreferenced.popitem(last=False)
            del self.blocks[key]
            freed.append(block.indices)
            self.counters.evicted_blocks += 1
        return torch.cat(freed) if freed else torch.empty(0, dtype=torch.int64)

    # -- references --------------------------------------------------------------

    def _ref(self, block: Block) -> None:
        if block.refs == 0:
            self.unreferenced.pop(block.key, None)
        block.refs += 1

    def _unref(self, block: Block) -> None:
        assert block.refs > 0, "a cache block's reference count went negative"
        block.refs -= 1
        if block.refs == 0:
            self.unreferenced[block.key] = block  # most recently used last


class CachedTable:
    """The target's request-to-token table with the prefix cache in front of it (or none).

    What the target runner calls instead of the table: allocation evicts
    unreferenced cache blocks when the pool is short, truncation leaves the
    cache's blocks to the cache, and prefills map cached blocks.
    """

    def __init__(self, table: ReqToTokenTable, cache: PrefixCache | None) -> None:
        self.table, self.cache = table, cache

    def available(self) -> int:
        """Free KV tokens, counting unreferenced cache blocks (evicted on demand)."""
        return self.table.available() + (self.cache.evictable_tokens() if self.cache else 0)

    def append(self, slots: Sequence[int], counts: Sequence[int]) -> torch.Tensor:
        short = sum(counts) - self.table.available()
        if short > 0 and self.cache is not None:
            freed = self.cache.evict(short)
            if freed.numel():
                self.table.allocator.free(freed)
        return self.table.append(slots, counts)

    def truncate(self, slots: Sequence[int], lengths: Sequence[int]) -> None:
        keep = None
        if self.cache is not None:
            held = self.table.lengths[list(slots)].tolist()
            keep = torch.cat([self.cache.truncate(s, n, h) for s, n, h in zip(slots, lengths, held)])
        self.table.truncate(slots, lengths, keep)

    def release(self, slots: Sequence[int]) -> None:
        held = list(dict.fromkeys(s for s in slots if int(self.table.lengths[s]) > 0))  # a slot may come twice
        if held:
            self.truncate(held, [0] * len(held))

    def begin(self, slot: int, salt: str | None) -> None:
        """A request starts in ``slot`` (empty) with this cache salt."""
        if self.cache is not None:
            self.cache.start(slot, salt)

    def map_prefix(self, slot: int, start: int, tokens: Sequence[int], limit: int) -> int:
        """Maps the cached blocks that continue ``slot`` over ``tokens`` (at most ``limit`` of
        them) into its row; returns how many tokens it mapped (the caller feeds the rest)."""
        if self.cache is None:
            return 0
        blocks = self.cache.match(slot, start, tokens, limit)
        if blocks:
            self.table.map(slot, torch.cat([b.indices for b in blocks]))
        return len(blocks) * self.cache.block_size

    def commit(self, slot: int, tokens: Sequence[int]) -> None:
        """``tokens`` are committed at the end of ``slot`` (its row holds them): register full blocks."""
        if self.cache is not None:
            self.cache.commit(slot, tokens, self.table.table[slot])
