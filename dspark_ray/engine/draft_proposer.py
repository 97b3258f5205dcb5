"""DraftProposer: the draft model over a per-slot sliding-window ring cache.

For each row it (1) rolls the slot's cache back to ``start`` (rejected
provisional tokens vanish), (2) catches up on the tokens the target accepted
since its last call, and (3) drafts ``num_draft`` tokens autoregressively,
sampling from its own processed distribution q (kept for verification) or
taking the argmax for greedy rows.

The cache holds only the last ``window + max_spec_tokens`` positions per slot,
so a long catch-up (a new prompt) runs as one full-sequence windowed forward
whose last positions are then written to the ring; short catch-ups and the
drafting steps read and write the ring through ``dspark_kernels``.

NOTE: padded drafting passes (issue 20). With ``pad_batches`` the k - 1
one-token passes of a proposal run at a fixed set of batch sizes: a proposal
of B rows runs at the smallest size >= B, and every added entry is padding
on slot 0 at position -1 (token 0, nothing fed), which the ring write skips
and the window attention masks, so it reads and writes only row 0 and
changes no live slot and no output (tested on CPU, where padding is pure
overhead and off by default). On CUDA the fixed sizes are what CUDA graphs
need: with ``cuda_graphs`` (``EngineConfig.cuda_graphs``, on by default) each
size's pass is captured once over static buffers and replayed, so a pass
costs one graph launch instead of a launch per kernel. Checked on an H200
(fourteenth session, bench/gpu_check.sh and bench/spec.py --eager-draft):
output unchanged (tests/test_engine_cuda.py); over two runs the draft's time
per step fell 9.1 -> 3.2 and 6.9 -> 3.4 ms at batch 1, and the engine ran
1.28-1.49x as fast at batch 1-8. The catch-up pass (a varying number of
tokens per row) stays eager.

NOTE: drafting ahead (``ahead``; the served draft worker, ``draft_ahead``).
With one request in flight the served engine drafts it in one step and
verifies it in the next, so the draft worker idles while the target
verifies. ``draft_ahead`` fills that idle time: after a greedy proposal for
the engine's only request (``ProposeRow.alone``: with others about, even a
one-row proposal's idle time is not the machine's spare time; drafting ahead
then measured 0.86x at concurrency 8) d1..dk it assumes every draft is accepted, feeds dk, takes its own
argmax b as a guess of the target's bonus token, feeds b and drafts the next
k tokens, and keeps them for the slot. The next proposal for that slot is
answered from them, with no model pass, exactly when it asks for what was
guessed: same epoch, start at dk's position, tokens (dk, b). Otherwise it
runs as always and the kept drafts are dropped. The worker stops drafting
ahead after the pass in which a call arrives (a call never waits for more
than one pass) and keeps what it has; a proposal that uses a cut-short
block drafts the rest itself. The
cache is then what the ordinary path would have left (the same tokens at the
same positions; computed one token per pass rather than in one catch-up
pass, so K/V can differ in the last bits), and drafts are only proposals:
the target verifies them, so output is unchanged. Greedy rows only: a
sampled row's drafts must not depend on timing. Drafting ahead writes up to
2k provisional positions past the committed length, so the ring has 2k
slack instead of k (rollback stays a length change; see DraftWindowCache).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dspark_kernels import cpu as cpu_kernels
from dspark_kernels import ops, reference
from dspark_ray.engine.interfaces import Proposal, ProposeRow
from dspark_ray.engine.logits_rules import apply_rules, needs_rules
from dspark_ray.engine.structured import SlotGrammars, fill_mask, unpack
from dspark_ray.engine.verifier import mask_vocab, sample_draft_tokens
from dspark_ray.model.llama import CausalAttention, CausalLM
from dspark_ray.model.mla import refuse_as_draft
from dspark_ray.slots import DraftWindowCache


# Padded batch sizes for the drafting passes (module docstring).
PAD_BATCHES = (1, 2, 4, 8, 16, 32, 64)


class DraftCacheBehind(RuntimeError):
    """A row starts past what the slot's draft cache holds (e.g. after a proposer restart)."""


@dataclass
class AheadCounts:
    """What drafting ahead did (module docstring): proposals drafted ahead, and how many of them the
    next proposal used or dropped."""

    drafted: int = 0
    used: int = 0
    dropped: int = 0
    cut_short: int = 0  # of ``drafted``: a call came before all k drafts were (the rest drafted then)


class RingAttention:
    """Attention callable over the window cache: write this step's K/V, then attend.

    On CPU, in float32, one call of the C kernel per layer writes and attends
    (``dspark_kernels.cpu.RingStep``; the first layer of a pass also grows the slots'
    lengths). Otherwise, on the CPU path (the kernels' torch references) where each entry goes
    in the ring and what each query sees is worked out once per forward pass, at the first
    layer, and reused by the others: every layer writes the same positions (a draft pass is two
    layers of a few ops each, and these masks were a third of its time)."""

    def __init__(self, cache: DraftWindowCache, slots: torch.Tensor, positions: torch.Tensor) -> None:
        self.cache, self.slots, self.positions = cache, slots, positions  # [B], [B, T]
        self.planned = not ops.uses_triton("window_attention", cache.k[0].device)
        self._native: cpu_kernels.RingStep | bool | None = None  # the C kernel's pass (decided at its first layer)
        self._ring_plan: reference.RingPlan | None = None
        self._window_plan: reference.WindowPlan | None = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c = self.cache
        scale = q.shape[-1] ** -0.5
        if self._native is None:  # the pass's first layer
            native = self.planned and cpu_kernels.takes(q, k, v, c.k[layer])
            self._native = native and cpu_kernels.RingStep(c.k, c.v, *c.checked(self.slots, self.positions),
                                                           c.length, c.window)
        if self._native:
            return self._native(layer, q, k, v)
        if not self.planned:
            c.append(layer, self.slots, self.positions, k.contiguous(), v.contiguous())
            return ops.window_attention(q.contiguous(), c.k[layer], c.v[layer], self.slots, self.positions,
                                        c.length, c.window, scale)
        if self._ring_plan is None:  # the first layer: positions checked, the slots' lengths moved on
            slots, positions = c.cover(self.slots, self.positions)
            self._ring_plan = reference.RingPlan.of(slots, positions, c.ring)
            self._window_plan = reference.WindowPlan.of(slots, positions, c.length, c.ring, c.window)
        reference.ring_write_planned(c.k[layer], c.v[layer], self._ring_plan, k, v)
        return reference.window_attention_planned(q, c.k[layer], c.v[layer], self.slots, self._window_plan, scale)


class RecordingAttention(CausalAttention):
    """Windowed full-sequence attention that also keeps each layer's K/V."""

    def __init__(self, window: int) -> None:
        super().__init__(window)
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, layer, q, k, v):
        self.kv.append((k, v))
        return super().__call__(layer, q, k, v)


class DraftProposer:
    def __init__(self, model: CausalLM, capacity: int, window: int, max_spec_tokens: int,
                 vocab_limit: int | None = None, grammars: SlotGrammars | None = None,
                 pad_batches: tuple[int, ...] | None = None, cuda_graphs: bool = True,
                 ahead: bool = False) -> None:
        """``vocab_limit``: ids at or above it (embedding padding the tokenizer lacks) are never proposed.
        ``grammars``: matchers per slot for structured-output rows (without them their drafts are
        unconstrained, and the engine cuts each draft at its first forbidden token).
        ``pad_batches``: the drafting passes' fixed batch sizes (module docstring); None: unpadded,
        or ``PAD_BATCHES`` when graphs are on. ``cuda_graphs``: capture them when the model is on
        CUDA (ignored elsewhere). ``ahead``: ``draft_ahead`` may be called between proposals
        (module docstring); the ring then has 2k positions of slack."""
        self.model = model
        self.grammars = grammars
        cfg = model.config
        self.vocab_limit = vocab_limit if vocab_limit is not None and vocab_limit < cfg.vocab_size else None
        param = next(model.parameters())
        self.device = param.device
        refuse_as_draft(cfg)
        kv_heads = model.model.layers[0].self_attn.k_proj.out_features // cfg.head_dim
        self.max_spec_tokens = max_spec_tokens
        self.ahead = ahead
        self.ahead_counts = AheadCounts()
        self._last: tuple[ProposeRow, list[int]] | None = None  # the last one-row greedy proposal
        self._kept: dict[int, tuple[ProposeRow, list[int]]] = {}  # slot -> (the row guessed, its drafts)
        slack = 2 * max_spec_tokens if ahead else max_spec_tokens
        self.cache = DraftWindowCache(cfg.num_layers, capacity, window, slack, kv_heads,
                                      cfg.head_dim, dtype=param.dtype, device=self.device)
        # A catch-up of this many tokens can go through the ring without overwriting
        # history that its own first query still needs.
        self.ring_chunk = self.cache.ring - window + 1
        # The tokens the ring's K/V and the next logits depend on (see _tail_forward).
        self.tail = cfg.num_layers * (window - 1) + 1
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        if pad_batches is None and self.cuda_graphs:
            pad_batches = PAD_BATCHES
        self.pad_batches = tuple(sorted(pad_batches)) if pad_batches else ()
        self._padded: dict[int, PaddedPass] = {}

    @torch.inference_mode()
    def propose(self, rows: list[ProposeRow]) -> Proposal:
        if not rows:
            return Proposal([], None)
        self._last = None
        if self._kept:
            kept = self._use_kept(rows)
            if kept is not None:
                return kept
        proposal = self._propose(rows)
        if self.ahead and len(rows) == 1 and self._aheadable(rows[0]):
            self._last = (rows[0], proposal.draft_token_ids[0])
        return proposal

    def _propose(self, rows: list[ProposeRow]) -> Proposal:
        slots = torch.tensor([r.slot for r in rows], dtype=torch.int64, device=self.device)
        self.cache.bind(slots, torch.tensor([r.epoch for r in rows], device=self.device))
        self._rollback(rows, slots)
        logits = self._catch_up(rows, slots)  # [B, V] next-token logits
        return self._draft(rows, slots, logits)

    # -- drafting ahead (module docstring) ---------------------------------------------

    @staticmethod
    def _aheadable(row: ProposeRow) -> bool:
        return (row.alone and row.num_draft > 0 and row.grammar is None and row.sampling.greedy
                and not needs_rules([row.sampling]))

    def _use_kept(self, rows: list[ProposeRow]) -> Proposal | None:
        """The drafts kept for a one-row proposal that asks for what was guessed (and, if drafting
        ahead was cut short, the rest drafted now); every slot in ``rows`` loses what was kept for it."""
        kept = [self._kept.pop(r.slot) for r in rows if r.slot in self._kept]
        if not kept:
            return None
        row = rows[0]
        guess, drafts = kept[0]
        if not (len(rows) == 1 and self._aheadable(row)
                and (row.epoch, row.start, tuple(row.token_ids)) == (guess.epoch, guess.start, guess.token_ids)
                and int(self.cache.epoch[row.slot]) == row.epoch):
            self.ahead_counts.dropped += len(kept)
            return None
        self.ahead_counts.used += 1
        out = drafts[:row.num_draft]
        if len(out) < row.num_draft:  # cut short: the rest is an ordinary proposal after the last draft kept
            last = guess.start + len(guess.token_ids) + len(out) - 1  # the position of out[-1], not fed yet
            rest = ProposeRow(row.slot, row.epoch, last, (out[-1],), row.num_draft - len(out), row.sampling)
            out = out + self._propose([rest]).draft_token_ids[0]
        self._last = (row, out)
        return Proposal([out], None)

    @torch.inference_mode()
    def draft_ahead(self, interrupted: Callable[[], bool] = lambda: False) -> bool:
        """Draft the next proposal of the last one-row greedy proposal, as if the target accepts all
        of it and its bonus token is the draft's own next choice (module docstring); call between
        proposals. ``interrupted`` is asked before every pass after the first: when it says a call
        waits, what is drafted so far is kept and the rest left to that proposal. False if there was
        nothing to draft."""
        last, self._last = self._last, None
        if last is None:
            return False
        row, drafts = last
        slot = torch.tensor([row.slot], dtype=torch.int64, device=self.device)
        fed = torch.ones(1, dtype=torch.bool, device=self.device)
        k = len(drafts)
        position = row.start + len(row.token_ids) + k - 1  # of the last draft; the cache holds up to it
        self.cache.set_length(slot, torch.tensor([position], device=self.device))
        token, guess, ahead = drafts[-1], None, []
        while len(ahead) < k and (guess is None or not interrupted()):
            # Feed the last token, take the next: first the guessed bonus token, then the drafts after it.
            logits = self._ring_forward_one(torch.tensor([token], device=self.device), fed,
                                            torch.tensor([position], device=self.device), slot)
            token = int(sample_draft_tokens(logits, [row.sampling], [position + 1])[0][0])
            position += 1
            if guess is None:
                guess = ProposeRow(row.slot, row.epoch, position - 1, (drafts[-1], token), k, row.sampling)
            else:
                ahead.append(token)
        if ahead:
            self._kept[row.slot] = (guess, ahead)
            self.ahead_counts.drafted += 1
            self.ahead_counts.cut_short += len(ahead) < k
        return True

    def _rollback(self, rows: list[ProposeRow], slots: torch.Tensor) -> None:
        held = self.cache.length[slots].tolist()
        for r, h in zip(rows, held):
            if r.start > h:
                raise DraftCacheBehind(
                    f"slot {r.slot}: row starts at {r.start} but the draft cache holds {h} positions; "
                    "resend the request's tokens from position 0"
                )
        self.cache.set_length(slots, torch.tensor([r.start for r in rows], device=self.device))

    def _catch_up(self, rows: list[ProposeRow], slots: torch.Tensor) -> torch.Tensor:
        """Feed each row the tokens it has not seen; [B, V] logits at each row's last token.

        Batched three ways, each exact: a row with at least the tail that the cache and the next
        logits depend on (or a fresh slot) runs one windowed forward over that tail (rows with
        equal tails together); the others go through the ring in rounds of at most ``ring_chunk``
        tokens (a round is one batched pass; most rows need one). A row that skipped speculation
        for a while (adaptive k = 0) catches up in one of these, not in a pass per token.
        """
        logits: list[torch.Tensor | None] = [None] * len(rows)
        tails: dict[int, list[int]] = {}
        ring: list[int] = []
        for i, r in enumerate(rows):
            n = len(r.token_ids)
            if n > self.ring_chunk and (r.start == 0 or n >= self.tail):
                tails.setdefault(min(n, self.tail), []).append(i)
            else:
                ring.append(i)
        for fed, idx in tails.items():
            for j, out in zip(idx, self._tail_forward([rows[i] for i in idx], fed, slots[idx])):
                logits[j] = out
        offset = 0
        while ring:
            out = self._ring_forward([rows[i].token_ids[offset:offset + self.ring_chunk] for i in ring],
                                     [rows[i].start + offset for i in ring], slots[ring])
            offset += self.ring_chunk
            for j, i in enumerate(ring):
                if len(rows[i].token_ids) <= offset:
                    logits[i] = out[j]
            ring = [i for i in ring if len(rows[i].token_ids) > offset]
        return torch.stack(logits)

    def _tail_forward(self, rows: list[ProposeRow], fed: int, slots: torch.Tensor) -> torch.Tensor:  # [B, V]
        """Rows that have (at least) their last ``fed`` tokens: one windowed forward over them.

        With a window of W keys per layer, layer l at position p depends on tokens p - l(W-1) .. p,
        so the last L(W-1) + 1 tokens (``tail``) give exactly the ring's K/V and the last logits
        (a long prompt, or a long stretch without speculation, costs the draft its window, not its
        length); the last W positions are written to the ring, the only ones later queries read."""
        ends = [r.start + len(r.token_ids) for r in rows]
        ids = torch.tensor([list(r.token_ids[-fed:]) for r in rows], device=self.device)
        pos = torch.stack([torch.arange(e - fed, e) for e in ends]).to(self.device)
        attn = RecordingAttention(self.cache.window)
        hidden = self.model.hidden_states(ids, pos, attn)
        keep = min(fed, self.cache.window)  # later queries never look further back
        for layer, (k, v) in enumerate(attn.kv):
            self.cache.append(layer, slots, pos[:, fed - keep:], k[:, fed - keep:].contiguous(),
                              v[:, fed - keep:].contiguous())
        return self._logits(hidden[:, -1])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V] float32
        return mask_vocab(self.model.logits(hidden), self.vocab_limit)

    def _ring_forward(self, token_ids: list, starts: list[int], slots: torch.Tensor) -> torch.Tensor:
        """Feed each row's tokens at its positions through the ring; [B, V] logits at each row's last."""
        B, T = len(token_ids), max(len(t) for t in token_ids)
        ids = torch.zeros((B, T), dtype=torch.int64)
        pos = torch.full((B, T), -1, dtype=torch.int64)
        for b, (toks, s) in enumerate(zip(token_ids, starts)):
            ids[b, :len(toks)] = torch.tensor(toks)
            pos[b, :len(toks)] = torch.arange(s, s + len(toks))
        ids, pos = ids.to(self.device), pos.to(self.device)
        hidden = self.model.hidden_states(ids, pos, RingAttention(self.cache, slots, pos))
        last = torch.tensor([len(t) - 1 for t in token_ids], device=self.device)
        return self._logits(hidden[torch.arange(B, device=self.device), last])

    def _draft(self, rows: list[ProposeRow], slots: torch.Tensor, logits: torch.Tensor) -> Proposal:
        B, K = len(rows), self.max_spec_tokens
        k_max = max(r.num_draft for r in rows)
        sampling = [r.sampling for r in rows]
        next_pos = [r.start + len(r.token_ids) for r in rows]
        next_pos_t = torch.tensor(next_pos, dtype=torch.int64, device=self.device)
        num_draft = torch.tensor([r.num_draft for r in rows], dtype=torch.int64, device=self.device)
        drafts = torch.zeros((B, k_max), dtype=torch.int64, device=self.device)
        probs = None
        rules = needs_rules(sampling)
        grammars = self._sync_grammars(rows)  # entries turn None when a row stops being masked
        matchers = list(grammars or ())
        consumed = [0] * B  # draft tokens each matcher took (rolled back at the end)
        try:
            for i in range(k_max):
                if grammars is not None:  # first, as on the target (structured.py)
                    logits = self._mask(logits, grammars)
                if rules:  # the target's rules, so that drafts follow the distribution they are verified against
                    logits = apply_rules(logits[:, None], sampling, drafts[:, :i].tolist(), offset=i)[:, 0]
                tokens, q = sample_draft_tokens(logits, sampling, [p + i for p in next_pos])
                drafts[:, i] = tokens
                if q is not None:
                    if probs is None:
                        probs = torch.zeros((B, K, q.shape[-1]), dtype=torch.float32, device=self.device)
                    probs[:, i] = q
                if grammars is not None:
                    self._advance(grammars, tokens.tolist(), consumed, [i < r.num_draft for r in rows])
                if i + 1 < k_max:
                    # The last draft token is never fed: the target verifies it.
                    logits = self._ring_forward_one(tokens, i + 1 < num_draft, next_pos_t + i, slots)
        finally:
            for b, (g, n) in enumerate(zip(matchers, consumed)):
                if g is not None and g.matcher.is_error():  # a matcher never leaves its error state
                    self.grammars.drop([rows[b].slot])
                elif g is not None and n:
                    g.matcher.rollback(n)  # back to the committed output
        out = drafts.tolist()
        return Proposal([out[b][:r.num_draft] for b, r in enumerate(rows)], probs)

    # -- structured outputs ----------------------------------------------------------

    def _sync_grammars(self, rows: list[ProposeRow]) -> list | None:
        """Per row: its slot's matcher at the committed output, or None; None if no row has one."""
        if self.grammars is None or all(r.grammar is None for r in rows):
            return None
        return [None if r.grammar is None else
                self.grammars.sync(r.slot, r.epoch, r.grammar.grammar, r.grammar.output_ids) for r in rows]

    def _mask(self, logits: torch.Tensor, grammars: list) -> torch.Tensor:  # [B, V] -> [B, V]
        """Forbidden ids to -inf on the rows with a matcher. A row whose grammar allows nothing
        here drafts unmasked (the target's masks decide; drafts are only a guess)."""
        words = next((g.words for g in grammars if g is not None), None)
        if words is None:
            return logits
        packed = torch.full((len(grammars), words), -1, dtype=torch.int32)  # -1: every id allowed
        for b, g in enumerate(grammars):
            if g is not None:
                fill_mask(g.matcher, packed[b])
                if not packed[b].any():
                    packed[b] = -1
                    grammars[b] = None
        # Ids past the mask's width are embedding padding the tokenizer lacks (masked anyway).
        return logits.masked_fill(~unpack(packed.to(logits.device), logits.shape[-1]), float("-inf"))

    @staticmethod
    def _advance(grammars: list, tokens: list[int], consumed: list[int], drafting: list[bool]) -> None:
        """Each matcher takes its row's new draft token (to mask the next one)."""
        for b, g in enumerate(grammars):
            if g is None or not drafting[b]:
                continue
            if tokens[b] in g.eos_ids:  # its drafts end here in effect (and a consumed EOS would not roll back)
                grammars[b] = None
            elif g.matcher.consume_token(tokens[b]):
                consumed[b] += 1
            else:  # cannot happen for a masked token; stop masking this row if it does
                grammars[b] = None

    def _ring_forward_one(self, tokens: torch.Tensor, fed: torch.Tensor, positions: torch.Tensor,
                          slots: torch.Tensor) -> torch.Tensor:
        """One token per row through the ring ([B] each, on the device, no host sync); rows not
        ``fed`` are padding (position -1: they write and read nothing). [B, V] logits. At a padded
        batch size when ``pad_batches`` has one that fits (module docstring)."""
        rows = next((n for n in self.pad_batches if n >= tokens.shape[0]), None)
        if rows is None:
            return self._one_pass(tokens, fed, positions, slots)
        if rows not in self._padded:
            self._padded[rows] = PaddedPass(self, rows, self.cuda_graphs)
        return self._padded[rows](tokens, fed, positions, slots)

    def _one_pass(self, tokens: torch.Tensor, fed: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor) -> torch.Tensor:  # [B, V]
        ids = torch.where(fed, tokens, 0)[:, None]
        pos = torch.where(fed, positions, -1)[:, None]
        hidden = self.model.hidden_states(ids, pos, RingAttention(self.cache, slots, pos))
        return self._logits(hidden[:, 0])


class PaddedPass:
    """The drafting pass at one fixed batch size: static input buffers whose entries past the
    live rows are padding (slot 0, position -1), run eagerly or replayed as a CUDA graph.

    The graph is captured with every entry padding, so capturing changes no cache state; a
    replay's logits are copied out before the next replay overwrites them."""

    def __init__(self, proposer: DraftProposer, rows: int, graph: bool) -> None:
        dev = proposer.device
        self.proposer, self.rows = proposer, rows
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.fed = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.positions = torch.full((rows,), -1, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        if graph:
            self._capture()

    def _run(self) -> torch.Tensor:
        return self.proposer._one_pass(self.tokens, self.fed, self.positions, self.slots)

    @torch.inference_mode()
    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compiles, the allocator settles
            for _ in range(2):
                self._run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._run()

    def __call__(self, tokens: torch.Tensor, fed: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:  # [B, V]
        n = tokens.shape[0]
        self.tokens[:n].copy_(tokens)
        self.fed[:n].copy_(fed)
        self.fed[n:] = False
        self.positions[:n].copy_(positions)
        self.positions[n:] = -1
        self.slots[:n].copy_(slots)
        self.slots[n:] = 0
        if self.graph is None:
            return self._run()[:n]
        self.graph.replay()
        return self.logits[:n].clone()
