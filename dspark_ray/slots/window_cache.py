"""The draft model's sliding-window K/V cache, one ring buffer per slot and layer.

NOTE: position ``p`` of a slot lives at ring index ``p % ring`` with
``ring = window + max_spec_tokens``. A query at ``p`` sees the key positions
``max(0, p - window + 1) .. p`` that were written in the slot's current epoch
(``< length``). The ``max_spec_tokens`` of slack is what makes rollback free:
writing ``k <= max_spec_tokens`` provisional tokens after a committed length
``L`` only overwrites positions below ``L - window``, which no later query
can see, so rolling back is just ``set_length``. (A ring of ``window`` alone
would overwrite live history with every provisional token.)

Epochs replace memsets: ``bind`` gives a slot whose epoch changed length 0,
and since nothing at or beyond ``length`` is ever read, the previous holder's
contents (or garbage) stay invisible until overwritten.

Row 0 of every buffer is the padding row: padded batch entries point there.
The raw tensors (``k[layer]``, ``v[layer]``, ``length``) are what the
attention kernels read; ``window_view`` and ``gather`` are the reference view
of what a query may see.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from dspark_kernels.ops import ring_write


# Index arguments may be int64 tensors (the hot path) or plain sequences (tests, tools).
Ints = torch.Tensor | Sequence[int]


@dataclass(frozen=True)
class WindowView:
    """What each query may attend to; masked-out entries are zero."""

    k: torch.Tensor  # [B, window, kv_heads, head_dim]
    v: torch.Tensor  # [B, window, kv_heads, head_dim]
    key_positions: torch.Tensor  # [B, window] int64, ascending, may be < 0
    mask: torch.Tensor  # [B, window] bool, True where the key is visible


class DraftWindowCache:
    """Per-slot ring buffers of the draft model's K/V.

    Args:
        num_layers: draft layers, one K and one V buffer each.
        capacity: usable slots ``1..capacity``; every buffer has ``capacity + 1`` rows.
        window: positions a query attends to, itself included.
        max_spec_tokens: most provisional tokens written before a rollback.
        kv_heads, head_dim: K/V shape per position.

    Attributes:
        k, v: per layer, ``[capacity + 1, ring, kv_heads, head_dim]``.
        epoch: ``[capacity + 1]`` int64, the epoch each slot is bound to (0: never bound).
        length: ``[capacity + 1]`` int64, positions written in the current epoch.
    """

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        window: int,
        max_spec_tokens: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if min(num_layers, capacity, window, kv_heads, head_dim) < 1 or max_spec_tokens < 0:
            raise ValueError("layers, capacity, window, kv_heads and head_dim must be positive")
        self.capacity = capacity
        self.window = window
        self.max_spec_tokens = max_spec_tokens
        self.ring = window + max_spec_tokens
        self.device = torch.device(device)
        shape = (capacity + 1, self.ring, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.epoch = torch.zeros(capacity + 1, dtype=torch.int64, device=device)
        self.length = torch.zeros(capacity + 1, dtype=torch.int64, device=device)

    def bind(self, slots: Ints, epochs: Ints) -> None:
        """Binds each slot ``[B]`` to its lease's epoch ``[B]``; a changed epoch empties the slot."""
        slots, epochs = self._long(slots), self._long(epochs)
        same = self.epoch[slots] == epochs
        self.length[slots] = torch.where(same, self.length[slots], 0)
        self.epoch[slots] = epochs

    def append(
        self,
        layer: int,
        slots: Ints,  # [B] int64
        positions: torch.Tensor | Sequence[Sequence[int]],  # [B, T] int64 absolute positions, < 0 = padding
        k: torch.Tensor,  # [B, T, kv_heads, head_dim]
        v: torch.Tensor,  # [B, T, kv_heads, head_dim]
    ) -> None:
        """Writes one layer's K/V of a step at ``position % ring``; lengths grow to cover them.

        Each row's positions continue its slot's length (or rewrite after a
        rollback); at most ``ring`` positions per row per call.
        """
        slots, positions = self.cover(slots, positions)
        ring_write(self.k[layer], self.v[layer], slots, positions, k, v)

    def cover(self, slots: Ints, positions: torch.Tensor | Sequence[Sequence[int]]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The length bookkeeping of ``append``: checks ``positions`` and grows each slot's length
        to cover them; returns both as int64 tensors. For a caller that writes every layer's K/V
        itself (the draft's CPU path, which works out the ring places once per pass)."""
        slots, positions = self.checked(slots, positions)
        ends = (positions.amax(dim=1) + 1).clamp_min(0)  # [B]; all-padding rows give 0
        self.length.scatter_reduce_(0, slots, ends, reduce="amax")
        return slots, positions

    def checked(self, slots: Ints, positions: torch.Tensor | Sequence[Sequence[int]]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``slots`` [B] and ``positions`` [B, T] as int64 tensors, T checked against the ring."""
        slots, positions = self._long(slots), self._long(positions)
        if positions.dim() != 2 or positions.shape[1] > self.ring:
            raise ValueError(f"positions must be [B, T] with T <= ring ({self.ring}), got {tuple(positions.shape)}")
        return slots, positions

    def set_length(self, slots: Ints, lengths: Ints) -> None:
        """Rolls each slot ``[B]`` back to ``lengths`` ``[B]`` positions (rejected tokens vanish).

        Never lengthens a slot: positions not written in its epoch cannot become visible.
        """
        slots = self._long(slots)
        self.length[slots] = torch.minimum(self.length[slots], self._long(lengths))

    def window_view(
        self,
        layer: int,
        slots: Ints,  # [B] int64
        positions: Ints,  # [B] int64 query positions, < 0 = padding
    ) -> WindowView:
        """The keys and values each query may attend to, as a fixed-size masked window."""
        slots, positions = self._long(slots), self._long(positions)
        offsets = torch.arange(self.window, device=self.device) - (self.window - 1)
        key_positions = positions[:, None] + offsets  # [B, window]
        length = self.length[slots][:, None]  # [B, 1]
        # Older than length - ring means overwritten by a later position.
        mask = (key_positions >= 0) & (key_positions < length) & (key_positions >= length - self.ring)
        ring_index = key_positions.remainder(self.ring)
        keep = mask[:, :, None, None]
        k = torch.where(keep, self.k[layer][slots[:, None], ring_index], 0)
        v = torch.where(keep, self.v[layer][slots[:, None], ring_index], 0)
        return WindowView(k=k, v=v, key_positions=key_positions, mask=mask)

    def gather(
        self, layer: int, slot: int, position: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [W, H, D], [W, H, D], [W] int64
        """The visible keys, values and their positions for one query, in position order."""
        view = self.window_view(layer, [slot], [position])
        mask = view.mask[0]
        return view.k[0][mask], view.v[0][mask], view.key_positions[0][mask]

    def _long(self, x: torch.Tensor | Sequence) -> torch.Tensor:
        return torch.as_tensor(x, dtype=torch.int64, device=self.device).contiguous()
