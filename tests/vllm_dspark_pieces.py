"""Run vLLM's own Qwen3 DSpark model class on CPU over a checkpoint, piece by piece (run by
tests/test_dspark_draft.py with bench/.vllm-venv's Python; not a test module itself).

vLLM 0.32's CPU build cannot run speculative method ``dspark`` (its V1 model runner refuses it
and the V2 runner needs Triton), and the draft's attention needs that runner's KV cache; so
this builds ``Qwen3DSparkForCausalLM`` alone, loads the checkpoint through vLLM's own
``load_weights``, and runs its pieces: the context K/V projection (fc, hidden_norm, k/v
projections, k_norm, RoPE), the block forward through its decoder layers with only the attention
kernel replaced by plain attention over [context K/V ; block] (what its non-causal backend
computes from the KV cache), then its Markov head left to right (greedy, as its speculator's
``_sample_sequential``) and its confidence head.

Usage: python vllm_dspark_pieces.py TARGET_DIR DRAFT_DIR INPUTS.pt OUTPUTS.pt
"""

import os
import sys

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(target_dir: str, draft_dir: str, inputs_path: str, outputs_path: str) -> None:
    from safetensors.torch import load_file
    from vllm.config import (DeviceConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig,
                             set_current_vllm_config)
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    inputs = torch.load(inputs_path)
    target = ModelConfig(model=target_dir, dtype="float32", skip_tokenizer_init=True, enforce_eager=True)
    parallel = ParallelConfig()
    spec = SpeculativeConfig(method="dspark", model=draft_dir, target_model_config=target,
                             target_parallel_config=parallel, num_speculative_tokens=inputs["block_size"])
    config = VllmConfig(model_config=target, parallel_config=parallel, device_config=DeviceConfig("cpu"))
    object.__setattr__(config, "speculative_config", spec)  # the CPU runner refuses dspark; the class alone is fine
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{inputs['port']}", backend="gloo")
        initialize_model_parallel(1, 1)
        from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

        model = Qwen3DSparkForCausalLM(vllm_config=config)
        model.load_weights(list(load_file(os.path.join(draft_dir, "model.safetensors")).items()))
        # The target's LM head, as load_dspark_model shares it (before the CPU path prepacks weights).
        model.lm_head.weight.data[:inputs["lm_head"].shape[0]] = inputs["lm_head"]
        process_weights_after_loading(model, spec.draft_model_config, torch.device("cpu"))
        with torch.no_grad():
            out = pieces(model, inputs)
    torch.save(out, outputs_path)


def pieces(model, inputs: dict) -> dict:
    inner = model.model
    taps, positions = inputs["taps"], inputs["positions"]  # [N, n * H], [N]
    n = taps.shape[0]
    ctx = model.combine_hidden_states(taps)
    k, v = inner._project_context_kv(ctx, n, inner._num_attn_layers, inner._num_kv_heads, inner._head_dim)
    # Each layer's own k_norm. (vLLM's fused path, ``_normalize_context_k``, passes the stacked
    # [L, head_dim] weights to one rms_norm op; on CUDA that picks each layer's row, but the CPU op
    # applies layer 0's weights to every layer, so it is not used here.)
    k = torch.stack([layer.self_attn.k_norm(layer_k) for layer, layer_k in zip(inner.layers, k)])
    rope = inner.layers[0].self_attn.rotary_emb
    rotated = [rope.forward_native(positions, layer_k.reshape(n, -1).clone(), None)[0].view_as(layer_k)
               for layer_k in k]
    for layer, (layer_k, layer_v) in zip(inner.layers, zip(rotated, v)):
        layer.self_attn.attn = PlainAttention(layer_k, layer_v, layer.self_attn)
    size, anchor = inputs["block_size"], int(inputs["anchor"])
    ids = torch.tensor([anchor] + [inner.mask_token_id] * (size - 1))
    hidden = inner(ids, n + torch.arange(size), inputs["embed"][ids])  # [S, H]
    base = model.compute_draft_logits(hidden)
    prev, tokens, logits, embeds = torch.tensor([anchor]), [], [], []
    for i in range(size):
        embed = model.markov_embed(prev)
        logits.append(base[i:i + 1] + model.markov_bias(embed))
        prev = logits[-1].argmax(dim=-1)
        tokens.append(int(prev))
        embeds.append(embed)
    return {
        "context_k": torch.stack(rotated), "context_v": v, "hidden": hidden, "tokens": tokens,
        "base": base, "logits": torch.cat(logits), "confidence": model.compute_confidence(hidden, torch.cat(embeds)),
    }


class PlainAttention(torch.nn.Module):
    """Non-causal attention of the block's queries over the layer's context K/V and the block's own."""

    def __init__(self, context_k, context_v, attn) -> None:
        super().__init__()
        self.k, self.v, self.heads, self.kv_heads, self.dim = context_k, context_v, attn.num_heads, \
            attn.num_kv_heads, attn.head_dim

    def forward(self, q, k, v):  # [S, heads * dim], [S, kv_heads * dim] x 2 -> [S, heads * dim]
        s = q.shape[0]
        keys = torch.cat((self.k, k.view(s, self.kv_heads, self.dim))).transpose(0, 1)
        values = torch.cat((self.v, v.view(s, self.kv_heads, self.dim))).transpose(0, 1)
        rep = self.heads // self.kv_heads
        out = torch.nn.functional.scaled_dot_product_attention(
            q.view(s, self.heads, self.dim).transpose(0, 1), keys.repeat_interleave(rep, 0),
            values.repeat_interleave(rep, 0))
        return out.transpose(0, 1).reshape(s, -1)


if __name__ == "__main__":
    main(*sys.argv[1:5])
