"""The paged KV pool of a multi-head-latent-attention target (DeepSeek-V3), and its attention.

The pool is addressed exactly as the ordinary one (target_runner.py: slot ->
request-to-token table row -> token indices), so prefix caching, rollback and
preemption work unchanged; only the per-token payload differs. Per layer and
token it keeps the compressed latent (``kv_lora_rank`` features, after
``kv_a_layernorm``) and the rotated key part shared by every head
(``qk_rope_head_dim``): one ``[pool_tokens, kv_lora_rank + qk_rope_head_dim]``
tensor per layer, never the expanded per-head keys and values. Under tensor
parallelism every rank keeps the whole latent (``kv_a_proj_with_mqa`` is
replicated) and expands or absorbs only its own heads (``kv_b_proj`` is
column-sliced, dspark_ray/model/tp.py).

Attention for a group of rows gathers each row's cached latents through the
table and runs ``attend_absorbed`` or ``attend_expanded``
(dspark_ray/model/mla.py), whichever costs less for the group's query count
(``absorb_pays``), unless ``LatentKVPool.form`` fixes one.
"""

from __future__ import annotations

import torch

from dspark_ray.engine.attention_group import AttentionGroup
from dspark_ray.model.config import ModelConfig
from dspark_ray.model.mla import LatentAttention, absorb_pays, attend_absorbed, attend_expanded

FORMS = ("auto", "absorbed", "expanded")


class LatentKVPool:
    """Per layer ``[pool_tokens, kv_lora_rank + qk_rope_head_dim]``: latent | rotated shared key."""

    def __init__(self, cfg: ModelConfig, pool_tokens: int, dtype: torch.dtype, device: torch.device,
                 form: str = "auto") -> None:
        """``form``: "absorbed" or "expanded" for every group, or "auto" (``absorb_pays``)."""
        assert cfg.mla is not None, "a latent pool is for multi-head latent attention models"
        self.width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
        self.pools = [torch.zeros(pool_tokens, self.width, dtype=dtype, device=device)
                      for _ in range(cfg.num_layers)]
        self.form = form

    def attention(
        self,
        write_index: torch.Tensor,  # [N] int64 pool index of each new token
        groups: list[AttentionGroup],
    ) -> LatentPackedAttention:
        """The attention callable of one packed step."""
        if self.form not in FORMS:
            raise ValueError(f"latent attention form {self.form!r}: use one of {', '.join(FORMS)}")
        return LatentPackedAttention(self.pools, write_index, groups, self.form)


class LatentPackedAttention:
    """``PackedAttention`` for MLA (a ``dspark_ray.model.mla.LatentKV``): writes each new token's
    latent and rotated key to the pool, attends through the table, group by group."""

    def __init__(
        self,
        pools: list[torch.Tensor],  # per layer [P, kv_lora_rank + rope]
        write_index: torch.Tensor,  # [N] int64
        groups: list[AttentionGroup],
        form: str = "auto",
    ) -> None:
        self.pools, self.write_index, self.groups, self.form = pools, write_index, groups, form

    def attend_latent(
        self,
        layer: int,
        q_nope: torch.Tensor,  # [1, N, H, nope]
        q_rot: torch.Tensor,  # [1, N, H, rope], rotated
        latent: torch.Tensor,  # [1, N, kv_lora_rank]
        k_rot: torch.Tensor,  # [1, N, rope], rotated
        attn: LatentAttention,
    ) -> torch.Tensor:  # [1, N, H, v]
        pool = self.pools[layer]
        pool.index_copy_(0, self.write_index, torch.cat((latent[0], k_rot[0]), dim=-1).to(pool.dtype))
        q_nope, q_rot = q_nope[0], q_rot[0]  # [N, H, *]
        n, heads = q_nope.shape[:2]
        out = q_nope.new_empty(n, heads, attn.v_dim)
        for g in self.groups:
            queries = g.queries.shape[1]
            if g.whole:  # every row the same length, in order: no gather, no scatter
                qn, qr = q_nope.view(*g.queries.shape, heads, -1), q_rot.view(*g.queries.shape, heads, -1)
            else:
                qn, qr = q_nope[g.queries], q_rot[g.queries]  # [G, T, H, *]
            keys = torch.index_select(pool, 0, g.key_index.reshape(-1)).view(*g.key_index.shape, -1)
            keys = keys.to(q_nope.dtype)  # [G, L, rank + rope]
            absorb = self.form == "absorbed" or (self.form == "auto" and absorb_pays(queries, attn))
            if absorb:
                res = attend_absorbed(qn, qr, keys, g.mask, *attn.absorbed_weights(), attn.softmax_scale)
            else:
                res = attend_expanded(qn, qr, keys, g.mask, attn.kv_b_weight(), attn.softmax_scale)
            if g.whole:
                return res.reshape(1, n, heads, -1)
            out[g.queries[g.valid]] = res[g.valid]
        return out[None]
