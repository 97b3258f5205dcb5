"""SmolLM2-135M-Instruct from its GGUF file through the engine, equal to transformers.

The reference is transformers' own GGUF loader in float32, greedy, on real chat prompts
(real_model_fixtures). The engine must produce the same tokens, token for token, alone and with
speculation: with the model as its own draft (every draft accepted, bonus tokens), with a
draft of its first 20 layers (a real model of the same family that disagrees with it now and
then, so drafts are both accepted and rejected), and with prompt lookup (``draft: ngram``).
"""

from __future__ import annotations

import pytest

from dspark_ray import LLM, SamplingParams
from gguf_fixtures import smollm2_path, write_truncated
from real_model_fixtures import MAX_TOKENS, smollm2_reference  # noqa: F401,F811 (a fixture)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shallow_draft(tmp_path_factory):
    return write_truncated(smollm2_path(), tmp_path_factory.mktemp("draft") / "smollm2-20-layers.gguf", 20)


def generate(llm: LLM, prompts: list[list[int]]):
    return llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))


def assert_equal_to_reference(outs, ref) -> None:
    for i, (out, expected, text) in enumerate(zip(outs, ref.outputs, ref.texts)):
        assert out.token_ids == expected, (i, out.text, text)
        assert out.text == text
        assert out.finish_reason == ("stop" if expected[-1] == ref.eos else "length")
    assert any(o.finish_reason == "stop" for o in outs) and any(o.finish_reason == "length" for o in outs)


def test_greedy_chat_equals_transformers(smollm2_reference):
    """The engine keeps the file's blocks (quantization auto, tests/test_quantized_model.py) where
    transformers dequantizes them: the answers agree anyway (0 of 8 diverge)."""
    ref = smollm2_reference
    llm = LLM(str(smollm2_path()), None, dtype="float32", quantization="auto", max_context=512, capacity=8)
    assert_equal_to_reference(generate(llm, ref.prompts), ref)
    assert "Paris" in ref.texts[0]


@pytest.mark.parametrize("draft_kind, k", [("self", 4), ("shallow", 3), ("ngram", 4)])
def test_greedy_chat_with_speculation_equals_transformers(smollm2_reference, shallow_draft, draft_kind, k):
    ref = smollm2_reference
    draft = {"self": smollm2_path(), "shallow": shallow_draft, "ngram": "ngram"}[draft_kind]
    # The draft attends to the whole context (its window cache as long as max_context), as the target does.
    llm = LLM(str(smollm2_path()), str(draft), dtype="float32", draft_dtype="float32", max_context=512,
              draft_window=512, capacity=8, num_speculative_tokens=k, adaptive_speculation=False)
    outs = generate(llm, ref.prompts)
    assert_equal_to_reference(outs, ref)
    proposed = sum(o.spec.draft_tokens for o in outs)
    accepted = sum(o.spec.accepted_tokens for o in outs)
    assert proposed > 0
    if draft_kind == "self":  # the same model proposes what it verifies: everything accepted
        assert accepted == proposed
    else:  # both paths taken on real weights
        assert 0 < accepted < proposed
