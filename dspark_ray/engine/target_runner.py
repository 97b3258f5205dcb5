"""TargetRunner: the target model over a paged KV pool, indexed by slot.

One ``step`` call feeds every row's unseen tokens plus its draft tokens,
computes logits at the last k+1 positions, verifies the drafts and keeps KV
for the accepted prefix only. Prefill is the same operation with more unseen
tokens and no drafts; a partial prefill (``VerifyRow.chunk``) feeds at most
its chunk, keeps the KV of everything it fed and emits nothing.

With ``taps`` (a DSpark draft's target layers) the forward also keeps the
residual stream after those layers, and the result carries, per row, the
concatenated taps of the positions it committed (``VerifyResult.context``):
the draft's context is made of them. Positions its prefix cache served were
not computed, so a row's context starts after them; ``make_target_runner``
therefore turns the prefix cache off when the draft is a DSpark one.

KV layout (SGLang's three levels): slot -> ``ReqToTokenTable`` row ->
token indices -> per-layer K/V pools ``[kv_pool_size, kv_heads, head_dim]`` (a
multi-head-latent-attention model, DeepSeek-V3: per-layer latent pools instead,
``LatentKVPool`` in latent_attention.py, addressed the same way).
Token index 0 and table row 0 are padding, so a padded batch entry writes
and reads only the padding token. Rollback after rejection is
``ReqToTokenTable.truncate`` — a length change.

Under tensor parallelism every rank runs this same code on its shard: the
logits are complete on every rank and randomness is derived from seeds, so
all ranks verify identically and keep their KV in lockstep with no extra
communication.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dspark_kernels import cpu as cpu_kernels
from dspark_kernels import ops
from dspark_ray.engine.attention_group import AttentionGroup
from dspark_ray.engine.interfaces import ContextStates, TargetStep, VerifyResult, VerifyRow
from dspark_ray.engine.latent_attention import LatentKVPool
from dspark_ray.engine.logits_rules import apply_rules, needs_rules
from dspark_ray.engine.structured import apply_masks
from dspark_ray.engine.logprobs import token_logprobs
from dspark_ray.engine.outputs import TokenLogprob
from dspark_ray.engine.verifier import mask_vocab, verify
from dspark_ray.model.llama import CausalLM
from dspark_ray.slots import ReqToTokenTable
from dspark_ray.slots.req_to_token import PADDING_TOKEN
from dspark_ray.slots.prefix_cache import CachedTable, PrefixCache


# CUDA only. With a boolean mask, scaled_dot_product_attention's default backend choice paid a
# large one-off cost for every new (batch, query, key) shape on an H200 (tens of ms per new shape
# in a probe; the step's key length grows by one every decode step), so the target's attention is
# pinned to the memory-efficient kernel (math as the fallback for what it cannot run), whose cost
# does not depend on having seen the shape, and the key length is rounded up to a multiple of 64
# (padding keys are masked) so shapes repeat and the mask needs no realignment copy.
KEY_BUCKET = 64

# Tokens per prefix-cache block (vLLM's default block size).
PREFIX_BLOCK = 16
CUDA_ATTENTION_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# True: on CUDA the target attends with the Triton paged kernel (dspark_kernels.paged_attention),
# which reads K/V through the request-to-token table in place; False: gather + SDPA (on CPU a float32
# step of short rows takes the C kernel instead, ``_native_step``). Off until a GPU run has checked the compiled kernel against its reference (issue 20:
# it is tested under Triton's interpreter only); bench/gpu_check.sh runs both.
PAGED_KERNEL = False


# A CPU step whose rows each feed at most this many tokens attends with the C kernel
# (``_native_step``); one with a longer prompt chunk takes the torch path, whose SDPA does a long
# causal prefill's many keys per query faster (1 thread, one row of n tokens, C against torch, us:
# 16: 21/34, 64: 72/74, 128: 232/194, 512: 3742/2628).
NATIVE_MAX_FED = 64


class StaleSlotState(RuntimeError):
    """A row's start position disagrees with the KV the slot holds (a bookkeeping bug)."""


class PackedAttention:
    """Attention callable for one packed step: writes new K/V to the pool, attends through the table.

    The step's tokens are packed into one sequence (``[1, N]``: no padding in
    the projections and MLPs, where the arithmetic is), and each group of
    rows of similar length attends with its queries padded only to the
    group's longest row, so a prefill chunk beside decode rows costs its own
    tokens, not batch x longest row.
    """

    def __init__(
        self,
        k_pools: list[torch.Tensor],  # per layer [P, Hkv, D]
        v_pools: list[torch.Tensor],
        write_index: torch.Tensor,  # [N] int64 pool index of each new token
        groups: list[AttentionGroup],
        sliding_window: int | None = None,
        paged: bool | None = None,
    ) -> None:
        """``paged``: attend with the Triton paged kernel, which reads K/V through the table in place;
        False: gather + SDPA; None: the kernel on CUDA when ``PAGED_KERNEL`` allows it, never on CPU."""
        self.k_pools, self.v_pools = k_pools, v_pools
        self.write_index, self.groups = write_index, groups
        self.sliding_window = sliding_window
        self.paged = PAGED_KERNEL and write_index.is_cuda if paged is None else paged
        self._paged_inputs: list[tuple[torch.Tensor, torch.Tensor]] = []  # per group (rows, positions)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_pool, v_pool = self.k_pools[layer], self.v_pools[layer]
        k_pool.index_copy_(0, self.write_index, k[0].to(k_pool.dtype))
        v_pool.index_copy_(0, self.write_index, v[0].to(v_pool.dtype))
        q = q[0]  # [N, Hq, D]
        out = torch.empty_like(q)
        n_rep = q.shape[1] // k.shape[2]
        for i, g in enumerate(self.groups):
            if g.whole:  # every row the same length (a decode step, or one row): no gather, no scatter
                qg = q.view(*g.queries.shape, *q.shape[1:])
            else:
                qg = _rows(q, g.queries)  # [G, T, Hq, D]
            if self.paged:
                res = self._paged(i, qg, k_pool, v_pool)  # [G, T, Hq, D]
            else:
                res = self._gathered(g, qg, k_pool, v_pool, n_rep)
            if g.whole:
                return res.reshape(1, *q.shape)
            out[g.queries[g.valid]] = res[g.valid]
        return out[None]  # [1, N, Hq, D]

    @staticmethod
    def _gathered(g: AttentionGroup, qg: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  n_rep: int) -> torch.Tensor:  # [G, T, Hq, D]
        """The group's K/V gathered into contiguous rows, then SDPA with the group's mask."""
        keys = _rows(k_pool, g.key_index).transpose(1, 2)  # [G, Hkv, L, D]
        values = _rows(v_pool, g.key_index).transpose(1, 2)
        gqa = {}
        if n_rep > 1 and qg.is_cuda:  # the pinned CUDA kernels take equal head counts
            keys = keys.repeat_interleave(n_rep, dim=1)
            values = values.repeat_interleave(n_rep, dim=1)
        elif n_rep > 1:  # on CPU the kernel shares each K/V head itself, without the copies
            gqa = {"enable_gqa": True}
        res = F.scaled_dot_product_attention(qg.transpose(1, 2), keys.to(qg.dtype), values.to(qg.dtype),
                                             attn_mask=g.mask, **gqa)  # [G, Hq, T, D]
        return res.transpose(1, 2)

    def _paged(self, i: int, qg: torch.Tensor, k_pool: torch.Tensor,
               v_pool: torch.Tensor) -> torch.Tensor:  # [G, T, Hq, D]
        """The Triton paged kernel over group ``i``: the group's key_index rows are its table.

        A query's position is the last key its mask lets it see (the mask is
        ``kp <= p`` and the window, so key p itself always is); padding queries
        get -1. Both are computed once per step, at the first layer."""
        if len(self._paged_inputs) <= i:
            g = self.groups[i]
            key_pos = torch.arange(g.key_index.shape[1], device=g.mask.device)  # [L]
            last = torch.where(g.mask[:, 0], key_pos, -1).amax(dim=-1)  # [G, T]
            rows = torch.arange(g.key_index.shape[0], device=g.mask.device)  # [G]
            self._paged_inputs.append((rows, torch.where(g.valid, last, -1)))
        rows, positions = self._paged_inputs[i]
        key_index = self.groups[i].key_index
        return ops.paged_attention(qg.contiguous(), k_pool, v_pool, key_index, rows, positions,
                                   qg.shape[-1] ** -0.5, self.sliding_window, max_keys=key_index.shape[1])


def _rows(
    pool: torch.Tensor,  # [P, ...]
    index: torch.Tensor,  # [G, L] int64
) -> torch.Tensor:  # [G, L, ...]
    """``pool[index]`` as one index_select over the flat index: on CPU, indexing with a 2-D index
    took a slower generic path (the same gather measured ~10% of a target step at batch 8-32)."""
    return torch.index_select(pool, 0, index.reshape(-1)).view(*index.shape, *pool.shape[1:])


def group_rows(counts: list[int], spread: int = 2) -> list[list[int]]:
    """Row indices grouped by length: within a group the longest row is at most ``spread`` times
    the shortest (or one longer than it), so padding queries to a group's longest row wastes
    little. Decode rows (k + 1 tokens) end up together, prefill chunks apart."""
    order = sorted(range(len(counts)), key=lambda b: counts[b])
    groups: list[list[int]] = []
    for b in order:
        if groups and counts[b] <= max(spread * counts[groups[-1][0]], counts[groups[-1][0]] + 1):
            groups[-1].append(b)
        else:
            groups.append([b])
    return groups


class TargetRunner:
    """Holds the target model, its KV pool and request-to-token table."""

    def __init__(
        self,
        model: CausalLM,
        capacity: int,
        max_context: int,
        kv_pool_size: int,
        max_spec_tokens: int,
        vocab_limit: int | None = None,
        prefix_block: int | None = PREFIX_BLOCK,
        taps: tuple[int, ...] | None = None,
        pad_batches: tuple[int, ...] | None = None,
    ) -> None:
        """``vocab_limit``: ids at or above it (embedding padding the tokenizer lacks) are never emitted.
        ``prefix_block``: tokens per prefix-cache block; None turns prefix caching off.
        ``taps``: layers (ascending, -1 = the embedding output) whose output each step also returns
        for the committed positions (a DSpark draft's ``target_layer_ids``); None: none, at no cost.
        ``pad_batches``: fixed batch sizes for decode and verify steps (NOTE at ``_padded_forward``);
        None: every step at its own size."""
        self.model = model
        self.pad_batches = tuple(sorted(pad_batches)) if pad_batches else ()
        self.padded_steps = 0  # steps run at a padded size (tests, benchmarks)
        self.taps = taps
        self.max_spec_tokens = max_spec_tokens
        self.vocab_limit = vocab_limit if vocab_limit is not None and vocab_limit < model.config.vocab_size else None
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.table = ReqToTokenTable(capacity, max_context, kv_pool_size, self.device)
        cfg = model.config
        # MLA (DeepSeek-V3) keeps its compressed latent per token instead of per-head K/V.
        self.latent = LatentKVPool(cfg, kv_pool_size, self.dtype, self.device) if cfg.mla is not None else None
        self.k_pools: list[torch.Tensor] = []
        self.v_pools: list[torch.Tensor] = []
        if self.latent is None:
            kv_heads = model.model.layers[0].self_attn.k_proj.out_features // cfg.head_dim
            shape = (kv_pool_size, kv_heads, cfg.head_dim)
            self.k_pools = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)]
            self.v_pools = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)]
        self.slot_epoch = [-1] * (capacity + 1)
        self.prefix_cache = PrefixCache(prefix_block, capacity) if prefix_block else None
        self.kv = CachedTable(self.table, self.prefix_cache)
        self.sliding_window = cfg.sliding_window
        # On CUDA: the attention's key length is rounded up and its backend pinned (see KEY_BUCKET).
        cuda = self.device.type == "cuda"
        self.key_bucket = KEY_BUCKET if cuda else 1
        self.attention_backends = CUDA_ATTENTION_BACKENDS if cuda else None

    # -- service API -------------------------------------------------------

    def kv_capacity(self) -> int:
        return self.table.allocator.size - 1

    def kv_free(self) -> int:
        """Free KV tokens, counting the prefix cache's unreferenced blocks (evicted on demand)."""
        return self.kv.available()

    def release(self, slots: list[int]) -> None:
        self.kv.release(slots)
        for s in slots:
            self.slot_epoch[s] = -1

    def _map_cached(self, rows: list[VerifyRow]) -> tuple[list[VerifyRow], list[int]]:
        """The rows as fed: cached blocks mapped into their slots and the rows shifted past them
        (an ordinary row keeps at least its last token to feed, for the logits; a partial prefill
        also one for its final chunk), partial prefills cut to their chunk."""
        out, cached = [], []
        for r in rows:
            m = 0
            if r.prefix_cache:
                if r.start == 0:
                    self.kv.begin(r.slot, r.cache_salt)
                if r.prompt_logprobs is None and len(r.token_ids) > 1:  # a prefill (a scored prompt is fed whole)
                    m = self.kv.map_prefix(r.slot, r.start, r.token_ids, len(r.token_ids) - (2 if r.chunk else 1))
            if r.chunk:  # never the last token: the final chunk feeds it and emits
                n = min(r.chunk, len(r.token_ids) - 1 - m)
                r = dataclasses.replace(r, start=r.start + m, token_ids=r.token_ids[m:m + n])
            elif m:
                r = dataclasses.replace(r, start=r.start + m, token_ids=r.token_ids[m:])
            out.append(r)
            cached.append(m)
        return out, cached

    @torch.inference_mode()
    def step(self, batch: TargetStep) -> VerifyResult:
        if batch.release_slots:
            self.release(batch.release_slots)
        rows = batch.rows
        if not rows:
            return VerifyResult([], [])
        self._bind(rows)
        starts = [r.start for r in rows]
        rows, cached = self._map_cached(rows)
        counts = [len(r.token_ids) + len(r.draft_token_ids) for r in rows]
        indices = self.kv.append([r.slot for r in rows], counts)
        logits, prompt_logits, taps = self._forward(rows, counts, indices)  # [B, K+1, V], per row [n-1, V]
        emitted, accepted = self._verify(rows, logits, batch.draft_probs)
        for b, r in enumerate(rows):
            if r.chunk:  # a prefill chunk: all its KV stays, nothing comes out
                emitted[b], accepted[b] = [], 0
        kept = [r.start + len(r.token_ids) + a for r, a in zip(rows, accepted)]
        # Rejected drafts' positions go back to the pool; a row that kept all it was given (a plain
        # decode step, a prefill) has nothing to cut, and a step of only those skips the table's work.
        cut = [(r.slot, k) for r, k, n in zip(rows, kept, counts) if k < r.start + n]
        if cut:
            self.kv.truncate([slot for slot, _ in cut], [k for _, k in cut])
        for r, k in zip(rows, kept):  # the prefix cache registers the blocks they filled
            if r.prefix_cache:
                self.kv.commit(r.slot, (r.token_ids + r.draft_token_ids)[:k - r.start])
        logprobs = prompt_logprobs = None
        if any(r.logprobs is not None for r in rows):
            logprobs = [None if r.logprobs is None or r.chunk else token_logprobs(logits[b, :len(e)], e, r.logprobs)
                        for b, (r, e) in enumerate(zip(rows, emitted))]
        if prompt_logits:
            prompt_logprobs = [self._prompt_logprobs(r, prompt_logits.get(b)) for b, r in enumerate(rows)]
        return VerifyResult(num_accepted=accepted, emitted=emitted, logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs, cached_tokens=cached,
                            prefilled=[k - s if r.chunk else 0 for r, k, s in zip(rows, kept, starts)],
                            context=None if taps is None else self._context(rows, counts, kept, taps))

    @staticmethod
    def _context(
        rows: list[VerifyRow],
        counts: list[int],
        kept: list[int],  # per row: its KV length after the step
        taps: torch.Tensor,  # [N, n_taps * hidden]: the packed step's taps
    ) -> list[ContextStates | None]:
        """Each row's taps at the positions it committed: its fed tokens and accepted drafts
        (copies, so the step's activations are not kept alive by the rejected ones)."""
        out, offset = [], 0
        for r, n, k in zip(rows, counts, kept):
            out.append(ContextStates(r.start, taps[offset:offset + k - r.start].clone()) if k > r.start else None)
            offset += n
        return out

    @staticmethod
    def _prompt_logprobs(row: VerifyRow, logits: torch.Tensor | None) -> list[TokenLogprob | None] | None:
        """token_ids[1:] scored by the logits before each ([n-1, V]); token_ids[0] has none here."""
        if logits is None:
            return None
        return [None, *token_logprobs(logits, list(row.token_ids[1:]), row.prompt_logprobs)]

    # -- steps ---------------------------------------------------------------

    def _bind(self, rows: list[VerifyRow]) -> None:
        """A slot seen with a new epoch starts empty; otherwise its KV must match ``start``."""
        fresh = [r.slot for r in rows if self.slot_epoch[r.slot] != r.epoch]
        if fresh:
            self.release(fresh)
        for r in rows:
            self.slot_epoch[r.slot] = r.epoch
            held = int(self.table.lengths[r.slot])
            if held != r.start:
                raise StaleSlotState(
                    f"slot {r.slot} (epoch {r.epoch}) holds {held} KV positions but the step starts at {r.start}"
                )

    def _forward(self, rows: list[VerifyRow], counts: list[int], indices: torch.Tensor
                 ) -> tuple[torch.Tensor, dict[int, torch.Tensor], torch.Tensor | None]:
        """Logits at each row's last k+1 entries [B, K+1, V], for rows asking for prompt
        log-probabilities the logits before each of their fed tokens (row b -> [n_b - 1, V]),
        and with ``taps`` the packed step's taps [N, n_taps * hidden] (else None).

        The rows' tokens are packed into one sequence (``PackedAttention``); a
        row's k+1 logits positions past its own tokens (fewer drafts than k)
        repeat its last one and are never read."""
        padded = self._padded_size(rows, counts)
        if padded is not None:
            return self._padded_forward(rows, counts, indices, padded)
        N = sum(counts)
        K1 = self.max_spec_tokens + 1
        dev = self.device
        vocab = self.model.config.vocab_size
        offsets = [0]
        for n in counts:
            offsets.append(offsets[-1] + n)
        tokens = torch.empty(N, dtype=torch.int64)
        positions = torch.empty(N, dtype=torch.int64)
        for b, (r, n) in enumerate(zip(rows, counts)):
            tokens[offsets[b]:offsets[b + 1]] = torch.tensor(self._fed(r, vocab))
            positions[offsets[b]:offsets[b + 1]] = torch.arange(r.start, r.start + n)
        attention = None
        if max(counts) <= NATIVE_MAX_FED:
            token_slots = torch.repeat_interleave(torch.tensor([r.slot for r in rows]), torch.tensor(counts))
            attention = self._native_step(indices, token_slots, positions)
        if attention is None:
            groups = [self._group(rows, counts, offsets, members) for members in group_rows(counts)]
            if self.latent is not None:
                attention = self.latent.attention(indices.to(dev), groups)
            else:
                attention = PackedAttention(self.k_pools, self.v_pools, indices.to(dev), groups, self.sliding_window)
        hidden, taps = self._hidden(tokens, positions, attention)  # [N, H]
        # Logits at the pending token and after each draft: row b's last k_b + 1 entries.
        first = torch.tensor([offsets[b] + len(r.token_ids) - 1 for b, r in enumerate(rows)])
        last = torch.tensor(offsets[1:]) - 1
        gather = torch.minimum(first[:, None] + torch.arange(K1)[None, :], last[:, None])  # [B, K+1]
        picked = hidden[gather.to(dev)]  # [B, K+1, H]
        prompt_logits = {
            b: mask_vocab(self.model.logits(hidden[offsets[b]:offsets[b] + len(r.token_ids) - 1]), self.vocab_limit)
            for b, r in enumerate(rows) if r.prompt_logprobs is not None
        }
        tapped = None if taps is None else torch.cat([taps[i][0] for i in self.taps], dim=-1)
        return mask_vocab(self.model.logits(picked), self.vocab_limit), prompt_logits, tapped

    @staticmethod
    def _fed(row: VerifyRow, vocab: int) -> tuple[int, ...]:
        """The ids a row feeds: its pending tokens and its drafts. A draft whose vocabulary is wider
        than the target's (padded embeddings) can propose ids the target does not have: verification
        rejects them, so a valid id is fed instead."""
        return (*row.token_ids, *(t if t < vocab else 0 for t in row.draft_token_ids))

    def _hidden(self, tokens: torch.Tensor, positions: torch.Tensor, attention
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor] | None]:
        """The packed step ([N] ids and positions, on the host) through the model: [N, H] hidden
        states, and with ``taps`` each tapped layer's [1, N, H] output."""
        backends = sdpa_kernel(self.attention_backends) if self.attention_backends else contextlib.nullcontext()
        taps = None if self.taps is None else dict.fromkeys(self.taps)
        with backends:
            hidden = self.model.hidden_states(tokens[None].to(self.device), positions[None].to(self.device),
                                              attention, taps=taps)[0]
        return hidden, taps

    def _native_step(self, write: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
                     ) -> cpu_kernels.PagedStep | None:
        """The C kernel's attention for a packed step of tokens at ``positions`` [N] in ``slots`` [N],
        written at pool indices ``write`` [N] (all on the host), where it takes this runner (CPU, float32
        pools, per-head K/V); None: the torch path. Token n sees keys ``p - window < k <= p`` of its slot's
        row of the table, ``p`` its own position (a row's length is past every position it feeds)."""
        if self.latent is not None or not cpu_kernels.takes(self.k_pools[0]):
            return None
        lo = (torch.zeros_like(positions) if self.sliding_window is None
              else (positions - self.sliding_window + 1).clamp_min(0))
        return cpu_kernels.PagedStep(self.k_pools, self.v_pools, write, self.table.table,
                                     slots * self.table.table.shape[1], lo, positions)

    def _keys(self, positions: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Key indices [G, L] (pool index of each key position, through the table) and mask
        [G, 1, T, L] of queries at ``positions`` [G, T] over rows of ``lengths`` [G] keys in ``slots``
        [G]: a query at p sees keys k <= p of its own row (and p - window < k with a sliding window)."""
        L = int(lengths.max())
        if self.key_bucket > 1:
            # Keys padded to a bucket (masked off): shape-keyed GPU attention plans are reused
            # instead of rebuilt at every new context length.
            L = min(-(-L // self.key_bucket) * self.key_bucket, self.table.max_context)
        key_pos = torch.arange(L)[None, None, :]
        mask = (key_pos <= positions[:, :, None]) & (key_pos < lengths[:, None, None])
        if self.sliding_window is not None:  # Mistral-style: a query at p sees keys p - window < k <= p
            mask &= key_pos > positions[:, :, None] - self.sliding_window
        dev = self.device
        return self.table.table[slots.to(dev), :L].long(), mask[:, None].to(dev)

    def _padded_size(self, rows: list[VerifyRow], counts: list[int]) -> int | None:
        """The padded batch size of this step, or None to run it at its own size: only decode and
        verify steps are padded (every row one pending token and its drafts, no prompt scored), and
        only up to the largest of ``pad_batches``."""
        if not self.pad_batches or self.latent is not None or len(rows) > self.pad_batches[-1]:
            return None
        if any(len(r.token_ids) != 1 or r.chunk or r.prompt_logprobs is not None for r in rows):
            return None
        if max(counts) > self.max_spec_tokens + 1:
            return None
        return next(n for n in self.pad_batches if n >= len(rows))

    def _padded_forward(self, rows: list[VerifyRow], counts: list[int], indices: torch.Tensor, size: int
                        ) -> tuple[torch.Tensor, dict[int, torch.Tensor], torch.Tensor | None]:
        """``_forward`` for a decode or verify step at the fixed shape [size, k + 1].

        NOTE: padded steps (issue 20). A CUDA graph replays fixed shapes, so a
        decode or verify step runs at the smallest of ``pad_batches`` that
        holds its rows, each row at k + 1 entries. Padding never touches a live
        request: a padding row is slot 0, whose table row maps every position
        to the padding token (index 0 of the KV pool, never handed out), so it
        writes its K/V there and attends to that key alone; a row with fewer
        than k drafts fills its entries past its own with copies of its last
        position that also write to the padding token and whose outputs are
        never read. Live rows never see the padding token: their masks stop at
        their own lengths. So output and every live slot's KV are what the
        unpadded step gives (``tests/test_target_padded.py`` runs both over a
        random schedule). The shape is fixed but for the keys' length L, the
        longest row's context (rounded up to ``key_bucket`` on CUDA); graphs
        over the target's pass (keys at max_context) are the GPU half of this,
        not built yet. The CPU runs the same padding without graphs."""
        B, K1 = len(rows), self.max_spec_tokens + 1
        dev = self.device
        vocab = self.model.config.vocab_size
        tokens = torch.zeros((size, K1), dtype=torch.int64)
        positions = torch.zeros((size, K1), dtype=torch.int64)
        write = torch.full((size, K1), PADDING_TOKEN, dtype=torch.int64)
        lengths = torch.ones(size, dtype=torch.int64)  # a padding row sees key 0 alone
        slots = torch.zeros(size, dtype=torch.int64)  # padding rows: slot 0, the padding row
        offset = 0
        for b, (r, n) in enumerate(zip(rows, counts)):
            tokens[b, :n] = torch.tensor(self._fed(r, vocab))
            tokens[b, n:] = tokens[b, n - 1]
            positions[b] = r.start + torch.minimum(torch.arange(K1), torch.tensor(n - 1))
            write[b, :n] = indices[offset:offset + n]
            lengths[b] = r.start + n
            slots[b] = r.slot
            offset += n
        attention = self._native_step(write.view(-1), slots[:, None].expand(size, K1).reshape(-1), positions.view(-1))
        if attention is None:
            key_index, mask = self._keys(positions, lengths, slots)
            group = AttentionGroup(torch.arange(size * K1).view(size, K1).to(dev),
                                   torch.ones((size, K1), dtype=torch.bool, device=dev), key_index, mask, whole=True)
            attention = PackedAttention(self.k_pools, self.v_pools, write.view(-1).to(dev), [group],
                                        self.sliding_window)
        hidden, taps = self._hidden(tokens.view(-1), positions.view(-1), attention)  # [size * K1, H]
        # Row b's logits at its pending token and after each draft; entries past its own repeat its last.
        base = torch.arange(B)[:, None] * K1
        picked = hidden[(base + torch.minimum(torch.arange(K1)[None, :],
                                              torch.tensor(counts)[:, None] - 1)).to(dev)]  # [B, K1, H]
        self.padded_steps += 1
        tapped = None
        if taps is not None:  # the live entries, packed in row order as _forward gives them
            live = torch.cat([torch.arange(b * K1, b * K1 + n) for b, n in enumerate(counts)]).to(dev)
            tapped = torch.cat([taps[i][0][live] for i in self.taps], dim=-1)
        return mask_vocab(self.model.logits(picked), self.vocab_limit), {}, tapped

    def _group(self, rows: list[VerifyRow], counts: list[int], offsets: list[int],
               members: list[int]) -> AttentionGroup:
        """The attention inputs of some rows: queries padded to the longest, keys to the longest context."""
        T = max(counts[b] for b in members)
        lengths = torch.tensor([rows[b].start + counts[b] for b in members])  # [G] keys per row
        steps = torch.arange(T)[None, :]  # [1, T]
        n = torch.tensor([counts[b] for b in members])[:, None]  # [G, 1]
        valid = steps < n  # [G, T]
        queries = torch.where(valid, torch.tensor([offsets[b] for b in members])[:, None] + steps, 0)
        starts = torch.tensor([rows[b].start for b in members])[:, None]
        positions = starts + torch.minimum(steps, n - 1)  # padding queries repeat the last position
        key_index, mask = self._keys(positions, lengths, torch.tensor([rows[b].slot for b in members]))
        dev = self.device
        whole = len(members) == len(rows) and members == sorted(members) and bool(valid.all())
        return AttentionGroup(queries.to(dev), valid.to(dev), key_index, mask, whole)

    def _verify(self, rows: list[VerifyRow], logits: torch.Tensor,
                draft_probs: torch.Tensor | None) -> tuple[list[list[int]], list[int]]:
        B, K = len(rows), self.max_spec_tokens
        drafts = torch.zeros((B, K), dtype=torch.int64)
        for b, r in enumerate(rows):
            drafts[b, :len(r.draft_token_ids)] = torch.tensor(r.draft_token_ids, dtype=torch.int64)
        num_draft = torch.tensor([len(r.draft_token_ids) for r in rows], dtype=torch.int64)
        first_positions = [r.start + len(r.token_ids) for r in rows]
        if draft_probs is not None:
            draft_probs = fit_vocab(draft_probs.to(self.device, torch.float32), logits.shape[-1])
        sampling = [r.sampling for r in rows]
        masked = any(r.allowed is not None for r in rows)
        if masked or needs_rules(sampling):  # on a copy: reported log-probabilities are the raw ones
            logits = logits.clone()
            if masked:  # structured outputs: the grammar first, then the rules
                apply_masks(logits, [r.allowed for r in rows])
            if needs_rules(sampling):
                logits = apply_rules(logits, sampling, [r.draft_token_ids for r in rows])
        out, accepted = verify(logits, drafts.to(self.device), num_draft.to(self.device), draft_probs,
                               sampling, first_positions)
        out, accepted = out.tolist(), accepted.tolist()
        emitted = [row[: a + 1] for row, a in zip(out, accepted)]
        return emitted, accepted


def fit_vocab(
    draft_probs: torch.Tensor,  # [B, K, Vd] float32, the draft's q
    vocab: int,  # the target's vocabulary size V
) -> torch.Tensor:  # [B, K, V] float32, contiguous
    """The draft's q over the target's vocabulary.

    Draft and target share a tokenizer but may pad their embeddings to
    different sizes. Ids only the draft has get target probability 0, so a
    draft token among them is always rejected; dropping their q mass leaves
    the residual max(0, p - q) over the target's ids unchanged, so the rule
    stays exact. Ids only the target has were never proposed: q is 0 there.
    """
    width = draft_probs.shape[-1]
    if width > vocab:
        return draft_probs[..., :vocab].contiguous()
    if width < vocab:
        return F.pad(draft_probs, (0, vocab - width))
    return draft_probs
