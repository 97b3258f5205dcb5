"""Input builders shared by the kernel tests and `bench/kernel_timings.py`.

Each builder returns a frozen case whose tensors look like one serving step:
live rows on distinct slots, padding rows on slot 0 with position -1, and
rings whose never-written entries are NaN. NaN stands in for a previous
owner's data (a slot rebound to a new epoch): a kernel that reads any of it
returns NaN, so a finite, matching output proves nothing stale was read.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import torch

from dspark_kernels import ops, reference
from dspark_kernels.reference import PAD_POSITION


def interpreter_in_process() -> bool:
    """Enable Triton's interpreter in this process; False if triton came first.

    Test modules call this at import. When some earlier import already loaded
    triton for the compiler, the module reruns itself in a fresh process with
    `rerun_in_fresh_process` instead of silently testing the reference.
    """
    try:
        ops.enable_interpreter()
    except ops.KernelBackendError:
        return False
    return True


def rerun_in_fresh_process(test_file: str, interpret: bool, timeout_s: float = 600.0) -> None:
    """Run one test file with pytest in a fresh process, Triton's interpreter on or off.

    On: the CPU suite, when triton was already imported for the compiler.
    Off: the CUDA tests, when another module turned the interpreter on.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    how = "under the interpreter" if interpret else "compiled"
    assert result.returncode == 0, f"{test_file} failed {how}:\n{result.stdout[-6000:]}\n{result.stderr[-2000:]}"


def refuse_references(monkeypatch, *names: str) -> None:
    """Make each named function of `reference` raise, so a silent fallback fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton backend fell back to the reference")

    for name in names:
        monkeypatch.setattr(reference, name, refuse)


@dataclass(frozen=True)
class RingWriteCase:
    k_cache: torch.Tensor  # [num_slots + 1, ring, kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_slots + 1, ring, kv_heads, head_dim]
    slots: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B, T] int64, < 0 = padding
    k: torch.Tensor  # [B, T, kv_heads, head_dim]
    v: torch.Tensor  # [B, T, kv_heads, head_dim]

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.k_cache, self.v_cache, self.slots, self.positions, self.k, self.v)

    def clone_caches(self) -> RingWriteCase:
        return RingWriteCase(
            self.k_cache.clone(), self.v_cache.clone(), self.slots, self.positions, self.k, self.v
        )


@dataclass(frozen=True)
class AttentionCase:
    q: torch.Tensor  # [B, T, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_slots + 1, ring, kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_slots + 1, ring, kv_heads, head_dim]
    slots: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B, T] int64, < 0 = padding
    cache_lengths: torch.Tensor  # [num_slots + 1] int64
    window: int
    scale: float

    def args(self) -> tuple:
        return (
            self.q, self.k_cache, self.v_cache, self.slots, self.positions,
            self.cache_lengths, self.window, self.scale,
        )


@dataclass(frozen=True)
class PagedAttentionCase:
    q: torch.Tensor  # [B, T, num_heads, head_dim]
    k_pool: torch.Tensor  # [P, kv_heads, head_dim]
    v_pool: torch.Tensor  # [P, kv_heads, head_dim]
    req_to_token: torch.Tensor  # [num_slots + 1, max_context] int32
    rows: torch.Tensor  # [B] int64 table row (slot) of each batch row
    positions: torch.Tensor  # [B, T] int64, < 0 = padding
    scale: float
    window: int | None

    def args(self) -> tuple:
        return (
            self.q, self.k_pool, self.v_pool, self.req_to_token, self.rows, self.positions,
            self.scale, self.window,
        )


@dataclass(frozen=True)
class RejectionCase:
    draft_token_ids: torch.Tensor  # [B, K] int64
    num_draft_tokens: torch.Tensor  # [B] int64
    draft_probs: torch.Tensor | None  # [B, K, V] float32
    target_logits: torch.Tensor  # [B, K + 1, V] float32
    target_probs: torch.Tensor | None  # [B, K + 1, V] float32
    is_greedy: torch.Tensor  # [B] bool
    uniforms: torch.Tensor  # [B, K] float32
    recovery_noise: torch.Tensor  # [B, K + 1, V] float32

    def args(self) -> tuple:
        return (
            self.draft_token_ids, self.num_draft_tokens, self.draft_probs, self.target_logits,
            self.target_probs, self.is_greedy, self.uniforms, self.recovery_noise,
        )


def _default_padding(batch: int, padding_rows: int | None) -> int:
    """One trailing padding row unless the batch has a single row."""
    return min(1, batch - 1) if padding_rows is None else padding_rows


def _slot_layout(
    batch: int, padding_rows: int, gen: torch.Generator
) -> tuple[int, torch.Tensor]:
    """Distinct random live slots for the first rows, slot 0 for padding rows."""
    live = batch - padding_rows
    num_slots = 2 * live + 1
    slots = torch.zeros(batch, dtype=torch.int64)
    slots[:live] = torch.randperm(num_slots, generator=gen)[:live] + 1
    return num_slots, slots


def make_ring_write_case(
    batch: int,
    steps: int,
    kv_heads: int,
    head_dim: int,
    ring: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    padding_rows: int | None = None,
    seed: int = 0,
) -> RingWriteCase:
    """One step's ring write: each live row writes `steps` consecutive positions
    (the last may be padding), starting anywhere so writes wrap the ring."""
    assert steps <= ring, "a step cannot write more positions than the ring holds"
    padding_rows = _default_padding(batch, padding_rows)
    gen = torch.Generator().manual_seed(seed)
    num_slots, slots = _slot_layout(batch, padding_rows, gen)
    start = torch.randint(0, 3 * ring, (batch, 1), generator=gen)
    positions = start + torch.arange(steps)  # [B, T]
    if steps > 1:
        positions[0, -1] = PAD_POSITION  # a row with fewer tokens this step
    positions[batch - padding_rows:] = PAD_POSITION
    shape = (num_slots + 1, ring, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    k = torch.randn((batch, steps, kv_heads, head_dim), generator=gen).to(dtype)
    v = torch.randn((batch, steps, kv_heads, head_dim), generator=gen).to(dtype)
    return RingWriteCase(
        k_cache.to(device), v_cache.to(device), slots.to(device), positions.to(device),
        k.to(device), v.to(device),
    )


def make_attention_case(
    batch: int,
    steps: int,
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    window: int,
    max_spec: int = 4,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    padding_rows: int | None = None,
    seed: int = 0,
) -> AttentionCase:
    """A decode/verify step over the draft window cache.

    Live row b has written positions 0..L_b-1 in its slot's current epoch
    (L_b from `steps` to three rings, so some rows are short and some have
    wrapped) and queries its last `steps` positions, the speculative block
    already written. Row 0 queries one position fewer (a trailing padding
    entry). Ring entries not written in this epoch are NaN.
    """
    ring = window + max_spec
    padding_rows = _default_padding(batch, padding_rows)
    assert steps <= max_spec + 1 and batch > padding_rows >= 0
    gen = torch.Generator().manual_seed(seed)
    num_slots, slots = _slot_layout(batch, padding_rows, gen)
    shape = (num_slots + 1, ring, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    cache_lengths = torch.zeros(num_slots + 1, dtype=torch.int64)
    positions = torch.full((batch, steps), PAD_POSITION, dtype=torch.int64)
    for b in range(batch - padding_rows):
        length = int(torch.randint(steps, 3 * ring, (1,), generator=gen))
        written = torch.arange(max(0, length - ring), length)
        slot = int(slots[b])
        k_cache[slot, written % ring] = torch.randn((len(written), kv_heads, head_dim), generator=gen)
        v_cache[slot, written % ring] = torch.randn((len(written), kv_heads, head_dim), generator=gen)
        cache_lengths[slot] = length
        positions[b] = torch.arange(length - steps, length)
    if steps > 1:
        positions[0, -1] = PAD_POSITION
    q = torch.randn((batch, steps, num_heads, head_dim), generator=gen)
    return AttentionCase(
        q.to(dtype).to(device),
        k_cache.to(dtype).to(device),
        v_cache.to(dtype).to(device),
        slots.to(device),
        positions.to(device),
        cache_lengths.to(device),
        window,
        head_dim**-0.5,
    )


def make_paged_attention_case(
    batch: int,
    steps: int,
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    contexts: list[int] | None = None,
    max_context: int = 64,
    window: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    padding_rows: int | None = None,
    seed: int = 0,
) -> PagedAttentionCase:
    """A verification step of the target over its paged KV pool.

    Live row b holds ``contexts[b]`` positions (default: random in
    steps..max_context), its last ``steps`` being the verified block already
    written, and queries those. Its positions map to scattered pool tokens (a
    random permutation, as after many allocations and frees); the table past
    a row's length points at token 0, the padding token, which holds finite
    junk as padding writes leave it. Pool tokens no row owns are NaN, so a
    kernel reading outside a row's visible keys returns NaN. Row 0 queries
    one position fewer (a trailing padding entry); padding rows use table
    row 0 with positions -1.
    """
    padding_rows = _default_padding(batch, padding_rows)
    live = batch - padding_rows
    assert live >= 1 and (contexts is None or len(contexts) == live)
    gen = torch.Generator().manual_seed(seed)
    num_slots, slots = _slot_layout(batch, padding_rows, gen)
    if contexts is None:
        contexts = torch.randint(steps, max_context + 1, (live,), generator=gen).tolist()
    assert all(steps <= n <= max_context for n in contexts)
    pool_tokens = 1 + sum(contexts) + 8  # the padding token, the rows' tokens, a few free ones
    shape = (pool_tokens, kv_heads, head_dim)
    k_pool = torch.full(shape, float("nan"))
    v_pool = torch.full(shape, float("nan"))
    k_pool[0] = torch.randn(shape[1:], generator=gen)
    v_pool[0] = torch.randn(shape[1:], generator=gen)
    owned = torch.randperm(pool_tokens - 1, generator=gen)[: sum(contexts)] + 1
    table = torch.zeros((num_slots + 1, max_context), dtype=torch.int32)
    positions = torch.full((batch, steps), PAD_POSITION, dtype=torch.int64)
    first = 0
    for b, n in enumerate(contexts):
        tokens = owned[first:first + n]
        first += n
        table[slots[b], :n] = tokens.int()
        k_pool[tokens] = torch.randn((n, kv_heads, head_dim), generator=gen)
        v_pool[tokens] = torch.randn((n, kv_heads, head_dim), generator=gen)
        positions[b] = torch.arange(n - steps, n)
    if steps > 1:
        positions[0, -1] = PAD_POSITION
    q = torch.randn((batch, steps, num_heads, head_dim), generator=gen)
    return PagedAttentionCase(
        q.to(dtype).to(device), k_pool.to(dtype).to(device), v_pool.to(dtype).to(device),
        table.to(device), slots.to(device), positions.to(device), head_dim**-0.5, window,
    )


def make_rejection_case(
    batch: int,
    k: int,
    vocab: int,
    greedy_rows: int | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> RejectionCase:
    """A verification step with realistic acceptance.

    The target distribution is the draft's perturbed, so random rows accept
    part of their drafts; greedy rows get a draft prefix equal to the target
    argmax of random length. Rows draft 0..k tokens; the first `greedy_rows`
    rows (default: a third) are greedy.
    """
    gen = torch.Generator().manual_seed(seed)
    if greedy_rows is None:
        greedy_rows = batch // 3
    draft_logits = 3.0 * torch.randn((batch, k + 1, vocab), generator=gen)
    target_logits = draft_logits + torch.randn((batch, k + 1, vocab), generator=gen)
    draft_probs = torch.softmax(draft_logits[:, :k], dim=-1)  # [B, K, V]
    target_probs = torch.softmax(target_logits, dim=-1)  # [B, K + 1, V]
    if k > 0:
        drafts = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=gen)
        drafts = drafts.reshape(batch, k)
    else:
        drafts = torch.zeros((batch, 0), dtype=torch.int64)
    is_greedy = torch.arange(batch) < greedy_rows
    argmax = target_logits[:, :k].argmax(dim=-1)  # [B, K]
    agree = torch.arange(k) < torch.randint(0, k + 1, (batch, 1), generator=gen)
    drafts = torch.where(is_greedy[:, None] & agree, argmax, drafts)
    num_draft = torch.randint(0, k + 1, (batch,), generator=gen)
    num_draft[0] = k
    uniforms = torch.rand((batch, k), generator=gen)
    noise = torch.empty((batch, k + 1, vocab)).exponential_(generator=gen)
    noise.clamp_(min=torch.finfo(torch.float32).tiny)
    return RejectionCase(
        drafts.to(device), num_draft.to(device), draft_probs.to(device),
        target_logits.to(device), target_probs.to(device), is_greedy.to(device),
        uniforms.to(device), noise.to(device),
    )
