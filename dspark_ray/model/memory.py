"""Memory planning: does a deployment fit its devices, and if not, what would.

NOTE: a plan is arithmetic over a checkpoint's config.json, read as the raw
dict, so it covers families the model code may not load yet (dense
Llama/Mistral/Qwen2/Qwen3, Qwen2/Qwen3-MoE, Mixtral, DeepSeek-V2/V3 with
multi-head latent attention, FP8 block-quantized checkpoints). Parameters are
counted tensor by tensor as the checkpoint stores them (``Tensor``), each with
how tensor parallelism splits it (dspark_ray/model/tp.py: q/k/v/gate/up by
output rows, o/down by input columns, whole heads per rank; embeddings, norms,
routers and the LM head replicated). Per device (a GPU, on a DGX Spark the
box's unified memory; on CPU one node's memory, shared by its ranks)::

    usable     = memory x memory_utilization
    fixed      = ranks x (weights + workspace + request table + runtime)    per rank
               + draft (weights + window cache + workspace + runtime)       on rank 0's device
    KV tokens  = (usable - fixed) / (ranks x KV bytes per token per rank)

The KV pool is in the activations' dtype: GQA keeps K and V of each rank's
K/V heads; MLA keeps the compressed latent (kv_lora_rank + qk_rope_head_dim a
layer), whole on every rank, as the target runner's latent pool does
(dspark_ray/engine/latent_attention.py). Rank 0's device also holds the draft, so it binds: every
rank's pool has the same size. Verdicts:

- ``FITS``: the KV pool holds every slot at full context, capacity x
  (max_context + k) tokens (or the fixed pool, ``kv_pool_tokens`` or the CPU
  sizing, fits);
- ``KV_LIMITED``: it holds at least one full-context request but not every
  slot at once (requests wait, or are preempted, when contexts run long);
- ``DOES_NOT_FIT``: not even one full-context request, or the fixed pool does not fit.

Workspace and runtime are allowances, not measurements: the activations of one
step at ``max_num_batched_tokens``, the keys each attention layer gathers for a
full batch at full context (on CUDA also their copies widened to the query
heads, as the target runner makes them today), the logits, and per process a
runtime (CUDA context, cuBLAS, NCCL; on CPU the interpreter, torch and the Ray
worker). GB in messages are 10**9 bytes. No torch here: plain arithmetic.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dspark_ray.model.errors import ModelLoadError, UnsupportedArchitecture

GB = 10**9
COLUMN, ROW, REPLICATED = "column", "row", "replicated"
FITS, KV_LIMITED, DOES_NOT_FIT = "fits", "kv-limited", "does not fit"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FP8_SCALE_BYTES = 4  # one float32 scale (weight_scale_inv) per weight block
# GGUF block types: (weights, bytes) per block (ggml's layouts), and those whose blocks a kernel reads on
# each device, so that quantization auto keeps them (dspark_ray/model/quantized.py, dspark_kernels.quant).
GGUF_BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q6_K": (256, 210)}
GGUF_KEPT = {"cpu": frozenset(GGUF_BLOCKS), "cuda": frozenset({"Q8_0", "Q4_0", "Q4_1"})}
ALLOCATOR_BYTES_PER_TOKEN = 9  # the KV allocator's int64 free stack and bool free mask (slots/req_to_token.py)
TABLE_BYTES_PER_POSITION = 4  # the request-to-token table: int32 [capacity + 1, max_context]
# Per process, beyond its tensors. CUDA: the context (~0.5 GB), cuBLAS workspaces, NCCL buffers.
# CPU: the interpreter, torch and the Ray worker.
RUNTIME_BYTES = {"cuda": 3 * GB // 2, "cpu": 2 * GB // 5}
MAX_RANKS = 64  # AppConfig.tensor_parallel_size's limit
SLOT_POOL_SHARE = 0.25  # EngineConfig.kv_tokens without kv_pool_tokens on CPU: a quarter of capacity x max_context


class MemoryPlanError(ValueError):
    """The deployment does not fit its memory; the message is the plan's explanation and what would fit."""

    def __init__(self, plan: MemoryPlan, detail: str = "") -> None:
        super().__init__(detail + plan.message())
        self.plan = plan


# -- what the checkpoint stores ------------------------------------------------


@dataclass(frozen=True)
class Tensor:
    """One weight of the checkpoint, repeated ``copies`` times (per layer, per expert)."""

    name: str
    rows: int  # output features; a vector's length
    cols: int = 1  # input features; 1 for a vector
    copies: int = 1
    active: int | None = None  # copies one token reads (routed experts: top-k per layer); None: all
    split: str = REPLICATED  # COLUMN: rows divided among the ranks; ROW: cols; REPLICATED: whole on each
    unit: int = 1  # the split dimension is divided in whole units (attention heads: one head's width)
    linear: bool = False  # a projection inside a decoder layer: FP8 blocks in an FP8 checkpoint

    @property
    def params(self) -> int:
        return self.rows * self.cols * self.copies

    @property
    def active_params(self) -> int:
        return self.rows * self.cols * (self.copies if self.active is None else self.active)

    def on_rank(self, tp: int) -> tuple[int, int]:
        """(rows, cols) of one copy on one of ``tp`` ranks (the largest share if they do not divide)."""
        if self.split == COLUMN:
            return _share(self.rows, self.unit, tp), self.cols
        if self.split == ROW:
            return self.rows, _share(self.cols, self.unit, tp)
        return self.rows, self.cols

    def divides(self, tp: int) -> bool:
        dim = {COLUMN: self.rows, ROW: self.cols}.get(self.split)
        return dim is None or (dim // self.unit) % tp == 0


def _share(n: int, unit: int, tp: int) -> int:
    return -(-(n // unit) // tp) * unit


@dataclass(frozen=True)
class KVLayout:
    """What the target's KV pool keeps per token and layer."""

    layers: int
    heads: int  # K/V heads (MLA: 1, the compressed latent every head reads)
    width: int  # values per head, K and V together (GQA: 2 x head_dim; MLA: kv_lora_rank + qk_rope_head_dim)
    sharded: bool  # heads divided among the ranks (GQA), or whole on every rank (MLA's latent)

    def heads_on_rank(self, tp: int) -> int:
        return -(-self.heads // tp) if self.sharded else self.heads

    def values_per_token(self, tp: int) -> int:
        return self.layers * self.heads_on_rank(tp) * self.width


@dataclass(frozen=True)
class FP8:
    """Block-quantized FP8 weights: 1 byte a weight plus a float32 scale per block (``weight_block_size``)."""

    block: tuple[int, int] | None = (128, 128)  # None: one scale per tensor
    skip: tuple[str, ...] = ()  # modules_to_not_convert / ignored_layers: name fragments kept unquantized

    def applies(self, t: Tensor) -> bool:
        return t.linear and not any(s and t.name.startswith(s + ".") for s in self.skip)

    def scales(self, rows: int, cols: int) -> int:
        return 1 if self.block is None else math.ceil(rows / self.block[0]) * math.ceil(cols / self.block[1])


@dataclass(frozen=True)
class Architecture:
    """A checkpoint's tensors and KV layout, from its config.json (``architecture``)."""

    name: str  # config.json's architectures[0]
    tensors: tuple[Tensor, ...]
    kv: KVLayout
    hidden_size: int
    vocab_size: int
    num_heads: int
    query_width: int  # q projection outputs per token, all heads
    mlp_width: int  # MLP features one token passes through per layer (MoE: its top-k experts + shared)
    experts: int  # routed experts per MoE layer; 0: dense
    dtype: str  # the checkpoint's torch_dtype
    fp8: FP8 | None  # its quantization_config
    notes: tuple[str, ...] = ()
    # A DSpark block draft: (its context window, None = the whole context; its block size). Its ring
    # holds window + block positions per slot, whatever the engine's draft_window and k.
    block_draft: tuple[int | None, int] | None = None

    @property
    def params(self) -> int:
        return sum(t.params for t in self.tensors)

    @property
    def active_params(self) -> int:
        return sum(t.active_params for t in self.tensors)

    def divides(self, tp: int) -> bool:
        """Whether the shard transform can split every layer over ``tp`` ranks (whole heads each)."""
        kv_ok = not self.kv.sharded or self.kv.heads % tp == 0
        return kv_ok and all(t.divides(tp) for t in self.tensors)


def _linear(name: str, out: int, inp: int, copies: int, split: str = REPLICATED, unit: int = 1,
            bias: bool = False, active: int | None = None) -> list[Tensor]:
    """A decoder projection and its bias. A row-parallel bias is added once, after the all-reduce."""
    weight = Tensor(f"{name}.weight", out, inp, copies, active, split, unit, linear=True)
    if not bias:
        return [weight]
    return [weight, Tensor(f"{name}.bias", out, 1, copies, active, COLUMN if split == COLUMN else REPLICATED, unit)]


def _mlp(name: str, inter: int, hidden: int, copies: int, active: int | None = None,
         bias: bool = False) -> list[Tensor]:
    return [*_linear(f"{name}.gate_proj", inter, hidden, copies, COLUMN, 1, bias, active),
            *_linear(f"{name}.up_proj", inter, hidden, copies, COLUMN, 1, bias, active),
            *_linear(f"{name}.down_proj", hidden, inter, copies, ROW, 1, bias, active)]


def _frame(raw: dict, layers: int) -> list[Tensor]:
    """Embeddings, the two norms of every layer, the final norm and the LM head (unless tied)."""
    vocab, hidden = raw["vocab_size"], raw["hidden_size"]
    out = [Tensor("embed_tokens.weight", vocab, hidden), Tensor("input_layernorm.weight", hidden, copies=layers),
           Tensor("post_attention_layernorm.weight", hidden, copies=layers), Tensor("norm.weight", hidden)]
    if not raw.get("tie_word_embeddings", False):
        out.append(Tensor("lm_head.weight", vocab, hidden))
    return out


def _heads(raw: dict) -> tuple[int, int, int]:
    """(query heads, K/V heads, head_dim)."""
    heads = raw["num_attention_heads"]
    return heads, raw.get("num_key_value_heads") or heads, raw.get("head_dim") or raw["hidden_size"] // heads


def _gqa(raw: dict, layers: int, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> list[Tensor]:
    hidden = raw["hidden_size"]
    heads, kv_heads, hd = _heads(raw)
    out = [*_linear("self_attn.q_proj", heads * hd, hidden, layers, COLUMN, hd, qkv_bias),
           *_linear("self_attn.k_proj", kv_heads * hd, hidden, layers, COLUMN, hd, qkv_bias),
           *_linear("self_attn.v_proj", kv_heads * hd, hidden, layers, COLUMN, hd, qkv_bias),
           *_linear("self_attn.o_proj", hidden, heads * hd, layers, ROW, hd, o_bias)]
    if qk_norm:  # Qwen3: RMSNorm over each head's q and k
        out += [Tensor("self_attn.q_norm.weight", hd, copies=layers),
                Tensor("self_attn.k_norm.weight", hd, copies=layers)]
    return out


def _gqa_layout(raw: dict) -> KVLayout:
    _, kv_heads, hd = _heads(raw)
    return KVLayout(raw["num_hidden_layers"], kv_heads, 2 * hd, sharded=True)


def _dense(name: str, raw: dict) -> Architecture:
    layers = raw["num_hidden_layers"]
    bias = bool(raw.get("attention_bias", False))
    qkv_bias, o_bias = {"Qwen2ForCausalLM": (True, False), "MistralForCausalLM": (False, False)}.get(name, (bias, bias))
    mlp_bias = bool(raw.get("mlp_bias", False)) and name == "LlamaForCausalLM"
    inter = raw["intermediate_size"]
    tensors = [*_frame(raw, layers), *_gqa(raw, layers, qkv_bias, o_bias, name == "Qwen3ForCausalLM"),
               *_mlp("mlp", inter, raw["hidden_size"], layers, bias=mlp_bias)]
    return _architecture(name, raw, tensors, _gqa_layout(raw), inter, 0)


def _mixtral(name: str, raw: dict) -> Architecture:
    layers, hidden = raw["num_hidden_layers"], raw["hidden_size"]
    experts, top_k, inter = raw["num_local_experts"], raw["num_experts_per_tok"], raw["intermediate_size"]
    tensors = [*_frame(raw, layers), *_gqa(raw, layers, False, False, False),
               Tensor("block_sparse_moe.gate.weight", experts, hidden, layers),
               *_mlp("block_sparse_moe.experts", inter, hidden, layers * experts, active=layers * top_k)]
    return _architecture(name, raw, tensors, _gqa_layout(raw), top_k * inter, experts)


def _qwen_moe(name: str, raw: dict) -> Architecture:
    """Qwen2-MoE and Qwen3-MoE: a layer is sparse unless in mlp_only_layers or off decoder_sparse_step."""
    layers, hidden = raw["num_hidden_layers"], raw["hidden_size"]
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
    experts = raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"]
    top_k, moe_inter = raw["num_experts_per_tok"], raw["moe_intermediate_size"]
    only, step = set(raw.get("mlp_only_layers") or ()), raw.get("decoder_sparse_step", 1)
    sparse = sum(1 for i in range(layers) if i not in only and experts > 0 and (i + 1) % step == 0)
    qwen3 = name == "Qwen3MoeForCausalLM"
    bias = bool(raw.get("attention_bias", False))
    qkv_bias, o_bias = (bias, bias) if qwen3 else (bool(raw.get("qkv_bias", True)), False)
    tensors = [*_frame(raw, layers), *_gqa(raw, layers, qkv_bias, o_bias, qwen3),
               *(_mlp("mlp", raw["intermediate_size"], hidden, layers - sparse) if layers > sparse else []),
               Tensor("mlp.gate.weight", experts, hidden, sparse),
               *_mlp("mlp.experts", moe_inter, hidden, sparse * experts, active=sparse * top_k)]
    width = top_k * moe_inter
    if not qwen3:  # Qwen2-MoE: a shared expert behind a sigmoid gate
        shared = raw["shared_expert_intermediate_size"]
        tensors += [*_mlp("mlp.shared_expert", shared, hidden, sparse),
                    Tensor("mlp.shared_expert_gate.weight", 1, hidden, sparse)]
        width += shared
    if sparse < layers:
        width = max(width, raw["intermediate_size"])
    return _architecture(name, raw, tensors, _gqa_layout(raw), width, experts)


def _mla(raw: dict, layers: int) -> list[Tensor]:
    """DeepSeek's multi-head latent attention. The down-projections (q_a, kv_a) are replicated on every
    rank, the up-projections split by heads, as vLLM shards them."""
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    nope, rope, v_dim = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"], raw["v_head_dim"]
    kv_rank, q_rank, bias = raw["kv_lora_rank"], raw.get("q_lora_rank"), bool(raw.get("attention_bias", False))
    q_head = nope + rope
    if q_rank:
        q = [*_linear("self_attn.q_a_proj", q_rank, hidden, layers, bias=bias),
             Tensor("self_attn.q_a_layernorm.weight", q_rank, copies=layers),
             *_linear("self_attn.q_b_proj", heads * q_head, q_rank, layers, COLUMN, q_head)]
    else:
        q = _linear("self_attn.q_proj", heads * q_head, hidden, layers, COLUMN, q_head)
    return [*q, *_linear("self_attn.kv_a_proj_with_mqa", kv_rank + rope, hidden, layers, bias=bias),
            Tensor("self_attn.kv_a_layernorm.weight", kv_rank, copies=layers),
            *_linear("self_attn.kv_b_proj", heads * (nope + v_dim), kv_rank, layers, COLUMN, nope + v_dim),
            *_linear("self_attn.o_proj", hidden, heads * v_dim, layers, ROW, v_dim, bias)]


def _deepseek(name: str, raw: dict) -> Architecture:
    """DeepSeek-V2/V3: MLA; dense MLPs in the first first_k_dense_replace layers, then routed experts plus
    shared ones. The multi-token-prediction layers (num_nextn_predict_layers) are not counted: they are
    not part of the model that generates (DeepSeek's 671B leaves out its 14B MTP module too)."""
    layers, hidden = raw["num_hidden_layers"], raw["hidden_size"]
    experts, top_k = raw.get("n_routed_experts") or 0, raw.get("num_experts_per_tok") or 0
    first, freq = raw.get("first_k_dense_replace", 0), raw.get("moe_layer_freq", 1)
    moe = sum(1 for i in range(layers) if experts and i >= first and i % freq == 0)
    moe_inter = raw.get("moe_intermediate_size", 0)
    shared = moe_inter * (raw.get("n_shared_experts") or 0)
    tensors = [*_frame(raw, layers), *_mla(raw, layers),
               *(_mlp("mlp", raw["intermediate_size"], hidden, layers - moe) if layers > moe else [])]
    if moe:
        tensors += [Tensor("mlp.gate.weight", experts, hidden, moe),
                    *_mlp("mlp.experts", moe_inter, hidden, moe * experts, active=moe * top_k),
                    *(_mlp("mlp.shared_experts", shared, hidden, moe) if shared else [])]
        if name == "DeepseekV3ForCausalLM" or raw.get("topk_method") == "noaux_tc":  # V3's routing bias
            tensors.append(Tensor("mlp.gate.e_score_correction_bias", experts, copies=moe))
    kv = KVLayout(layers, 1, raw["kv_lora_rank"] + raw["qk_rope_head_dim"], sharded=False)
    notes = ()
    if raw.get("num_nextn_predict_layers"):
        notes = (f"{raw['num_nextn_predict_layers']} multi-token-prediction layer(s) in the checkpoint are not "
                 "counted: they do not take part in generation here",)
    width = max(top_k * moe_inter + shared, raw["intermediate_size"] if moe < layers else 0)
    arch = _architecture(name, raw, tensors, kv, width, experts)
    q_width = raw["num_attention_heads"] * (raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"])
    return dataclasses.replace(arch, query_width=q_width, notes=notes)


def _architecture(name: str, raw: dict, tensors: list[Tensor], kv: KVLayout, mlp_width: int,
                  experts: int) -> Architecture:
    heads, _, hd = _heads(raw)
    return Architecture(name, tuple(tensors), kv, raw["hidden_size"], raw["vocab_size"], heads, heads * hd,
                        mlp_width, experts, str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
                        _fp8(raw))


def _fp8(raw: dict) -> FP8 | None:
    q = raw.get("quantization_config")
    if not q:
        return None
    if q.get("quant_method") != "fp8":
        raise UnsupportedArchitecture(f"quantization {q.get('quant_method')!r} cannot be planned; fp8 can "
                                      "(quant_method fp8, with or without weight_block_size)")
    block = q.get("weight_block_size")
    # A module of one layer ("model.layers.3.mlp.gate") stands for that module in every layer: the
    # plan counts a tensor's copies over the layers together.
    skip = {re.sub(r"^(model\.)?layers\.\d+\.", "", s) for s in q.get("modules_to_not_convert") or
            q.get("ignored_layers") or ()}
    return FP8(tuple(block) if block else None, tuple(sorted(skip)))


def _dspark(name: str, raw: dict) -> Architecture:
    """A DSpark block draft (dspark_ray/model/dspark.py): Qwen3 decoder layers, ``fc`` from the target's
    concatenated layer states, the Markov (and confidence) head, and a copy of the target's embedding
    (and untied LM head) in the draft's process; its KV is the per-slot context ring."""
    from dspark_ray.model.dspark import DSparkConfig  # torch, only when a DSpark draft is planned

    cfg = DSparkConfig.from_dict(raw)
    layers, hidden, vocab = cfg.backbone.num_layers, cfg.hidden_size, cfg.vocab_size
    tensors = [*_frame(raw, layers), *_gqa(raw, layers, False, False, True),
               *_mlp("mlp", raw["intermediate_size"], hidden, layers),
               Tensor("fc.weight", hidden, len(cfg.target_layer_ids) * cfg.target_hidden_size),
               Tensor("hidden_norm.weight", hidden),
               Tensor("markov_head.markov_w1.weight", vocab, cfg.markov_rank),
               Tensor("markov_head.markov_w2.weight", cfg.draft_vocab_size or vocab, cfg.markov_rank)]
    if cfg.confidence:
        width = hidden + (cfg.markov_rank if cfg.confidence_with_markov else 0)
        tensors += [Tensor("confidence_head.proj.weight", 1, width), Tensor("confidence_head.proj.bias", 1)]
    arch = _architecture(name, raw, tensors, _gqa_layout(raw), raw["intermediate_size"], 0)
    return dataclasses.replace(arch, block_draft=(cfg.window, cfg.block_size))


FAMILIES: dict[str, Callable[[str, dict], Architecture]] = {
    "LlamaForCausalLM": _dense, "MistralForCausalLM": _dense, "Qwen2ForCausalLM": _dense,
    "Qwen3ForCausalLM": _dense, "MixtralForCausalLM": _mixtral, "Qwen2MoeForCausalLM": _qwen_moe,
    "Qwen3MoeForCausalLM": _qwen_moe, "DeepseekV2ForCausalLM": _deepseek, "DeepseekV3ForCausalLM": _deepseek,
    "Qwen3DSparkModel": _dspark, "DSparkDraftModel": _dspark,
}


def architecture(raw: dict) -> Architecture:
    """The tensors and KV layout of the checkpoint whose config.json is ``raw``."""
    archs = raw.get("architectures") or []
    family = FAMILIES.get(archs[0]) if len(archs) == 1 else None
    if family is None:
        raise UnsupportedArchitecture(f"cannot plan memory for architectures {archs!r}; known: {', '.join(FAMILIES)}")
    try:
        return family(archs[0], raw)
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks {exc.args[0]!r}, which {archs[0]} needs") from exc


def read_config(path: str | Path) -> dict:
    """config.json of a checkpoint folder, or a config.json file itself, or the config a GGUF file's
    metadata implies (``dspark_ray.model.checkpoint``)."""
    from dspark_ray.model.checkpoint import locate
    from dspark_ray.model.checkpoint import read_config as read

    return read(locate(path))


def checkpoint_name(path: str | Path) -> str:
    """A checkpoint's name for messages: its folder's (also for a path to its config.json), or a
    config file's stem."""
    path = Path(path)
    if path.is_dir() or path.name == "config.json":
        return (path if path.is_dir() else path.parent).resolve().name
    return path.stem


# -- what runs where ---------------------------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    """A model as it will run: its architecture, the dtype of activations, KV cache and unquantized
    weights, and whether its projections stay FP8."""

    arch: Architecture
    dtype: str
    fp8: FP8 | None = None
    name: str = ""
    # A GGUF file's weights kept as blocks: tensor name -> the block type of each copy (layer).
    gguf_kept: dict[str, tuple[str, ...]] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")

    @classmethod
    def of(cls, raw: dict, device: str = "cuda", dtype: str = "auto", quantization: str = "auto",
           name: str = "") -> Checkpoint:
        """``dtype`` auto: float32 on CPU, the checkpoint's on CUDA (engine/dtypes.runtime_dtype).
        ``quantization``: auto keeps FP8 weights FP8 on CUDA and dequantizes them on CPU, as the
        loader does, and a GGUF file's blocks where a kernel reads them on ``device``; fp8 plans FP8
        blocks of 128 x 128 (or the checkpoint's); none plans every weight in ``dtype``."""
        arch = architecture(raw)
        if dtype == "auto":
            dtype = "float32" if device == "cpu" else arch.dtype
        choices = {"auto": arch.fp8 if device == "cuda" else None, "fp8": arch.fp8 or FP8(), "none": None}
        if quantization not in choices:
            raise ValueError(f"quantization must be auto, fp8 or none, got {quantization!r}")
        fp8 = choices[quantization]
        kept = None
        if raw.get("gguf_tensor_types") and quantization == "auto":  # a GGUF file (dspark_ray/model/gguf.py)
            keep = GGUF_KEPT.get(device, frozenset())
            kept = {t: types for t, types in raw["gguf_tensor_types"].items() if all(q in keep for q in types)}
        return cls(arch, dtype if dtype in DTYPE_BYTES else "bfloat16", fp8, name or arch.name, kept or None)

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def weight_bytes(self, tp: int = 1) -> int:
        """Bytes of one rank's weights (FP8 projections: 1 byte a weight plus their block scales)."""
        total = 0
        for t in self.arch.tensors:
            rows, cols = t.on_rank(tp)
            if self.gguf_kept is not None and t.name in self.gguf_kept:  # its blocks, as the file stores them
                total += sum(rows * cols * GGUF_BLOCKS[q][1] // GGUF_BLOCKS[q][0] for q in self.gguf_kept[t.name])
            elif self.fp8 is not None and self.fp8.applies(t):
                total += t.copies * (rows * cols + self.fp8.scales(rows, cols) * FP8_SCALE_BYTES)
            else:
                total += t.copies * rows * cols * self.act_bytes
        return total

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """KV cache bytes one token costs on one rank (the pool is in the activations' dtype)."""
        return self.arch.kv.values_per_token(tp) * self.act_bytes


@dataclass(frozen=True)
class Placement:
    """Where one replica's target ranks run, and how much memory each device has."""

    tensor_parallel_size: int = 1
    nodes: int = 1  # boxes the ranks are spread over (STRICT_SPREAD: one rank per node)
    memory_bytes: int = 128 * GB  # one device: a GPU (DGX Spark: the box's unified memory), or a node's RAM on CPU
    memory_utilization: float = 0.9  # the share of memory_bytes this replica may use
    device: str = "cuda"  # cuda: a GPU per rank (the draft on rank 0's); cpu: a node's ranks share its memory

    def __post_init__(self) -> None:
        if self.device not in RUNTIME_BYTES:
            raise ValueError(f"device must be cuda or cpu, got {self.device!r}")
        if not 1 <= self.nodes <= self.tensor_parallel_size:
            raise ValueError(f"nodes must be 1..tensor_parallel_size ({self.tensor_parallel_size}), got {self.nodes}")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be positive, got {self.memory_bytes}")

    @property
    def ranks_per_device(self) -> int:
        return 1 if self.device == "cuda" else -(-self.tensor_parallel_size // self.nodes)

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_bytes * self.memory_utilization)


@dataclass(frozen=True)
class Workload:
    """The engine settings that size its buffers (EngineConfig's names)."""

    capacity: int = 64  # this replica's slots
    max_context: int = 512
    num_speculative_tokens: int = 4
    draft_window: int = 32
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 4096
    kv_pool_tokens: int | None = None  # a fixed pool
    kv_pool_share: float | None = None  # a fixed pool of this share of capacity x max_context (CPU: 1/4)
    draft_ahead: bool = False  # EngineConfig.draft_ahead: the draft's ring holds window + 2k

    def __post_init__(self) -> None:
        for name in ("capacity", "max_context", "draft_window", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def fixed_pool(self) -> int | None:
        """The pool's size if it does not depend on memory (EngineConfig.kv_tokens), else None."""
        if self.kv_pool_tokens is not None:
            return self.kv_pool_tokens
        if self.kv_pool_share is None:
            return None
        return max(int(self.capacity * self.max_context * self.kv_pool_share),
                   self.max_context + self.num_speculative_tokens)


@dataclass(frozen=True)
class Costs:
    """Bytes one process holds besides the KV pool."""

    weights: int
    workspace: int
    buffers: int  # the target's request-to-token table; the draft's window cache
    runtime: int

    @property
    def total(self) -> int:
        return self.weights + self.workspace + self.buffers + self.runtime


def _activations(ck: Checkpoint, tp: int, tokens: int, rows: int, logit_positions: int) -> int:
    """One step's live activations: the residual stream and its neighbours, q/k/v, the MLP's (or the
    chosen experts') intermediates and the router's scores for ``tokens`` tokens; the logits (float32,
    with a masked copy and the probabilities) at ``rows`` x ``logit_positions``."""
    a, arch = ck.act_bytes, ck.arch
    per_token = a * (4 * arch.hidden_size + _share(arch.query_width, 1, tp)
                     + arch.kv.heads_on_rank(tp) * arch.kv.width + 3 * _share(arch.mlp_width, 1, tp))
    per_token += 4 * arch.experts
    return tokens * per_token + 3 * 4 * rows * logit_positions * arch.vocab_size


def _target_costs(ck: Checkpoint, place: Placement, work: Workload, k: int) -> Costs:
    tp, arch = place.tensor_parallel_size, ck.arch
    tokens = max(work.max_num_batched_tokens, work.max_num_seqs * (k + 1))
    rows = min(work.max_num_seqs, work.capacity)
    # Attention: each layer gathers every row's keys and values from the pool (target_runner._rows); on
    # CUDA a grouped-query model's are then copied out to the query heads (repeat_interleave).
    heads = arch.kv.heads_on_rank(tp)
    widen = place.device == "cuda" and arch.kv.sharded and arch.num_heads != arch.kv.heads
    widened = -(-arch.num_heads // tp) if widen else 0
    attention = rows * work.max_context * ck.act_bytes * arch.kv.width * (heads + widened)
    attention += tokens * work.max_context  # the boolean mask
    table = (work.capacity + 1) * work.max_context * TABLE_BYTES_PER_POSITION
    return Costs(ck.weight_bytes(tp), _activations(ck, tp, tokens, rows, k + 1) + attention, table,
                 RUNTIME_BYTES[place.device])


def _draft_costs(ck: Checkpoint, place: Placement, work: Workload, k: int) -> Costs:
    """The draft, whole on rank 0's device: its weights, its window cache (``window + k`` positions,
    ``window + 2k`` when it drafts ahead, for every slot and the padding row; a DSpark draft's
    context ring: its window + its block) and one step's activations."""
    rows = min(work.max_num_seqs, work.capacity)
    window, ahead = work.draft_window, 2 * k if work.draft_ahead else k
    if ck.arch.block_draft is not None:
        ring_window, ahead = ck.arch.block_draft
        window = min(ring_window or work.max_context, work.max_context)  # engine/dspark_proposer.context_window
    cache = (work.capacity + 1) * (window + ahead) * ck.kv_bytes_per_token()
    workspace = _activations(ck, 1, work.max_num_batched_tokens, rows, max(k, 1))
    return Costs(ck.weight_bytes(), workspace, cache, RUNTIME_BYTES[place.device])


# -- the plan ------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPlan:
    """The numbers of one plan (``plan``), its verdict and, unless it fits, what would."""

    target: Checkpoint
    draft: Checkpoint | None
    placement: Placement
    workload: Workload
    rank: Costs  # one target rank
    draft_costs: Costs | None
    kv_bytes_per_token: int  # one rank, the allocator's bookkeeping included
    spec_tokens: int  # k (0 without a draft)
    kv_pool_tokens: int  # the pool each rank gets (0: none fits)
    verdict: str
    suggestions: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        """It can start: the pool holds at least one full-context request."""
        return self.verdict != DOES_NOT_FIT

    @property
    def request_tokens(self) -> int:
        """KV tokens of one request at full context, speculative tokens included."""
        return self.workload.max_context + self.spec_tokens

    @property
    def needed_tokens(self) -> int:
        """KV tokens of every slot at full context."""
        return self.workload.capacity * self.request_tokens

    @property
    def fixed_bytes(self) -> int:
        """Rank 0's device before any KV cache."""
        draft = self.draft_costs.total if self.draft_costs else 0
        return self.placement.ranks_per_device * self.rank.total + draft

    def pool_bytes(self, tokens: int) -> int:
        """Rank 0's device's KV pools of ``tokens`` tokens each (and the padding token)."""
        return self.placement.ranks_per_device * (tokens + 1) * self.kv_bytes_per_token

    @property
    def spare_bytes(self) -> int:
        """Rank 0's device's usable memory left for the KV pool."""
        return self.placement.usable_bytes - self.fixed_bytes

    def table(self) -> str:
        """The plan as a table of GB per rank and on rank 0's device."""
        p, w, ck = self.placement, self.workload, self.target
        ranks = p.ranks_per_device
        arch = ck.arch
        stored = "FP8 projections + " + ck.dtype if ck.fp8 else ck.dtype
        lines = [
            f"{ck.name}: {arch.name}, {arch.params / 1e9:.2f}B parameters ({arch.active_params / 1e9:.2f}B active "
            f"per token), {stored}",
            f"placement: tensor_parallel_size {p.tensor_parallel_size} on {p.nodes} node(s), {p.device}, "
            f"{ranks} rank(s) per device of {_gb(p.memory_bytes)} x memory_utilization {p.memory_utilization:g} = "
            f"{_gb(p.usable_bytes)} usable",
            f"workload: {w.capacity} slots x max_context {w.max_context} (+{self.spec_tokens} speculative), "
            f"max_num_seqs {w.max_num_seqs}, max_num_batched_tokens {w.max_num_batched_tokens}",
            f"  {'':34}{'per rank':>12}{'device 0':>12}",
        ]
        rows = [("target weights", self.rank.weights), ("workspace (activations, attention)", self.rank.workspace),
                ("request-to-token table", self.rank.buffers), ("runtime (per process)", self.rank.runtime)]
        lines += [f"  {label:34}{_gb(v):>12}{_gb(ranks * v):>12}" for label, v in rows]
        if self.draft_costs is not None:
            d = self.draft_costs
            lines += [f"  {label:34}{'':>12}{_gb(v):>12}" for label, v in (
                (f"draft weights ({self.draft.name})", d.weights), ("draft window cache", d.buffers),
                ("draft workspace + runtime", d.workspace + d.runtime))]
        pool = self.kv_pool_tokens
        lines += [
            f"  {'fixed':34}{'':>12}{_gb(self.fixed_bytes):>12}",
            f"  {'KV cache, ' + format(pool, ',') + ' tokens':34}"
            f"{_gb((pool + 1) * self.kv_bytes_per_token if pool else 0):>12}"
            f"{_gb(self.pool_bytes(pool) if pool else 0):>12}",
            f"  {'total':34}{'':>12}{_gb(self.fixed_bytes + (self.pool_bytes(pool) if pool else 0)):>12}"
            f" of {_gb(p.usable_bytes)}",
            f"KV cache: {self.kv_bytes_per_token:,} bytes per token per rank; one full-context request "
            f"{self.request_tokens:,} tokens, every slot at full context {self.needed_tokens:,}",
            f"verdict: {self.verdict.upper()}" + ("" if self.verdict == FITS else f": {self.message()}"),
        ]
        lines += [f"note: {n}" for n in arch.notes]
        return "\n".join(lines)

    def message(self) -> str:
        """Why it fits only partly or not at all, with the numbers, and what would fit."""
        p, w, ck = self.placement, self.workload, self.target
        usable = f"{_gb(p.usable_bytes)} usable at memory_utilization {p.memory_utilization:g}"
        if p.device == "cuda":
            where = f"{p.tensor_parallel_size} GPU(s) of {p.memory_bytes / GB:.1f} GB ({usable})"
        else:
            where = (f"{p.nodes} node(s) with {p.memory_bytes / GB:.1f} GB available ({usable}), "
                     f"{p.tensor_parallel_size} rank(s)")
        head = (f"{ck.name} with {w.capacity} slots x max_context {w.max_context} on {where}: rank 0's device "
                f"needs {_gb(self.fixed_bytes)} before any KV cache ({_gb(p.ranks_per_device * self.rank.weights)} "
                f"of target weights), " + (f"leaving {_gb(self.spare_bytes)}" if self.spare_bytes >= 0 else
                                            f"{_gb(-self.spare_bytes)} more than it has"))
        kv = f"{self.kv_bytes_per_token:,} bytes per token per rank"
        fixed = w.fixed_pool()
        if self.verdict == FITS:
            text = f"{head}; the KV pool of {self.kv_pool_tokens:,} tokens fits"
        elif fixed is not None:
            text = (f"{head}; the KV pool of {fixed:,} tokens needs {_gb(self.pool_bytes(fixed))} ({kv}): it does "
                    "not fit")
        elif self.verdict == KV_LIMITED:
            full = self.kv_pool_tokens // self.request_tokens
            text = (f"{head} for a KV pool of {self.kv_pool_tokens:,} tokens ({kv}): {full} of the {w.capacity} slots "
                    f"can be at full context at once (every slot needs {self.needed_tokens:,} tokens, "
                    f"{_gb(self.pool_bytes(self.needed_tokens))})")
        else:
            text = (f"{head}; one request at full context needs {self.request_tokens:,} tokens of KV cache, "
                    f"{_gb(self.pool_bytes(self.request_tokens))} ({kv}): it does not fit")
        if self.suggestions:
            text += ". What would fit: " + "; ".join(self.suggestions)
        return text


def _gb(n: int) -> str:
    return f"{n / GB:.2f} GB" if abs(n) >= GB // 100 or n == 0 else f"{n / 10**6:.1f} MB"


def _evaluate(target: Checkpoint, draft: Checkpoint | None, place: Placement, work: Workload) -> MemoryPlan:
    k = work.num_speculative_tokens if draft is not None else 0
    tp = place.tensor_parallel_size
    rank = _target_costs(target, place, work, k)
    draft_costs = _draft_costs(draft, place, work, k) if draft is not None else None
    kv_token = target.kv_bytes_per_token(tp) + ALLOCATOR_BYTES_PER_TOKEN
    plan = MemoryPlan(target, draft, place, work, rank, draft_costs, kv_token, k, 0, DOES_NOT_FIT)
    one, fixed = work.max_context + k, work.fixed_pool()
    if fixed is not None:
        fits = plan.pool_bytes(fixed) <= plan.spare_bytes
        return dataclasses.replace(plan, kv_pool_tokens=fixed if fits else 0, verdict=FITS if fits else DOES_NOT_FIT)
    room = max(plan.spare_bytes, 0) // (place.ranks_per_device * kv_token) - 1
    pool = max(min(room, plan.needed_tokens), 0)
    verdict = FITS if pool >= plan.needed_tokens else KV_LIMITED if pool >= one else DOES_NOT_FIT
    return dataclasses.replace(plan, kv_pool_tokens=pool if verdict != DOES_NOT_FIT else 0, verdict=verdict)


def plan(target: Checkpoint, placement: Placement, workload: Workload,
         draft: Checkpoint | None = None) -> MemoryPlan:
    """The plan of ``target`` (and ``draft``) on ``placement`` for ``workload``; unless every slot fits
    at full context, with suggestions of what would."""
    result = _evaluate(target, draft, placement, workload)
    if result.verdict == FITS:
        return result
    return dataclasses.replace(result, suggestions=_suggest(target, draft, placement, workload, result))


def _largest(ok: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The largest x in lo..hi with ok(x), for ok true up to some point and false after it."""
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _suggest(target: Checkpoint, draft: Checkpoint | None, place: Placement, work: Workload,
             result: MemoryPlan) -> tuple[str, ...]:
    """Changes that make every slot fit at full context, each alone."""

    def fits(t: Checkpoint = target, p: Placement = place, **changes) -> bool:
        return _evaluate(t, draft, p, dataclasses.replace(work, **changes)).verdict == FITS

    out = []
    context = _largest(lambda m: fits(max_context=m), 2, work.max_context - 1)
    if context is not None:
        out.append(f"max_context {context} with {work.capacity} slots")
    slots = _largest(lambda c: fits(capacity=c), 1, work.capacity - 1)
    if slots is not None:
        out.append(f"{slots} slots (capacity) at max_context {work.max_context}")
    if context is None and slots is None:
        least = _evaluate(target, draft, place, dataclasses.replace(work, capacity=1, max_context=2))
        out.append(f"no max_context or capacity on these devices: even 1 slot of max_context 2 needs "
                   f"{_gb(least.fixed_bytes)} on rank 0's device before any KV cache, of the "
                   f"{_gb(place.usable_bytes)} usable")
    out += _more_ranks(target, draft, place, work)
    if target.fp8 is None:
        fp8 = dataclasses.replace(target, fp8=FP8())
        if fits(t=fp8):
            per_rank = fp8.weight_bytes(place.tensor_parallel_size)
            out.append(f"FP8 weights (a block-quantized FP8 checkpoint): {_gb(per_rank)} per rank instead of "
                       f"{_gb(result.rank.weights)}")
    if place.memory_utilization < 0.95 and fits(p=dataclasses.replace(place, memory_utilization=0.95)):
        left = place.memory_bytes - int(place.memory_bytes * 0.95)
        out.append(f"memory_utilization 0.95 (leaves {_gb(left)} of each device to everything else)")
    return tuple(out)


def _more_ranks(target: Checkpoint, draft: Checkpoint | None, place: Placement, work: Workload) -> list[str]:
    """The fewest ranks (on as many more nodes) that hold every slot at full context and, if fewer
    ranks already run, those."""
    out = []
    for factor in range(2, MAX_RANKS // place.tensor_parallel_size + 1):
        tp = place.tensor_parallel_size * factor
        more = dataclasses.replace(place, tensor_parallel_size=tp, nodes=place.nodes * factor)
        if not target.arch.divides(tp):
            continue
        result = _evaluate(target, draft, more, work)
        where = (f"tensor_parallel_size {tp} over {more.nodes} nodes like these "
                 f"({_gb(target.weight_bytes(tp))} of weights per rank)")
        if result.verdict == FITS:
            return [*out, where]
        if result.fits and not out:
            full = result.kv_pool_tokens // result.request_tokens
            out.append(f"{where} runs, {full} of {work.capacity} slots at full context at once")
    return out


# -- memory on this machine ----------------------------------------------------


def available_host_memory() -> int:
    """Bytes of host memory available to new allocations (MemAvailable: free memory plus the page
    cache the kernel reclaims on demand)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def pool_tokens_after_load(plan: MemoryPlan, free_bytes: int, total_bytes: int, draft_pending: bool) -> int:
    """KV pool tokens for a rank whose weights are loaded (CUDA): the free memory, less the share of
    the device left to others ((1 - memory_utilization) x total), this rank's workspace, table and
    runtime and, if the draft still has to load on this device, the draft's plan; at most what every
    slot at full context needs. Negative if not even the padding token fits."""
    draft = plan.draft_costs.total if draft_pending and plan.draft_costs else 0
    spare = free_bytes - int(total_bytes * (1 - plan.placement.memory_utilization)) - draft
    spare -= plan.rank.workspace + plan.rank.buffers + plan.rank.runtime
    return min(spare // plan.kv_bytes_per_token - 1, plan.needed_tokens)
