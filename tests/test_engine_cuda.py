"""The whole engine on a CUDA GPU with the shipped pair: compiled Triton kernels in the loop.

Skipped where there is no CUDA device (CI). What it shows on a GPU box:
speculative greedy decoding on CUDA emits exactly the target's own greedy
tokens, the CUDA engine agrees with the CPU engine, and seeded sampling is
independent of the batch a request runs in.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import SHIPPED_DRAFT, SHIPPED_TARGET

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [
    "MACBETH.\nIs this a dagger which I see before me,",
    "VIOLA.\nWhat country, friends, is this?\n",
    "First Witch.\nWhen shall we three meet again\n",
    "ORSINO.\nIf music be the food of love, play on;",
    "LADY MACBETH.\n",
    "CLOWN.\nWhy, sir,",
]


@pytest.fixture(scope="module")
def engines():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("Triton's interpreter is on in this process; run this file on its own on a GPU box")
    from dspark_ray import LLM

    common = dict(max_context=512, capacity=16, max_num_seqs=16, dtype="float32")
    return {
        "cuda_spec": LLM(str(SHIPPED_TARGET), str(SHIPPED_DRAFT), device="cuda", num_speculative_tokens=4, **common),
        "cuda_plain": LLM(str(SHIPPED_TARGET), None, device="cuda", **common),
        "cpu_plain": LLM(str(SHIPPED_TARGET), None, device="cpu", **common),
    }


def test_speculative_greedy_on_cuda_is_lossless(engines):
    from dspark_ray import SamplingParams

    params = SamplingParams(max_tokens=48, ignore_eos=True)
    spec = engines["cuda_spec"].generate(PROMPTS, params)
    plain = engines["cuda_plain"].generate(PROMPTS, params)
    for s, p in zip(spec, plain):
        assert s.error is None and p.error is None
        assert s.token_ids == p.token_ids
    accepted = [o.spec.mean_acceptance_length for o in spec]
    # The draft proposes and the target accepts some: the speculative path really ran.
    assert sum(accepted) / len(accepted) > 1.5, accepted


def test_cuda_engine_agrees_with_cpu_engine(engines):
    from dspark_ray import SamplingParams

    params = SamplingParams(max_tokens=32, ignore_eos=True)
    gpu = engines["cuda_spec"].generate(PROMPTS, params)
    cpu = engines["cpu_plain"].generate(PROMPTS, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]


def test_seeded_sampling_on_cuda_is_batch_independent(engines):
    from dspark_ray import SamplingParams

    llm = engines["cuda_spec"]
    seeded = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded)[0]
    others = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True) for i in range(5)]
    crowded = llm.generate(PROMPTS, [seeded] + others)[0]
    assert alone.token_ids == crowded.token_ids
    greedy = llm.generate(PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert alone.token_ids != greedy.token_ids  # it really sampled


def test_draft_cuda_graphs_change_no_output(engines):
    """The draft's drafting passes replayed as CUDA graphs at padded batch sizes (``cuda_graphs``, on by
    default): greedy output equals the target's own, seeded sampled output equals an engine whose
    passes run eagerly, and both sizes a mixed batch pads to were captured."""
    from dspark_ray import LLM, SamplingParams

    graphs = engines["cuda_spec"]
    eager = LLM(str(SHIPPED_TARGET), str(SHIPPED_DRAFT), device="cuda", num_speculative_tokens=4,
                max_context=512, capacity=16, max_num_seqs=16, dtype="float32", cuda_graphs=False)
    greedy = SamplingParams(max_tokens=48, ignore_eos=True)
    got = graphs.generate(PROMPTS, greedy)
    assert [o.token_ids for o in got] == [o.token_ids for o in engines["cuda_plain"].generate(PROMPTS, greedy)]
    assert graphs.generate(PROMPTS[0], greedy)[0].token_ids == got[0].token_ids  # one row: another size
    sampled = [SamplingParams(max_tokens=40, temperature=0.8, seed=i, ignore_eos=True) for i in range(len(PROMPTS))]
    assert ([o.token_ids for o in graphs.generate(PROMPTS, sampled)]
            == [o.token_ids for o in eager.generate(PROMPTS, sampled)])
    proposer = graphs.engine.draft
    assert proposer.cuda_graphs and len(proposer._padded) >= 2
    assert all(p.graph is not None for p in proposer._padded.values())
    assert not eager.engine.draft.cuda_graphs and not eager.engine.draft._padded


def test_paged_kernel_in_the_engine_changes_no_greedy_output(engines, monkeypatch):
    """The target attending through the compiled Triton paged kernel (``target_runner.PAGED_KERNEL``,
    off by default) instead of gather + SDPA: float32 greedy output, with and without speculation,
    is the gather path's, token for token."""
    from dspark_kernels import ops
    from dspark_ray import SamplingParams
    from dspark_ray.engine import target_runner

    params = SamplingParams(max_tokens=48, ignore_eos=True)
    gathered = [o.token_ids for o in engines["cuda_plain"].generate(PROMPTS, params)]
    launches = []
    kernel = ops.paged_attention
    monkeypatch.setattr(ops, "paged_attention", lambda *a, **kw: launches.append(1) or kernel(*a, **kw))
    monkeypatch.setattr(target_runner, "PAGED_KERNEL", True)  # read by every step's attention
    assert [o.token_ids for o in engines["cuda_plain"].generate(PROMPTS, params)] == gathered
    assert [o.token_ids for o in engines["cuda_spec"].generate(PROMPTS, params)] == gathered
    assert launches  # the kernel really ran
