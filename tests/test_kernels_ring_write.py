"""Ring-buffer write: Triton (interpreted on CPU) vs the reference, bit for bit."""

from __future__ import annotations

import pytest
import torch

from dspark_kernels import ops, reference
from dspark_kernels.testing import make_ring_write_case

from kernel_fixtures import _under_interpreter, rerun_file_if_needed, triton_only_fixture  # noqa: F401

test_file_under_interpreter = rerun_file_if_needed(__file__)
triton_only = triton_only_fixture("ring_write")

# Kept before `triton_only` replaces the module attribute the dispatcher uses.
REFERENCE = reference.ring_write


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "batch,steps,kv_heads,head_dim,ring",
    [(1, 1, 1, 8, 4), (3, 1, 2, 16, 6), (4, 3, 2, 8, 5), (2, 5, 4, 16, 9), (5, 2, 1, 64, 3)],
)
def test_triton_matches_reference(triton_only, batch, steps, kv_heads, head_dim, ring, dtype):
    case = make_ring_write_case(batch, steps, kv_heads, head_dim, ring, dtype=dtype, seed=1)
    want = case.clone_caches()
    REFERENCE(*want.args())
    ops.ring_write(*case.args())
    assert torch.equal(case.k_cache, want.k_cache)
    assert torch.equal(case.v_cache, want.v_cache)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_writes_land_at_position_mod_ring(backend):
    ring = 5
    case = make_ring_write_case(2, 3, 1, 4, ring, padding_rows=0, seed=2)
    case.positions.copy_(torch.tensor([[3, 4, 5], [12, 13, -1]]))
    before = case.clone_caches()
    with ops.use_backend(backend):
        ops.ring_write(*case.args())
    s0, s1 = (int(s) for s in case.slots)
    for b, slot, t, index in [(0, s0, 0, 3), (0, s0, 1, 4), (0, s0, 2, 0), (1, s1, 0, 2), (1, s1, 1, 3)]:
        assert torch.equal(case.k_cache[slot, index], case.k[b, t])
        assert torch.equal(case.v_cache[slot, index], case.v[b, t])
    assert torch.equal(case.k_cache[s0, 1:3], before.k_cache[s0, 1:3])
    untouched = [0, 1, 4]  # row 1's padding entry (position -1) wrote nothing
    assert torch.equal(case.k_cache[s1, untouched], before.k_cache[s1, untouched])


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_padding_entries_touch_nothing(backend):
    """Position -1 writes nowhere, whatever slot the row points at."""
    case = make_ring_write_case(3, 2, 2, 8, 4, seed=3)
    case.positions.fill_(-1)
    before = case.clone_caches()
    with ops.use_backend(backend):
        ops.ring_write(*case.args())
    assert torch.equal(case.k_cache, before.k_cache)
    assert torch.equal(case.v_cache, before.v_cache)


def test_wrong_inputs_are_rejected_before_launch():
    case = make_ring_write_case(2, 2, 2, 8, 4, seed=4)
    with pytest.raises(ops.KernelInputError, match="slots: expected dtype"):
        ops.ring_write(case.k_cache, case.v_cache, case.slots.int(), case.positions, case.k, case.v)
    with pytest.raises(ops.KernelInputError, match="k: expected shape"):
        ops.ring_write(case.k_cache, case.v_cache, case.slots, case.positions, case.k[:, :1], case.v)
    with pytest.raises(ops.KernelInputError, match="v_cache: expected dtype"):
        ops.ring_write(case.k_cache, case.v_cache.half(), case.slots, case.positions, case.k, case.v)
    with pytest.raises(ops.KernelInputError, match="k_cache: must be contiguous"):
        k_cache = case.k_cache.transpose(2, 3).contiguous().transpose(2, 3)
        ops.ring_write(k_cache, case.v_cache, case.slots, case.positions, case.k, case.v)
