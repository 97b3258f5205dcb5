"""Speculative acceptance: greedy tables, Triton vs reference, determinism, distribution.

Modelled on vLLM v1's tests/v1/sample/test_rejection_sampler.py: hand-written
greedy tables, seeded determinism, a statistical test that sampled output
follows the target distribution, and the kernel compared with the reference
over a grid of shapes.
"""

from __future__ import annotations

import pytest
import torch

from dspark_kernels import ops, reference
from dspark_kernels.testing import make_rejection_case

from kernel_fixtures import _under_interpreter, rerun_file_if_needed, triton_only_fixture  # noqa: F401

test_file_under_interpreter = rerun_file_if_needed(__file__)
triton_only = triton_only_fixture("rejection_sample")

# Kept before `triton_only` replaces the module attribute the dispatcher uses.
REFERENCE = reference.rejection_sample
BACKENDS = ["triton", "reference"]


# ---------------------------------------------------------------------------
# Greedy tables
# ---------------------------------------------------------------------------

V = 8


def greedy_logits(argmax_rows: list[list[int]]) -> torch.Tensor:  # [B, K + 1, V]
    """Target logits whose argmax at each position is the given token."""
    logits = torch.zeros((len(argmax_rows), len(argmax_rows[0]), V))
    for b, row in enumerate(argmax_rows):
        for i, token in enumerate(row):
            logits[b, i, token] = 5.0
    return logits


def run_greedy(drafts, num_draft, argmax_rows, backend):
    B, K = len(drafts), len(drafts[0])
    with ops.use_backend(backend):
        return ops.rejection_sample(
            torch.tensor(drafts, dtype=torch.int64).reshape(B, K),
            torch.tensor(num_draft, dtype=torch.int64),
            None,
            greedy_logits(argmax_rows),
            None,
            torch.ones(B, dtype=torch.bool),
            torch.rand((B, K)),
            torch.ones((B, K + 1, V)),
        )


GREEDY_TABLES = {
    # name: (drafts, num_draft, target argmax per position, expected output, accepted)
    "all_accepted": ([[1, 2, 3]], [3], [[1, 2, 3, 4]], [[1, 2, 3, 4]], [3]),
    "early_mismatch": ([[1, 5, 3]], [3], [[1, 2, 3, 4]], [[1, 2, -1, -1]], [1]),
    "first_token_mismatch": ([[6, 2, 3]], [3], [[1, 2, 3, 4]], [[1, -1, -1, -1]], [0]),
    "last_token_mismatch": ([[1, 2, 7]], [3], [[1, 2, 3, 4]], [[1, 2, 3, -1]], [2]),
    "k_zero": ([[1, 2, 3]], [0], [[5, 2, 3, 4]], [[5, -1, -1, -1]], [0]),
    "per_request_k": (
        [[1, 2, 3], [1, 2, 3], [7, 7, 7]],
        [2, 1, 0],
        [[1, 2, 6, 4], [1, 0, 3, 4], [3, 1, 1, 1]],
        [[1, 2, 6, -1], [1, 0, -1, -1], [3, -1, -1, -1]],
        [2, 1, 0],
    ),
    "drafts_past_k_are_ignored": ([[1, 2, 3]], [1], [[1, 2, 3, 4]], [[1, 2, -1, -1]], [1]),
    "out_of_range_draft_rejected": ([[1, -1, 3]], [3], [[1, 2, 3, 4]], [[1, 2, -1, -1]], [1]),
    "no_drafts_at_all": ([[]], [0], [[3]], [[3]], [0]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(GREEDY_TABLES))
def test_greedy_table(name, backend):
    drafts, num_draft, argmax_rows, expected, accepted = GREEDY_TABLES[name]
    out, num_accepted = run_greedy(drafts, num_draft, argmax_rows, backend)
    assert out.tolist() == expected
    assert num_accepted.tolist() == accepted


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_rows_ignore_probabilities_in_a_mixed_batch(backend):
    """A greedy row next to random rows follows argmax, whatever p, q and u say."""
    case = make_rejection_case(4, 3, V, greedy_rows=1, seed=11)
    logits = greedy_logits([[1, 2, 3, 4]] + [[0, 0, 0, 0]] * 3)
    drafts = case.draft_token_ids.clone()
    drafts[0] = torch.tensor([1, 2, 5])
    with ops.use_backend(backend):
        out, num_accepted = ops.rejection_sample(
            drafts, case.num_draft_tokens, case.draft_probs, logits, case.target_probs,
            case.is_greedy, case.uniforms, case.recovery_noise,
        )
    assert out[0].tolist() == [1, 2, 3, -1] and num_accepted[0] == 2


# ---------------------------------------------------------------------------
# Triton vs reference
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch,k,vocab,greedy_rows",
    [(1, 1, 16, 0), (4, 3, 40, 1), (6, 4, 100, 2), (3, 0, 24, 1), (5, 2, 33, 5), (8, 4, 64, 0)],
)
def test_triton_matches_reference(triton_only, batch, k, vocab, greedy_rows):
    for seed in range(3):
        case = make_rejection_case(batch, k, vocab, greedy_rows, seed=seed)
        want = REFERENCE(*case.args())
        got = ops.rejection_sample(*case.args())
        assert torch.equal(got[0], want[0]), (seed, got[0], want[0])
        assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("num_splits,block_v", [(1, 16), (2, 16), (3, 8), (8, 8)])
def test_vocab_splits_and_blocks_agree(num_splits, block_v):
    """The split emit step and its combine give the reference's token."""
    case = make_rejection_case(5, 3, 50, greedy_rows=1, seed=12)
    want = REFERENCE(*case.args())
    from dspark_kernels import rejection

    got = rejection.rejection_sample(*case.args(), num_splits=num_splits, block_v=block_v)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_residual_falls_back_to_target(backend):
    """p == q: the rejection had probability zero, so sample p, not index 0."""
    case = make_rejection_case(2, 2, 16, greedy_rows=0, seed=13)
    probs = case.target_probs.clone()
    probs[:, :2] = case.draft_probs
    uniforms = torch.full_like(case.uniforms, 1.0)  # force a rejection at position 0
    noise = case.recovery_noise
    with ops.use_backend(backend):
        out, num_accepted = ops.rejection_sample(
            case.draft_token_ids, torch.tensor([2, 2]), case.draft_probs, case.target_logits,
            probs, case.is_greedy, uniforms, noise,
        )
    assert num_accepted.tolist() == [0, 0]
    assert out[:, 0].tolist() == (probs[:, 0] / noise[:, 0]).argmax(-1).tolist()


def test_draw_random_shares_noise_across_positions():
    uniforms, noise = ops.draw_random([1, None, 3], 3, 4, 10, "cpu")
    assert uniforms.shape == (3, 4) and noise.shape == (3, 5, 10)
    assert noise.stride() == (10, 0, 1)
    assert (noise > 0).all() and ((uniforms >= 0) & (uniforms < 1)).all()


# ---------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_rows_repeat_and_ignore_their_batch(backend):
    """Same seed, same tokens: run twice, and with the row moved in another batch."""
    case = make_rejection_case(4, 3, 32, greedy_rows=0, seed=14)
    seeds = [101, 202, 303, 404]

    def run(order: list[int]) -> torch.Tensor:
        rows = torch.tensor(order)
        uniforms, noise = ops.draw_random([seeds[r] for r in order], len(order), 3, 32, "cpu")
        with ops.use_backend(backend):
            out, _ = ops.rejection_sample(
                case.draft_token_ids[rows], case.num_draft_tokens[rows],
                case.draft_probs[rows], case.target_logits[rows], case.target_probs[rows],
                case.is_greedy[rows], uniforms, noise,
            )
        return out

    first = run([0, 1, 2, 3])
    assert torch.equal(first, run([0, 1, 2, 3]))
    shuffled = run([2, 0, 3])
    assert torch.equal(shuffled, first[[2, 0, 3]])


# ---------------------------------------------------------------------------
# Distribution: the emitted tokens follow the target
# ---------------------------------------------------------------------------

# p and q differ strongly, each puts mass where the other has none (token 3
# only via recovery, token 4 always rejected), so a wrong acceptance or
# recovery rule moves mass by far more than the sampling noise.
TARGET = torch.tensor(
    [[0.40, 0.25, 0.15, 0.20, 0.00], [0.05, 0.10, 0.50, 0.15, 0.20], [0.30, 0.05, 0.05, 0.20, 0.40]]
)
DRAFT = torch.tensor([[0.10, 0.30, 0.30, 0.00, 0.30], [0.40, 0.30, 0.10, 0.10, 0.10]])
# Chi-square critical value, 4 degrees of freedom, p = 0.001.
CHI2_CRITICAL = 18.47


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of `tokens` against `probs` (cells with p > 0)."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * len(tokens)
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token the target gives probability 0"
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


def sample_speculative(
    n: int, num_draft: torch.Tensor, seed: int, backend: str, draft_probs_seen=DRAFT
) -> tuple[torch.Tensor, torch.Tensor]:
    """n independent rows of one K=2 step with the fixed TARGET / DRAFT."""
    gen = torch.Generator().manual_seed(seed)
    K, vocab = DRAFT.shape
    drafts = torch.multinomial(DRAFT, n, replacement=True, generator=gen).T.contiguous()  # [n, K]
    target_probs = TARGET.expand(n, K + 1, vocab).contiguous()
    uniforms = torch.rand((n, K), generator=gen)
    noise = torch.empty((n, K + 1, vocab)).exponential_(generator=gen)
    with ops.use_backend(backend):
        return ops.rejection_sample(
            drafts, num_draft, draft_probs_seen.expand(n, K, vocab).contiguous(),
            target_probs.log(), target_probs, torch.zeros(n, dtype=torch.bool), uniforms, noise,
        )


def test_emitted_tokens_follow_the_target():
    """First token ~ p_0; second token (when the first draft is accepted) ~ p_1.

    Half the rows draft 2 tokens (the second emitted token is accepted or
    recovered, a third one is the bonus from p_2), half draft 1 (the second
    token is the bonus).
    """
    n = 40_000
    num_draft = torch.tensor([2, 1]).repeat(n // 2)
    out, num_accepted = sample_speculative(n, num_draft, 15, "reference")
    assert chi_square(out[:, 0], TARGET[0]) < CHI2_CRITICAL
    second = num_accepted >= 1
    assert second.sum() > n // 10
    assert chi_square(out[second, 1], TARGET[1]) < CHI2_CRITICAL
    bonus = second & (num_draft == 1)
    assert chi_square(out[bonus, 1], TARGET[1]) < CHI2_CRITICAL
    third = num_accepted == 2
    assert chi_square(out[third, 2], TARGET[2]) < CHI2_CRITICAL


def test_triton_samples_like_the_reference(triton_only):
    """The kernel emits the reference's tokens on the statistical setup, so the
    distribution test above holds for it too (each interpreted row costs
    milliseconds, too slow to sample 40k rows here)."""
    n = 128
    num_draft = torch.tensor([2, 1]).repeat(n // 2)
    got = sample_speculative(n, num_draft, 15, "triton")
    with ops.use_backend("reference"), pytest.MonkeyPatch.context() as patch:
        patch.setattr(reference, "rejection_sample", REFERENCE)
        want = sample_speculative(n, num_draft, 15, "reference")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_distribution_test_rejects_a_wrong_rule():
    """Power check: the same statistic fails when the sampler is told q == p.

    Then every draft the target allows is accepted (u * p < p), so tokens
    follow the draft instead of the target.
    """
    n = 40_000
    num_draft = torch.full((n,), 2)
    out, num_accepted = sample_speculative(n, num_draft, 15, "reference", TARGET[:2])
    assert chi_square(out[:, 0], TARGET[0]) > 10 * CHI2_CRITICAL
    second = num_accepted >= 1
    assert chi_square(out[second, 1], TARGET[1]) > 10 * CHI2_CRITICAL


def test_wrong_inputs_are_rejected_before_launch():
    case = make_rejection_case(3, 2, 16, seed=16)
    args = list(case.args())
    with pytest.raises(ops.KernelInputError, match="uniforms: expected dtype"):
        ops.rejection_sample(*args[:6], case.uniforms.double(), args[7])
    with pytest.raises(ops.KernelInputError, match="draft_probs: expected shape"):
        ops.rejection_sample(args[0], args[1], case.draft_probs[:, :1], *args[3:])
    with pytest.raises(ops.KernelInputError, match="target_probs is required"):
        ops.rejection_sample(*args[:4], None, *args[5:])
    with pytest.raises(ops.KernelInputError, match="vocab dim must be contiguous"):
        ops.rejection_sample(*args[:7], case.recovery_noise.transpose(1, 2).contiguous().transpose(1, 2))


def test_first_argmax_is_argmax_with_ties_nan_and_masked_entries():
    """The greedy rule's argmax (first_argmax, through max's indices): the first largest entry of each
    row, as torch's argmax, whatever ties, NaN or -inf masks the row holds."""
    from dspark_kernels.reference import first_argmax

    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        x = torch.randint(0, 4, (6, 3, 97), generator=gen).float()  # many ties
        x[1, 2] = float("-inf")  # a whole row masked
        x[2, :, ::2] = float("-inf")
        if trial % 5 == 0:
            x[0, 1, 40] = float("nan")
        assert torch.equal(first_argmax(x), x.argmax(dim=-1))
        assert torch.equal(first_argmax(x[:, 0]), x[:, 0].argmax(dim=-1))
