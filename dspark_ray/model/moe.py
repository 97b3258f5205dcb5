"""Sparse mixture-of-experts feed-forward block (Qwen3-MoE, Mixtral, DeepSeek-V3).

NOTE: the algorithm. A router (``gate``, a linear with no bias) scores every
token against every expert; the scores go through a float32 softmax and each
token keeps its ``top_k`` experts, their probabilities renormalised to sum to
one when the family says so (Qwen3-MoE: ``norm_topk_prob``; Mixtral: always).
DeepSeek-V3 routes differently (``route_grouped``): sigmoid scores, a learned
per-expert bias that steers the choice but not the weights, the choice limited
to the best ``topk_group`` of ``n_group`` expert groups, and the weights scaled
by ``routed_scaling_factor``; it also has an always-on shared expert.
Each expert is a SwiGLU MLP, ``down(silu(gate(x)) * up(x))``, and a token's
output is the weighted sum of its experts' outputs. The experts run batched:
the (token, expert) pairs are sorted by expert, so each expert multiplies its
whole contiguous group of tokens at once; the Python loop is over the experts
that received tokens, never over tokens.

Checkpoint names are Hugging Face's (``...mlp.gate.weight``,
``...mlp.experts.E.gate_proj.weight`` for Qwen3-MoE and DeepSeek-V3, whose
``mlp.gate`` also has an ``e_score_correction_bias`` and whose
``mlp.shared_experts`` is a plain SwiGLU MLP;
``...block_sparse_moe.experts.E.w1.weight`` for Mixtral), so the loader reads
each expert's tensors as it reads any linear. After loading, ``stack_experts``
packs them into two 3-D tensors (``w13`` [E, 2I, H], ``w2`` [E, H, I]) and
makes every expert's parameters views of them: the state dict, its names and
the memory used stay the same (once a layer is stacked), while the forward
indexes one stacked tensor.

Tensor parallelism (``dspark_ray.model.tp``) slices every expert the way it
slices a dense MLP: each rank holds a column block of every expert's gate/up
and the matching row block of its down projection, so each rank's output is a
partial sum and the block ends with a single all-reduce (``tp``), whatever the
number of experts a token visits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dspark_ray.model.config import MoeConfig


@dataclass(frozen=True)
class ExpertNames:
    """How one family's checkpoint names its MoE block and each expert's three projections."""

    block: str  # the decoder layer's attribute: "mlp" | "block_sparse_moe"
    gate: str  # SwiGLU gate projection [I, H]
    up: str  # SwiGLU up projection [I, H]
    down: str  # down projection [H, I]


QWEN_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
MIXTRAL_NAMES = ExpertNames("block_sparse_moe", "w1", "w3", "w2")


def expert_names(architecture: str) -> ExpertNames:
    return MIXTRAL_NAMES if architecture == "MixtralForCausalLM" else QWEN_NAMES


class Expert(nn.Module):
    """One expert's weights under the checkpoint's names. It holds parameters only:
    ``SparseMoE`` computes all experts together from their stacked weights."""

    def __init__(self, hidden: int, intermediate: int, names: ExpertNames) -> None:
        super().__init__()
        self.names = names
        setattr(self, names.gate, nn.Linear(hidden, intermediate, bias=False))
        setattr(self, names.up, nn.Linear(hidden, intermediate, bias=False))
        setattr(self, names.down, nn.Linear(intermediate, hidden, bias=False))

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """(gate, up, down), whatever the checkpoint calls them."""
        n = self.names
        return getattr(self, n.gate), getattr(self, n.up), getattr(self, n.down)


def route(
    router_logits: torch.Tensor,  # [N, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [N, k] float32, experts [N, k] int64
    """Each token's top-k experts and their weights: softmax in float32, top-k, optionally
    renormalised over the chosen k (as transformers' Qwen3MoeTopKRouter / MixtralTopKRouter)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def route_grouped(
    router_logits: torch.Tensor,  # [N, E] float32
    correction_bias: torch.Tensor,  # [E]: added to the scores for choosing only
    moe: MoeConfig,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [N, k] float32, experts [N, k] int64
    """DeepSeek-V3's choice (transformers' DeepseekV3TopkRouter): sigmoid scores; each group of
    experts ranked by the sum of its two best biased scores; the top-k biased scores among the
    best topk_group groups; their unbiased scores as weights, renormalised if norm_topk_prob,
    times routed_scaling_factor."""
    n = router_logits.shape[0]
    scores = router_logits.float().sigmoid()
    biased = scores + correction_bias.float()
    grouped = biased.view(n, moe.n_group, -1)  # [N, G, E/G]
    best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(moe.topk_group, dim=-1).indices  # [N, topk_group]
    allowed = torch.zeros(n, moe.n_group, dtype=torch.bool, device=scores.device).scatter_(1, best_groups, True)
    biased = grouped.masked_fill(~allowed[:, :, None], float("-inf")).view(n, -1)
    experts = biased.topk(moe.top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, experts


def swiglu(
    x: torch.Tensor,  # [N, H]
    gate: torch.Tensor,  # [I, H]
    up: torch.Tensor,  # [I, H]
    down: torch.Tensor,  # [H, I]
) -> torch.Tensor:  # [N, H]
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def grouped_experts(
    x: torch.Tensor,  # [N, H]
    w13: torch.Tensor,  # [E, 2I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [N, k] float32
    experts: torch.Tensor,  # [N, k] int64
) -> torch.Tensor:  # [N, H] float32: sum over each token's k experts of weight * expert(x)
    """The routed experts' weighted sum, one matmul pair per expert that received tokens."""
    n, k = experts.shape
    pairs = experts.reshape(-1)  # [N*k], pair p = (token p // k, its (p % k)-th expert)
    order = torch.argsort(pairs, stable=True)  # pairs grouped by expert
    tokens = order // k  # [N*k] the token of each sorted pair
    counts = torch.bincount(pairs, minlength=w13.shape[0]).tolist()  # one host sync per layer
    xs = x[tokens]  # [N*k, H] tokens in expert order
    ys = torch.empty_like(xs)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        group = slice(start, start + count)
        gate, up = F.linear(xs[group], w13[e]).chunk(2, dim=-1)
        ys[group] = F.linear(F.silu(gate) * up, w2[e])
        start += count
    scaled = ys.float() * weights.reshape(-1)[order, None]
    return torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tokens, scaled)


class Router(nn.Module):
    """The gate: router logits [N, E] from hidden states (replicated under tensor parallelism)."""

    def __init__(self, hidden: int, num_experts: int, grouped_sigmoid: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))  # as transformers: all experts alike
        # DeepSeek-V3 scores in float32 and carries a per-expert selection bias.
        self.float32 = grouped_sigmoid
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts)) if grouped_sigmoid else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, E]
        if self.float32:
            return F.linear(x.float(), self.weight.float())
        return F.linear(x, self.weight)


class SparseMoE(nn.Module):
    """The routed feed-forward block of one decoder layer; ``state_dict()`` uses HF names."""

    tp: Any = None  # TensorParallel | None, set by tp.shard: the block's output is all-reduced over it
    w13: torch.Tensor | None = None  # [E, 2I, H], set by stack_experts
    w2: torch.Tensor | None = None  # [E, H, I]

    def __init__(self, hidden: int, moe: MoeConfig, names: ExpertNames) -> None:
        super().__init__()
        self.moe = moe
        self.top_k, self.renormalize = moe.top_k, moe.norm_topk_prob
        self.gate = Router(hidden, moe.num_experts, moe.grouped_sigmoid)
        self.experts = nn.ModuleList(Expert(hidden, moe.intermediate_size, names) for _ in range(moe.num_experts))
        self.shared_experts = (Expert(hidden, moe.shared_intermediate_size, QWEN_NAMES)
                               if moe.shared_intermediate_size else None)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] float32, experts [N, k] int64) from router logits [N, E]."""
        if self.moe.grouped_sigmoid:
            return route_grouped(router_logits, self.gate.e_score_correction_bias, self.moe)
        return route(router_logits, self.top_k, self.renormalize)

    def stack_experts(self) -> None:
        """Stack the experts' weights into ``w13``/``w2`` and make each expert's parameters views of
        them (no memory beyond one layer's copy while it runs; an in-place update through either name
        is seen by both). After loading."""
        projections = [e.projections() for e in self.experts]
        self.w13 = torch.stack([torch.cat([g.weight.detach(), u.weight.detach()]) for g, u, _ in projections])
        self.w2 = torch.stack([d.weight.detach() for _, _, d in projections])
        inter = self.w2.shape[2]
        for e, (g, u, d) in enumerate(projections):
            g.weight = nn.Parameter(self.w13[e, :inter], requires_grad=False)
            u.weight = nn.Parameter(self.w13[e, inter:], requires_grad=False)
            d.weight = nn.Parameter(self.w2[e], requires_grad=False)

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2): the stacked weights, or stacked now if ``stack_experts`` has not run."""
        if self.w13 is not None:
            return self.w13, self.w2
        projections = [e.projections() for e in self.experts]
        return (torch.stack([torch.cat([g.weight, u.weight]) for g, u, _ in projections]),
                torch.stack([d.weight for _, _, d in projections]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, H] -> [B, T, H]
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        weights, experts = self.route(self.gate(flat))
        w13, w2 = self.stacked()
        out = grouped_experts(flat, w13, w2, weights, experts).to(x.dtype)
        if self.shared_experts is not None:  # under TP also a partial sum: one all-reduce for both
            out += swiglu(flat, *(lin.weight for lin in self.shared_experts.projections()))
        if self.tp is not None and self.tp.world_size > 1:
            self.tp.all_reduce(out)  # every rank summed its slice of every expert
        return out.view_as(x)
