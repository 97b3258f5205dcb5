"""Building an engine whose three services live in this process."""

from __future__ import annotations

import torch

from dspark_ray.engine.config import EngineConfig
from dspark_ray.engine.draft_proposer import DraftProposer
from dspark_ray.engine.engine import Engine
from dspark_ray.engine.target_runner import TargetRunner
from dspark_ray.model import load
from dspark_ray.slots import SlotRegistry
from dspark_ray.tokenizer import Tokenizer, check_compatible


def runtime_dtype(dtype: str, device: str) -> str:
    """'auto' means float32 on CPU (bf16 matmuls are slow and lossy there), else the checkpoint's."""
    if dtype != "auto":
        return dtype
    return "float32" if torch.device(device).type == "cpu" else "auto"


def build_local_engine(config: EngineConfig, owner: str = "local") -> Engine:
    tokenizer = Tokenizer.from_path(config.model)
    dtype = runtime_dtype(config.dtype, config.device)
    target_model = load(config.model, dtype=dtype, device=config.device)
    k = config.spec_tokens
    vocab = tokenizer.vocab_size  # models may pad their embeddings past it: those ids never come out
    target = TargetRunner(target_model, config.capacity, config.max_context, config.kv_tokens + 1, k, vocab)
    draft = None
    if config.draft:
        check_compatible(tokenizer, Tokenizer.from_path(config.draft))
        draft_model = load(config.draft, dtype=dtype, device=config.device)
        draft = DraftProposer(draft_model, config.capacity, config.draft_window, k, vocab)
    return Engine(config, tokenizer, SlotRegistry(config.capacity), target, draft, owner=owner)
