"""Sliding-window ring attention: Triton (interpreted on CPU) vs the reference.

The reference is itself checked against a per-query loop written straight
from the rule in `ops.window_attention`, so the kernel is compared with an
independent statement of the semantics, not only with a vectorised twin.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dspark_kernels import ops, reference
from dspark_kernels.testing import AttentionCase, make_attention_case

from kernel_fixtures import (_under_interpreter, attention_tolerance, rerun_file_if_needed,  # noqa: F401
                             triton_only_fixture)

test_file_under_interpreter = rerun_file_if_needed(__file__)
triton_only = triton_only_fixture("window_attention")

# Kept before `triton_only` replaces the module attribute the dispatcher uses.
REFERENCE = reference.window_attention


def naive_window_attention(case: AttentionCase) -> torch.Tensor:
    """One query at a time, straight from the rule; float64."""
    B, T, H, D = case.q.shape
    ring, kv_heads = case.k_cache.shape[1], case.k_cache.shape[2]
    group = H // kv_heads
    out = torch.zeros((B, T, H, D), dtype=torch.float64)
    for b, t in itertools.product(range(B), range(T)):
        p = int(case.positions[b, t])
        slot = int(case.slots[b])
        length = int(case.cache_lengths[slot])
        keys = [kp for kp in range(max(0, p - case.window + 1), p + 1) if kp < length]
        if p < 0 or not keys:
            continue
        index = torch.tensor(keys) % ring
        for h in range(H):
            k = case.k_cache[slot, index, h // group].double()  # [n, D]
            v = case.v_cache[slot, index, h // group].double()  # [n, D]
            weights = torch.softmax(k @ case.q[b, t, h].double() * case.scale, dim=0)
            out[b, t, h] = weights @ v
    return out


GRID = [
    # batch, steps, num_heads, kv_heads, head_dim, window, max_spec
    (1, 1, 2, 2, 16, 4, 4),
    (2, 1, 4, 1, 16, 8, 2),
    (3, 3, 4, 2, 16, 5, 4),
    (4, 5, 8, 2, 8, 8, 4),
    (3, 2, 3, 1, 24, 16, 1),
    (2, 4, 2, 1, 16, 3, 3),
]


@pytest.mark.parametrize("batch,steps,num_heads,kv_heads,head_dim,window,max_spec", GRID)
def test_reference_matches_naive_rule(batch, steps, num_heads, kv_heads, head_dim, window, max_spec):
    case = make_attention_case(batch, steps, num_heads, kv_heads, head_dim, window, max_spec, seed=1)
    out = reference.window_attention(*case.args())
    torch.testing.assert_close(out.double(), naive_window_attention(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,steps,num_heads,kv_heads,head_dim,window,max_spec", GRID)
def test_triton_matches_reference(
    triton_only, batch, steps, num_heads, kv_heads, head_dim, window, max_spec, dtype
):
    case = make_attention_case(
        batch, steps, num_heads, kv_heads, head_dim, window, max_spec, dtype=dtype, seed=2
    )
    want = REFERENCE(*case.args())
    got = ops.window_attention(*case.args())
    assert got.dtype == dtype and got.shape == case.q.shape
    assert not got.isnan().any(), "read a stale (NaN-poisoned) ring entry"
    torch.testing.assert_close(got, want, **attention_tolerance(dtype))
    torch.testing.assert_close(got.double(), naive_window_attention(case), **attention_tolerance(dtype))


def test_triton_matches_reference_with_small_key_blocks():
    """Several key blocks per program: exercises the online-softmax rescaling."""
    from dspark_kernels import window_attention as kernel

    case = make_attention_case(3, 3, 4, 2, 16, window=40, max_spec=4, seed=3)
    got = kernel.window_attention(*case.args(), block_n=16)
    torch.testing.assert_close(got, reference.window_attention(*case.args()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_padding_rows_read_nothing_and_write_nothing(backend):
    """Padding queries return zeros even when their slot is live and poisoned."""
    case = make_attention_case(3, 2, 4, 2, 16, window=6, seed=4)
    poisoned_slot = int(case.slots[1])
    case.k_cache[poisoned_slot] = float("nan")  # every entry, live or not
    case.v_cache[poisoned_slot] = float("nan")
    case.positions[1] = -1  # row 1 is padding now, on a live slot
    k_before, v_before = case.k_cache.clone(), case.v_cache.clone()
    with ops.use_backend(backend):
        out = ops.window_attention(*case.args())
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # the slot-0 padding row
    assert not out.isnan().any()
    assert torch.equal(k_before.nan_to_num(), case.k_cache.nan_to_num())
    assert torch.equal(v_before.nan_to_num(), case.v_cache.nan_to_num())


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_new_epoch_reads_only_its_own_positions(backend):
    """A reused slot at length 2 sees positions 0 and 1 only, never the old ring."""
    case = make_attention_case(2, 2, 2, 1, 16, window=6, seed=5, padding_rows=0)
    slot = int(case.slots[1])
    case.k_cache[slot, 2:] = float("nan")
    case.v_cache[slot, 2:] = float("nan")
    case.cache_lengths[slot] = 2
    case.positions[1] = torch.tensor([0, 1])
    with ops.use_backend(backend):
        out = ops.window_attention(*case.args())
    torch.testing.assert_close(out.double(), naive_window_attention(case), atol=1e-5, rtol=1e-5)
    # Position 0 sees only itself: its output is its own value vector.
    torch.testing.assert_close(out[1, 0, 0], case.v_cache[slot, 0, 0])


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_query_with_no_visible_key_returns_zeros(backend):
    """Length 0 (a slot whose new epoch wrote nothing yet) gives zeros, not NaN."""
    case = make_attention_case(2, 1, 2, 1, 16, window=4, seed=6, padding_rows=0)
    case.cache_lengths[case.slots[0]] = 0
    with ops.use_backend(backend):
        out = ops.window_attention(*case.args())
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert out[1].abs().sum() > 0


def test_wrong_inputs_are_rejected_before_launch():
    case = make_attention_case(2, 1, 4, 2, 16, window=4, seed=7)
    args = list(case.args())
    with pytest.raises(ops.KernelInputError, match="positions: expected dtype"):
        ops.window_attention(*args[:4], case.positions.int(), *args[5:])
    with pytest.raises(ops.KernelInputError, match="q: must be contiguous"):
        ops.window_attention(case.q.transpose(2, 3).contiguous().transpose(2, 3), *args[1:])
    with pytest.raises(ops.KernelInputError, match="window"):
        ops.window_attention(*args[:6], case.k_cache.shape[1] + 1, case.scale)
    with pytest.raises(ops.KernelInputError, match="multiple of kv_heads"):
        ops.window_attention(case.q[:, :, :3].contiguous(), *args[1:])
