"""The target's request-to-token table and the token-level KV allocator behind it.

Two of the three levels of the target's KV memory (as in SGLang's
``ReqToTokenPool`` / ``TokenToKVPool``): a slot's position ``p`` lives at
token index ``table[slot, p]`` of a KV pool of ``size`` tokens, and the
attention kernels read K/V through that indirection. Token index 0 is the
padding token and row 0 the padding row: both are never handed out, so a
padded batch entry or a position past a slot's length reads the padding
token, never another request's KV.

Rollback after a rejected speculation is a length change: ``truncate`` frees
the tail's token indices; nothing is copied.

Validity checks (double free, out-of-range indices) read tensor values and
therefore synchronise when the table lives on a GPU; they run once per step,
not once per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

PADDING_TOKEN = 0


class KVPoolExhausted(RuntimeError):
    """Not enough free tokens in the KV pool; nothing was allocated."""


class TokenKVAllocator:
    """Free list of token indices ``1..size-1`` of a KV pool; index 0 (padding) is never handed out.

    The free list is a preallocated stack (no slicing, no concatenation):
    ``allocate`` pops from the top, ``free`` pushes back.
    """

    def __init__(self, size: int, device: torch.device | str = "cpu") -> None:
        if not 2 <= size <= torch.iinfo(torch.int32).max:
            raise ValueError(f"KV pool size must be in 2..2**31-1 (index 0 is padding), got {size}")
        self.size = size
        # Reversed so that a fresh pool hands out 1, 2, 3, ... in order.
        self._stack = torch.arange(size - 1, 0, -1, dtype=torch.int64, device=device)  # [size-1]
        self._top = size - 1  # entries _stack[:_top] are free
        self._is_free = torch.ones(size, dtype=torch.bool, device=device)  # [size]
        self._is_free[PADDING_TOKEN] = False

    def available(self) -> int:
        """Free tokens."""
        return self._top

    def allocate(self, n: int) -> torch.Tensor:  # [n] int64
        """Takes ``n`` free token indices; raises ``KVPoolExhausted`` (changing nothing) if short."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} tokens")
        if n > self._top:
            raise KVPoolExhausted(
                f"need {n} KV tokens, {self._top} of {self.size - 1} free; "
                "admit fewer or shorter requests, or enlarge the KV pool"
            )
        indices = self._stack[self._top - n : self._top].flip(0)
        self._top -= n
        self._is_free[indices] = False
        return indices

    def free(self, indices: torch.Tensor) -> None:  # [n] int64
        """Returns ``indices`` to the pool; raises ``ValueError`` (changing nothing) on a double free."""
        n = indices.numel()
        if n == 0:
            return
        indices = indices.to(device=self._stack.device, dtype=torch.int64).flatten()
        if bool(((indices < 1) | (indices >= self.size)).any()):
            raise ValueError(f"token indices must be in 1..{self.size - 1}")
        if bool(self._is_free[indices].any()) or torch.unique(indices).numel() != n:
            raise ValueError("double free of KV token indices")
        self._is_free[indices] = True
        self._stack[self._top : self._top + n] = indices.flip(0)
        self._top += n


class ReqToTokenTable:
    """Maps each slot's positions to token indices of the target's KV pool.

    Args:
        capacity: usable slots ``1..capacity``; the table has ``capacity + 1`` rows.
        max_context: positions per slot.
        kv_pool_size: tokens in the KV pool (index 0 is the padding token).
        device: where the table and the free list live; ``lengths`` stays on the host.

    Attributes:
        table: ``[capacity + 1, max_context]`` int32, 0 (padding) past each slot's length.
        lengths: ``[capacity + 1]`` int64 on the CPU, positions held per slot.
        allocator: the ``TokenKVAllocator`` of the pool.
    """

    def __init__(
        self,
        capacity: int,
        max_context: int,
        kv_pool_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if capacity < 1 or max_context < 1:
            raise ValueError(f"capacity and max_context must be positive, got {capacity}, {max_context}")
        self.capacity = capacity
        self.max_context = max_context
        self.table = torch.zeros(capacity + 1, max_context, dtype=torch.int32, device=device)
        self.lengths = torch.zeros(capacity + 1, dtype=torch.int64)
        self.allocator = TokenKVAllocator(kv_pool_size, device)

    def available(self) -> int:
        """Free tokens in the KV pool."""
        return self.allocator.available()

    def tokens(self, slot: int) -> torch.Tensor:  # [lengths[slot]] int32
        """The token indices of ``slot``'s positions ``0..length-1`` (a view)."""
        self._check_slots([slot])
        return self.table[slot, : int(self.lengths[slot])]

    def append(self, slots: Sequence[int], counts: Sequence[int]) -> torch.Tensor:  # [sum(counts)] int64
        """Gives each slot ``counts[i]`` new positions at its end, all or nothing.

        Returns the new token indices, slot by slot in the order given: where
        the step writes its K/V. Raises ``KVPoolExhausted`` or ``ValueError``
        (changing nothing) when the pool or a slot's context is too small.
        """
        self._check_slots(slots)
        starts = self.lengths[list(slots)]  # [B]
        counts_t = torch.as_tensor(counts, dtype=torch.int64)  # [B]
        if counts_t.shape != starts.shape or bool((counts_t < 0).any()):
            raise ValueError(f"need one non-negative count per slot, got {list(counts)}")
        if bool((starts + counts_t > self.max_context).any()):
            raise ValueError(f"appending {list(counts)} to slots {list(slots)} exceeds max_context {self.max_context}")
        indices = self.allocator.allocate(int(counts_t.sum()))
        rows, cols = _spans(torch.as_tensor(slots, dtype=torch.int64), starts, counts_t)
        self.table[rows.to(self.table.device), cols.to(self.table.device)] = indices.to(torch.int32)
        self.lengths[list(slots)] = starts + counts_t
        return indices

    def truncate(self, slots: Sequence[int], lengths: Sequence[int], keep: torch.Tensor | None = None) -> None:
        """Shortens each slot to ``lengths[i]`` positions, freeing the tail's tokens (rollback).

        ``keep``: [cut positions, slot by slot] bool, True for pool indices that are
        not the slot's to free (a prefix cache's blocks): they leave the row only."""
        self._check_slots(slots)
        old = self.lengths[list(slots)]  # [B]
        new = torch.as_tensor(lengths, dtype=torch.int64)  # [B]
        if new.shape != old.shape or bool(((new < 0) | (new > old)).any()):
            raise ValueError(f"truncate needs 0 <= length <= current {old.tolist()}, got {list(lengths)}")
        rows, cols = _spans(torch.as_tensor(slots, dtype=torch.int64), new, old - new)
        rows, cols = rows.to(self.table.device), cols.to(self.table.device)
        cut = self.table[rows, cols]
        if keep is not None:
            assert keep.shape == cut.shape, f"keep has {keep.numel()} entries for {cut.numel()} cut positions"
            cut = cut[~keep.to(cut.device)]
        self.allocator.free(cut)
        self.table[rows, cols] = PADDING_TOKEN
        self.lengths[list(slots)] = new

    def map(self, slot: int, indices: torch.Tensor) -> None:  # [n] int64
        """Appends existing pool indices (shared, not allocated: a prefix cache's blocks) to ``slot``."""
        self._check_slots([slot])
        start, n = int(self.lengths[slot]), indices.numel()
        if start + n > self.max_context:
            raise ValueError(f"mapping {n} positions to slot {slot} exceeds max_context {self.max_context}")
        self.table[slot, start:start + n] = indices.to(device=self.table.device, dtype=torch.int32)
        self.lengths[slot] = start + n

    def release(self, slots: Sequence[int]) -> None:
        """Frees all tokens of each slot (the request ended)."""
        self.truncate(slots, [0] * len(slots))

    def _check_slots(self, slots: Sequence[int]) -> None:
        if any(not 1 <= s <= self.capacity for s in slots):
            raise ValueError(f"slots must be in 1..{self.capacity} (0 is padding), got {list(slots)}")
        if len(set(slots)) != len(slots):
            raise ValueError(f"each slot may appear once per call, got {list(slots)}")


def _spans(
    slots: torch.Tensor,  # [B] int64
    starts: torch.Tensor,  # [B] int64
    counts: torch.Tensor,  # [B] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # ([N] int64, [N] int64), N = counts.sum()
    """Row and column of every position in ``starts[i] .. starts[i] + counts[i] - 1`` of ``slots[i]``."""
    rows = torch.repeat_interleave(slots, counts)
    offsets = torch.cumsum(counts, 0) - counts  # where each slot's span starts in the output
    cols = torch.arange(int(counts.sum())) + torch.repeat_interleave(starts - offsets, counts)
    return rows, cols
