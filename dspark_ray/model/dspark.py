"""DSpark's block drafter: one parallel forward per block, conditioned on the target's hidden states.

NOTE: the algorithm, for one request whose target has committed positions ``0 .. p0-1`` and
whose last sampled token ``x`` sits at position ``p0``:

1. **Context.** The target's residual stream after each configured layer
   (``target_layer_ids``; -1 is the embedding output) at every committed
   position is concatenated, projected by ``fc`` and normalised
   (``hidden_norm``); each draft layer turns that into its own context K/V with
   its ``k_proj``/``v_proj`` (K also through ``k_norm`` and RoPE at the
   position). This is per position, so it is computed once when the target
   commits a position and kept in a per-slot ring (``dspark_ray.slots.context_ring``;
   the engine's draft service over both: ``dspark_ray.engine.dspark_proposer``).
2. **Block.** The query block is ``[x, mask, .., mask]`` at positions
   ``p0 .. p0+S-1`` (``S`` = the block size, or fewer). It runs through the
   draft's Qwen3 decoder layers; each layer's attention sees the context K/V
   before ``p0`` (a window of it) and the whole block (non-causal; layers a
   checkpoint marks causal see the block up to themselves). Its final norm and
   the target's LM head give base logits ``[S, V]``: position ``j`` predicts
   the token at ``p0 + j + 1`` (vLLM's ``sample_from_anchor``). A draft with a
   reduced vocabulary (``draft_vocab_size`` N < V, EAGLE-3's and FR-Spec's
   idea) has its own LM head of N rows, the target's most frequent output
   tokens, and a map ``draft_to_target`` of their target ids: its base logits
   are ``[S, N]`` at N / V of the full head's cost.
3. **Markov head.** Left to right, position ``j``'s logits get the low-rank
   transition bias ``markov_w2 @ markov_w1[prev]`` of the token before it
   (``x`` for ``j = 0``, then each sampled draft), and the draft token is
   sampled (or argmax'd) from them; the distribution q it was drawn from is
   kept for lossless verification. With a reduced vocabulary the biased
   logits are scattered into the target's vocabulary first (-inf elsewhere,
   as vLLM's speculator does), so tokens are target ids and q is a proper
   distribution over them, zero outside the draft's N.
4. **Confidence.** ``sigmoid(proj([hidden_j, markov_w1[prev_j]]))`` estimates
   the chance that draft ``j`` is accepted.

The checkpoint layout is the one vLLM 0.32 loads as speculative method ``dspark``
(``Qwen3DSparkModel``; DeepSpec's export): tensors ``layers.N.*`` (a Qwen3 decoder
layer), ``norm``, ``fc``, ``hidden_norm``, ``markov_head.markov_w1/markov_w2``,
``confidence_head.proj``; the embeddings and LM head are the target's unless the
checkpoint ships its own that differ. A reduced vocabulary ships ``lm_head.weight``
``[N, hidden]`` and ``d2t`` ``[N]`` (int64 offsets: target id = draft id + d2t[draft id],
EAGLE-3's convention), as vLLM requires. The paper: DSpark (arXiv 2607.05147); the
block drafting follows DFlash.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from dspark_ray.model.checkpoint import locate, read_tensors
from dspark_ray.model.config import ModelConfig
from dspark_ray.model.errors import CheckpointFileMissing, ModelLoadError, TensorMissing, TensorShapeMismatch
from dspark_ray.model.layers import Linear, RMSNorm, apply_rope
from dspark_ray.model.llama import CausalLM, DecoderLayer
from dspark_ray.model.loader import check_device_dtype, resolve_dtype, weight_files
from dspark_ray.model.rope import rope_attention_scaling, rope_inv_freq

# config.json architectures that name this family (vLLM's registry and its DeepSpec alias).
DSPARK_ARCHITECTURES = ("Qwen3DSparkModel",)
_QWEN3_ALIAS = "DSparkDraftModel"  # with model_type "qwen3"

# Tensors a DSpark checkpoint may carry that serving does not read: the training-only vocabulary map
# t2d, d2t of a draft whose vocabulary is the target's, DFlash's unused mask placeholder, cached RoPE.
_IGNORED = ("t2d", "d2t", "mask_embedding", "rotary_emb.inv_freq")


class DSparkConfigError(ModelLoadError):
    """The DSpark draft's config.json is malformed or asks for something not implemented."""


class DraftTargetMismatch(ModelLoadError):
    """The DSpark draft does not fit the target it is paired with."""


def is_dspark_config(raw: dict) -> bool:
    """Whether a config.json dict describes a Qwen3 DSpark draft (vLLM's detection by architecture)."""
    archs = raw.get("architectures") or []
    return any(a in DSPARK_ARCHITECTURES for a in archs) or (_QWEN3_ALIAS in archs and raw.get("model_type") == "qwen3")


def is_dspark_checkpoint(path: str | Path) -> bool:
    """Whether the checkpoint folder at ``path`` holds a DSpark draft (by its config.json)."""
    cfg_file = locate(path) / "config.json"
    if not cfg_file.is_file():  # also a GGUF file: never a DSpark draft
        return False
    try:
        return is_dspark_config(json.loads(cfg_file.read_text()))
    except json.JSONDecodeError:
        return False


# -- configuration -----------------------------------------------------------------------------


@dataclass(frozen=True)
class DSparkConfig:
    """A DSpark draft's config.json, resolved the way vLLM resolves it (keys in ``from_dict``)."""

    backbone: ModelConfig  # the draft's decoder layers (Qwen3 layers; num_layers = draft layers)
    block_size: int  # query tokens per block: the last token and block_size - 1 masks
    mask_token_id: int
    # Target layers whose output feeds the context, ascending; -1 is the embedding output.
    target_layer_ids: tuple[int, ...]
    target_layer_key: str  # the config.json key they came from (error messages name it)
    target_hidden_size: int
    markov_rank: int
    confidence: bool  # enable_confidence_head
    confidence_with_markov: bool  # the head also reads markov_w1[prev]
    layer_windows: tuple[int | None, ...]  # per draft layer: sliding window, None = the whole context
    layer_causal: tuple[bool, ...]  # per draft layer: causal within the block
    num_target_layers: int | None = None  # the target the draft was trained for, when it says
    draft_vocab_size: int | None = None  # the LM head's rows (a reduced vocabulary); None = vocab_size
    value_scale: float | None = None  # dflash_config.attention_value_scale: V times this
    logit_scale: float = 1.0
    draft_topk: int | None = None  # dspark_draft_topk: the Markov head corrects only the top-k base logits

    def __post_init__(self) -> None:
        for name in ("block_size", "markov_rank", "target_hidden_size"):
            if getattr(self, name) <= 0:
                raise DSparkConfigError(f"DSpark config {name} must be a positive integer, got {getattr(self, name)}")
        if not 0 <= self.mask_token_id < self.backbone.vocab_size:
            raise DSparkConfigError(
                f"DSpark config mask_token_id {self.mask_token_id} is outside the draft vocabulary "
                f"0..{self.backbone.vocab_size - 1}; set it to the mask token's id"
            )
        ids = self.target_layer_ids
        if not ids or list(ids) != sorted(set(ids)) or ids[0] < -1:
            raise DSparkConfigError(
                f"DSpark config {self.target_layer_key} must be a non-empty, strictly increasing list of "
                f"layer indices (-1 = the embedding output), got {list(ids)}"
            )
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.backbone.vocab_size:
            raise DSparkConfigError(f"DSpark config draft_vocab_size must be in 1..vocab_size "
                                    f"({self.backbone.vocab_size}), got {self.draft_vocab_size}")
        if self.draft_topk is not None and not 1 <= self.draft_topk <= self.output_vocab_size:
            raise DSparkConfigError(f"DSpark config dspark_draft_topk must be in 1..{self.output_vocab_size} "
                                    f"(the draft's vocabulary), got {self.draft_topk}")

    @property
    def vocab_size(self) -> int:
        return self.backbone.vocab_size

    @property
    def output_vocab_size(self) -> int:
        """The LM head's rows: ``draft_vocab_size``, or the whole vocabulary."""
        return self.draft_vocab_size or self.backbone.vocab_size

    @property
    def reduced_vocab(self) -> bool:
        """Whether the draft proposes from a subset of the target's vocabulary (``d2t`` maps it)."""
        return self.output_vocab_size < self.backbone.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.backbone.hidden_size

    @property
    def window(self) -> int | None:
        """The widest sliding window of any layer; None if some layer attends to the whole context."""
        return None if any(w is None for w in self.layer_windows) else max(self.layer_windows)

    @classmethod
    def from_dict(cls, raw: dict) -> DSparkConfig:
        if not is_dspark_config(raw):
            raise DSparkConfigError(
                f"config.json architectures {raw.get('architectures')!r} do not name a DSpark draft; "
                f"expected one of {', '.join(DSPARK_ARCHITECTURES)}"
            )
        _refuse_unsupported(raw)
        flash = raw.get("dflash_config") or {}
        backbone_raw = {**raw, "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": False}
        if not raw.get("rope_theta") and not (raw.get("rope_parameters") or {}).get("rope_theta"):
            backbone_raw["rope_theta"] = 1_000_000.0  # vLLM's default for DFlash/DSpark Qwen3 layers
        try:
            backbone = ModelConfig.from_dict(backbone_raw)
        except KeyError as exc:
            raise DSparkConfigError(f"DSpark config.json lacks the required key {exc.args[0]!r}") from exc
        ids, key = _target_layer_ids(raw)
        layers = backbone.num_layers
        attention = [_layer_attention(raw, flash, i) for i in range(layers)]
        return cls(
            backbone=backbone,
            block_size=_int(raw, "block_size", _first(raw.get("block_size"), raw.get("dspark_block_size"))),
            mask_token_id=_int(raw, "mask_token_id", _first(flash.get("mask_token_id"), raw.get("mask_token_id"),
                                                            raw.get("dspark_noise_token_id"))),
            target_layer_ids=ids,
            target_layer_key=key,
            target_hidden_size=int(raw.get("target_hidden_size") or backbone.hidden_size),
            markov_rank=_int(raw, "markov_rank", raw.get("markov_rank")),
            confidence=bool(raw.get("enable_confidence_head", False)),
            confidence_with_markov=bool(raw.get("confidence_head_with_markov", False)),
            layer_windows=tuple(w for w, _ in attention),
            layer_causal=tuple(c for _, c in attention),
            num_target_layers=raw.get("num_target_layers"),
            draft_vocab_size=raw.get("draft_vocab_size"),
            value_scale=flash.get("attention_value_scale"),
            logit_scale=float(raw.get("logit_scale", 1.0) or 1.0),
            draft_topk=raw.get("dspark_draft_topk"),
        )

    @classmethod
    def from_path(cls, path: str | Path) -> DSparkConfig:
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise CheckpointFileMissing(f"{cfg_file} not found: point the draft path at a DSpark checkpoint folder")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as exc:
            raise DSparkConfigError(f"{cfg_file} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)


def _first(*values):
    return next((v for v in values if v is not None), None)


def _int(raw: dict, key: str, value) -> int:
    if value is None:
        raise DSparkConfigError(f"DSpark config.json lacks the required key {key!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise DSparkConfigError(f"DSpark config {key} must be an integer, got {value!r}")
    return value


def _refuse_unsupported(raw: dict) -> None:
    """Checkpoint variants vLLM's Qwen3 DSpark serves that this implementation does not (yet)."""
    flash = raw.get("dflash_config") or {}
    eagle = raw.get("eagle_config") or {}
    checks = (
        ("markov_head_type", raw.get("markov_head_type", "vanilla") == "vanilla",
         "only the 'vanilla' Markov head (markov_w1, markov_w2) is implemented"),
        ("sample_from_anchor", raw.get("sample_from_anchor", True) is True,
         "only the anchor-as-first-prediction block layout is implemented (sample_from_anchor=true)"),
        ("dspark_bonus_anchor", not raw.get("dspark_bonus_anchor", False), "set dspark_bonus_anchor to false"),
        ("use_aux_hidden_state", _first(flash.get("use_aux_hidden_state"), eagle.get("use_aux_hidden_state"),
                                        raw.get("use_aux_hidden_state"), True) is True,
         "the draft must read the target's intermediate layers (use_aux_hidden_state=true)"),
        ("is_neox_style", raw.get("is_neox_style", True) is True, "only neox-style (half-split) RoPE is implemented"),
        ("dflash_config.attention_sink_bias", not _first(flash.get("attention_sink_bias"),
                                                         raw.get("add_swa_attention_sink_bias"), False),
         "attention sink biases are not implemented"),
    )
    for key, ok, why in checks:
        if not ok:
            raise DSparkConfigError(f"DSpark config {key}: {why}")


def _target_layer_ids(raw: dict) -> tuple[tuple[int, ...], str]:
    """The target layers feeding the context, in DSpark's meaning (the output of layer i; -1 = the
    embeddings), and the key they came from. vLLM's precedence: ``eagle_aux_hidden_state_layer_ids``
    (counted one higher: i + 1 = the stream entering layer i + 1), ``dflash_config.target_layer_ids``,
    ``dspark_target_layer_ids``, ``target_layer_ids``."""
    flash = raw.get("dflash_config") or {}
    candidates = (
        ("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"), 1),
        ("dflash_config.target_layer_ids", flash.get("target_layer_ids"), 0),
        ("dspark_target_layer_ids", raw.get("dspark_target_layer_ids"), 0),
        ("target_layer_ids", raw.get("target_layer_ids"), 0),
    )
    for key, ids, shift in candidates:
        if ids:
            integers = all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
            if not isinstance(ids, (list, tuple)) or not integers:
                raise DSparkConfigError(f"DSpark config {key} must be a list of integers, got {ids!r}")
            return tuple(i - shift for i in ids), key
    raise DSparkConfigError("DSpark config.json names no target layers; set target_layer_ids")


def _layer_attention(raw: dict, flash: dict, layer: int) -> tuple[int | None, bool]:
    """(sliding window or None, causal within the block) of one draft layer, as vLLM resolves them
    from ``layer_types``, ``dflash_config.use_swa``/``swa_window_size``/``causal`` and ``is_causal``."""
    types = raw.get("layer_types")
    use_swa = bool(flash.get("use_swa", False))
    if types is not None and len(types) != raw.get("num_hidden_layers"):
        raise DSparkConfigError(f"DSpark config layer_types has {len(types)} entries for "
                                f"{raw.get('num_hidden_layers')} layers (num_hidden_layers)")
    any_sliding = bool(types) and "sliding_attention" in types
    sliding = use_swa if types is None or (use_swa and not any_sliding) else types[layer] == "sliding_attention"
    window = None
    if sliding:
        window = _first(flash.get("swa_window_size"), raw.get("sliding_window"))
        if not isinstance(window, int) or window <= 0:
            raise DSparkConfigError(
                "DSpark config: a sliding-attention layer needs a positive dflash_config.swa_window_size "
                f"or sliding_window, got {window!r}"
            )
    causal = _first(raw.get("is_causal"), flash.get("causal"))
    if causal is None:
        causal = bool(types) and types[layer] == "sliding_attention"
    return window, bool(causal)


# -- what the draft takes from its target ------------------------------------------------------


@dataclass(frozen=True)
class TargetHeads:
    """The target's config and the two weights a DSpark draft shares with it."""

    config: ModelConfig
    embed: torch.Tensor  # [V, H] the target's input embedding
    lm_head: torch.Tensor  # [V, H] its LM head (the embedding itself when tied)

    @classmethod
    def of(cls, target: CausalLM) -> TargetHeads:
        """From a loaded (unsharded) target model; the tensors are shared, not copied, unless the
        target keeps them as GGUF blocks (dspark_ray/model/quantized.py): then the draft gets
        float copies (a block draft reads rows of both as float tensors)."""
        embed_module = target.model.embed_tokens
        if hasattr(embed_module, "dequantized"):  # a BlockEmbedding
            embed = embed_module.dequantized()
        else:
            embed = embed_module.weight.detach()
        lm = embed if target.lm_head is None else _float_weight(target.lm_head, embed.dtype)
        return cls(target.config, embed, lm)

    @classmethod
    def read(cls, path: str | Path, dtype: str | torch.dtype | None = "auto",
             device: str | torch.device = "cpu") -> TargetHeads:
        """Only the config, embedding and LM head of the target checkpoint at ``path`` (a draft
        process needs these, not the target's layers)."""
        path = locate(path)
        cfg = ModelConfig.from_path(path)
        dtype = resolve_dtype(dtype, cfg)
        names = {name: t.to(device, dtype) for name, t in
                 read_tensors(path, {"model.embed_tokens.weight", "lm_head.weight"}).items()}
        names.setdefault("lm_head.weight", None)
        embed = names["model.embed_tokens.weight"]
        if embed is None:
            raise TensorMissing(f"target checkpoint at {path} lacks 'model.embed_tokens.weight'")
        lm = embed if cfg.tie_word_embeddings else names["lm_head.weight"]
        if lm is None:
            raise TensorMissing(f"target checkpoint at {path} lacks 'lm_head.weight' (tie_word_embeddings is false)")
        return cls(cfg, embed, lm)


def _float_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A linear's [out, in] weight as a float tensor, dequantizing GGUF blocks kept in place."""
    qtype = getattr(linear, "qtype", None)
    if qtype is None:
        return linear.weight.detach()
    from dspark_kernels import quant

    return quant.dequantize(linear.weight, qtype, (linear.out_features, linear.in_features)).to(dtype)


def check_fits(cfg: DSparkConfig, target: ModelConfig) -> None:
    """Raise DraftTargetMismatch, naming the draft's field and the target's value, unless the draft fits."""
    n = target.num_layers

    def refuse(field: str, value, has: str) -> None:
        raise DraftTargetMismatch(f"DSpark draft {field} is {value}, but the target has {has}; "
                                  "pair the draft with the target it was trained for")

    outside = [i for i in cfg.target_layer_ids if not -1 <= i < n]
    if outside:
        refuse(cfg.target_layer_key, list(cfg.target_layer_ids),
               f"{n} layers (ids -1..{n - 1}, -1 = embeddings); {outside} lie outside it")
    if cfg.num_target_layers is not None and cfg.num_target_layers != n:
        refuse("num_target_layers", cfg.num_target_layers, f"{n} layers")
    if cfg.target_hidden_size != target.hidden_size:
        refuse("target_hidden_size", cfg.target_hidden_size, f"hidden_size {target.hidden_size}")
    if cfg.hidden_size != target.hidden_size:
        refuse("hidden_size", cfg.hidden_size, f"hidden_size {target.hidden_size} (the draft shares its embeddings)")
    if cfg.vocab_size != target.vocab_size:
        refuse("vocab_size", cfg.vocab_size, f"vocab_size {target.vocab_size}")


# -- the model ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockContext:
    """The context K/V a block attends to, per draft layer, with where each entry sits."""

    k: tuple[torch.Tensor, ...]  # per layer [B, W, kv_heads, head_dim], RoPE applied
    v: tuple[torch.Tensor, ...]  # per layer [B, W, kv_heads, head_dim], value scale applied
    positions: torch.Tensor  # [B, W] int64
    visible: torch.Tensor  # [B, W] bool: False for padding, other epochs, or positions the ring lost

    @classmethod
    def of(cls, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor], positions: torch.Tensor) -> BlockContext:
        """A context given whole (no ring): per layer K/V ``[B, T, kv_heads, head_dim]`` at ``positions``
        ``[B, T]`` (< 0 = padding)."""
        return cls(tuple(k), tuple(v), positions, positions >= 0)


class Sampler(Protocol):
    """Draws block position ``step``'s draft tokens from its logits (the Markov bias applied)."""

    def __call__(
        self,
        logits: torch.Tensor,  # [B, V] float32
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([B] int64 tokens, [B, V] float32 q, or None if all greedy)
        ...


def greedy(logits: torch.Tensor, step: int) -> tuple[torch.Tensor, None]:
    """The argmax at every position (the Sampler for greedy rows)."""
    return logits.argmax(dim=-1), None


@dataclass(frozen=True)
class BlockDraft:
    tokens: torch.Tensor  # [B, S] int64: the proposed tokens (target ids), position j at p0 + j + 1
    logits: torch.Tensor  # [B, S, V] float32: each position's logits over the target's vocabulary, Markov bias
    # applied (-inf outside a reduced draft vocabulary)
    probs: torch.Tensor | None  # [B, S, V] float32: q each token was drawn from (zeros on greedy rows)
    confidence: torch.Tensor | None  # [B, S] float32 in (0, 1): estimated acceptance; None without the head


class MarkovHead(nn.Module):
    """The low-rank transition bias: ``markov_w2 @ markov_w1[prev]`` (over the draft's vocabulary, from
    the previous token's target id)."""

    def __init__(self, vocab: int, out_vocab: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = Linear(rank, out_vocab, bias=False)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:  # [B] int64 -> [B, r]
        return self.markov_w1(prev)

    def bias(self, embed: torch.Tensor) -> torch.Tensor:  # [B, r] -> [B, N] float32 (N: the draft's vocabulary)
        return self.markov_w2(embed).float()


class ConfidenceHead(nn.Module):
    """Per-position acceptance estimate: ``sigmoid(proj(features))``, computed in float32."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.proj = Linear(in_features, 1, bias=True)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [..., F] -> [...]
        return torch.sigmoid(F.linear(features.float(), self.proj.weight, self.proj.bias).squeeze(-1))


class BlockAttention:
    """The draft layers' attention for one block: the block's queries over [context ; block].

    Context keys are seen where ``context.visible`` (and within the layer's sliding window);
    block keys are all seen (non-causal) or those up to the query (a causal layer)."""

    def __init__(self, cfg: DSparkConfig, context: BlockContext, positions: torch.Tensor) -> None:
        self.cfg, self.context, self.positions = cfg, context, positions  # positions: [B, S]
        self._masks: dict[tuple[int | None, bool], torch.Tensor] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [B, S, Hq, D]; k, v: [B, S, Hkv, D] -> [B, S, Hq, D]
        ctx = self.context
        if self.cfg.value_scale is not None:
            v = v * self.cfg.value_scale
        keys = torch.cat((ctx.k[layer].to(k.dtype), k), dim=1)  # [B, W + S, Hkv, D]
        values = torch.cat((ctx.v[layer].to(v.dtype), v), dim=1)
        mask = self._mask(self.cfg.layer_windows[layer], self.cfg.layer_causal[layer])  # [B, 1, S, W + S]
        rep = q.shape[2] // k.shape[2]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2).repeat_interleave(rep, dim=1),
            values.transpose(1, 2).repeat_interleave(rep, dim=1), attn_mask=mask)
        return out.transpose(1, 2)

    def _mask(self, window: int | None, causal: bool) -> torch.Tensor:
        if (window, causal) not in self._masks:
            qpos = self.positions[:, :, None]  # [B, S, 1]
            ctx = self.context.visible[:, None, :] & (self.context.positions[:, None, :] < self.positions[:, :1, None])
            ctx = ctx.expand(-1, qpos.shape[1], -1)
            block = torch.ones_like(qpos, dtype=torch.bool).expand(-1, -1, qpos.shape[1])
            if causal:
                block = self.positions[:, None, :] <= qpos
            if window is not None:
                ctx = ctx & (self.context.positions[:, None, :] > qpos - window)
                block = block & (self.positions[:, None, :] > qpos - window)
            self._masks[(window, causal)] = torch.cat((ctx, block), dim=2)[:, None]
        return self._masks[(window, causal)]


class DSparkDraft(nn.Module):
    """A Qwen3 DSpark draft; ``state_dict()`` names are the checkpoint's.

    The embedding and LM head are the target's tensors (``embed``, ``lm_weight``), not parameters;
    with a reduced vocabulary ``lm_weight`` is the draft's own ``[N, hidden]`` head and
    ``draft_to_target`` ``[N]`` its rows' target ids (a buffer, filled by the loader or the trainer).
    """

    def __init__(self, cfg: DSparkConfig, embed: torch.Tensor, lm_weight: torch.Tensor) -> None:
        super().__init__()
        self.config = cfg
        b = cfg.backbone
        self.layers = nn.ModuleList(DecoderLayer(b, i) for i in range(b.num_layers))
        self.norm = RMSNorm(b.hidden_size, b.rms_norm_eps)
        self.fc = Linear(len(cfg.target_layer_ids) * cfg.target_hidden_size, b.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(b.hidden_size, b.rms_norm_eps)
        self.markov_head = MarkovHead(b.vocab_size, cfg.output_vocab_size, cfg.markov_rank)
        in_features = b.hidden_size + (cfg.markov_rank if cfg.confidence_with_markov else 0)
        self.confidence_head = ConfidenceHead(in_features) if cfg.confidence else None
        self.embed, self.lm_weight = embed, lm_weight  # [V, H]; [N, H]
        # [N] int64: the target ids of a reduced vocabulary's rows; None when it is the target's
        self.register_buffer("draft_to_target", torch.arange(cfg.output_vocab_size) if cfg.reduced_vocab else None,
                             persistent=False)
        self.register_buffer("inv_freq", rope_inv_freq(b.head_dim, b.rope_theta, b.rope_scaling), persistent=False)
        self.attention_scaling = rope_attention_scaling(b.rope_scaling)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, D] for ``positions`` [B, T] (computed in float32, as the target's)."""
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    # (a) context

    def context_kv(
        self,
        states: torch.Tensor,  # [B, T, n * target_hidden]: the target layers' outputs, concatenated
        positions: torch.Tensor,  # [B, T] int64
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # per draft layer: K, V [B, T, kv_heads, head_dim]
        """Each draft layer's context K/V for target positions (independent per position)."""
        ctx = self.hidden_norm(self.fc(states.to(self.fc.weight.dtype)))
        cos, sin = self.rope(positions, ctx.dtype)
        b, t, _ = ctx.shape
        ks, vs = [], []
        for layer in self.layers:
            attn = layer.self_attn
            k = attn.k_norm(attn.k_proj(ctx).view(b, t, -1, attn.head_dim))
            v = attn.v_proj(ctx).view(b, t, -1, attn.head_dim)
            ks.append(apply_rope(k, cos, sin))
            vs.append(v * self.config.value_scale if self.config.value_scale is not None else v)
        return ks, vs

    # (b) the block forward

    def block_hidden(
        self,
        anchor_ids: torch.Tensor,  # [B] int64: each row's last sampled token
        anchor_positions: torch.Tensor,  # [B] int64: its position p0 (= the committed context length)
        context: BlockContext,
        num_query: int | None = None,  # S <= block_size; default block_size
    ) -> torch.Tensor:  # [B, S, hidden], after the final norm
        s = self.config.block_size if num_query is None else num_query
        if not 1 <= s <= self.config.block_size:
            raise ValueError(f"a block holds 1..{self.config.block_size} queries, asked for {s}")
        ids = torch.full((anchor_ids.shape[0], s), self.config.mask_token_id, dtype=torch.int64,
                         device=anchor_ids.device)
        ids[:, 0] = anchor_ids
        positions = anchor_positions[:, None] + torch.arange(s, device=anchor_ids.device)  # [B, S]
        x = F.embedding(ids, self.embed)
        cos, sin = self.rope(positions, x.dtype)
        attention = BlockAttention(self.config, context, positions)
        for i, layer in enumerate(self.layers):
            x = layer(i, x, cos, sin, attention)
        return self.norm(x)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., N] float32
        """The LM head over the draft's vocabulary (N = V unless reduced: ``to_target`` maps it)."""
        logits = F.linear(hidden, self.lm_weight).float()
        return logits * self.config.logit_scale if self.config.logit_scale != 1.0 else logits

    def to_target(self, logits: torch.Tensor) -> torch.Tensor:  # [..., N] -> [..., V]
        """Draft-vocabulary logits placed at their target ids, -inf at every other id (the same
        tensor when the draft's vocabulary is the target's)."""
        if self.draft_to_target is None:
            return logits
        out = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.draft_to_target, logits)

    # (c) the Markov head, left to right

    def sample_block(
        self,
        base: torch.Tensor,  # [B, S, N] float32 base logits over the draft's vocabulary
        anchor_ids: torch.Tensor,  # [B] int64: the token before position 0
        sample: Sampler = greedy,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """([B, S] tokens, [B, S, V] biased logits, [B, S, V] q or None, [B, S, r] Markov embeddings);
        tokens, logits and q are over the target's vocabulary (V), whatever the draft's."""
        b, s, _ = base.shape
        v = self.config.vocab_size
        if self.config.draft_topk is not None:
            values, candidates = base.topk(self.config.draft_topk, dim=-1)
            base = torch.full_like(base, float("-inf")).scatter_(-1, candidates, values)
        tokens = torch.empty((b, s), dtype=torch.int64, device=base.device)
        logits = torch.empty((b, s, v), dtype=base.dtype, device=base.device)
        embeds, probs = [], None
        prev = anchor_ids
        for j in range(s):
            e = self.markov_head.embed(prev)  # [B, r]
            logits[:, j] = self.to_target(base[:, j] + self.markov_head.bias(e) * self.config.logit_scale)
            tokens[:, j], q = sample(logits[:, j], j)
            if q is not None:
                if probs is None:
                    probs = torch.zeros((b, s, v), dtype=torch.float32, device=base.device)
                probs[:, j] = q
            embeds.append(e)
            prev = tokens[:, j]
        return tokens, logits, probs, torch.stack(embeds, dim=1)

    # (d) the confidence head

    def confidence(
        self,
        hidden: torch.Tensor,  # [B, S, hidden]
        markov_embeds: torch.Tensor,  # [B, S, r]: markov_w1 of each position's previous token
    ) -> torch.Tensor | None:  # [B, S] float32 in (0, 1); None without the head
        if self.confidence_head is None:
            return None
        features = torch.cat((hidden, markov_embeds.to(hidden.dtype)), dim=-1) \
            if self.config.confidence_with_markov else hidden
        return self.confidence_head(features)

    def draft(
        self,
        anchor_ids: torch.Tensor,  # [B] int64
        anchor_positions: torch.Tensor,  # [B] int64
        context: BlockContext,
        num_query: int | None = None,
        sample: Sampler = greedy,
    ) -> BlockDraft:
        """One block: the parallel forward, then the Markov head left to right, then the confidence."""
        hidden = self.block_hidden(anchor_ids, anchor_positions, context, num_query)
        tokens, logits, probs, embeds = self.sample_block(self.base_logits(hidden), anchor_ids, sample)
        return BlockDraft(tokens, logits, probs, self.confidence(hidden, embeds))


def tap_hidden_states(
    target: CausalLM,
    input_ids: torch.Tensor,  # [B, T] int64
    layer_ids: Sequence[int],  # ascending; -1 = the embedding output
    positions: torch.Tensor | None = None,  # [B, T] int64
    attention=None,  # an Attention callable (default: causal over the sequence)
) -> tuple[torch.Tensor, torch.Tensor]:  # ([B, T, hidden] final normed, [B, T, n * hidden] taps)
    """The target's forward that also returns the residual stream after ``layer_ids`` (vLLM's
    auxiliary hidden states): what a DSpark draft's context is made of."""
    taps: dict[int, torch.Tensor | None] = dict.fromkeys(layer_ids)
    hidden = target.hidden_states(input_ids, positions, attention, taps=taps)
    return hidden, torch.cat([taps[i] for i in layer_ids], dim=-1)


# -- loading -----------------------------------------------------------------------------------


def load_dspark(
    path: str | Path,
    target: TargetHeads | CausalLM,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
) -> DSparkDraft:
    """Load the DSpark draft at ``path`` for ``target`` (a loaded model, or ``TargetHeads.read``).

    Refuses (``DraftTargetMismatch``) a draft whose target layers, hidden size or vocabulary do not
    fit the target; ``dtype`` 'auto' takes the target's weights' dtype. A reduced vocabulary needs
    ``d2t``; its LM head is the checkpoint's ``lm_head.weight`` ``[N, hidden]`` (vLLM requires it),
    or else the target head's rows that ``d2t`` names.
    """
    heads = TargetHeads.of(target) if isinstance(target, CausalLM) else target
    path = Path(path)
    cfg = DSparkConfig.from_path(path)
    check_fits(cfg, heads.config)
    dtype = heads.embed.dtype if dtype in (None, "auto") else resolve_dtype(dtype)
    device = torch.device(device)
    check_device_dtype(device, dtype)
    embed, lm = heads.embed.to(device, dtype), heads.lm_head.to(device, dtype)
    with torch.device("meta"):
        model = DSparkDraft(cfg, embed, lm)
    model = model.to(dtype)
    if model.confidence_head is not None:
        model.confidence_head.float()  # vLLM keeps this head in float32
    model = model.to_empty(device=device)
    model.inv_freq = rope_inv_freq(cfg.backbone.head_dim, cfg.backbone.rope_theta, cfg.backbone.rope_scaling).to(device)
    own = _fill(model, weight_files(path), path)
    if cfg.reduced_vocab:
        _place_reduced_head(model, own, path)
        own.pop("lm_head.weight", None)
        model.lm_weight = model.lm_weight.to(device, dtype)
    for name, attr, shared in (("embed_tokens.weight", "embed", embed), ("lm_head.weight", "lm_weight", lm)):
        if name in own and not torch.equal(own[name].to(device, dtype), shared):
            setattr(model, attr, own[name].to(device, dtype))  # a draft with its own copy keeps it (as vLLM)
    return model.eval().requires_grad_(False)


def _place_reduced_head(model: DSparkDraft, own: dict[str, torch.Tensor], path: Path) -> None:
    """A reduced vocabulary's map (``d2t`` offsets -> ``draft_to_target``, checked: N distinct target
    ids) and LM head (the shipped ``[N, hidden]`` rows, or the target's rows it names)."""
    cfg, n = model.config, model.config.output_vocab_size
    d2t = own.pop("d2t", None)
    if d2t is None:
        raise TensorMissing(f"DSpark checkpoint at {path} has draft_vocab_size {n} < vocab_size {cfg.vocab_size} "
                            "but no 'd2t' tensor mapping draft ids to target ids")
    if tuple(d2t.shape) != (n,) or d2t.is_floating_point():
        raise TensorShapeMismatch(f"tensor 'd2t' must be [draft_vocab_size] = [{n}] integers, got "
                                  f"{tuple(d2t.shape)} {d2t.dtype}")
    ids = torch.arange(n) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size or len(ids.unique()) != n:
        raise ModelLoadError(f"DSpark checkpoint at {path}: 'd2t' must map the {n} draft ids to distinct target "
                             f"ids in 0..{cfg.vocab_size - 1}")
    device = model.fc.weight.device
    model.draft_to_target = ids.to(device)
    head = own.get("lm_head.weight")
    if head is None:
        model.lm_weight = model.lm_weight[model.draft_to_target]
    elif tuple(head.shape) != (n, cfg.hidden_size):
        raise TensorShapeMismatch(f"tensor 'lm_head.weight' has shape {tuple(head.shape)} but a draft vocabulary "
                                  f"of {n} needs ({n}, {cfg.hidden_size})")
    else:
        model.lm_weight = head


def _fill(model: DSparkDraft, files: list[Path], path: Path) -> dict[str, torch.Tensor]:
    """Copy the checkpoint's tensors into ``model``; returns the shared ones it ships (embed_tokens, lm_head)
    and, for a reduced vocabulary, its map ``d2t``."""
    params = dict(model.named_parameters())
    pending, own = set(params), {}
    has_confidence = False
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name in ("embed_tokens.weight", "lm_head.weight") or (name == "d2t" and model.config.reduced_vocab):
                    own[name] = f.get_tensor(name)
                    continue
                if name.startswith("confidence_head."):
                    has_confidence = True
                    if model.confidence_head is None:
                        continue  # enable_confidence_head is false: vLLM drops the head too
                if name not in params:
                    if any(part in name for part in _IGNORED):
                        continue
                    raise ModelLoadError(f"checkpoint tensor {name!r} has no place in a DSpark draft; "
                                         "check that config.json matches the weights")
                param = params[name]
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(param.shape):
                    raise TensorShapeMismatch(f"tensor {name!r} has shape {shape} but config.json implies "
                                              f"{tuple(param.shape)}; check the draft's config.json")
                with torch.no_grad():
                    param.copy_(f.get_tensor(name))
                pending.discard(name)
    if model.confidence_head is not None and not has_confidence:
        model.confidence_head = None  # enabled but not shipped: no estimate (as vLLM)
        pending = {n for n in pending if not n.startswith("confidence_head.")}
    if pending:
        names = sorted(pending)
        raise TensorMissing(f"DSpark checkpoint at {path} lacks {len(names)} tensor(s) the config needs, "
                            f"e.g. {names[0]!r}")
    return own
