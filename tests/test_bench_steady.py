"""bench/steady.py's load: ``batch`` requests always in flight, counted between completions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import SHIPPED_DRAFT, SHIPPED_TARGET, shipped
from dspark_ray import LLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from steady import output_lengths, steady_tokens_per_s  # noqa: E402


def test_the_load_stays_at_the_batch_and_ends_clean():
    target, draft = shipped(SHIPPED_TARGET, "model.safetensors"), shipped(SHIPPED_DRAFT, "model.safetensors")
    llm = LLM(str(target), str(draft), num_speculative_tokens=2, max_context=256, capacity=4, max_num_seqs=3)
    engine = llm.engine
    in_flight, added = [], engine.add_request

    def counted(*args, **kwargs):
        in_flight.append(sum(1 for r in engine.requests.values() if not r.finished))
        return added(*args, **kwargs)

    engine.add_request = counted
    rate = steady_tokens_per_s(llm, batch=3, cycles=2, max_tokens=6)
    assert rate > 0
    # 3 at the start, then one each time one ended: never more than 3 in flight, and 3 + 3 * 3 added
    # (the last completions counted are those of the third batch).
    assert len(in_flight) == 3 + 3 * 3 and max(in_flight) <= 3 - 1
    assert not engine.has_unfinished() and not engine.requests  # the rest were ended, slots freed


def test_varied_lengths_are_the_same_for_every_system_and_within_the_range():
    assert output_lengths(64, 0.0, 5) == [64] * 5
    varied = output_lengths(64, 0.5, 400)
    assert varied == output_lengths(64, 0.5, 400)  # every system gets the same lengths in the same order
    assert min(varied) >= 32 and max(varied) <= 96 and len(set(varied)) > 30
    with pytest.raises(ValueError):
        output_lengths(64, 1.0, 3)


def test_requests_ask_for_their_drawn_lengths():
    target, draft = shipped(SHIPPED_TARGET, "model.safetensors"), shipped(SHIPPED_DRAFT, "model.safetensors")
    llm = LLM(str(target), str(draft), num_speculative_tokens=2, max_context=256, capacity=4, max_num_seqs=3)
    engine, added, asked = llm.engine, llm.engine.add_request, []

    def counted(prompt, params, *args, **kwargs):
        asked.append(params.max_tokens)
        return added(prompt, params, *args, **kwargs)

    engine.add_request = counted
    assert steady_tokens_per_s(llm, batch=3, cycles=2, max_tokens=8, range_ratio=0.5) > 0
    # The lengths repeat after batch * (cycles + 2) requests: the last step may end several requests at
    # once (unseeded sampled ones, so it varies from run to run), and each adds the next.
    drawn = output_lengths(8, 0.5, 3 * 4)
    assert len(asked) >= 3 * 3 and asked == [drawn[i % len(drawn)] for i in range(len(asked))]
    assert len(set(asked)) > 1
