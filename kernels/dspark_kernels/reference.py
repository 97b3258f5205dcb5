"""Plain-PyTorch references for every kernel in this package.

Each function here defines what its Triton kernel must compute, and is also
the CPU path: `dspark_kernels.ops` calls these whenever a tensor is not on a
CUDA device (or the reference backend is forced). They are written for
clarity and vectorised with torch ops, never with Python loops over tokens.

Layout shared with the slot manager (see DESIGN.md): every per-slot buffer has
`num_slots + 1` rows and row 0 is the padding row. The draft window cache of
one layer is a ring per slot, `[num_slots + 1, ring, kv_heads, head_dim]`;
absolute position `p` lives at ring index `p % ring`. `cache_lengths[slot]`
counts the positions written in the slot's current epoch, so a slot rebound to
a new request reads none of its previous owner's ring.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Positions below zero mark padding entries throughout.
PAD_POSITION = -1
# Token id written after the emitted tokens of a row.
PLACEHOLDER_TOKEN_ID = -1


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)``: the first index of each row's largest value (NaN counts as largest),
    computed as ``x.max(dim=-1).indices``, which gives the same indices, ties and NaN included, and
    on CPU takes ~0.6x the time (torch 2.13, 1 thread: 71 against 116 us over [16, 4096] float32,
    175 against 287 us over [8, 5, 4096]): a greedy step takes one over the target's logits and
    one per draft pass."""
    return x.max(dim=-1).indices


def ring_write(
    k_cache: torch.Tensor,  # [num_slots + 1, ring, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots + 1, ring, kv_heads, head_dim]
    slots: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, T] int64, < 0 = padding (skipped)
    k: torch.Tensor,  # [B, T, kv_heads, head_dim]
    v: torch.Tensor,  # [B, T, kv_heads, head_dim]
) -> None:
    """Scatter a step's new K/V into each slot's ring at `position % ring`."""
    ring_write_planned(k_cache, v_cache, RingPlan.of(slots, positions, k_cache.shape[1]), k, v)


class RingPlan:
    """Where a step's entries go in the rings: the same for every layer of one forward pass."""

    def __init__(self, rows: torch.Tensor, cols: torch.Tensor, slot: torch.Tensor, ring_index: torch.Tensor) -> None:
        self.rows, self.cols, self.slot, self.ring_index = rows, cols, slot, ring_index

    @classmethod
    def of(cls, slots: torch.Tensor, positions: torch.Tensor, ring: int) -> RingPlan:
        rows, cols = torch.nonzero(positions >= 0, as_tuple=True)
        return cls(rows, cols, slots[rows], positions[rows, cols] % ring)


def ring_write_planned(k_cache: torch.Tensor, v_cache: torch.Tensor, plan: RingPlan, k: torch.Tensor,
                       v: torch.Tensor) -> None:
    """``ring_write`` with the entries' places computed already (``RingPlan``)."""
    k_cache[plan.slot, plan.ring_index] = k[plan.rows, plan.cols].to(k_cache.dtype)
    v_cache[plan.slot, plan.ring_index] = v[plan.rows, plan.cols].to(v_cache.dtype)


def window_attention(
    q: torch.Tensor,  # [B, T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots + 1, ring, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots + 1, ring, kv_heads, head_dim]
    slots: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, T] int64 query positions, < 0 = padding
    cache_lengths: torch.Tensor,  # [num_slots + 1] int64
    window: int,
    scale: float,
) -> torch.Tensor:  # [B, T, num_heads, head_dim], q.dtype
    """Sliding-window attention of each query over its slot's ring.

    A query at position p attends to key positions kp with
    max(0, p - window + 1) <= kp <= p and kp < cache_lengths[slot]. Padding
    queries (p < 0) and queries with no visible key produce zeros.

    NOTE: ring index r holds, for a query at p, the latest position
    kp <= p with kp % ring == r, i.e. kp = p - ((p - r) mod ring). Because
    window <= ring that is the only candidate inside the window, so the mask
    over ring indices is exact. Ring entries never written in the current
    epoch (r >= cache_length) are zeroed before use so that stale or poisoned
    (NaN) contents cannot leak through a zero attention weight.
    """
    plan = WindowPlan.of(slots, positions, cache_lengths, k_cache.shape[1], window)
    return window_attention_planned(q, k_cache, v_cache, slots, plan, scale)


class WindowPlan:
    """Which ring entries each query sees: the same for every layer of one forward pass (every
    layer writes the same positions, so the lengths after the first layer's write hold for all)."""

    def __init__(self, live: torch.Tensor, mask: torch.Tensor, any_visible: torch.Tensor) -> None:
        self.live, self.mask, self.any_visible = live, mask, any_visible
        # Whether the masking below changes anything (asked once a pass, not per layer): once a slot has
        # written its whole ring every entry is live, and only padding queries see no key.
        self.all_live = bool(live.all())
        self.all_visible = bool(any_visible.all())

    @classmethod
    def of(cls, slots: torch.Tensor, positions: torch.Tensor, cache_lengths: torch.Tensor, ring: int,
           window: int) -> WindowPlan:
        length = cache_lengths[slots]  # [B]
        ring_index = torch.arange(ring, device=positions.device)  # [ring]
        live = (ring_index[None, :] < length[:, None])[:, None, :, None]  # [B, 1, ring, 1]
        p = positions[:, :, None]  # [B, T, 1]
        key_pos = p - torch.remainder(p - ring_index, ring)  # [B, T, ring]
        visible = (
            (p >= 0)
            & (key_pos >= 0)
            & (key_pos > p - window)
            & (key_pos < length[:, None, None])
        )  # [B, T, ring]
        any_visible = visible.any(dim=-1)  # [B, T]
        # A query that sees nothing attends to everything (a finite softmax) and is zeroed after.
        mask = (visible | ~any_visible[:, :, None])[:, None]  # [B, 1, T, ring]
        return cls(live, mask, any_visible)


def window_attention_planned(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                             plan: WindowPlan, scale: float) -> torch.Tensor:
    """``window_attention`` with the visibility computed already (``WindowPlan``)."""
    k = k_cache[slots].transpose(1, 2).float()  # [B, kvh, ring, D]
    v = v_cache[slots].transpose(1, 2).float()
    if not plan.all_live:  # entries not written in the slot's epoch may hold anything, NaN included
        k, v = torch.where(plan.live, k, 0.0), torch.where(plan.live, v, 0.0)
    out = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k, v, attn_mask=plan.mask, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[2]).transpose(1, 2)  # [B, T, H, D]
    if not plan.all_visible:
        out = torch.where(plan.any_visible[:, :, None, None], out, 0.0)
    return out.to(q.dtype)


def paged_attention(
    q: torch.Tensor,  # [B, T, num_heads, head_dim]
    k_pool: torch.Tensor,  # [P, kv_heads, head_dim]
    v_pool: torch.Tensor,  # [P, kv_heads, head_dim]
    req_to_token: torch.Tensor,  # [R, C] int32/int64: pool index of (table row, position)
    rows: torch.Tensor,  # [B] int64 table row of each batch row
    positions: torch.Tensor,  # [B, T] int64 query positions, < 0 = padding
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [B, T, num_heads, head_dim], q.dtype
    """The target's decode/verify attention: gather each row's K/V through the table, then SDPA.

    A query at position p attends to key positions kp with p - window < kp <= p
    (no window: 0 <= kp <= p), key kp read at pool index
    ``req_to_token[rows[b], kp]``. Padding queries (p < 0) return zeros. This
    is what ``PackedAttention`` computes today (gather, boolean mask, SDPA in
    q's dtype, K/V cast to it, heads grouped), with keys only up to the
    batch's last query position instead of a bucketed length: masked keys add
    nothing.
    """
    keys_len = max(int(positions.max()) + 1, 1)
    key_index = req_to_token[rows, :keys_len].long()  # [B, L]
    keys = k_pool[key_index].transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
    values = v_pool[key_index].transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
    p = positions[:, :, None]  # [B, T, 1]
    kp = torch.arange(keys_len, device=q.device)  # [L]
    visible = (p >= 0) & (kp <= p)  # [B, T, L]
    if window is not None:
        visible &= kp > p - window
    live = visible.any(dim=-1)  # [B, T]
    # A padding query attends to everything (a finite softmax) and is zeroed after.
    mask = (visible | ~live[:, :, None])[:, None]  # [B, 1, T, L]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=keys.shape[1] != q.shape[2])  # [B, Hq, T, D]
    return torch.where(live[:, :, None, None], out.transpose(1, 2), 0.0).to(q.dtype)


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [B, K] int64
    num_draft_tokens: torch.Tensor,  # [B] int64 in 0..K
    draft_probs: torch.Tensor | None,  # [B, K, V] float32
    target_logits: torch.Tensor,  # [B, K + 1, V] float32
    target_probs: torch.Tensor | None,  # [B, K + 1, V] float32
    is_greedy: torch.Tensor,  # [B] bool
    uniforms: torch.Tensor,  # [B, K] float32 in [0, 1)
    recovery_noise: torch.Tensor,  # [B, K + 1, V] float32, Exponential(1)
) -> tuple[torch.Tensor, torch.Tensor]:  # ([B, K + 1] int64, [B] int64)
    """Speculative acceptance (Leviathan et al. 2023), see ops.rejection_sample."""
    B, K = draft_token_ids.shape
    V = target_logits.shape[-1]
    device = draft_token_ids.device
    steps = torch.arange(K, device=device)  # [K]
    in_range = (draft_token_ids >= 0) & (draft_token_ids < V)  # [B, K]
    tokens = draft_token_ids.clamp(0, V - 1)  # [B, K]

    target_argmax = first_argmax(target_logits)  # [B, K + 1]
    accept = in_range & (tokens == target_argmax[:, :K])  # [B, K] greedy rule
    if target_probs is not None and K > 0:
        assert draft_probs is not None
        p = target_probs[:, :K].gather(-1, tokens[..., None])[..., 0]  # [B, K]
        q = draft_probs.gather(-1, tokens[..., None])[..., 0]  # [B, K]
        # u < min(1, p/q)  <=>  u * q < p  for u in [0, 1), q >= 0.
        random_accept = in_range & (uniforms * q < p)
        accept = torch.where(is_greedy[:, None], accept, random_accept)
    accept &= steps[None, :] < num_draft_tokens[:, None]
    # Accepted drafts are a prefix: count until the first rejection.
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]
    emit_pos = num_accepted  # [B] where the recovered / bonus token goes

    emitted = target_argmax.gather(1, emit_pos[:, None])[:, 0]  # [B] greedy
    if target_probs is not None:
        random_token = _sample_emitted(
            emit_pos, num_draft_tokens, draft_probs, target_probs, recovery_noise
        )
        emitted = torch.where(is_greedy, emitted, random_token)

    out = torch.full((B, K + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    out[:, :K] = torch.where(steps[None, :] < num_accepted[:, None], draft_token_ids, out[:, :K])
    out.scatter_(1, emit_pos[:, None], emitted[:, None])
    return out, num_accepted


def _sample_emitted(
    emit_pos: torch.Tensor,  # [B] int64
    num_draft_tokens: torch.Tensor,  # [B] int64
    draft_probs: torch.Tensor | None,  # [B, K, V] float32
    target_probs: torch.Tensor,  # [B, K + 1, V] float32
    recovery_noise: torch.Tensor,  # [B, K + 1, V] float32
) -> torch.Tensor:  # [B] int64
    """Recovered token from norm(max(0, p - q)) or bonus token from p.

    Sampling is the exponential race argmax(dist / noise), which picks index i
    with probability dist_i / sum(dist) without normalising. If the residual
    is identically zero (p == q up to rounding, so rejection had probability
    zero) the target distribution itself is used.
    """
    B, _, V = target_probs.shape
    index = emit_pos[:, None, None].expand(B, 1, V)  # [B, 1, V]
    p = target_probs.gather(1, index)[:, 0]  # [B, V]
    noise = recovery_noise.gather(1, index)[:, 0]  # [B, V]
    is_bonus = emit_pos >= num_draft_tokens  # [B]
    if draft_probs is None or draft_probs.shape[1] == 0:
        dist = p
    else:
        q_index = emit_pos.clamp(max=draft_probs.shape[1] - 1)[:, None, None].expand(B, 1, V)
        q = draft_probs.gather(1, q_index)[:, 0]  # [B, V]
        residual = (p - q).clamp(min=0.0)  # [B, V]
        use_residual = ~is_bonus & (residual > 0).any(dim=-1)  # [B]
        dist = torch.where(use_residual[:, None], residual, p)
    return first_argmax(dist / noise)


def logits_to_probs(
    logits: torch.Tensor,  # [N, V] float
    temperature: torch.Tensor,  # [N] float, > 0
    top_k: torch.Tensor,  # [N] int64, <= 0 or >= V disables
    top_p: torch.Tensor,  # [N] float in (0, 1], 1 disables
) -> torch.Tensor:  # [N, V] float32
    """Processed sampling distribution: temperature, then top-k, then top-p.

    Rows with temperature 0 are greedy and must not be passed here. Top-k
    keeps every token tied with the k-th largest logit; top-p keeps the
    smallest prefix of the sorted distribution whose mass reaches top_p
    (always at least the most likely token).

    Only the rows that truncate (top-k below V, or top-p below 1) are sorted: a
    row with both disabled is the softmax of its scaled logits, all of them
    (the OpenAI API's default sampling, temperature 1 and nothing else, sends
    only such rows; sorting 4096 logits of each had been half the cost of a
    sampled speculative step).
    """
    N, V = logits.shape
    scaled = logits.float() / temperature.float()[:, None]  # [N, V]
    truncates = ((top_k > 0) & (top_k < V)) | (top_p.float() < 1.0)  # [N]
    if bool(truncates.all()):
        return _truncated_probs(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    rows = truncates.nonzero()[:, 0]
    if rows.numel() == 0:
        return probs
    probs[rows] = _truncated_probs(scaled[rows], top_k[rows], top_p[rows])
    return probs


def _truncated_probs(
    scaled: torch.Tensor,  # [N, V] float32, temperature applied
    top_k: torch.Tensor,  # [N] int64
    top_p: torch.Tensor,  # [N] float
) -> torch.Tensor:  # [N, V] float32
    """``logits_to_probs`` of rows that truncate: sorted, top-k, then top-p."""
    N, V = scaled.shape
    sorted_logits, _ = scaled.sort(dim=-1, descending=True)  # [N, V]

    k = torch.where((top_k <= 0) | (top_k >= V), V, top_k).clamp(min=1)  # [N]
    kth = sorted_logits.gather(1, (k - 1)[:, None])  # [N, 1]
    keep = scaled >= kth  # [N, V]

    sorted_probs = torch.softmax(sorted_logits.masked_fill(
        torch.arange(V, device=scaled.device)[None, :] >= k[:, None], float("-inf")
    ), dim=-1)  # [N, V]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [N, V]
    in_nucleus = mass_before < top_p.float()[:, None]  # [N, V]
    # Smallest logit still inside the nucleus (rank 0 is always inside).
    last = in_nucleus.sum(dim=-1, keepdim=True) - 1  # [N, 1]
    threshold = sorted_logits.gather(1, last)  # [N, 1]
    keep &= scaled >= threshold
    return torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)


def markov_sample(
    base: torch.Tensor,  # [B, S, V] float32 base logits
    prev0: torch.Tensor,  # [B] int64 anchor token (before position 0)
    w1: torch.Tensor,  # [V_in, r] markov_w1 (an embedding)
    w2: torch.Tensor,  # [V, r] markov_w2 (a linear: bias = w2 @ e), w1's dtype
    logit_scale: float,
    num_query: torch.Tensor,  # [B] int64: positions sampled per row
    is_greedy: torch.Tensor,  # [B] bool
    temperature: torch.Tensor,  # [B] float32, > 0 on sampled rows
    noise: torch.Tensor,  # [B, S, V] float32 Exponential(1)
) -> tuple[torch.Tensor, torch.Tensor]:  # ([B, S] int64, [B, S, V] float32)
    """The DSpark Markov head's left-to-right sampling, see ops.markov_sample.

    Position j's logits are ``base[:, j] + F.linear(w1[prev], w2).float() * logit_scale``
    (``MarkovHead.bias`` in the weights' dtype, as ``DSparkDraft.sample_block``);
    greedy rows take their argmax, sampled rows the exponential race
    argmax(q / noise) with q = softmax(logits / T). A row whose anchor lies
    outside 0..V_in-1 samples nothing. The loop over positions is inherent:
    each bias depends on the token sampled just before.
    """
    B, S, V = base.shape
    device = base.device
    tokens = torch.full((B, S), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    q = torch.zeros((B, S, V), dtype=torch.float32, device=device)
    live = (prev0 >= 0) & (prev0 < w1.shape[0])  # [B]
    # Greedy rows may carry temperature 0; they never read their softmax.
    safe_temperature = torch.where(is_greedy, 1.0, temperature.float())[:, None]  # [B, 1]
    prev = prev0.clamp(0, w1.shape[0] - 1)  # [B]
    for j in range(S):
        logits = base[:, j] + F.linear(w1[prev], w2).float() * logit_scale  # [B, V]
        probs = torch.softmax(logits / safe_temperature, dim=-1)  # [B, V]
        sampled = (probs / noise[:, j]).argmax(dim=-1)  # [B]
        token = torch.where(is_greedy, logits.argmax(dim=-1), sampled)  # [B]
        active = live & (j < num_query)  # [B]
        tokens[:, j] = torch.where(active, token, PLACEHOLDER_TOKEN_ID)
        q[:, j] = torch.where((active & ~is_greedy)[:, None], probs, 0.0)
        prev = token
    return tokens, q
