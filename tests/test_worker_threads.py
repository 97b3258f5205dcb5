"""``single_thread_max_rows``: a worker runs a step of few rows on one torch thread and a larger one
on ``torch_threads``, on its torch thread, and what it computes does not depend on which.

Served, a request's output must not depend on the rest of its batch (invariant 3); the rule makes
the thread count depend on the batch's size, so the kernels' results must not depend on the thread
count. Checked here bit for bit on the draft's proposals (tokens and q of sampled rows), and on the
in-process engine's greedy output at one and two threads.
"""

from __future__ import annotations

import torch

from dspark_ray.engine import EngineConfig, SamplingParams
from dspark_ray.engine.interfaces import ProposeRow, SamplingRow
from dspark_ray.engine.local import build_local_engine
from dspark_ray.runtime.workers import DraftWorker

PROMPTS = ["ROMEO:\nBut soft, what light", "JULIET:\nO Romeo", "KING:\nNow is the", "First Citizen:\nBefore we"]


def test_a_worker_runs_small_steps_on_one_thread_with_the_same_proposals(shipped_target, shipped_draft):
    config = EngineConfig(model=str(shipped_target), draft=str(shipped_draft), capacity=8, max_context=128)
    ruled = DraftWorker(config, torch_threads=2, single_thread_max_rows=2)
    plain = DraftWorker(config, torch_threads=2)

    def propose(worker: DraftWorker, rows: list[ProposeRow]):
        proposal = worker.torch.call(worker.propose, rows)
        return proposal, worker.torch.call(torch.get_num_threads)

    tokens = [(11, 402, 37, 9, 1200, 5), (77, 3, 3, 91), (5, 6, 7, 8, 9), (1000, 2000, 3000)]
    sampling = [SamplingRow(0.0, 1.0, 0, 0), SamplingRow(0.9, 1.0, 0, 17), SamplingRow(1.0, 0.9, 0, 5),
                SamplingRow(0.0, 1.0, 0, 0)]
    schedule = [[1, 2], [1, 2, 3, 4], [2], [1, 3, 4], [3, 4]]  # the slots proposing, step by step
    start = {slot: 0 for slot in range(1, 5)}
    seen = set()
    for slots in schedule:
        rows = [ProposeRow(s, 1, start[s], tokens[s - 1][start[s]:] or tokens[s - 1][-1:], 3, sampling[s - 1])
                for s in slots]
        got, threads = propose(ruled, rows)
        want, plain_threads = propose(plain, rows)
        assert threads == (1 if len(rows) <= 2 else 2) and plain_threads == 2
        seen.add(threads)
        assert got.draft_token_ids == want.draft_token_ids
        assert (got.draft_probs is None) == (want.draft_probs is None)
        if got.draft_probs is not None:
            assert torch.equal(got.draft_probs, want.draft_probs)  # bit for bit
        for s in slots:  # the next proposal starts where this one's catch-up ended
            start[s] = len(tokens[s - 1])
    assert seen == {1, 2}


def test_greedy_output_does_not_depend_on_the_thread_count(shipped_target, shipped_draft):
    outputs = []
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            engine = build_local_engine(EngineConfig(model=str(shipped_target), draft=str(shipped_draft),
                                                     adaptive_speculation=False, capacity=16, max_context=256))
            ids = [engine.add_request(p, SamplingParams(max_tokens=48, ignore_eos=True)) for p in PROMPTS * 3]
            tokens = {i: [] for i in ids}
            while engine.has_unfinished():
                for out in engine.step():
                    tokens[out.req_id] += out.new_token_ids
        finally:
            torch.set_num_threads(before)
        outputs.append([tokens[i] for i in ids])
    assert all(len(t) == 48 for t in outputs[0])
    assert outputs[0] == outputs[1]
