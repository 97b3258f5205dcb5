"""Multi-head latent attention (DeepSeek-V2/V3), in plain PyTorch: the plain model and the math of
its cached (paged) form.

NOTE: the idea. Instead of projecting keys and values per head, each token is
compressed to one latent of ``kv_lora_rank`` features (``kv_a_proj_with_mqa``,
then ``kv_a_layernorm``) plus one ``qk_rope_head_dim`` key part that carries
the rotary position and is shared by every head; ``kv_b_proj`` expands the
latent into each head's unrotated key part and its value. Queries go through
a low-rank pair (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``) or a plain
``q_proj``. A head's query/key is [unrotated | rotated] (``qk_nope_head_dim``
+ ``qk_rope_head_dim``), its value ``v_head_dim`` wide.

Two ways to run it:

- Plain (``CausalAttention``, the reference the parity tests use): the latent
  is expanded and the layer hands full per-head q/k/v to the ``Attention``
  callable, like any other layer.
- Cached (an attention callable that is a ``LatentKV``, the target runner's
  paged latent pool, dspark_ray/engine/latent_attention.py): the layer hands
  over the latent and the rotated shared key, kv_lora_rank + qk_rope_head_dim
  numbers per token (576 for DeepSeek-V3, against 128 heads x (192 + 128)
  expanded), and that is all the pool keeps. Attention over the cached
  context then runs in one of two exactly equivalent forms (equal up to
  floating-point rounding; tests compare both with transformers):
  ``attend_expanded`` expands every cached key with ``kv_b_proj`` (cheap when
  many queries share the keys: a prefill chunk), ``attend_absorbed`` folds
  ``kv_b_proj`` into the query and the output instead, q_nope . (W_UK c) =
  (q_nope W_UK) . c and sum_j p_j (W_UV c_j) = W_UV (sum_j p_j c_j), so
  attention runs in latent space, one key/value "head" shared by all query
  heads (cheap for decode and verify rows: no per-key expansion).

The softmax scale is transformers' ``qk_head_dim ** -0.5``, times YaRN's
``mscale(factor, mscale_all_dim) ** 2`` when the rotary scaling is YaRN. The
plain form folds it into q so that the attention callables keep their default
scale; the cached forms pass it to the kernel (``LatentAttention.softmax_scale``).
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from dspark_ray.model.config import ModelConfig, RopeScaling
from dspark_ray.model.errors import UnsupportedArchitecture
from dspark_ray.model.layers import Attention, Linear, RMSNorm, apply_rope


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


@runtime_checkable
class LatentKV(Protocol):
    """An attention callable that caches MLA's compressed KV: ``LatentAttention`` hands it the
    latent and the rotated shared key instead of expanded per-head keys and values."""

    def attend_latent(
        self,
        layer: int,
        q_nope: torch.Tensor,  # [B, T, H, qk_nope_head_dim]
        q_rot: torch.Tensor,  # [B, T, H, qk_rope_head_dim], rotated
        latent: torch.Tensor,  # [B, T, kv_lora_rank], after kv_a_layernorm
        k_rot: torch.Tensor,  # [B, T, qk_rope_head_dim], rotated
        attn: LatentAttention,  # the layer: its kv_b_proj and softmax scale
    ) -> torch.Tensor:  # [B, T, H, v_head_dim]
        ...


class LatentAttention(nn.Module):
    """MLA with transformers' module names (``self_attn.q_a_proj`` ...); heads are read from the
    (possibly sharded) ``kv_b_proj``, as SelfAttention reads them from its projections."""

    _kv_b_dense: torch.Tensor | None = None  # kv_b_proj dequantised, for an FP8 kv_b_proj (kv_b_weight)

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
        self.softmax_scale = softmax_scale(qk, cfg.rope_scaling)
        # Attention callables divide by sqrt(q's width); the model's own scale is folded into q.
        self.q_scale = self.softmax_scale * math.sqrt(qk)

    @property
    def num_heads(self) -> int:
        """Heads on this rank (kv_b_proj is column-sliced under tensor parallelism)."""
        return self.kv_b_proj.out_features // (self.nope + self.v_dim)

    def kv_b_weight(self) -> torch.Tensor:
        """[H * (nope + v), kv_lora_rank] in the activations' dtype: ``kv_b_proj``'s weight, or for
        an FP8 weight kept quantised on CUDA (dspark_ray/model/fp8.py, 128 x 128 blocks aligned with
        this rank's slice) its dequantised copy, made once: the cached forms multiply by it directly.
        NOTE: that copy (kv_b_proj in the activations' dtype, ~2 GB a rank for DeepSeek-V3 at TP 2)
        is not in the memory plan (dspark_ray/model/memory.py)."""
        weight = self.kv_b_proj.weight
        if weight.dtype in (torch.float32, torch.bfloat16, torch.float16):
            return weight
        if self._kv_b_dense is None:
            from dspark_ray.model.fp8 import Fp8Gemm, dequantize

            dtype = self.kv_a_layernorm.weight.dtype
            self._kv_b_dense = dequantize(weight, self.kv_b_proj.weight_scale_inv, Fp8Gemm.BLOCK, dtype=dtype)
        return self._kv_b_dense

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, kv_lora_rank], W_UV [H, v, kv_lora_rank]): views of ``kv_b_weight``."""
        w = self.kv_b_weight().view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, :self.nope], w[:, self.nope:]

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
        attention: Attention | LatentKV,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        rotate = apply_rope_interleaved if self.interleaved else apply_rope
        q = self._queries(x).view(b, t, -1, self.nope + self.rope_dim)
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        q_rot = rotate(q_rot, cos, sin)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_rot = rotate(k_rot.view(b, t, 1, self.rope_dim), cos, sin)  # [B, T, 1, rope]: one for all heads
        if isinstance(attention, LatentKV):
            out = attention.attend_latent(layer, q_nope, q_rot, latent, k_rot[:, :, 0], self)
        else:
            kv = self.kv_b_proj(latent).view(b, t, -1, self.nope + self.v_dim)
            k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
            q = torch.cat((q_nope, q_rot), dim=-1) * self.q_scale
            k = torch.cat((k_nope, k_rot.expand(b, t, kv.shape[2], self.rope_dim)), dim=-1)
            out = attention(layer, q, k, v.contiguous())  # [B, T, heads, v_head_dim]
        return self.o_proj(out.reshape(b, t, -1))


# -- attention over cached latents (gathered per group of rows by the caller) ----------------------


def attend_expanded(
    q_nope: torch.Tensor,  # [G, T, H, nope]
    q_rot: torch.Tensor,  # [G, T, H, rope], rotated
    keys: torch.Tensor,  # [G, L, kv_lora_rank + rope]: cached latent | rotated shared key
    mask: torch.Tensor,  # [G, 1, T, L] bool, True = attend
    kv_b: torch.Tensor,  # [H * (nope + v), kv_lora_rank]: kv_b_proj's weight (this rank's heads)
    scale: float,  # the softmax scale (LatentAttention.softmax_scale)
) -> torch.Tensor:  # [G, T, H, v]
    """Every cached latent expanded into per-head keys and values, then ordinary attention: the
    plain model's computation over the cached context."""
    g, t, h, nope = q_nope.shape
    rank = kv_b.shape[1]
    latent, k_rot = keys.split([rank, keys.shape[-1] - rank], dim=-1)
    kv = F.linear(latent, kv_b).view(g, keys.shape[1], h, -1)  # [G, L, H, nope + v]
    k_nope, v = kv.split([nope, kv.shape[-1] - nope], dim=-1)
    k = torch.cat((k_nope, k_rot[:, :, None].expand(-1, -1, h, -1)), dim=-1)  # [G, L, H, qk]
    q = torch.cat((q_nope, q_rot), dim=-1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, scale=scale)  # [G, H, T, v]
    return out.transpose(1, 2)


def attend_absorbed(
    q_nope: torch.Tensor,  # [G, T, H, nope]
    q_rot: torch.Tensor,  # [G, T, H, rope], rotated
    keys: torch.Tensor,  # [G, L, kv_lora_rank + rope]: cached latent | rotated shared key
    mask: torch.Tensor,  # [G, 1, T, L] bool, True = attend
    w_uk: torch.Tensor,  # [H, nope, kv_lora_rank] (LatentAttention.absorbed_weights)
    w_uv: torch.Tensor,  # [H, v, kv_lora_rank]
    scale: float,
) -> torch.Tensor:  # [G, T, H, v]
    """Attention in latent space: each head's query is taken into the latent (q_nope W_UK) and
    the output out of it (W_UV), so the cached latents serve as keys and values as they are, one
    key/value head for every query head. The heads are laid out as extra query rows of that one
    head (as FlashMLA does), so a row's T x H queries meet its keys in one matmul."""
    g, t, h, _ = q_nope.shape
    rank = w_uk.shape[2]
    q_latent = torch.einsum("gthn,hnr->gthr", q_nope, w_uk)  # [G, T, H, rank]
    q = torch.cat((q_latent, q_rot), dim=-1).reshape(g, 1, t * h, -1)  # [G, 1, T*H, rank + rope]
    mask = mask[:, :, :, None, :].expand(-1, -1, -1, h, -1).reshape(g, 1, t * h, -1)  # [G, 1, T*H, L]
    out = F.scaled_dot_product_attention(q, keys[:, None], keys[:, None, :, :rank], attn_mask=mask,
                                         scale=scale)  # [G, 1, T*H, rank]
    return torch.einsum("gthr,hvr->gthv", out.view(g, t, h, rank), w_uv)


def absorb_pays(queries: int, attn: LatentAttention) -> bool:
    """Whether ``queries`` queries of one row attend more cheaply in the absorbed form. Per cached
    key and head, the expanded form first expands the key (kv_lora_rank x (nope + v) multiply-adds,
    shared by the row's queries) and then attends in qk + v widths; the absorbed form attends in
    2 x kv_lora_rank + rope widths. So absorbing pays for decode and verify rows and loses for long
    prefill chunks (DeepSeek-V3: up to 170 queries)."""
    rank = attn.kv_lora_rank
    expanded = rank * (attn.nope + attn.v_dim) + queries * (attn.nope + attn.rope_dim + attn.v_dim)
    absorbed = queries * (2 * rank + attn.rope_dim)
    return absorbed <= expanded


def refuse_as_draft(cfg: ModelConfig) -> None:
    """Raise UnsupportedArchitecture for an MLA model as the draft: the draft's window cache holds
    per-head K and V of ``head_dim`` features, not MLA's latent."""
    if cfg.mla is not None:
        raise UnsupportedArchitecture(
            f"{cfg.architecture} (multi-head latent attention) cannot be the draft: the draft's window cache holds "
            "per-head K and V, not its compressed latent, and a DeepSeek-sized draft is not a use case. Serve it "
            "as the target, with a small dense draft (Llama/Qwen/Mistral family) that shares its tokenizer"
        )
