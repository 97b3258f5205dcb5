"""A DSpark draft's per-slot ring of projected context K/V (``dspark_ray.model.dspark``).

NOTE: this is ``DraftWindowCache`` (position ``p`` of a slot at ring index
``p % ring``, ``ring = window + block_size``, epochs instead of memsets, row 0
for padding) holding what a block drafter needs: the context K/V the draft
projected from the target's hidden states, one entry per committed position.
A block anchored at ``p0`` reads the ``window`` positions before ``p0``.

Two things differ from the independent draft's cache, and both are guards:

- A write says exactly what the slot holds: positions ``a .. e-1`` written
  make its length ``e``. Only a row's last ``ring`` positions are stored (a
  long prefill costs the ring, not its length), and a write may start past
  the slot's length (the target sent only the tail): nothing before ``a`` is
  then visible.
- ``floor``: the first position still intact. A position is lost when a later
  position ``ring`` ahead of it was written, even if that one was rolled back
  afterwards; a rollback of at most ``block_size`` (rejected drafts) loses
  nothing, a deeper one shows the block less context, never stale entries.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from dspark_kernels.ops import ring_write

from dspark_ray.model.dspark import BlockContext
from dspark_ray.slots.window_cache import DraftWindowCache, Ints


class ContextRing(DraftWindowCache):
    """Per-slot rings of a DSpark draft's context K/V.

    Args:
        num_layers: draft layers (one K and one V ring each).
        capacity: usable slots ``1..capacity``; every buffer has ``capacity + 1`` rows.
        window: context positions a block attends to.
        block_size: the draft's block, the most positions rolled back at once.
        kv_heads, head_dim: K/V shape per position.

    Attributes (besides DraftWindowCache's ``k``, ``v``, ``epoch``, ``length``):
        floor: ``[capacity + 1]`` int64, the first position still intact in the current epoch.
        high: ``[capacity + 1]`` int64, the furthest end written in the current epoch.
    """

    def __init__(self, num_layers: int, capacity: int, window: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__(num_layers, capacity, window, block_size, kv_heads, head_dim, dtype, device)
        self.floor = torch.zeros(capacity + 1, dtype=torch.int64, device=device)
        self.high = torch.zeros(capacity + 1, dtype=torch.int64, device=device)

    def bind(self, slots: Ints, epochs: Ints) -> None:
        """Binds each slot ``[B]`` to its lease's epoch ``[B]``; a changed epoch empties the slot."""
        slots, epochs = self._long(slots), self._long(epochs)
        same = self.epoch[slots] == epochs
        for t in (self.length, self.floor, self.high):
            t[slots] = torch.where(same, t[slots], 0)
        self.epoch[slots] = epochs

    def write(
        self,
        slots: Ints,  # [B] int64, distinct
        positions: torch.Tensor,  # [B, T] int64: each row ascending by one, then < 0 padding
        k: Sequence[torch.Tensor],  # per layer [B, T, kv_heads, head_dim]
        v: Sequence[torch.Tensor],  # per layer [B, T, kv_heads, head_dim]
    ) -> None:
        """Stores each row's context K/V; afterwards the slot holds exactly the positions before its
        row's last one + 1 (rows of only padding change nothing)."""
        slots, positions = self._long(slots), self._long(positions)
        valid = positions >= 0
        if positions.dim() != 2 or len(k) != len(self.k) or len(v) != len(self.v):
            raise ValueError(f"positions must be [B, T] and K/V one per layer ({len(self.k)})")
        if ((positions[:, 1:] != positions[:, :-1] + 1) & valid[:, 1:]).any() or (valid[:, 1:] & ~valid[:, :-1]).any():
            raise ValueError("each row's positions must ascend by one, padding (< 0) only at the end")
        rows = valid.any(dim=1)
        start = torch.where(valid, positions, positions.new_full((), 2**62)).amin(dim=1)  # [B]
        end = (positions.amax(dim=1) + 1).clamp_min(0)  # [B]
        kept = torch.where(valid & (positions >= (end - self.ring)[:, None]), positions, -1)
        for layer in range(len(self.k)):
            ring_write(self.k[layer], self.v[layer], slots, kept, k[layer], v[layer])
        length, floor, high = self.length[slots], self.floor[slots], self.high[slots]
        # A gap: nothing before it was written. Otherwise positions from the start are fresh.
        floor = torch.where(start > length, start, torch.minimum(floor, start))
        high = torch.maximum(high, end)
        self.floor[slots] = torch.where(rows, torch.maximum(floor, high - self.ring), self.floor[slots])
        self.high[slots] = torch.where(rows, high, self.high[slots])
        self.length[slots] = torch.where(rows, end, length)

    def view(
        self,
        slots: Ints,  # [B] int64
        anchors: Ints,  # [B] int64: each block's first position p0
    ) -> BlockContext:
        """The context a block at ``anchors`` attends to: positions ``p0 - window .. p0 - 1`` that
        this epoch wrote and the ring still holds; K/V ``[B, window, kv_heads, head_dim]`` per layer."""
        slots, anchors = self._long(slots), self._long(anchors)
        positions = anchors[:, None] - self.window + torch.arange(self.window, device=self.device)  # [B, W]
        visible = ((positions >= 0) & (positions >= self.floor[slots][:, None])
                   & (positions < self.length[slots][:, None]) & (positions < anchors[:, None]))
        index = positions.remainder(self.ring)
        keep = visible[:, :, None, None]
        k = tuple(torch.where(keep, ring[slots[:, None], index], 0) for ring in self.k)
        v = tuple(torch.where(keep, ring[slots[:, None], index], 0) for ring in self.v)
        return BlockContext(k, v, positions, visible)
