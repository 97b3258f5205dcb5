"""A GGUF model's decoder layers in one C call a step: the CPU path for kept blocks.

Where a model's linears are GGUF blocks kept on the CPU (``quantized.py``), a step's arithmetic
is the block matmuls and the attention, both C kernels; what the compiled forward
(``compiled.py``) adds around them is the cost of calling them: per layer ~10 fused elementwise
loops, four ``dspark::linear`` and one ``dspark::attention`` through the dispatcher into Python,
a tensor allocated per op. On SmolLM2-135M at one decode token, one thread, that was ~4 ms of a
~17 ms step (the matmuls ~9). ``dspark_kernels.cpu.Decoder`` runs every layer of the step in one
C call instead (csrc/cpu_decoder.c: the norms, the rotary embedding, SiLU x up and the residual
adds written out, the matmuls and the attention the same kernels), and the step keeps only the
embedding, the rotary tables, the final norm and the LM head in torch.

It takes a step whose attention is the C kernel's (``cpu.PagedStep``: CPU float32 pools, the
runner's native attention); any other step (a prompt chunk past the kernel's fed limit, taps for a
DSpark drafter, the torch attention) runs the compiled (or eager) forward as before. Both compute
every row alone, so a request's tokens do not depend on its neighbours on either path; the two
paths' elementwise code rounds differently (as compiled and eager do, ~1e-5 in the logits).

Used for a model with: every layer a dense MLP (no MoE) and ordinary attention (no MLA, no q/k
norm), q/k/v and gate/up fused, every linear's weight blocks kept (``BlockGemm``), float32 norms
and activations, all heads on this rank (no tensor parallelism: the C call has no all-reduce).
``engine.local.make_target_runner`` attaches it to a target without taps, compiled or not (it needs
the C kernels, not torch.compile). ``DSPARK_NATIVE_DECODER=0`` turns it off (the compiled or eager
forward everywhere).
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)


def enabled() -> bool:
    """Whether the native decoder may be used (``DSPARK_NATIVE_DECODER``, default on)."""
    return os.environ.get("DSPARK_NATIVE_DECODER", "1") != "0"


def unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run its layers natively (module docstring), or None. Asked of a loaded
    model before ``compile_model``, whose op then stands in for the linears' block matmuls."""
    from dspark_kernels import cpu

    from dspark_ray.model.quantized import BlockGemm

    cfg = model.config
    if cfg.moe is not None or cfg.mla is not None or cfg.qk_norm:
        return "a mixture-of-experts, latent-attention or q/k-norm model"
    if not cpu.can_build() or cpu.library() is None:
        return "no CPU kernels here"
    hd = cfg.head_dim
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = attn.fused_qkv, getattr(mlp, "fused_gate_up", None)
        if qkv is None or gate_up is None:
            return f"layer {i}'s projections are not fused"
        linears = (qkv, attn.o_proj, gate_up, mlp.down_proj)
        if not all(isinstance(lin.gemm, BlockGemm) and lin.gemm._kernel is not None for lin in linears):
            return f"layer {i} has a linear whose blocks are not kept on the CPU"
        if qkv.sizes != [cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd] \
                or attn.o_proj.out_features != cfg.hidden_size or gate_up.sizes != [cfg.intermediate_size] * 2:
            return f"layer {i}'s heads or MLP are split across ranks"
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(w.dtype != torch.float32 for w in norms):
            return "the model's float tensors are not float32"
    return None


class NativeForward:
    """``model.hidden_states`` for a step on the C attention: the embedding and rotary tables in
    torch, the layers in one ``cpu.Decoder`` call, the final norm. Installed as ``model.native`` by
    ``attach``; it holds the layers' blocks and norms (the model's own tensors, not copies)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from dspark_kernels import cpu

        def block(lin) -> cpu.BlockLinear:  # a linear's kept blocks (its BlockGemm's) and bias
            return cpu.BlockLinear(lin.gemm.weight.blocks, lin.gemm.weight.qtype, lin.gemm.int8, lin.bias)

        cfg = model.config
        layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(cpu.DecoderLayerWeights(
                layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                block(attn.fused_qkv), block(attn.o_proj), block(mlp.fused_gate_up), block(mlp.down_proj)))
        self.model = model
        self.decoder = cpu.Decoder(layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   cfg.intermediate_size, cfg.rms_norm_eps)
        self._step_type = cpu.PagedStep

    def takes(self, attention: object) -> bool:
        """Whether a step on ``attention`` runs here: the C kernel's paged attention."""
        return isinstance(attention, self._step_type)

    def __call__(
        self,
        input_ids: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor,  # [B, T] int64
        attention,  # cpu.PagedStep over the B * T tokens
    ) -> torch.Tensor:  # [B, T, hidden], after the final norm
        from dspark_ray.model.quantized import follow_torch_threads

        model = self.model
        x = model.model.embed_tokens(input_ids)
        if x.dtype != torch.float32:
            raise ValueError(f"the native decoder runs float32 activations, the embedding gave {x.dtype}")
        cos, sin = model.rope(positions, torch.float32)
        d = cos.shape[-1]
        follow_torch_threads()  # the kernels' pool: as many threads as torch's ops
        hidden = self.decoder(x.reshape(-1, x.shape[-1]).contiguous(), cos.reshape(-1, d).contiguous(),
                              sin.reshape(-1, d).contiguous(), attention)
        return model.model.norm(hidden).reshape(x.shape)


def attach(model: torch.nn.Module) -> bool:
    """Install ``NativeForward`` as ``model.native`` where the model takes it (``unsupported``) and it
    is ``enabled``; returns whether it did."""
    if not enabled():
        return False
    reason = unsupported(model)
    if reason is not None:
        log.debug("native decoder: not used (%s)", reason)
        return False
    model.native = NativeForward(model)
    return True
