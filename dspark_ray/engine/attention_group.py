"""AttentionGroup: rows of one packed target step that attend together.

The target runner packs a step's tokens into one sequence and attends group
by group (rows of similar length, ``target_runner.group_rows``); a group says
where its queries sit in the packed step and which pool entries are its keys.
Both paged attentions read it: the ordinary K/V pools' (``target_runner.
PackedAttention``) and the latent pool's of a multi-head-latent-attention
target (``latent_attention.LatentPackedAttention``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionGroup:
    """Rows of similar length attended together: their queries padded to ``T``, keys to ``L``."""

    queries: torch.Tensor  # [G, T] int64: each query's place in the packed step (padding: 0, unused)
    valid: torch.Tensor  # [G, T] bool: real queries
    key_index: torch.Tensor  # [G, L] int64: pool index of each key position
    mask: torch.Tensor  # [G, 1, T, L] bool, True = attend
    whole: bool = False  # the group is the whole step, unpadded, in order: queries are a view
