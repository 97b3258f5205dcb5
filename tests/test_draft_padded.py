"""Padded drafting passes (issue 20): a proposal run at a fixed batch size, its extra entries
padding on slot 0, drafts exactly what the unpadded proposer drafts and never touches row 0.

On CPU padding is pure overhead (the CUDA graphs it exists for are captured on CUDA only), so
the proposer runs unpadded by default; this file turns it on and compares, over a random
schedule of proposals (rows joining and leaving, slots reused with new epochs, greedy and
sampled rows, 1 to 4 drafts), with the same proposer unpadded.
"""

from __future__ import annotations

import random

import torch

from dspark_ray.engine.draft_proposer import DraftProposer, PaddedPass
from dspark_ray.engine.interfaces import ProposeRow, SamplingRow
from dspark_ray.model import load

CAPACITY, WINDOW, K = 6, 8, 4


def test_padded_passes_draft_what_unpadded_ones_do_and_leave_row_zero_alone(shipped_draft):
    model = load(shipped_draft, dtype=torch.float32)
    plain = DraftProposer(model, CAPACITY, WINDOW, K)
    padded = DraftProposer(model, CAPACITY, WINDOW, K, pad_batches=(3, 8))
    for layer in range(len(padded.cache.k)):  # row 0 poisoned: a pass that reads it makes NaN drafts
        padded.cache.k[layer][0] = float("nan")
        padded.cache.v[layer][0] = float("nan")
    rng = random.Random(7)
    vocab = model.config.vocab_size
    live: dict[int, dict] = {}  # slot -> {epoch, tokens, committed, sampling}
    epochs = {slot: 0 for slot in range(1, CAPACITY + 1)}
    sampled_rows = 0
    for step in range(40):
        free = [s for s in range(1, CAPACITY + 1) if s not in live]
        if free and (not live or rng.random() < 0.4):  # a request joins (a reused slot: a new epoch)
            slot = rng.choice(free)
            epochs[slot] += 1
            seed = rng.randrange(1000)
            sampling = SamplingRow(0.0, 1.0, 0, 0) if rng.random() < 0.5 else SamplingRow(0.8, 0.95, 0, seed)
            live[slot] = {"tokens": [rng.randrange(1, vocab) for _ in range(rng.randrange(2, 20))],
                          "committed": 0, "sampling": sampling}
        rows = []
        for slot in rng.sample(sorted(live), rng.randrange(1, len(live) + 1)):
            r = live[slot]
            rows.append(ProposeRow(slot, epochs[slot], r["committed"], tuple(r["tokens"][r["committed"]:]),
                                   rng.randrange(1, K + 1), r["sampling"]))
        want, got = plain.propose(rows), padded.propose(rows)
        assert got.draft_token_ids == want.draft_token_ids, f"step {step}"
        if want.draft_probs is not None:
            sampled_rows += 1
            assert torch.isfinite(got.draft_probs).all()
            torch.testing.assert_close(got.draft_probs, want.draft_probs, rtol=0, atol=1e-5)
        for row, drafts in zip(rows, want.draft_token_ids):  # the target accepts some, emits one more
            r = live[row.slot]
            r["committed"] = len(r["tokens"])
            r["tokens"] += drafts[:rng.randrange(0, len(drafts) + 1)] + [rng.randrange(1, vocab)]
        for slot in [s for s in live if rng.random() < 0.1]:  # a request ends
            del live[slot]
    assert sampled_rows and set(padded._padded) == {3, 8}  # both sizes ran, sampled rows too
    for layer in range(len(padded.cache.k)):
        assert padded.cache.k[layer][0].isnan().all() and padded.cache.v[layer][0].isnan().all()
        for slot in range(1, CAPACITY + 1):  # every live slot holds what the unpadded cache holds
            n = int(plain.cache.length[slot])
            assert int(padded.cache.length[slot]) == n
            torch.testing.assert_close(padded.cache.k[layer][slot, :min(n, plain.cache.ring)],
                                       plain.cache.k[layer][slot, :min(n, plain.cache.ring)], rtol=0, atol=1e-5)
    assert int(padded.cache.length[0]) == 0 and int(padded.cache.epoch[0]) == 0


def test_a_padded_pass_clears_what_a_larger_batch_left_in_its_buffers(shipped_draft):
    """Entries past the live rows are padding again after a call with more rows."""
    model = load(shipped_draft, dtype=torch.float32)
    proposer = DraftProposer(model, CAPACITY, WINDOW, K, pad_batches=(4,))
    run = PaddedPass(proposer, 4, graph=False)
    ones = torch.ones(3, dtype=torch.int64)
    run(ones, torch.ones(3, dtype=torch.bool), ones * 0, torch.tensor([1, 2, 3]))
    out = run(ones[:1], torch.ones(1, dtype=torch.bool), ones[:1] * 0, torch.tensor([4]))
    assert out.shape == (1, model.config.vocab_size)
    assert run.slots.tolist() == [4, 0, 0, 0] and run.fed.tolist() == [True, False, False, False]
    assert run.positions.tolist() == [0, -1, -1, -1]


def test_cuda_graphs_setting_reaches_the_proposer_and_changes_nothing_on_cpu(shipped_draft, shipped_target):
    """``cuda_graphs`` (on by default) goes from the Serve config to the engine config and the
    proposer; off CUDA a proposer built with it neither pads nor captures."""
    from dspark_ray.engine.config import EngineConfig
    from dspark_ray.engine.local import make_draft_proposer
    from dspark_ray.serve.config import AppConfig

    app = dict(model=str(shipped_target), draft=str(shipped_draft))
    assert AppConfig(**app).engine_config().cuda_graphs
    assert not AppConfig(**app, cuda_graphs=False).engine_config().cuda_graphs
    config = EngineConfig(model=str(shipped_target), draft=str(shipped_draft), capacity=CAPACITY)
    assert config.cuda_graphs
    proposer = make_draft_proposer(config, None)
    assert not proposer.cuda_graphs and proposer.pad_batches == ()
