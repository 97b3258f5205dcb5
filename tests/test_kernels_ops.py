"""Dispatch layer, the shared sampling distribution, and the random draws."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_kernels import ops, reference
from dspark_kernels.testing import make_ring_write_case

# ---------------------------------------------------------------------------
# Backend switch
# ---------------------------------------------------------------------------


def test_use_backend_scopes_and_restores():
    assert ops.get_backend() == "auto"
    with ops.use_backend("reference"):
        assert ops.get_backend() == "reference"
        with ops.use_backend("triton"):
            assert ops.get_backend() == "triton"
        assert ops.get_backend() == "reference"
    assert ops.get_backend() == "auto"


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'"):
        ops.set_backend("cuda")
    assert ops.get_backend() == "auto"


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_cpu_tensors_take_the_reference(monkeypatch, backend):
    calls = []
    monkeypatch.setattr(reference, "ring_write", lambda *args: calls.append(args))
    case = make_ring_write_case(2, 1, 1, 4, 4)
    with ops.use_backend(backend):
        ops.ring_write(*case.args())
    assert len(calls) == 1


def test_forced_triton_without_interpreter_says_how_to_fix(monkeypatch):
    from dspark_kernels import ring_write

    monkeypatch.setattr(ring_write, "runs_in_interpreter", lambda: False)
    case = make_ring_write_case(2, 1, 1, 4, 4)
    with ops.use_backend("triton"), pytest.raises(ops.KernelBackendError, match="TRITON_INTERPRET"):
        ops.ring_write(*case.args())


# ---------------------------------------------------------------------------
# logits_to_probs
# ---------------------------------------------------------------------------

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def probs_of(temperature=1.0, top_k=0, top_p=1.0, logits=None) -> torch.Tensor:
    logits = PROBS.log()[None] if logits is None else logits
    return ops.logits_to_probs(
        logits, torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p])
    )[0]


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        (dict(), [0.5, 0.3, 0.15, 0.05]),
        (dict(top_k=2), [0.625, 0.375, 0.0, 0.0]),
        (dict(top_k=4), [0.5, 0.3, 0.15, 0.05]),
        (dict(top_k=-1), [0.5, 0.3, 0.15, 0.05]),
        (dict(top_p=0.7), [0.625, 0.375, 0.0, 0.0]),
        (dict(top_p=0.5), [1.0, 0.0, 0.0, 0.0]),
        (dict(top_p=0.81), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (dict(top_k=3, top_p=0.8), [0.625, 0.375, 0.0, 0.0]),
    ],
)
def test_top_k_top_p_tables(kwargs, expected):
    torch.testing.assert_close(probs_of(**kwargs), torch.tensor(expected))


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5]])
    torch.testing.assert_close(probs_of(0.5, logits=logits), torch.softmax(logits[0] / 0.5, dim=0))


def test_rows_use_their_own_parameters():
    logits = PROBS.log().expand(3, 4)
    probs = ops.logits_to_probs(
        logits, torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 2, 0]), torch.tensor([1.0, 1.0, 0.5])
    )
    torch.testing.assert_close(probs[0], PROBS)
    torch.testing.assert_close(probs[1], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(probs[2], torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_rows_that_do_not_truncate_are_the_softmax_of_every_logit():
    """top_k disabled (0, -1 or V) and top_p 1: exactly the tempered softmax, the tail included (the
    unsorted fast path), whether the batch's other rows truncate or not; masked ids stay at zero."""
    logits = torch.randn((6, 50), generator=torch.Generator().manual_seed(5)) * 4
    logits[:, 45:] = float("-inf")  # ids past the tokenizer (mask_vocab)
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 2.0, 0.5])
    top_k = torch.tensor([0, -1, 50, 0, 5, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.3])
    want = torch.softmax(logits / temperature[:, None], dim=-1)
    mixed = ops.logits_to_probs(logits, temperature, top_k, top_p)
    alone = ops.logits_to_probs(logits[:4], temperature[:4], top_k[:4], top_p[:4])
    assert torch.equal(mixed[:4], want[:4]) and torch.equal(alone, want[:4])
    assert bool((mixed[:, 45:] == 0).all())
    # The truncating rows are what they are alone.
    for b in (4, 5):
        one = ops.logits_to_probs(logits[b:b + 1], temperature[b:b + 1], top_k[b:b + 1], top_p[b:b + 1])
        assert torch.equal(mixed[b:b + 1], one)
    assert int((mixed[4] > 0).sum()) == 5 and int((mixed[5] > 0).sum()) < 45


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(1, 40),
    temperature=st.floats(0.05, 5.0),
    top_k=st.integers(-1, 45),
    top_p=st.floats(0.01, 1.0),
)
def test_distribution_properties(seed, vocab, temperature, top_k, top_p):
    """Sums to 1, keeps the top token, at most k tokens, and the smallest nucleus."""
    logits = torch.randn((1, vocab), generator=torch.Generator().manual_seed(seed)) * 3
    probs = probs_of(temperature, top_k, top_p, logits)
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-5)
    assert probs[logits[0].argmax()] > 0
    kept = probs > 0
    if 0 < top_k < vocab:
        assert int(kept.sum()) <= top_k
    # Every kept token is at least as likely as every dropped one.
    if (~kept).any():
        assert logits[0][kept].min() >= logits[0][~kept].max()
    # Dropping the least likely kept token would leave less than top_p of the
    # top-k mass (nucleus is minimal); only checked without ties.
    if len(set(logits[0].tolist())) == vocab:
        base = probs_of(temperature, top_k, 1.0, logits)
        kept_mass = float(base[kept].sum())
        smallest = float(base[kept].min())
        assert kept_mass - smallest < top_p + 1e-5 or int(kept.sum()) == 1


# ---------------------------------------------------------------------------
# draw_random
# ---------------------------------------------------------------------------


def test_seeded_draws_repeat_per_row():
    u1, n1 = ops.draw_random([7, 8], 2, 3, 16, "cpu")
    u2, n2 = ops.draw_random([8, 7, None], 3, 3, 16, "cpu")
    assert torch.equal(u1[0], u2[1]) and torch.equal(n1[0], n2[1])
    assert torch.equal(u1[1], u2[0]) and torch.equal(n1[1], n2[0])


def test_generators_are_consumed_in_order():
    gen_a = torch.Generator().manual_seed(3)
    gen_b = torch.Generator().manual_seed(3)
    first = ops.draw_random([gen_a], 1, 2, 8, "cpu")
    second = ops.draw_random([gen_a], 1, 2, 8, "cpu")
    assert not torch.equal(first[0], second[0])
    assert torch.equal(first[0], ops.draw_random([gen_b], 1, 2, 8, "cpu")[0])


def test_draw_random_checks_one_generator_per_row():
    with pytest.raises(ops.KernelInputError, match="expected 3 entries"):
        ops.draw_random([1, 2], 3, 2, 8, "cpu")
