"""A decoder-only transformer for the Llama family, in plain PyTorch.

One implementation serves LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM (q/k/v bias) and Qwen3ForCausalLM (per-head q/k RMSNorm), and
their mixture-of-experts relatives Qwen3MoeForCausalLM and MixtralForCausalLM,
whose sparse layers put a ``dspark_ray.model.moe.SparseMoE`` where the MLP is,
and DeepseekV3ForCausalLM (also ``dspark_ray.model.mla.LatentAttention``, whose
cached form the paged target runs over a latent pool; not as a draft).
Module names match the Hugging Face checkpoints (``model.layers.N.self_attn.
q_proj`` ...), so ``state_dict()`` keys are the safetensors keys.

The model holds no cache. Attention is a pluggable callable: the default,
``CausalAttention``, attends within the sequence it is given (the reference
path that tests compare against); the engine passes callables that read and
write its paged target KV or the draft's window cache. Tensor parallelism is a
transform over this module (``dspark_ray.model.tp``), which is why head counts
are read from the projection shapes at run time rather than from the config.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark_ray.model.config import ModelConfig
from dspark_ray.model.layers import Attention, FusedLinears, Linear, RMSNorm, apply_rope
from dspark_ray.model.mla import LatentAttention
from dspark_ray.model.moe import SparseMoE, expert_names
from dspark_ray.model.rope import rope_attention_scaling, rope_inv_freq


class CausalAttention:
    """Full causal attention over the given sequence, optionally windowed."""

    def __init__(self, sliding_window: int | None = None) -> None:
        self.sliding_window = sliding_window

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = q.shape[1]
        n_rep = q.shape[2] // k.shape[2]
        qh = q.transpose(1, 2)  # [B, Hq, T, D]
        kh = k.transpose(1, 2).repeat_interleave(n_rep, dim=1)
        vh = v.transpose(1, 2).repeat_interleave(n_rep, dim=1)
        if self.sliding_window is None or self.sliding_window >= t:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        else:
            mask = causal_window_mask(t, self.sliding_window, q.device)
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
        return out.transpose(1, 2)


def causal_window_mask(t: int, window: int, device: torch.device) -> torch.Tensor:
    """Bool [T, T]: query i sees key j when i - window < j <= i."""
    i = torch.arange(t, device=device)[:, None]
    j = torch.arange(t, device=device)[None, :]
    return (j <= i) & (j > i - window)


def fuse_projections(model: CausalLM) -> CausalLM:
    """q/k/v and gate/up of every layer as one matmul each (see FusedLinears), the experts of a
    sparse layer stacked (``SparseMoE.stack_experts``); in place, after loading."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.ffn
        linears = [attn.q_proj, attn.k_proj, attn.v_proj] if isinstance(attn, SelfAttention) else []  # not MLA
        # All with a bias or none, and none with a matmul of its own (an FP8 weight, dspark_ray/model/fp8.py).
        if linears and len({lin.bias is None for lin in linears}) == 1 and _fusable(linears):
            attn.fused_qkv = FusedLinears(linears)
        if isinstance(mlp, SparseMoE):
            mlp.stack_experts()
        elif _fusable([mlp.gate_proj, mlp.up_proj]):
            mlp.fused_gate_up = FusedLinears([mlp.gate_proj, mlp.up_proj])
    return model


def _fusable(linears: list[nn.Linear]) -> bool:
    """Linears that can be one matmul: none with a matmul of its own yet, one dtype, and for GGUF
    blocks kept (dspark_ray/model/quantized.py) one block type."""
    return (all(lin.gemm is None for lin in linears) and len({lin.weight.dtype for lin in linears}) == 1
            and len({getattr(lin, "qtype", None) for lin in linears}) == 1)


class SelfAttention(nn.Module):
    fused_qkv: FusedLinears | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.head_dim = hd
        self.q_proj = Linear(d, cfg.num_heads * hd, bias=cfg.attention_bias)
        self.k_proj = Linear(d, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.v_proj = Linear(d, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.num_heads * hd, d, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        layer: int,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,  # [B, T, D]
        sin: torch.Tensor,  # [B, T, D]
        attention: Attention,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        hd = self.head_dim
        # Head counts come from the (possibly sharded) projections.
        if self.fused_qkv is not None and self.q_norm is None:
            # q and k sit side by side in the fused output: rotated as one [B, T, Hq + Hkv, D] tensor
            # (the same arithmetic per element, bit for bit, half the rotary ops), then split; q and k
            # reach the attention as views. A 5-token pass of the shipped pair, 1 thread: 1.01-1.06x.
            y = self.fused_qkv.matmul(x)
            nq, nk, _ = self.fused_qkv.sizes
            qk = apply_rope(y[..., :nq + nk].unflatten(-1, (-1, hd)), cos, sin)
            q, k = qk.split((nq // hd, nk // hd), dim=2)
            out = attention(layer, q, k, y[..., nq + nk:].unflatten(-1, (-1, hd)))  # [B, T, Hq, D]
            return self.o_proj(out.reshape(b, t, -1))
        if self.fused_qkv is not None:
            q, k, v = (y.reshape(b, t, -1, hd) for y in self.fused_qkv(x))
        else:
            q = self.q_proj(x).view(b, t, -1, self.head_dim)
            k = self.k_proj(x).view(b, t, -1, self.head_dim)
            v = self.v_proj(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(layer, q, k, v)  # [B, T, Hq, D]
        return self.o_proj(out.reshape(b, t, -1))


class MLP(nn.Module):
    fused_gate_up: FusedLinears | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, m = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(d, m, bias=cfg.mlp_bias)
        self.up_proj = Linear(d, m, bias=cfg.mlp_bias)
        self.down_proj = Linear(m, d, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up is not None:
            gate, up = self.fused_gate_up(x)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.mla is not None:  # DeepSeek-V3
            self.self_attn = LatentAttention(cfg)
        else:
            self.self_attn = SelfAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The feed-forward block, under the checkpoint's name: "mlp", or Mixtral's "block_sparse_moe".
        self.ffn_name = "mlp"
        if cfg.is_sparse(index):
            names = expert_names(cfg.architecture)
            self.ffn_name = names.block
            setattr(self, names.block, SparseMoE(cfg.hidden_size, cfg.moe, names))
        else:
            self.mlp = MLP(cfg)

    @property
    def ffn(self) -> MLP | SparseMoE:
        """The feed-forward block (dense MLP or SparseMoE), whatever its checkpoint name."""
        return getattr(self, self.ffn_name)

    def forward(self, layer: int, x, cos, sin, attention: Attention) -> torch.Tensor:
        x = x + self.self_attn(layer, self.input_layernorm(x), cos, sin, attention)
        return x + self.ffn(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Token ids in, next-token logits out; ``state_dict()`` uses HF names."""

    lm_gemm = None  # PackedGemm of lm_weight | None (dspark_ray.model.cpu_gemm)
    compiled = None  # CompiledForward | None: hidden_states compiled (dspark_ray.model.compiled)
    native = None  # NativeForward | None: the layers in one C call (dspark_ray.model.native)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False
        )
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False
        )
        self.attention_scaling = rope_attention_scaling(cfg.rope_scaling)  # YaRN's; 1.0 otherwise

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, D] for ``positions`` [B, T], computed in float32."""
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_scaling != 1.0:
            return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor | None = None,  # [B, T] int64, default 0..T-1
        attention: Attention | None = None,
        taps: dict[int, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:  # [B, T, hidden], after the final norm
        """``taps``: layer ids (-1: the embedding output) whose residual stream output is also wanted;
        each entry is set to that layer's ``[B, T, hidden]`` output (a DSpark draft's context,
        ``dspark_ray.model.dspark.tap_hidden_states``). Runs the native layers when the model has them
        (``native.attach``) and the attention is the C kernel's, else the compiled forward when the
        model has one (``compile_model``); either when the call gives positions and attention and
        wants no taps."""
        if self.native is not None and taps is None and positions is not None and self.native.takes(attention):
            return self.native(input_ids, positions, attention)
        if self.compiled is not None and taps is None and positions is not None and attention is not None:
            return self.compiled(input_ids, positions, attention)
        return self.eager_hidden_states(input_ids, positions, attention, taps)

    def eager_hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention: Attention | None = None,
        taps: dict[int, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """``hidden_states`` op by op (what ``compile_model`` compiles)."""
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        if attention is None:
            attention = CausalAttention(self.config.sliding_window)
        x = self.model.embed_tokens(input_ids)
        if taps is not None and -1 in taps:
            taps[-1] = x
        cos, sin = self.rope(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(i, x, cos, sin, attention)
            if taps is not None and i in taps:
                taps[i] = x
        return self.model.norm(x)

    @property
    def lm_weight(self) -> torch.Tensor:
        """[V, hidden]: the LM head's weight, or the embedding's when they are tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., V] float32 logits."""
        if self.lm_gemm is not None:
            return self.lm_gemm(hidden).float()
        return F.linear(hidden, self.lm_weight).float()

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor | None = None,  # [B, T] int64
        attention: Attention | None = None,
    ) -> torch.Tensor:  # [B, T, V] float32
        return self.logits(self.hidden_states(input_ids, positions, attention))
