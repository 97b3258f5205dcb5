"""The target's paged attention: Triton (interpreted on CPU) vs the reference vs PackedAttention.

Three links, so the kernel is held to the engine's own semantics:

- the reference against a per-query loop written straight from the rule in
  `ops.paged_attention` (float64);
- the Triton kernel against the reference over a grid of shapes (T 1..5,
  GQA ratios, head dims 16/64/128, contexts crossing key blocks and splits,
  split-K on and off, sliding window on and off, rows of different lengths,
  padding entries);
- the reference against what PackedAttention computes today (gather + SDPA)
  on the shipped target's real KV pools and request-to-token table, and
  PackedAttention with the kernel switched on against the same.

Pool tokens no live row owns are NaN: a finite result shows the kernel read
only the keys its queries may see.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dspark_kernels import ops, reference
from dspark_kernels.testing import PagedAttentionCase, make_paged_attention_case

from conftest import SHIPPED_TARGET, shipped
from kernel_fixtures import (_under_interpreter, attention_tolerance, rerun_file_if_needed,  # noqa: F401
                             triton_only_fixture)

test_file_under_interpreter = rerun_file_if_needed(__file__)
triton_only = triton_only_fixture("paged_attention")

# Kept before `triton_only` replaces the module attribute the dispatcher uses.
REFERENCE = reference.paged_attention


def naive_paged_attention(case: PagedAttentionCase) -> torch.Tensor:
    """One query at a time, straight from the rule; float64."""
    B, T, H, D = case.q.shape
    group = H // case.k_pool.shape[1]
    window = case.window if case.window is not None else 1 << 40
    out = torch.zeros((B, T, H, D), dtype=torch.float64)
    for b, t in itertools.product(range(B), range(T)):
        p = int(case.positions[b, t])
        if p < 0:
            continue
        keys = range(max(0, p - window + 1), p + 1)
        tokens = case.req_to_token[int(case.rows[b]), list(keys)].long()
        for h in range(H):
            k = case.k_pool[tokens, h // group].double()  # [n, D]
            v = case.v_pool[tokens, h // group].double()  # [n, D]
            weights = torch.softmax(k @ case.q[b, t, h].double() * case.scale, dim=0)
            out[b, t, h] = weights @ v
    return out


# batch, steps, num_heads, kv_heads, head_dim, contexts (live rows), window, num_splits
GRID = [
    (1, 1, 2, 2, 16, [1], None, 1),  # one key
    (3, 1, 4, 1, 16, [17, 64], None, 1),  # GQA 4, a context of exactly one key block
    (3, 3, 4, 2, 16, [3, 65], None, 3),  # split-K: 64 + 1 keys and an empty third split
    (4, 5, 8, 2, 64, [130, 5, 70], None, 2),  # k + 1 = 5 queries, GQA 4, head_dim 64
    (2, 2, 6, 3, 16, [150], 20, 1),  # sliding window
    (3, 5, 4, 2, 16, [140, 40], 100, 3),  # sliding window with split-K
    (2, 4, 2, 1, 128, [66], None, 2),  # head_dim 128
    (3, 2, 3, 3, 24, [9, 33], 4, 1),  # head_dim not a power of two, a window shorter than T's span
]


@pytest.mark.parametrize("batch,steps,num_heads,kv_heads,head_dim,contexts,window,splits", GRID[:5])
def test_reference_matches_naive_rule(batch, steps, num_heads, kv_heads, head_dim, contexts, window, splits):
    case = make_paged_attention_case(batch, steps, num_heads, kv_heads, head_dim, contexts, max_context=160,
                                     window=window, seed=1)
    out = reference.paged_attention(*case.args())
    torch.testing.assert_close(out.double(), naive_paged_attention(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch,steps,num_heads,kv_heads,head_dim,contexts,window,splits", GRID)
def test_triton_matches_reference(triton_only, batch, steps, num_heads, kv_heads, head_dim, contexts, window,
                                  splits):
    case = make_paged_attention_case(batch, steps, num_heads, kv_heads, head_dim, contexts, max_context=160,
                                     window=window, seed=2)
    # max_keys: the longest context, so the splits cut it (the table's width would leave it whole).
    got = ops.paged_attention(*case.args(), num_splits=splits, max_keys=max(contexts))
    assert got.dtype == case.q.dtype and got.shape == case.q.shape
    assert not got.isnan().any(), "read a pool token no visible key maps to (NaN-poisoned)"
    torch.testing.assert_close(got, REFERENCE(*case.args()), **attention_tolerance(torch.float32))
    torch.testing.assert_close(got.double(), naive_paged_attention(case), **attention_tolerance(torch.float32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_matches_reference_in_half_precision_pools(triton_only, dtype):
    case = make_paged_attention_case(3, 5, 4, 2, 64, [90, 7], max_context=96, dtype=dtype, seed=3)
    got = ops.paged_attention(*case.args(), num_splits=2, max_keys=90)
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got, REFERENCE(*case.args()), **attention_tolerance(dtype))


def test_more_splits_than_key_blocks():
    """Splits that see no key (lse = -inf) weigh nothing in the merge."""
    from dspark_kernels import paged_attention as kernel

    case = make_paged_attention_case(2, 2, 4, 2, 16, [20], max_context=32, seed=4)
    got = kernel.paged_attention(*case.args(), num_splits=5, block_n=16)
    torch.testing.assert_close(got, REFERENCE(*case.args()), atol=1e-5, rtol=1e-5)


def test_split_heuristic():
    from dspark_kernels.paged_attention import MAX_SPLITS, MIN_SPLIT_KEYS, choose_splits

    sms = 132
    assert choose_splits(1, 8, 2048, sms) == 2048 // MIN_SPLIT_KEYS  # small batch, long context: split
    assert choose_splits(1, 8, 32768, sms) == MAX_SPLITS
    assert choose_splits(1, 8, 300, sms) == 1  # short context: one split
    assert choose_splits(64, 8, 2048, sms) == 1  # 512 programs fill the GPU already
    for batch, keys in itertools.product((1, 2, 8, 32, 64), (1, 255, 512, 2048, 8192)):
        splits = choose_splits(batch, 8, keys, sms)
        assert 1 <= splits <= MAX_SPLITS and (splits == 1 or keys // splits >= MIN_SPLIT_KEYS)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_padding_entries_read_nothing_and_leave_live_rows_alone(backend):
    """A padding row on a live, poisoned slot returns zeros; padding rows that do read (slot 0,
    positions from 0, as a CUDA-graph batch pads) leave the live rows' outputs unchanged."""
    case = make_paged_attention_case(4, 2, 4, 2, 16, [40, 25], max_context=48, padding_rows=2, seed=5)
    with ops.use_backend(backend):
        alone = ops.paged_attention(*case.args())
        positions = case.positions.clone()
        rows = case.rows.clone()
        positions[2] = -1
        rows[2] = case.rows[1]  # row 2 is padding on row 1's live slot
        if backend == "triton":  # the kernel never loads a key past a query; the reference's gather
            case.k_pool[0] = float("nan")  # does, as PackedAttention's does (padding writes keep it finite)
        padded = ops.paged_attention(case.q, case.k_pool, case.v_pool, case.req_to_token, rows, positions,
                                     case.scale)
    assert torch.equal(padded[2], torch.zeros_like(padded[2]))
    assert torch.equal(padded[3], torch.zeros_like(padded[3]))
    assert torch.equal(padded[:2], alone[:2])
    assert not padded.isnan().any()

    case.k_pool[0] = 1.0
    positions[3] = torch.arange(2)  # the slot-0 padding row reads the padding token
    with ops.use_backend(backend):
        reading = ops.paged_attention(case.q, case.k_pool, case.v_pool, case.req_to_token, rows, positions,
                                      case.scale)
    assert torch.equal(reading[:2], alone[:2])
    assert reading[3].abs().sum() > 0


def test_wrong_inputs_are_rejected_before_launch():
    case = make_paged_attention_case(2, 1, 4, 2, 16, [8], max_context=16, seed=6)
    args = list(case.args())
    with pytest.raises(ops.KernelInputError, match="positions: expected dtype"):
        ops.paged_attention(*args[:5], case.positions.int(), *args[6:])
    with pytest.raises(ops.KernelInputError, match="q: must be contiguous"):
        ops.paged_attention(case.q.transpose(2, 3).contiguous().transpose(2, 3), *args[1:])
    with pytest.raises(ops.KernelInputError, match="req_to_token: expected dtype"):
        ops.paged_attention(*args[:3], case.req_to_token.float(), *args[4:])
    with pytest.raises(ops.KernelInputError, match="multiple of kv_heads"):
        ops.paged_attention(case.q[:, :, :3].contiguous(), *args[1:])
    with pytest.raises(ops.KernelInputError, match="window"):
        ops.paged_attention(*args[:7], 0)


# -- PackedAttention on the shipped target's pools -----------------------------------------


class CheckedAttention:
    """PackedAttention's gather + SDPA for every layer, checked against the reference and, on the
    ``kernel_layers``, against PackedAttention with the paged kernel, on the same pools."""

    def __init__(self, gathered, paged, table, slots, positions, offsets, kernel_layers):
        self.gathered, self.paged = gathered, paged
        self.table, self.slots, self.positions = table, slots, positions  # [R, C], [B], [B, T]
        self.kernel_layers = kernel_layers
        T = positions.shape[1]
        # Where each (row, step) query sits in the packed step; padding steps point at 0 and are dropped.
        self.place = torch.where(positions >= 0, torch.tensor(offsets[:-1])[:, None] + torch.arange(T), 0)
        self.checked = 0

    def __call__(self, layer, q, k, v):
        out = self.gathered(layer, q, k, v)  # [1, N, Hq, D]; writes the step's K/V into the pools
        live = self.positions >= 0
        want = reference.paged_attention(q[0][self.place], self.gathered.k_pools[layer],
                                         self.gathered.v_pools[layer], self.table, self.slots, self.positions,
                                         q.shape[-1] ** -0.5, self.gathered.sliding_window)  # [B, T, Hq, D]
        torch.testing.assert_close(want[live], out[0][self.place[live]], atol=1e-6, rtol=1e-6)
        if layer in self.kernel_layers:
            with ops.use_backend("triton"):
                got = self.paged(layer, q, k, v)
            torch.testing.assert_close(got, out, atol=1e-5, rtol=1e-5)
        self.checked += 1
        return out


@pytest.mark.parametrize("drafts,window", [((0, 0, 0), None), ((4, 2, 4), 24)])
def test_reference_and_kernel_match_packed_attention_on_real_pools(drafts, window):
    """A decode step (one query per row: PackedAttention's whole-batch path) and a verify step
    (5, 3 and 5 queries: padded queries in one group), on KV the shipped target wrote itself."""
    from dspark_ray.engine.interfaces import SamplingRow, TargetStep, VerifyRow
    from dspark_ray.engine.target_runner import PackedAttention, TargetRunner, group_rows
    from dspark_ray.model.loader import load

    model = load(shipped(SHIPPED_TARGET, "config.json"), dtype="float32")
    runner = TargetRunner(model, capacity=4, max_context=192, kv_pool_size=600, max_spec_tokens=4,
                          prefix_block=None)
    runner.sliding_window = window
    greedy = SamplingRow(0.0, 1.0, 0, 0)
    gen = torch.Generator().manual_seed(7)
    prompts = {3: 70, 1: 5, 4: 130}  # slot: prompt length; slots out of order, rows of unequal length
    runner.step(TargetStep([VerifyRow(s, 1, 0, tuple(torch.randint(1, 4000, (n,), generator=gen).tolist()), (),
                                      greedy) for s, n in prompts.items()]))

    rows = [VerifyRow(s, 1, n, (11,), tuple(range(20, 20 + d)), greedy) for (s, n), d in zip(prompts.items(), drafts)]
    counts = [1 + d for d in drafts]
    offsets = [0, *itertools.accumulate(counts)]
    indices = runner.kv.append([r.slot for r in rows], counts)
    groups = [runner._group(rows, counts, offsets, members) for members in group_rows(counts)]
    assert len(groups) == 1 and groups[0].whole == (drafts == (0, 0, 0))
    T = max(counts)
    positions = torch.full((len(rows), T), -1, dtype=torch.int64)
    for b, (r, n) in enumerate(zip(rows, counts)):
        positions[b, :n] = torch.arange(r.start, r.start + n)
    gathered = PackedAttention(runner.k_pools, runner.v_pools, indices, groups, window, paged=False)
    paged = PackedAttention(runner.k_pools, runner.v_pools, indices, groups, window, paged=True)
    assert not PackedAttention(runner.k_pools, runner.v_pools, indices, groups).paged, "the kernel is CUDA-only"
    last_layer = model.config.num_layers - 1
    checked = CheckedAttention(gathered, paged, runner.table.table, torch.tensor([r.slot for r in rows]),
                               positions, offsets, kernel_layers={0, last_layer})
    tokens = torch.tensor([t for r in rows for t in r.token_ids + r.draft_token_ids])
    with torch.inference_mode():
        model.hidden_states(tokens[None], positions[positions >= 0][None], checked)
    assert checked.checked == model.config.num_layers
