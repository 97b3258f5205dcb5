"""The DSpark Markov head's left-to-right sampling: reference vs the model's loop, Triton vs
reference, the sampled tokens' distribution, and input checks.

The oracle chain: the reference equals a re-statement of ``DSparkDraft.sample_block`` built
on a real ``MarkovHead`` (its embed and bias are the model's math); the Triton kernel (under
the interpreter here) equals the reference over a grid of shapes; and the reference's tokens
follow the q it returns, position 1 conditional on position 0 (a chi-square test with a power
check).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dspark_kernels import ops, reference
from dspark_ray.model.dspark import MarkovHead

from kernel_fixtures import _under_interpreter, rerun_file_if_needed, triton_only_fixture  # noqa: F401

test_file_under_interpreter = rerun_file_if_needed(__file__)
triton_only = triton_only_fixture("markov_sample")

# Kept before `triton_only` replaces the module attribute the dispatcher uses.
REFERENCE = reference.markov_sample
BACKENDS = ["triton", "reference"]
TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class MarkovCase:
    base: torch.Tensor  # [B, S, V] float32
    prev0: torch.Tensor  # [B] int64
    w1: torch.Tensor  # [V_in, r]
    w2: torch.Tensor  # [V, r]
    logit_scale: float
    num_query: torch.Tensor  # [B] int64
    is_greedy: torch.Tensor  # [B] bool
    temperature: torch.Tensor  # [B] float32 (0 on greedy rows)
    noise: torch.Tensor  # [B, S, V] float32 Exponential(1)

    def args(self) -> tuple:
        return (self.base, self.prev0, self.w1, self.w2, self.logit_scale, self.num_query,
                self.is_greedy, self.temperature, self.noise)


def make_case(batch: int, steps: int, vocab: int, rank: int, dtype=torch.float32, greedy_rows: int = 0,
              vocab_in: int | None = None, draft_topk: int | None = None, seed: int = 0) -> MarkovCase:
    """Random base logits and weights with a bias as large as the base (so the chain matters);
    row 0 samples every position, the others a random count (0 included)."""
    gen = torch.Generator().manual_seed(seed)
    vocab_in = vocab_in or vocab
    base = torch.randn((batch, steps, vocab), generator=gen) * 2
    if draft_topk is not None:
        base = topk_masked(base, draft_topk)
    w1 = torch.randn((vocab_in, rank), generator=gen).to(dtype)
    w2 = (torch.randn((vocab, rank), generator=gen) / rank**0.5).to(dtype)
    num_query = torch.randint(0, steps + 1, (batch,), generator=gen)
    num_query[0] = steps
    is_greedy = torch.arange(batch) < greedy_rows
    temperature = torch.where(is_greedy, 0.0, 0.3 + 1.5 * torch.rand((batch,), generator=gen))
    noise = torch.empty((batch, steps, vocab)).exponential_(generator=gen).clamp_(min=TINY)
    return MarkovCase(base, torch.randint(0, vocab_in, (batch,), generator=gen), w1, w2, 1.5, num_query,
                      is_greedy, temperature, noise)


def topk_masked(base: torch.Tensor, k: int) -> torch.Tensor:  # [B, S, V] -> [B, S, V]
    """The caller's handling of ``draft_topk``: -inf outside each position's top-k, as sample_block."""
    values, candidates = base.topk(k, dim=-1)
    return torch.full_like(base, float("-inf")).scatter_(-1, candidates, values)


# ---------------------------------------------------------------------------
# The reference is the model's loop
# ---------------------------------------------------------------------------


def markov_head(w1: torch.Tensor, w2: torch.Tensor) -> MarkovHead:
    head = MarkovHead(w1.shape[0], w2.shape[0], w1.shape[1]).to(w1.dtype)
    with torch.no_grad():
        head.markov_w1.weight.copy_(w1)
        head.markov_w2.weight.copy_(w2)
    return head


def sample_block_restated(head: MarkovHead, base: torch.Tensor, anchor: torch.Tensor, logit_scale: float,
                          sample, draft_topk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``DSparkDraft.sample_block``'s loop: ([B, S] tokens, [B, S, V] q, zeros where greedy)."""
    if draft_topk is not None:
        base = topk_masked(base, draft_topk)
    tokens = torch.empty(base.shape[:2], dtype=torch.int64)
    probs = torch.zeros_like(base)
    prev = anchor
    for j in range(base.shape[1]):
        logits = base[:, j] + head.bias(head.embed(prev)) * logit_scale
        tokens[:, j], q = sample(logits, j)
        if q is not None:
            probs[:, j] = q
        prev = tokens[:, j]
    return tokens, probs


def greedy_sampler(logits: torch.Tensor, step: int):
    return logits.argmax(dim=-1), None


def race_sampler(temperature: torch.Tensor, noise: torch.Tensor):
    """A temperature-only sampler drawing the exponential race with the case's noise."""

    def sample(logits: torch.Tensor, step: int):
        q = torch.softmax(logits / temperature[:, None], dim=-1)
        return (q / noise[:, step]).argmax(dim=-1), q

    return sample


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("draft_topk", [None, 3])
def test_reference_greedy_is_the_models_loop(dtype, draft_topk):
    case = make_case(6, 5, 48, 8, dtype, greedy_rows=6, seed=1)
    head = markov_head(case.w1, case.w2)
    with torch.no_grad():
        want, _ = sample_block_restated(head, case.base, case.prev0, case.logit_scale, greedy_sampler, draft_topk)
    base = case.base if draft_topk is None else topk_masked(case.base, draft_topk)
    tokens, q = REFERENCE(base, *case.args()[1:5], torch.full((6,), 5), *case.args()[6:])
    assert torch.equal(tokens, want)
    assert not q.any()
    # The bias matters: another anchor changes the block.
    other, _ = REFERENCE(base, (case.prev0 + 1) % 48, *case.args()[2:5], torch.full((6,), 5), *case.args()[6:])
    assert not torch.equal(other, tokens)


def test_reference_sampled_is_the_models_loop_with_a_temperature_sampler():
    case = make_case(6, 4, 40, 8, greedy_rows=0, seed=2)
    head = markov_head(case.w1, case.w2)
    with torch.no_grad():
        want, want_q = sample_block_restated(head, case.base, case.prev0, case.logit_scale,
                                             race_sampler(case.temperature, case.noise))
    tokens, q = REFERENCE(case.base, *case.args()[1:5], torch.full((6,), 4), *case.args()[6:])
    assert torch.equal(tokens, want)
    torch.testing.assert_close(q, want_q, atol=1e-7, rtol=0)
    # q is the engine's processed distribution (logits_to_probs) for temperature-only rows.
    prev = torch.cat((case.prev0[:, None], tokens[:, :-1]), dim=1)  # [B, S]
    with torch.no_grad():
        logits = case.base + head.bias(head.embed(prev)) * case.logit_scale  # [B, S, V]
    temperature = case.temperature.repeat_interleave(4)
    engine_q = ops.logits_to_probs(logits.reshape(24, 40), temperature, torch.zeros(24, dtype=torch.int64),
                                   torch.ones(24))
    torch.testing.assert_close(q.reshape(24, 40), engine_q, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_num_query_and_greedy_rows(backend):
    """Past num_query: token -1 and zero q; greedy rows: zero q; sampled rows: q sums to one."""
    case = make_case(4, 3, 20, 4, greedy_rows=2, seed=3)
    num_query = torch.tensor([3, 1, 0, 2])
    with ops.use_backend(backend):
        tokens, q = ops.markov_sample(case.base, case.prev0, case.w1, case.w2, case.logit_scale, num_query,
                                      *case.args()[6:])
    live = torch.arange(3)[None, :] < num_query[:, None]  # [B, S]
    assert ((tokens >= 0) == live).all() and (tokens[~live] == -1).all()
    sums = q.sum(dim=-1)  # [B, S]
    sampled = live & ~case.is_greedy[:, None]
    torch.testing.assert_close(sums[sampled], torch.ones(int(sampled.sum())))
    assert not q[~sampled].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_and_block(backend):
    for batch, steps in ((0, 3), (2, 0)):
        case = make_case(max(batch, 1), max(steps, 1), 8, 2, seed=4)
        rows = slice(0, batch)
        base = case.base[rows, :steps].contiguous()
        noise = case.noise[rows, :steps]
        with ops.use_backend(backend):
            tokens, q = ops.markov_sample(base, case.prev0[rows], case.w1, case.w2, 1.0, case.num_query[rows],
                                          case.is_greedy[rows], case.temperature[rows], noise)
        assert tokens.shape == (batch, steps) and q.shape == (batch, steps, 8)


# ---------------------------------------------------------------------------
# Triton vs reference
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch,steps,vocab,vocab_in,rank,dtype,greedy_rows,draft_topk",
    [
        (1, 1, 16, 16, 4, torch.float32, 0, None),
        (4, 3, 40, 45, 12, torch.float32, 1, None),
        (3, 4, 37, 37, 8, torch.bfloat16, 1, None),
        (5, 2, 33, 40, 5, torch.float16, 2, None),
        (2, 4, 24, 24, 3, torch.float32, 2, None),
        (4, 3, 50, 64, 16, torch.bfloat16, 0, 4),
    ],
)
def test_triton_matches_reference(triton_only, batch, steps, vocab, vocab_in, rank, dtype, greedy_rows, draft_topk):
    for seed in range(2):
        case = make_case(batch, steps, vocab, rank, dtype, greedy_rows, vocab_in, draft_topk, seed=10 + seed)
        want = REFERENCE(*case.args())
        got = ops.markov_sample(*case.args())
        assert torch.equal(got[0], want[0]), (seed, got[0], want[0])
        torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("block_v,block_r", [(16, 4), (8, 16)])
def test_vocab_tiles_and_rank_chunks_agree(block_v, block_r):
    """Several vocab tiles (the last partial) and rank chunks, -inf tiles from draft_topk included."""
    from dspark_kernels import markov

    for draft_topk in (None, 2):
        case = make_case(3, 3, 37, 10, torch.bfloat16, greedy_rows=1, draft_topk=draft_topk, seed=20)
        want = REFERENCE(*case.args())
        got = markov.markov_sample(*case.args(), block_v=block_v, block_r=block_r)
        assert torch.equal(got[0], want[0]), (got[0], want[0])
        torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_break_to_the_first_index_across_tiles(backend):
    """Equal maxima at 5, 21 and 23 (tiles of 16): greedy and the race both pick 5."""
    from dspark_kernels import markov

    vocab = 32
    base = torch.full((2, 1, vocab), -3.0)
    base[:, :, [5, 21, 23]] = 1.0
    w1, w2 = torch.ones((vocab, 2)), torch.zeros((vocab, 2))
    noise = torch.ones((2, 1, vocab))
    args = (base, torch.tensor([0, 0]), w1, w2, 1.0, torch.tensor([1, 1]), torch.tensor([True, False]),
            torch.tensor([0.0, 1.0]), noise)
    if backend == "triton":
        tokens, _ = markov.markov_sample(*args, block_v=16)
    else:
        tokens, _ = REFERENCE(*args)
    assert tokens[:, 0].tolist() == [5, 5]


def test_out_of_range_anchor_samples_nothing_on_device():
    """Past ops' CPU check (what a CUDA call relies on): the row emits -1 and reads nothing."""
    from dspark_kernels import markov

    case = make_case(3, 2, 16, 4, greedy_rows=1, seed=5)
    prev0 = torch.tensor([-1, 16, 3])
    num_query = torch.full((3,), 2)
    for run in (REFERENCE, markov.markov_sample):
        tokens, q = run(case.base, prev0, *case.args()[2:5], num_query, *case.args()[6:])
        assert (tokens[:2] == -1).all() and not q[:2].any() and (tokens[2] >= 0).all()


# ---------------------------------------------------------------------------
# Distribution: tokens follow q, position 1 conditional on position 0
# ---------------------------------------------------------------------------

STAT_V = 5
STAT_TEMPERATURE = 0.8
# Chi-square critical value, 24 degrees of freedom (5 x 5 cells), p = 0.001.
CHI2_CRITICAL = 51.18


def stat_case(n: int, seed: int, shared_noise: bool = False) -> MarkovCase:
    """n rows of one fixed two-position block (same anchor, base and weights), fresh noise each."""
    weights = torch.Generator().manual_seed(30)
    base = (torch.randn((2, STAT_V), generator=weights) * 0.5).expand(n, 2, STAT_V).contiguous()
    # A bias that moves the conditionals of position 1 apart (total variation up to 0.28) while
    # every (token0, token1) cell keeps > 100 expected counts of 40k.
    w1 = torch.randn((STAT_V, 3), generator=weights) * 0.5
    w2 = torch.randn((STAT_V, 3), generator=weights) * 0.5
    gen = torch.Generator().manual_seed(seed)
    if shared_noise:  # one draw read at both positions: the misuse ops.markov_sample warns about
        noise = torch.empty((n, 1, STAT_V)).exponential_(generator=gen).expand(n, 2, STAT_V)
    else:
        noise = torch.empty((n, 2, STAT_V)).exponential_(generator=gen)
    return MarkovCase(base, torch.full((n,), 2), w1, w2, 1.0, torch.full((n,), 2),
                      torch.zeros(n, dtype=torch.bool), torch.full((n,), STAT_TEMPERATURE), noise.clamp(min=TINY))


def expected_joint(case: MarkovCase) -> torch.Tensor:  # [V, V] float64: P(token0, token1)
    """Independently of the code under test, in float64."""
    w1, w2, base = case.w1.double(), case.w2.double(), case.base[0].double()

    def q(prev: int, j: int) -> torch.Tensor:
        return torch.softmax((base[j] + w2 @ w1[prev] * case.logit_scale) / STAT_TEMPERATURE, dim=-1)

    first = q(int(case.prev0[0]), 0)
    return torch.stack([first[t] * q(t, 1) for t in range(STAT_V)])


def joint_chi_square(tokens: torch.Tensor, joint: torch.Tensor) -> float:
    counts = torch.bincount(tokens[:, 0] * STAT_V + tokens[:, 1], minlength=STAT_V**2).double()
    expected = joint.flatten() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampled_tokens_follow_q():
    n = 40_000
    case = stat_case(n, seed=31)
    tokens, q = REFERENCE(*case.args())
    joint = expected_joint(case)
    assert joint.min() * n > 100  # every cell well populated
    assert joint_chi_square(tokens, joint) < CHI2_CRITICAL
    # q at position 1 is the distribution given the token drawn at position 0.
    torch.testing.assert_close(q[:, 0], joint.sum(dim=1).float().expand(n, STAT_V), atol=1e-6, rtol=0)
    conditional = (joint / joint.sum(dim=1, keepdim=True)).float()
    torch.testing.assert_close(q[:, 1], conditional[tokens[:, 0]], atol=1e-6, rtol=0)


def test_distribution_test_rejects_wrong_samplers():
    """Power check: the statistic fails when both positions race on one noise draw, and when
    position 1 is drawn after the anchor instead of after the token drawn at position 0."""
    n = 40_000
    shared = stat_case(n, seed=31, shared_noise=True)
    tokens, _ = REFERENCE(*shared.args())
    assert joint_chi_square(tokens, expected_joint(shared)) > 10 * CHI2_CRITICAL

    case = stat_case(n, seed=31)
    tokens, _ = REFERENCE(*case.args())
    unchained, _ = REFERENCE(case.base[:, 1:].contiguous(), *case.args()[1:5], torch.ones(n, dtype=torch.int64),
                             case.is_greedy, case.temperature, case.noise[:, 1:])
    tokens[:, 1] = unchained[:, 0]
    assert joint_chi_square(tokens, expected_joint(case)) > 10 * CHI2_CRITICAL


def test_triton_samples_like_the_reference(triton_only):
    """The kernel draws the reference's tokens on the statistical setup, so the distribution test
    holds for it too (interpreted rows cost milliseconds, too slow for 40k rows here)."""
    case = stat_case(48, seed=32)
    got = ops.markov_sample(*case.args())
    want = REFERENCE(*case.args())
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------


def test_wrong_inputs_are_rejected_before_launch(triton_only, monkeypatch):
    def no_launch(name):
        raise AssertionError("a kernel was reached")

    monkeypatch.setattr(ops, "_kernel_module", no_launch)
    case = make_case(3, 2, 16, 4, greedy_rows=1, seed=40)
    a = list(case.args())

    def with_(index: int, value) -> list:
        return a[:index] + [value] + a[index + 1:]

    bad = [
        (with_(0, case.base[0]), "base: expected \\[B, S, V\\]"),
        (with_(0, case.base.double()), "base: expected dtype"),
        (with_(1, case.prev0.int()), "prev0: expected dtype"),
        (with_(1, torch.tensor([0, 16, 2])), "prev0: anchor ids \\[16\\]"),
        (with_(1, torch.tensor([0, -1, 2])), "prev0: anchor ids \\[-1\\]"),
        (with_(2, case.w1[:8]), "w2 has 16 output tokens but w1 embeds only 8"),
        (with_(2, case.w1.t().contiguous().t()), "w1: must be contiguous"),
        (with_(3, case.w2.half()), "w2: expected dtype"),
        (with_(3, case.w2[:, :3].contiguous()), "w2: expected shape"),
        (with_(4, float("nan")), "logit_scale must be finite"),
        (with_(5, case.num_query[:2]), "num_query: expected shape"),
        (with_(6, case.is_greedy.long()), "is_greedy: expected dtype"),
        (with_(7, torch.tensor([0.0, 0.0, 1.0])), "temperature: sampled rows \\[1\\]"),
        (with_(8, case.noise[:, :1]), "noise: expected shape"),
        (with_(8, case.noise.transpose(1, 2).contiguous().transpose(1, 2)), "vocab dim must be contiguous"),
    ]
    for args, message in bad:
        with pytest.raises(ops.KernelInputError, match=message):
            ops.markov_sample(*args)
