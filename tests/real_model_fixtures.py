"""The real model (SmolLM2-135M-Instruct, the GGUF file deploy/setup.sh installs) and its reference
outputs from transformers' own GGUF loader, computed once per test session.

``CHAT_PROMPTS`` are chat questions rendered through the model's chat template; the reference is
transformers' greedy generation in float32, 64 new tokens each (fewer where the model ends its
answer with <|im_end|>).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest

from gguf_fixtures import hf_smollm2

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "List three primary colors.",
    "How do I reverse a list in Python?",
    "Give me a short tip for sleeping better.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish and French.",
]
MAX_TOKENS = 64


@dataclass(frozen=True)
class Reference:
    prompts: list[list[int]]  # the chat prompts' token ids (template rendered, no BOS added)
    outputs: list[list[int]]  # transformers' greedy continuation of each, EOS included where it ended
    texts: list[str]  # the continuations' text, special tokens skipped
    eos: int


@pytest.fixture(scope="session")
def smollm2_reference() -> Reference:
    return reference()


@functools.cache
def reference() -> Reference:
    """Computed once per test process, whichever modules ask (each imports the fixture)."""
    import torch

    model, tok = hf_smollm2()
    prompts, outputs = [], []
    for question in CHAT_PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        prompts.append(ids)
        outputs.append(out[0, len(ids):].tolist())
    texts = [tok.decode(o, skip_special_tokens=True) for o in outputs]
    return Reference(prompts, outputs, texts, tok.eos_token_id)
