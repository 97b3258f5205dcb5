"""A DSpark block draft beside the real GGUF target (SmolLM2-135M-Instruct), whose weights the loader
keeps as GGUF blocks (dspark_ray/model/quantized.py): the draft gets float copies of the target's
embedding and LM head (``TargetHeads.of``), equal to the dequantized model's, and a reduced-vocabulary
draft of the target's shape (random weights, the Markov head taught the target's own greedy
transitions so that some drafts are accepted) speculates in the engine with greedy output equal to
the target alone.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from gguf_fixtures import smollm2_path
from test_dspark_draft import write_checkpoint

from dspark_ray import LLM, SamplingParams
from dspark_ray.drafter.costs import random_draft
from dspark_ray.model import load
from dspark_ray.model.dspark import TargetHeads

QUESTIONS = ["What is the capital of France?", "Give me a short tip for sleeping better."]


@pytest.fixture(scope="module")
def target():
    return load(smollm2_path(), dtype="float32")


def test_heads_of_a_target_kept_as_blocks_are_its_dequantized_weights(target):
    plain = load(smollm2_path(), dtype="float32", quantization="none")
    assert target.model.embed_tokens.weight.dtype == torch.uint8  # the blocks are kept
    heads = TargetHeads.of(target)
    assert heads.embed.dtype == torch.float32 and heads.embed.shape == (49152, 576)
    assert torch.equal(heads.embed, plain.model.embed_tokens.weight)
    assert heads.lm_head is heads.embed  # tied


def test_a_reduced_vocabulary_draft_speculates_losslessly_on_the_gguf_target(target, tmp_path):
    path = smollm2_path()
    alone = LLM(str(path), None, max_context=256, capacity=2)
    tok = alone.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in QUESTIONS]
    params = SamplingParams(max_tokens=24)
    reference = [o.token_ids for o in alone.generate(prompts, params)]
    pairs = Counter((a, b) for p, out in zip(prompts, reference) for a, b in zip((p[-1], *out), out))
    ids = sorted({t for p, out in zip(prompts, reference) for t in (*p, *out)} | set(range(2048)))
    rank = 64
    draft = random_draft(target.config, 1, 4, 64, len(ids), rank, torch.float32)
    tensors = {k: v.contiguous() for k, v in draft.state_dict().items()}
    w1, w2 = torch.zeros(49152, rank), torch.zeros(len(ids), rank)
    best: dict[int, int] = {}
    for (a, b), _ in pairs.most_common():
        best.setdefault(a, b)
    for i, (a, b) in enumerate(list(best.items())[:rank]):
        w1[a, i], w2[ids.index(b), i] = 1.0, 100.0
    tensors.update({"markov_head.markov_w1.weight": w1, "markov_head.markov_w2.weight": w2,
                    "lm_head.weight": TargetHeads.of(target).lm_head[torch.tensor(ids)].clone(),
                    "d2t": torch.tensor(ids) - torch.arange(len(ids))})
    config = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": 576,
              "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
              "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "num_hidden_layers": 1,
              "block_size": 4, "mask_token_id": 3, "target_layer_ids": [0, 1, 2], "num_target_layers": 30,
              "markov_rank": rank, "layer_types": ["sliding_attention"], "sliding_window": 64, "is_causal": True,
              "draft_vocab_size": len(ids), "max_position_embeddings": 8192}
    folder = write_checkpoint(tmp_path / "draft", config, tensors)
    spec = LLM(str(path), str(folder), max_context=256, capacity=2, adaptive_speculation=False,
               num_speculative_tokens=4)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.spec.accepted_tokens for o in outs) > 0
