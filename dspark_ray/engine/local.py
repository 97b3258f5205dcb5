"""Building the engine's parts: in this process, or one part per Ray actor.

``make_target_runner`` and ``make_draft_proposer`` are what every target
shard and the draft worker call too, so the in-process engine and the
distributed one are built the same way.

The draft is one of two kinds, told apart by its config.json
(``is_dspark_checkpoint``): an independent small language model
(``DraftProposer``) or DSpark's block drafter (``DSparkProposer``), whose
context is the target's hidden states at a few layers, so its target runs
with ``taps`` (and without its prefix cache: ``make_target_runner``).
``draft: ngram`` names no checkpoint: prompt lookup in the request's own
tokens (``NgramProposer``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark_ray.engine.config import EngineConfig, is_ngram
from dspark_ray.engine.draft_proposer import DraftProposer
from dspark_ray.engine.dspark_proposer import DSparkProposer
from dspark_ray.engine.dtypes import draft_runtime_dtype, runtime_dtype
from dspark_ray.engine.engine import Engine
from dspark_ray.engine.ngram_proposer import NgramProposer
from dspark_ray.engine.structured import GrammarCompiler, SlotGrammars
from dspark_ray.engine.target_runner import PREFIX_BLOCK, TargetRunner
from dspark_ray.model import ModelConfig, load, native
from dspark_ray.model.compiled import compile_model, warm_up
from dspark_ray.model.dspark import DSparkConfig, TargetHeads, check_fits, is_dspark_checkpoint, load_dspark
from dspark_ray.model.llama import CausalLM
from dspark_ray.model.rope import check_max_context
from dspark_ray.model.mla import refuse_as_draft
from dspark_ray.model.parallel import TensorParallel
from dspark_ray.slots import SlotRegistry
from dspark_ray.tokenizer import Tokenizer, check_compatible

# The [rows, tokens] shapes compiled at load with compile_model: one per specialisation (a dimension of
# 1, or more). The target runs its step packed as one sequence of every row's tokens, [1, N]; the
# draft one pass per draft token, [rows, 1], and a catch-up pass over the accepted tokens, [rows, n].
TARGET_SHAPES = [(1, 1), (1, 8)]
DRAFT_SHAPES = [(1, 1), (1, 8), (4, 1), (4, 8)]


def uses_dspark(config: EngineConfig) -> bool:
    """Whether the engine speculates with a DSpark block drafter (by the draft's config.json)."""
    return (bool(config.draft) and config.spec_tokens > 0 and not is_ngram(config.draft)
            and is_dspark_checkpoint(config.draft))


def check_draft(config: EngineConfig, tokenizer: Tokenizer) -> None:
    """Refuse a draft that cannot serve with this target, from the config files alone (before any
    weight is read): tokenizers that differ, an MLA model as an independent draft, a DSpark draft
    whose target layers, hidden size or vocabulary do not fit the target (``DraftTargetMismatch``).
    A DSpark checkpoint may ship no tokenizer (it reads the target's ids); one it ships must match."""
    if not config.draft or is_ngram(config.draft):
        return
    if is_dspark_checkpoint(config.draft):
        check_fits(DSparkConfig.from_path(config.draft), ModelConfig.from_path(config.model))
        if (Path(config.draft) / "tokenizer.json").is_file():
            check_compatible(tokenizer, Tokenizer.from_path(config.draft))
        return
    check_compatible(tokenizer, Tokenizer.from_path(config.draft))
    refuse_as_draft(ModelConfig.from_path(config.draft))


def make_target_runner(config: EngineConfig, vocab_limit: int | None, tp: TensorParallel | None = None) -> TargetRunner:
    """The target (or this rank's shard of it) with its KV pool and request-to-token table.

    ``vocab_limit``: the tokenizer's vocabulary size; models may pad their
    embeddings past it, and those ids must never come out.
    With a DSpark draft the target also returns its hidden states at the draft's target layers
    (``taps``), and its prefix cache is off: positions it serves from the cache are never
    computed, so the draft's context would lack them, and then a request's drafts (and, for a
    seeded sampled request, its tokens) would depend on what other requests left in the cache
    (invariant 3). A DSpark context cache beside the prefix cache would lift this.
    Raises ContextTooLong if ``max_context`` exceeds the model's context length
    (``dspark_ray.model.rope.max_context_length``). On CUDA the KV pool takes the memory the
    weights leave (``kv_pool_tokens`` unless set), and a deployment that cannot fit raises
    ``MemoryPlanError`` before any weight is read (engine/memory_budget.py).
    """
    model_config = ModelConfig.from_path(config.model)
    check_max_context(model_config, config.max_context)
    plan = None
    if torch.device(config.device).type == "cuda":  # refuse what cannot fit before any weight is read
        from dspark_ray.engine.memory_budget import check_fits, cuda_pool_tokens

        plan = check_fits(config, tp)
    model = load(config.model, dtype=runtime_dtype(config.dtype, config.device), device=config.device, tp=tp,
                 quantization=config.quantization)
    kv_tokens = config.kv_tokens if plan is None else cuda_pool_tokens(config, plan, tp)
    taps = DSparkConfig.from_path(config.draft).target_layer_ids if uses_dspark(config) else None
    prefix_block = PREFIX_BLOCK if config.enable_prefix_caching and taps is None else None
    if taps is None:
        # GGUF blocks kept on the CPU: a step on the C attention runs every layer in one C call
        # (before compile_model, whose op then stands in for the linears' block matmuls).
        native.attach(model)
    if config.compile_model and taps is None:
        # A target with taps (a DSpark draft) runs eager: its passes want the tapped layers.
        compile_model(model)
        warm_up(model, TARGET_SHAPES)
    return TargetRunner(model, config.capacity, config.max_context, kv_tokens + 1, config.spec_tokens,
                        vocab_limit, prefix_block, taps)


def make_draft_proposer(config: EngineConfig, vocab_limit: int | None,
                        target: CausalLM | None = None) -> DraftProposer | DSparkProposer | NgramProposer:
    """The draft service for ``config.draft``. A DSpark draft shares the target's embedding and LM
    head: ``target``'s when it is loaded in this process (unsharded), else read from its checkpoint."""
    if is_ngram(config.draft):
        vocab = vocab_limit if vocab_limit is not None else ModelConfig.from_path(config.model).vocab_size
        return NgramProposer(config.capacity, config.max_context, config.spec_tokens, vocab,
                             config.prompt_lookup_min, config.prompt_lookup_max)
    if is_dspark_checkpoint(config.draft):
        heads = TargetHeads.of(target) if target is not None else TargetHeads.read(
            config.model, runtime_dtype(config.dtype, config.device), config.device)
        model = load_dspark(config.draft, heads, draft_runtime_dtype(config), config.device)
        return DSparkProposer(model, config.capacity, config.max_context, config.spec_tokens, vocab_limit)
    refuse_as_draft(ModelConfig.from_path(config.draft))  # before any weight is read
    model = load(config.draft, dtype=draft_runtime_dtype(config), device=config.device,
                 quantization=config.quantization)
    if config.compile_model:
        compile_model(model)
        warm_up(model, DRAFT_SHAPES)
    # Structured-output rows mask their drafts with the grammar too (compiled on first use).
    grammars = SlotGrammars(lambda: GrammarCompiler.of(Tokenizer.from_path(config.model)))
    return DraftProposer(model, config.capacity, config.draft_window, config.spec_tokens, vocab_limit, grammars,
                         cuda_graphs=config.cuda_graphs, ahead=config.draft_ahead)


class LocalServices:
    """An engine's services in this process: a slot registry, the target runner, the draft proposer.

    The serving layer's ``EngineServices`` without Ray, for tests of the HTTP
    layer and for single-process use (``DSparkServer(config, services=LocalServices.build)``).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        tokenizer = Tokenizer.from_path(config.model)
        self.vocab_limit = tokenizer.vocab_size
        self.slots = SlotRegistry(config.capacity)
        if config.spec_tokens > 0:
            check_draft(config, tokenizer)
        self.target = make_target_runner(config, self.vocab_limit)
        self.draft = None
        if config.draft and config.spec_tokens > 0:
            self.draft = make_draft_proposer(config, self.vocab_limit, self.target.model)

    @classmethod
    def build(cls, app_config, app_name: str = "", replica: str = "") -> LocalServices:
        """A ``ServicesFactory``: from the deploy-level ``AppConfig``."""
        return cls(app_config.engine_config())

    def rebuild_target(self) -> TargetRunner:
        self.target = make_target_runner(self.config, self.vocab_limit)
        return self.target

    def shutdown(self) -> None:
        pass


def build_local_engine(config: EngineConfig, owner: str = "local") -> Engine:
    """An engine whose services are plain objects in this process (a bad draft is refused first)."""
    tokenizer = Tokenizer.from_path(config.model)
    check_draft(config, tokenizer)
    target = make_target_runner(config, tokenizer.vocab_size)
    draft = make_draft_proposer(config, tokenizer.vocab_size, target.model) if config.draft else None
    return Engine(config, tokenizer, SlotRegistry(config.capacity), target, draft, owner=owner)
