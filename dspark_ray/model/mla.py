"""Multi-head latent attention (DeepSeek-V2/V3), in plain PyTorch, for the plain model.

NOTE: the idea. Instead of projecting keys and values per head, each token is
compressed to one latent of ``kv_lora_rank`` features (``kv_a_proj_with_mqa``,
then ``kv_a_layernorm``) plus one ``qk_rope_head_dim`` key part that carries
the rotary position and is shared by every head; ``kv_b_proj`` expands the
latent into each head's unrotated key part and its value. Queries go through
a low-rank pair (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``) or a plain
``q_proj``. A head's query/key is [unrotated | rotated] (``qk_nope_head_dim``
+ ``qk_rope_head_dim``), its value ``v_head_dim`` wide.

Here the latent is expanded before attention and the layer hands full
per-head q/k/v to the model's ``Attention`` callable, so the plain model (and
``CausalAttention``) runs unchanged: the KV a cache would hold is the
expanded one. A serving path would cache the latent and the rotated key
instead (kv_lora_rank + qk_rope_head_dim numbers per token, e.g. 576 for
DeepSeek-V3 against 128 heads x (192 + 128) expanded) and absorb ``kv_b_proj``
into the query and output projections; the paged target does neither yet
(``TargetRunner`` refuses an MLA model).

The softmax scale is transformers' ``qk_head_dim ** -0.5``, times YaRN's
``mscale(factor, mscale_all_dim) ** 2`` when the rotary scaling is YaRN; it is
folded into q so that the attention callables keep their default scale.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dspark_ray.model.config import ModelConfig, RopeScaling
from dspark_ray.model.errors import UnsupportedArchitecture
from dspark_ray.model.llama import Attention, Linear, RMSNorm, apply_rope


def apply_rope_interleaved(
    x: torch.Tensor,  # [B, T, H, D], rotary pairs (x0, x1), (x2, x3), ...
    cos: torch.Tensor,  # [B, T, D] (cat(freqs, freqs), as CausalLM.rope gives)
    sin: torch.Tensor,  # [B, T, D]
) -> torch.Tensor:  # [B, T, H, D], the rotated pairs de-interleaved into halves (as transformers)
    half = x.shape[-1] // 2
    cos, sin = cos[:, :, None, :half], sin[:, :, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


def softmax_scale(qk_head_dim: int, scaling: RopeScaling) -> float:
    """transformers' DeepseekV3Attention.scaling."""
    scale = qk_head_dim ** -0.5
    if scaling.kind != "default" and scaling.mscale_all_dim and scaling.factor > 1:
        mscale = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
        scale *= mscale * mscale
    return scale


class LatentAttention(nn.Module):
    """MLA with transformers' module names (``self_attn.q_a_proj`` ...); heads are read from the
    (possibly sharded) ``kv_b_proj``, as SelfAttention reads them from its projections."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        mla, d, heads = cfg.mla, cfg.hidden_size, cfg.num_heads
        self.nope, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_lora_rank, self.interleaved = mla.kv_lora_rank, mla.rope_interleave
        qk = self.nope + self.rope_dim
        self.low_rank_q = mla.q_lora_rank is not None
        if not self.low_rank_q:
            self.q_proj = Linear(d, heads * qk, bias=False)
        else:
            self.q_a_proj = Linear(d, mla.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(mla.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(d, mla.kv_lora_rank + self.rope_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(mla.kv_lora_rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(heads * self.v_dim, d, bias=cfg.attention_bias)
        # Attention callables divide by sqrt(q's width); the model's own scale is folded into q.
        self.q_scale = softmax_scale(qk, cfg.rope_scaling) * math.sqrt(qk)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, hidden] -> [B, T, heads * qk]
        if self.low_rank_q:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def forward(
        self,
        layer: int,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,  # [B, T, qk_rope_head_dim]
        sin: torch.Tensor,
        attention: Attention,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        rotate = apply_rope_interleaved if self.interleaved else apply_rope
        q = self._queries(x).view(b, t, -1, self.nope + self.rope_dim)
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        heads = kv.shape[2]
        k_rot = rotate(k_rot.view(b, t, 1, self.rope_dim), cos, sin).expand(b, t, heads, self.rope_dim)
        q = torch.cat((q_nope, rotate(q_rot, cos, sin)), dim=-1) * self.q_scale
        k = torch.cat((k_nope, k_rot), dim=-1)
        out = attention(layer, q, k, v.contiguous())  # [B, T, heads, v_head_dim]
        return self.o_proj(out.reshape(b, t, -1))


def refuse_cached(cfg: ModelConfig, cache: str) -> None:
    """Raise UnsupportedArchitecture for an MLA model: ``cache`` (the target's paged KV pool, the
    draft's window cache) holds per-head K and V of ``head_dim`` features, not MLA's latent."""
    if cfg.mla is not None:
        raise UnsupportedArchitecture(
            f"{cfg.architecture} (multi-head latent attention) runs only as a plain model: {cache} does not "
            "hold its compressed KV yet; serve a Llama/Qwen/Mistral-family or Qwen3-MoE/Mixtral model instead"
        )
