"""Public kernel API: validate inputs, then dispatch to Triton or the reference.

Backends:

- ``"auto"`` (default): Triton for CUDA tensors, the PyTorch reference
  elsewhere.
- ``"triton"``: always the Triton kernels. On CPU tensors this needs the
  Triton interpreter: call ``enable_interpreter()`` (or export
  ``TRITON_INTERPRET=1`` before the kernels are first imported; Triton
  decides interpreter-or-compiler when a kernel is decorated). Tests and
  ``bench/kernel_timings.py`` use it to run the kernels on CPU.
- ``"reference"``: always the reference in ``dspark_kernels.reference``.

Choose with ``set_backend(...)`` or, scoped, ``with use_backend(...):``.
Kernel modules are imported lazily, on the first Triton call, so importing
this module never decides the interpreter question for anyone.

Every entry point checks shapes, dtypes and contiguity on the host before a
launch; these checks never synchronise with the device.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Literal

import torch

from dspark_kernels import reference

Backend = Literal["auto", "triton", "reference"]
_BACKENDS: tuple[str, ...] = ("auto", "triton", "reference")
_backend: Backend = "auto"


class KernelBackendError(RuntimeError):
    """The requested backend cannot run on the given tensors."""


class KernelInputError(ValueError):
    """A kernel argument has the wrong shape, dtype, device or layout."""


def set_backend(backend: Backend) -> None:
    """Select the kernel backend for every later call (process-wide)."""
    global _backend
    if backend not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; use one of {_BACKENDS}")
    _backend = backend


def get_backend() -> Backend:
    """The backend currently selected by `set_backend` / `use_backend`."""
    return _backend


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[None]:
    """Select `backend` inside a `with` block, restoring the previous one after."""
    previous = _backend
    set_backend(backend)
    try:
        yield
    finally:
        set_backend(previous)


def enable_interpreter() -> None:
    """Run the Triton kernels in Triton's interpreter from now on (CPU tensors).

    For tests and CPU benchmarks only: it sets TRITON_INTERPRET=1 for the
    whole process. Triton picks interpreter or compiler when a function is
    decorated, its own library included, so this must run before `triton` is
    first imported (this package imports it lazily, on the first Triton call).

    Raises:
      KernelBackendError: triton was already imported for the compiler; set
        TRITON_INTERPRET=1 in the environment of the process instead.
    """
    if "triton" in sys.modules and not _triton_interprets():
        raise KernelBackendError(
            "triton was imported before enable_interpreter(); export TRITON_INTERPRET=1 "
            "before starting the process, or call enable_interpreter() earlier"
        )
    os.environ["TRITON_INTERPRET"] = "1"


def _triton_interprets() -> bool:
    """Whether the imported triton decorated its own library for the interpreter."""
    import triton
    import triton.language as tl

    return not isinstance(tl.argmax, triton.runtime.JITFunction)


def _kernel_module(name: str):
    """Import `dspark_kernels.<name>` (a Triton kernel file) on first use."""
    try:
        return importlib.import_module(f"dspark_kernels.{name}")
    except ImportError as exc:  # triton missing on this machine
        raise KernelBackendError(
            f"the Triton backend needs the 'triton' package ({exc}); install the "
            "'triton' extra or use set_backend('reference')"
        ) from exc


def _use_triton(module_name: str, device: torch.device) -> bool:
    """Decide the backend for one call and check that Triton can run there."""
    if _backend == "reference":
        return False
    if _backend == "auto":
        return device.type == "cuda"
    if device.type != "cuda":
        module = _kernel_module(module_name)
        if not module.runs_in_interpreter():
            raise KernelBackendError(
                f"backend 'triton' on {device.type} tensors needs the Triton interpreter: "
                "call dspark_kernels.ops.enable_interpreter() (or export TRITON_INTERPRET=1 "
                "before the kernels are imported), or use set_backend('reference')"
            )
    return True


def uses_triton(kernel: str, device: torch.device) -> bool:
    """Whether ``kernel`` (ring_write, window_attention, paged_attention, rejection, markov) runs as Triton on ``device``;
    False: its torch reference (``dspark_kernels.reference``) runs."""
    return _use_triton(kernel, device)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise KernelInputError(message)


def _check_tensor(
    name: str,
    tensor: torch.Tensor,
    shape: Sequence[int],
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    contiguous: bool = True,
) -> None:
    _check(
        tuple(tensor.shape) == tuple(shape),
        f"{name}: expected shape {tuple(shape)}, got {tuple(tensor.shape)}",
    )
    _check(tensor.dtype in dtypes, f"{name}: expected dtype in {dtypes}, got {tensor.dtype}")
    _check(tensor.device == device, f"{name}: expected device {device}, got {tensor.device}")
    if contiguous:
        _check(tensor.is_contiguous(), f"{name}: must be contiguous (call .contiguous())")


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------
# Ring-buffer write
# ---------------------------------------------------------------------------


def ring_write(
    k_cache: torch.Tensor,  # [num_slots + 1, ring, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots + 1, ring, kv_heads, head_dim]
    slots: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, T] int64 absolute positions, < 0 = padding
    k: torch.Tensor,  # [B, T, kv_heads, head_dim]
    v: torch.Tensor,  # [B, T, kv_heads, head_dim]
) -> None:
    """Write a step's new keys and values into each slot's ring, in place.

    Entry (b, t) goes to `k_cache[slots[b], positions[b, t] % ring]`; entries
    with a negative position are padding and write nothing. Two entries of a
    step must not land on the same (slot, ring index) unless that slot is the
    padding row 0.
    """
    _check(k_cache.dim() == 4, f"k_cache: expected 4 dims, got shape {tuple(k_cache.shape)}")
    rows, ring, kv_heads, head_dim = k_cache.shape
    B, T = positions.shape if positions.dim() == 2 else (-1, -1)
    device = k_cache.device
    _check(positions.dim() == 2, f"positions: expected [B, T], got {tuple(positions.shape)}")
    _check_tensor("k_cache", k_cache, (rows, ring, kv_heads, head_dim), _FLOAT_DTYPES, device)
    _check_tensor("v_cache", v_cache, (rows, ring, kv_heads, head_dim), (k_cache.dtype,), device)
    _check_tensor("slots", slots, (B,), (torch.int64,), device)
    _check_tensor("positions", positions, (B, T), (torch.int64,), device)
    _check_tensor("k", k, (B, T, kv_heads, head_dim), _FLOAT_DTYPES, device)
    _check_tensor("v", v, (B, T, kv_heads, head_dim), (k.dtype,), device)
    if B == 0 or T == 0:
        return
    if _use_triton("ring_write", device):
        _kernel_module("ring_write").ring_write(k_cache, v_cache, slots, positions, k, v)
    else:
        reference.ring_write(k_cache, v_cache, slots, positions, k, v)


# ---------------------------------------------------------------------------
# Sliding-window attention over the ring
# ---------------------------------------------------------------------------


def window_attention(
    q: torch.Tensor,  # [B, T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots + 1, ring, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots + 1, ring, kv_heads, head_dim]
    slots: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, T] int64 query positions, < 0 = padding
    cache_lengths: torch.Tensor,  # [num_slots + 1] int64, positions written this epoch
    window: int,
    scale: float,
) -> torch.Tensor:  # [B, T, num_heads, head_dim], q.dtype
    """Decode attention of 1..k+1 queries per row over the slot's window.

    A query at position p attends to the key positions kp with
    max(0, p - window + 1) <= kp <= p and kp < cache_lengths[slot], read
    from ring index kp % ring. This one rule gives the sliding window, the
    causal mask inside a speculative block, and the epoch check (a slot
    rebound to a new request starts at length 0, so its old ring is never
    read). Heads are grouped (GQA): query head h reads kv head
    h // (num_heads // kv_heads). Padding queries (p < 0) and queries with no
    visible key return zeros and read nothing from the ring. Scores and
    softmax accumulate in float32.
    """
    _check(q.dim() == 4, f"q: expected [B, T, num_heads, head_dim], got {tuple(q.shape)}")
    _check(k_cache.dim() == 4, f"k_cache: expected 4 dims, got shape {tuple(k_cache.shape)}")
    B, T, num_heads, head_dim = q.shape
    rows, ring, kv_heads, _ = k_cache.shape
    device = q.device
    _check_tensor("q", q, (B, T, num_heads, head_dim), _FLOAT_DTYPES, device)
    _check_tensor("k_cache", k_cache, (rows, ring, kv_heads, head_dim), (q.dtype,), device)
    _check_tensor("v_cache", v_cache, (rows, ring, kv_heads, head_dim), (q.dtype,), device)
    _check_tensor("slots", slots, (B,), (torch.int64,), device)
    _check_tensor("positions", positions, (B, T), (torch.int64,), device)
    _check_tensor("cache_lengths", cache_lengths, (rows,), (torch.int64,), device)
    _check(num_heads % kv_heads == 0, f"num_heads {num_heads} is not a multiple of kv_heads {kv_heads}")
    _check(1 <= window <= ring, f"window {window} must be in 1..ring ({ring})")
    if B == 0 or T == 0:
        return torch.zeros_like(q)
    if _use_triton("window_attention", device):
        module = _kernel_module("window_attention")
        return module.window_attention(
            q, k_cache, v_cache, slots, positions, cache_lengths, window, scale
        )
    return reference.window_attention(
        q, k_cache, v_cache, slots, positions, cache_lengths, window, scale
    )


# ---------------------------------------------------------------------------
# The target's paged attention through the request-to-token table
# ---------------------------------------------------------------------------


def paged_attention(
    q: torch.Tensor,  # [B, T, num_heads, head_dim]
    k_pool: torch.Tensor,  # [P, kv_heads, head_dim]
    v_pool: torch.Tensor,  # [P, kv_heads, head_dim]
    req_to_token: torch.Tensor,  # [R, C] int32/int64: pool index of each (table row, position)
    rows: torch.Tensor,  # [B] int64 table row of each batch row (0: the padding row)
    positions: torch.Tensor,  # [B, T] int64 query positions, < 0 = padding
    scale: float,
    window: int | None = None,
    num_splits: int | None = None,
    max_keys: int | None = None,
) -> torch.Tensor:  # [B, T, num_heads, head_dim], q.dtype
    """Decode/verify attention of 1..k+1 queries per row over the row's paged KV.

    A query at position p attends to the key positions kp with
    p - window < kp <= p (every kp <= p without a window), reading key kp
    from pool index ``req_to_token[rows[b], kp]``: the causal order inside the
    verified block, the optional sliding window (Mistral), and nothing past
    the query. Heads are grouped (GQA): query head h reads kv head
    h // (num_heads // kv_heads). Padding queries (p < 0) return zeros and
    read nothing. Scores and softmax accumulate in float32 in the kernel; the
    reference (the CPU path) is PackedAttention's gather + SDPA.

    ``num_splits`` (Triton only): key splits per row (flash-decoding); None
    picks them from the batch and ``max_keys``, a host-side upper bound on
    any row's keys (default the table's width), so no device sync.
    """
    _check(q.dim() == 4, f"q: expected [B, T, num_heads, head_dim], got {tuple(q.shape)}")
    _check(k_pool.dim() == 3, f"k_pool: expected [P, kv_heads, head_dim], got {tuple(k_pool.shape)}")
    _check(req_to_token.dim() == 2, f"req_to_token: expected [R, C], got {tuple(req_to_token.shape)}")
    B, T, num_heads, head_dim = q.shape
    pool_tokens, kv_heads, _ = k_pool.shape
    device = q.device
    _check_tensor("q", q, (B, T, num_heads, head_dim), _FLOAT_DTYPES, device)
    _check_tensor("k_pool", k_pool, (pool_tokens, kv_heads, head_dim), _FLOAT_DTYPES, device)
    _check_tensor("v_pool", v_pool, (pool_tokens, kv_heads, head_dim), (k_pool.dtype,), device)
    _check_tensor("req_to_token", req_to_token, req_to_token.shape, (torch.int32, torch.int64), device)
    _check_tensor("rows", rows, (B,), (torch.int64,), device)
    _check_tensor("positions", positions, (B, T), (torch.int64,), device)
    _check(num_heads % kv_heads == 0, f"num_heads {num_heads} is not a multiple of kv_heads {kv_heads}")
    _check(window is None or window >= 1, f"window {window} must be None (no window) or >= 1")
    _check(num_splits is None or num_splits >= 1, f"num_splits {num_splits} must be None or >= 1")
    if B == 0 or T == 0:
        return torch.zeros_like(q)
    if _use_triton("paged_attention", device):
        return _kernel_module("paged_attention").paged_attention(
            q, k_pool, v_pool, req_to_token, rows, positions, scale, window, num_splits, max_keys
        )
    return reference.paged_attention(q, k_pool, v_pool, req_to_token, rows, positions, scale, window)


# ---------------------------------------------------------------------------
# Speculative acceptance
# ---------------------------------------------------------------------------


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [B, K] int64
    num_draft_tokens: torch.Tensor,  # [B] int64 in 0..K
    draft_probs: torch.Tensor | None,  # [B, K, V] float32; None only if all rows greedy
    target_logits: torch.Tensor,  # [B, K + 1, V] float32
    target_probs: torch.Tensor | None,  # [B, K + 1, V] float32; None only if all greedy
    is_greedy: torch.Tensor,  # [B] bool
    uniforms: torch.Tensor,  # [B, K] float32 in [0, 1)
    recovery_noise: torch.Tensor,  # [B, K + 1, V] float32, Exponential(1); see draw_random
) -> tuple[torch.Tensor, torch.Tensor]:  # ([B, K + 1] int64, [B] int64)
    """Verify a speculative block losslessly (Leviathan et al. 2023, arXiv 2211.17192).

    Vocabulary (as in vLLM v1's rejection sampler):

    - accepted tokens: the prefix of the draft tokens the target agrees with;
    - recovered token: emitted at the first rejected position, sampled from
      norm(max(0, p - q)) so that the emitted token is distributed as p;
    - bonus token: emitted after all drafts of a row are accepted, sampled
      from the target's next-position distribution.

    Each row emits its accepted tokens and then exactly one recovered or
    bonus token, so between 1 and num_draft_tokens[b] + 1 tokens.

    Rule for row b (n = num_draft_tokens[b], x_i its drafts):
      greedy rows: accept x_i while x_i == argmax target_logits[b, i]; the
        recovered / bonus token is argmax target_logits[b, j].
      random rows: accept x_i while u_i < min(1, p_i(x_i) / q_i(x_i)),
        p = target_probs, q = draft_probs, u = uniforms; at the first
        rejection j the recovered token is drawn from norm(max(0, p_j - q_j))
        (from p_j if that residual is all zero); if all n drafts are accepted
        the bonus token is drawn from p_n. Draws are the exponential race
        argmax(dist / recovery_noise[b, j]).
    Draft ids outside 0..V-1 are rejected (greedy and random).

    Returns:
      output_token_ids: [B, K + 1] int64, the accepted tokens, then the
        recovered or bonus token, then -1.
      num_accepted: [B] int64, accepted drafts (not counting the emitted
        recovered / bonus token).
    """
    _check(draft_token_ids.dim() == 2, f"draft_token_ids: expected [B, K], got {tuple(draft_token_ids.shape)}")
    _check(target_logits.dim() == 3, f"target_logits: expected [B, K + 1, V], got {tuple(target_logits.shape)}")
    B, K = draft_token_ids.shape
    V = target_logits.shape[-1]
    device = target_logits.device
    _check_tensor("draft_token_ids", draft_token_ids, (B, K), (torch.int64,), device)
    _check_tensor("num_draft_tokens", num_draft_tokens, (B,), (torch.int64,), device)
    _check_tensor("target_logits", target_logits, (B, K + 1, V), (torch.float32,), device)
    _check_tensor("is_greedy", is_greedy, (B,), (torch.bool,), device)
    _check_tensor("uniforms", uniforms, (B, K), (torch.float32,), device)
    _check_noise(recovery_noise, B, K, V, device)
    if target_probs is not None:
        _check_tensor("target_probs", target_probs, (B, K + 1, V), (torch.float32,), device)
        _check(
            draft_probs is not None or K == 0,
            "draft_probs is required with target_probs when K > 0 (random rows need q)",
        )
    else:
        _check(draft_probs is None, "target_probs is required with draft_probs (random rows need p)")
    if draft_probs is not None:
        _check_tensor("draft_probs", draft_probs, (B, K, V), (torch.float32,), device)
    if B == 0:
        return (
            torch.empty((0, K + 1), dtype=torch.int64, device=device),
            torch.empty((0,), dtype=torch.int64, device=device),
        )
    if _use_triton("rejection", device):
        module = _kernel_module("rejection")
        return module.rejection_sample(
            draft_token_ids, num_draft_tokens, draft_probs, target_logits,
            target_probs, is_greedy, uniforms, recovery_noise,
        )
    return reference.rejection_sample(
        draft_token_ids, num_draft_tokens, draft_probs, target_logits,
        target_probs, is_greedy, uniforms, recovery_noise,
    )


def _check_noise(noise: torch.Tensor, B: int, K: int, V: int, device: torch.device) -> None:
    # The noise may be a stride-0 broadcast over the position dim (draw_random
    # returns one); only the vocab dim must be dense.
    _check_tensor("recovery_noise", noise, (B, K + 1, V), (torch.float32,), device, contiguous=False)
    _check(noise.stride(-1) == 1, "recovery_noise: the vocab dim must be contiguous (stride 1)")


def draw_random(
    generators: Sequence[torch.Generator | int | None],
    B: int,
    K: int,
    V: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([B, K] float32, [B, K + 1, V] float32)
    """Draw the randomness rejection_sample consumes, per request.

    Args:
      generators: one entry per row: a torch.Generator (on `device`), an int
        seed (a fresh generator on `device` seeded with it), or None (the
        global default generator; unseeded).
      B, K, V: batch rows, maximum draft length, vocabulary size.
      device: where the tensors are drawn and returned.

    Returns:
      uniforms: [B, K] float32 in [0, 1), the acceptance tests.
      recovery_noise: [B, K + 1, V] float32 Exponential(1), a stride-0 view of
        one [B, V] draw per row. Sharing the noise across positions is exact:
        a row consumes noise at exactly one position (its recovered or bonus
        token), and which position is decided by the uniforms and drafts
        alone, independently of the noise. It also cuts the draw K+1 fold.

    A row's values depend only on its own generator, so a seeded request
    draws the same numbers whatever batch it runs in.
    """
    device = torch.device(device)
    _check(len(generators) == B, f"generators: expected {B} entries, got {len(generators)}")
    uniforms = torch.empty((B, K), dtype=torch.float32, device=device)
    noise = torch.empty((B, V), dtype=torch.float32, device=device)
    unseeded = [b for b, g in enumerate(generators) if g is None]
    for b, gen in enumerate(generators):
        if gen is None:
            continue
        if isinstance(gen, int):
            gen = torch.Generator(device=device).manual_seed(gen)
        uniforms[b].uniform_(generator=gen)
        noise[b].exponential_(generator=gen)
    if unseeded:
        rows = torch.tensor(unseeded, device=device)
        uniforms[rows] = torch.rand((len(unseeded), K), device=device)
        noise[rows] = torch.empty((len(unseeded), V), device=device).exponential_()
    # exponential_ can return exactly 0; 0 / 0 would make the race NaN.
    noise.clamp_(min=torch.finfo(torch.float32).tiny)
    return uniforms, noise[:, None, :].expand(B, K + 1, V)


# ---------------------------------------------------------------------------
# Sampling distribution
# ---------------------------------------------------------------------------


def logits_to_probs(
    logits: torch.Tensor,  # [N, V] float
    temperature: torch.Tensor,  # [N] float, > 0 (greedy rows are not passed)
    top_k: torch.Tensor,  # [N] int64, <= 0 or >= V disables
    top_p: torch.Tensor,  # [N] float in (0, 1], 1 disables
) -> torch.Tensor:  # [N, V] float32
    """Processed sampling distribution shared by the engine and the proposer.

    Temperature scaling, then top-k (ties with the k-th logit are kept), then
    top-p over the top-k distribution (at least one token always survives).
    Plain PyTorch on every device.
    """
    _check(logits.dim() == 2, f"logits: expected [N, V], got {tuple(logits.shape)}")
    N, V = logits.shape
    device = logits.device
    _check_tensor("logits", logits, (N, V), _FLOAT_DTYPES, device, contiguous=False)
    _check_tensor("temperature", temperature, (N,), _FLOAT_DTYPES, device, contiguous=False)
    _check_tensor("top_k", top_k, (N,), (torch.int32, torch.int64), device, contiguous=False)
    _check_tensor("top_p", top_p, (N,), _FLOAT_DTYPES, device, contiguous=False)
    return reference.logits_to_probs(logits, temperature, top_k, top_p)


# ---------------------------------------------------------------------------
# The DSpark Markov head: left-to-right draft sampling
# ---------------------------------------------------------------------------


def markov_sample(
    base: torch.Tensor,  # [B, S, V] float32 base logits of the block
    prev0: torch.Tensor,  # [B] int64 anchor token, in 0..V_in-1
    w1: torch.Tensor,  # [V_in, r] markov_w1 (an embedding), float32/float16/bfloat16
    w2: torch.Tensor,  # [V, r] markov_w2 (a linear: bias = w2 @ e), w1's dtype; V <= V_in
    logit_scale: float,
    num_query: torch.Tensor,  # [B] int64: positions sampled per row (the rest: token -1)
    is_greedy: torch.Tensor,  # [B] bool
    temperature: torch.Tensor,  # [B] float32, > 0 on sampled rows (ignored on greedy rows)
    noise: torch.Tensor,  # [B, S, V] float32 Exponential(1), vocab dim dense
) -> tuple[torch.Tensor, torch.Tensor]:  # ([B, S] int64, [B, S, V] float32)
    """Sample a DSpark draft block left to right through the Markov head.

    Position j's logits are ``base[:, j] + (w2 @ w1[prev]) * logit_scale``,
    the product rounded to the weights' dtype as ``MarkovHead.bias`` returns
    it, with ``prev`` the token drawn at j - 1 (``prev0`` for j = 0): the
    loop of ``DSparkDraft.sample_block``. Greedy rows take the argmax (first
    maximum on ties); sampled rows draw the exponential race
    argmax(q / noise) from q = softmax(logits / temperature). Only positions
    j < num_query[b] are sampled.

    Who may call it: greedy rows and temperature-only rows. A batch with a
    row using top-k or top-p goes through ``DSparkDraft.sample_block`` with
    the engine's sampler (``verifier.sample_draft_tokens``), whose q is
    processed by ``logits_to_probs``; neither the kernel nor the reference
    applies top-k/top-p. The checkpoint's ``draft_topk`` is applied by the
    caller beforehand, masking ``base`` to -inf outside each position's
    top-k (exactly what ``sample_block`` does before adding the bias); -inf
    logits are supported, but every sampled position needs a finite one.

    Noise: sampled rows need an independent draw at every position (a draw
    shared across positions correlates the positions' tokens, unlike
    ``draw_random``'s recovery noise, which a row reads at one position
    only). A stride-0 broadcast is fine where the noise is never read:
    greedy rows, positions past num_query.

    Checks never synchronise with the device: an anchor outside 0..V_in-1
    or a non-positive temperature on a sampled row raises KernelInputError
    for CPU tensors only. On CUDA a row with an out-of-range anchor samples
    nothing (tokens -1) rather than reading outside w1.

    Returns:
      tokens: [B, S] int64, the drafted tokens, -1 past num_query.
      q: [B, S, V] float32, the distribution each sampled token was drawn
        from (for lossless verification); zeros on greedy rows and past
        num_query.
    """
    _check(base.dim() == 3, f"base: expected [B, S, V], got {tuple(base.shape)}")
    _check(w1.dim() == 2, f"w1: expected [V_in, r], got {tuple(w1.shape)}")
    B, S, V = base.shape
    V_in, rank = w1.shape
    device = base.device
    _check(V >= 1 and rank >= 1, f"base vocab {V} and w1 rank {rank} must be >= 1")
    _check_tensor("base", base, (B, S, V), (torch.float32,), device)
    _check_tensor("prev0", prev0, (B,), (torch.int64,), device)
    _check_tensor("w1", w1, (V_in, rank), _FLOAT_DTYPES, device)
    _check_tensor("w2", w2, (V, rank), (w1.dtype,), device)
    _check(V <= V_in, f"w2 has {V} output tokens but w1 embeds only {V_in}: sampled tokens index w1")
    _check_tensor("num_query", num_query, (B,), (torch.int64,), device)
    _check_tensor("is_greedy", is_greedy, (B,), (torch.bool,), device)
    _check_tensor("temperature", temperature, (B,), (torch.float32,), device)
    _check_tensor("noise", noise, (B, S, V), (torch.float32,), device, contiguous=False)
    _check(noise.stride(-1) == 1, "noise: the vocab dim must be contiguous (stride 1)")
    _check(math.isfinite(logit_scale), f"logit_scale must be finite, got {logit_scale}")
    if device.type == "cpu":
        _check_markov_values(prev0, V_in, is_greedy, temperature)
    if B == 0 or S == 0:
        return (
            torch.empty((B, S), dtype=torch.int64, device=device),
            torch.zeros((B, S, V), dtype=torch.float32, device=device),
        )
    if _use_triton("markov", device):
        return _kernel_module("markov").markov_sample(
            base, prev0, w1, w2, logit_scale, num_query, is_greedy, temperature, noise
        )
    return reference.markov_sample(base, prev0, w1, w2, logit_scale, num_query, is_greedy, temperature, noise)


def _check_markov_values(
    prev0: torch.Tensor,  # [B] int64, on the CPU
    vocab_in: int,
    is_greedy: torch.Tensor,  # [B] bool
    temperature: torch.Tensor,  # [B] float32
) -> None:
    bad = (prev0 < 0) | (prev0 >= vocab_in)
    _check(not bool(bad.any()), f"prev0: anchor ids {prev0[bad].tolist()} lie outside w1's 0..{vocab_in - 1}")
    cold = ~is_greedy & ~(temperature > 0)
    _check(not bool(cold.any()), f"temperature: sampled rows {cold.nonzero().flatten().tolist()} need "
                                 "temperature > 0 (mark temperature-0 rows greedy)")
