"""Padded target steps (issue 20): a decode or verify step run at a fixed batch size, its padding
rows on slot 0 and its short rows filled to k + 1 entries, gives exactly what the unpadded step
gives and never touches a live request's KV.

On CPU padding is pure overhead (the CUDA graphs it exists for are not built for the target
yet), so the target runs unpadded by default; this file turns it on in one of two in-process
engines and drives both through the same random schedule: requests joining and leaving,
greedy and seeded sampled, each with its own k (0 to 4, so rows carry different numbers of
drafts), batches of 1 to 6 rows padded to 2, 4 or 8; with the independent draft and with the
DSpark block draft (whose context states the target returns).
"""

from __future__ import annotations

import random

import pytest
import torch

from dspark_ray.engine import EngineConfig, SamplingParams
from dspark_ray.engine.local import build_local_engine
from dspark_ray.slots.req_to_token import PADDING_TOKEN
from conftest import SHIPPED_DSPARK, shipped

K = 4


def engines(target, draft):
    config = EngineConfig(model=str(target), draft=str(draft), num_speculative_tokens=K, adaptive_speculation=False,
                          capacity=8, max_context=128, max_num_seqs=6, draft_dtype="float32",
                          enable_prefix_caching=False)
    plain, padded = build_local_engine(config), build_local_engine(config)
    padded.target.pad_batches = (2, 4, 8)
    return plain, padded


@pytest.mark.parametrize("kind", ["independent", "dspark"])
def test_padded_target_steps_change_no_output_and_no_live_kv(shipped_target, shipped_draft, kind):
    """With the DSpark block draft the target also returns its tap states for the committed
    positions (the draft's context): the padded step must return the same ones."""
    draft = shipped_draft if kind == "independent" else shipped(SHIPPED_DSPARK, "model.safetensors")
    plain, padded = engines(shipped_target, draft)
    rng = random.Random(11)
    vocab = 4000
    outputs = {"plain": {}, "padded": {}}
    n = 0
    for step in range(200):
        if n < 14 and (rng.random() < 0.3 or not plain.has_unfinished()):
            prompt = [rng.randrange(5, vocab) for _ in range(rng.randrange(3, 24))]
            greedy = rng.random() < 0.5
            params = SamplingParams(max_tokens=rng.randrange(8, 40), ignore_eos=True,
                                    temperature=0.0 if greedy else 0.9, seed=None if greedy else rng.randrange(1000),
                                    num_speculative_tokens=rng.randrange(0, K + 1))
            for engine in (plain, padded):
                engine.add_request(prompt, params, f"r{n}")
            n += 1
        if not plain.has_unfinished():
            break
        for name, engine in (("plain", plain), ("padded", padded)):
            for out in engine.step():
                outputs[name].setdefault(out.req_id, []).extend(out.new_token_ids)
        # Every live request's KV (through its table row) is what the unpadded target holds, up to the
        # last bits: a padded step has more rows, and a float32 matmul of more rows may take oneDNN's
        # packed kernel where the unpadded one took torch's (model/cpu_gemm.py; ~1e-6 relative apart).
        a, b = plain.target, padded.target
        assert torch.equal(a.table.lengths, b.table.lengths), f"step {step}"
        for slot in range(1, a.table.lengths.shape[0]):
            length = int(a.table.lengths[slot])
            index = a.table.table[slot, :length].long()
            assert torch.equal(index, b.table.table[slot, :length].long())
            for layer in range(len(a.k_pools)):
                torch.testing.assert_close(b.k_pools[layer][index], a.k_pools[layer][index], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(b.v_pools[layer][index], a.v_pools[layer][index], rtol=1e-5, atol=1e-5)
    assert not plain.has_unfinished() and not padded.has_unfinished()
    assert n == 14 and outputs["padded"] == outputs["plain"]
    assert padded.target.padded_steps > 20 and plain.target.padded_steps == 0
    # The padding row still maps every position to the padding token, and no slot was left behind.
    assert (padded.target.table.table[0] == PADDING_TOKEN).all()
    assert padded.target.kv_free() == plain.target.kv_free() == padded.target.kv_capacity()


def test_prefills_and_batches_past_the_largest_size_run_unpadded(shipped_target, shipped_draft):
    _, padded = engines(shipped_target, shipped_draft)
    padded.target.pad_batches = (2,)
    for i in range(3):  # three rows (past the largest padded size), the same greedy tokens: they end together
        padded.add_request([5, 6, 7] * 3, SamplingParams(max_tokens=6, ignore_eos=True), f"r{i}")
    padded.step()  # the prefill step
    assert padded.target.padded_steps == 0
    while padded.has_unfinished():
        padded.step()
    assert padded.target.padded_steps == 0
    padded.add_request([5, 6, 7] * 3, SamplingParams(max_tokens=6, ignore_eos=True), "r3")  # one row: padded
    while padded.has_unfinished():
        padded.step()
    assert padded.target.padded_steps > 0
