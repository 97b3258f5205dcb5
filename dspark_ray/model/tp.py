"""Tensor parallelism as a transform over the plain model (Megatron-style).

``shard(model, tp)`` swaps linears in place: q/k/v/gate/up become
column-parallel (each rank keeps a contiguous block of output features, so a
block of whole heads), o/down become row-parallel (each rank keeps the
matching input features and the partial outputs are summed with one
all-reduce). Embeddings, norms and the LM head stay replicated, so every rank
ends with identical hidden states and logits. The model code itself is
unchanged: attention reads head counts from the projection shapes.

Mixture-of-experts layers are sliced the same way, expert by expert: each
rank holds a column block of every expert's gate/up and the matching row block
of its down projection (``ExpertShard``), the router stays replicated, and the
block's output is all-reduced once. The alternative, whole experts per rank
(expert parallelism), needs the same one all-reduce per layer but leaves the
ranks unevenly loaded whenever a token's top-k experts are not split evenly
between them; at the small decode batches of two DGX Sparks over ConnectX-7,
with a handful of experts active per step, the step waits for the busier rank
(with top-8 of many experts on 2 ranks, about 5 of the 8 on average), while
slicing every expert halves each rank's weight reads exactly.

Run on the meta device before loading, so that each rank allocates and reads
only its slices of the checkpoint (``parallel.shard_slice`` tells the loader which).
"""

from __future__ import annotations

from dspark_ray.model.errors import ModelLoadError
from dspark_ray.model.llama import CausalLM
from dspark_ray.model.moe import SparseMoE
from dspark_ray.model.parallel import ColumnParallelLinear, ExpertShard, RowParallelLinear, TensorParallel

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj")  # the last two: MLA
_ROW = ("o_proj", "down_proj")


def shard(model: CausalLM, tp: TensorParallel) -> CausalLM:
    """Replace the model's linears with their tensor-parallel shards, in place."""
    cfg = model.config
    w = tp.world_size
    for what, n in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                    ("intermediate_size", cfg.intermediate_size),
                    ("moe_intermediate_size", cfg.moe.intermediate_size if cfg.moe else 0)):
        if n % w:
            raise ModelLoadError(
                f"{what} ({n}) is not divisible by tensor_parallel_size {w}; choose a size that divides it"
            )
    if w == 1:
        return model
    for layer in model.model.layers:
        if isinstance(layer.ffn, SparseMoE):
            _shard_experts(layer.ffn, tp)
        for parent in (layer.self_attn, layer.ffn):
            for name in _COLUMN + _ROW:
                full = getattr(parent, name, None)
                if full is None:
                    continue
                cls = ColumnParallelLinear if name in _COLUMN else RowParallelLinear
                setattr(parent, name, cls(full, tp))
    return model


def _shard_experts(moe: SparseMoE, tp: TensorParallel) -> None:
    """Every expert (the shared one too) sliced as a dense MLP is (gate/up by rows, down by columns);
    one all-reduce for the block."""
    shared = [] if moe.shared_experts is None else [moe.shared_experts]
    for expert in [*moe.experts, *shared]:
        names = expert.names
        for name, dim in ((names.gate, 0), (names.up, 0), (names.down, 1)):
            setattr(expert, name, ExpertShard(getattr(expert, name), tp, dim))
    moe.tp = tp
