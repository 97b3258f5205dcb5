"""Prompt-lookup drafting (``draft: ngram``): drafts copied from the request's own tokens, no model.

The proposer keeps each request's tokens (prompt and output so far) in a row of its own, indexed by
the request's slot like every per-request buffer (row 0 is the padding row, never a request's); a
new epoch for a slot empties its row. To draft, it takes the last ``n`` tokens for ``n`` from
``max_n`` down to ``min_n``, finds their most recent earlier occurrence, and proposes the tokens
that followed it. The copy may run past the end of the history into its own drafts (a loop of
period ``p`` shorter than ``k`` is drafted whole), as an LZ77 copy does. No match: no drafts for
that row this step (the engine verifies it alone).

It is what vLLM's ``method: ngram`` and the "prompt lookup decoding" of Saxena (2023) do; it pays
where an answer repeats its prompt or itself (quoting, editing code, summaries, retrieval, and
a small model's loops) and costs microseconds a row, so it runs wherever the target's step is
sent from (target rank 0, ``runtime/actors.py``), with no worker of its own.

Lossless as every draft: the target verifies each token. A drafted token is a point mass (q = 1
at the token): greedy rows need no q; a sampled row's draft is accepted with probability p(token),
and a rejection samples from p with that token removed (``kernels/dspark_kernels``'s rejection
sampling with a one-hot q). A structured-output row's drafts are not masked here: the engine cuts
them at the first token its grammar forbids.
"""

from __future__ import annotations

import numpy as np
import torch

from dspark_ray.engine.draft_proposer import DraftCacheBehind
from dspark_ray.engine.interfaces import Proposal, ProposeRow

class NgramProposer:
    """The draft service for ``draft: ngram`` (module docstring)."""

    def __init__(self, capacity: int, max_context: int, max_spec_tokens: int, vocab_size: int,
                 min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_spec_tokens = max_spec_tokens
        self.vocab_size = vocab_size
        self.min_n, self.max_n = min_n, max_n
        # Per slot: its tokens, then the drafts last proposed (the engine's next row starts inside
        # them when some were accepted); row 0 is the padding row.
        self.tokens = np.zeros((capacity + 1, max_context + max_spec_tokens + 1), dtype=np.int64)
        self.length = np.zeros(capacity + 1, dtype=np.int64)
        self.epoch = np.full(capacity + 1, -1, dtype=np.int64)

    def propose(self, rows: list[ProposeRow]) -> Proposal:
        if not rows:
            return Proposal([], None)
        for r in rows:  # every row checked before any slot's state changes
            if not 1 <= r.slot < len(self.length):
                raise ValueError(f"slot {r.slot} is outside 1..{len(self.length) - 1}")
            held = self.length[r.slot] if self.epoch[r.slot] == r.epoch else 0
            if r.start > held:
                raise DraftCacheBehind(
                    f"slot {r.slot}: row starts at {r.start} but the proposer holds {held} tokens; "
                    "resend the request's tokens from position 0")
            if r.start + len(r.token_ids) + r.num_draft > self.tokens.shape[1]:
                raise ValueError(f"slot {r.slot}: {r.start + len(r.token_ids)} tokens and {r.num_draft} drafts "
                                 f"exceed the proposer's {self.tokens.shape[1]} positions")
        drafts = []
        for r in rows:
            self.epoch[r.slot] = r.epoch
            end = r.start + len(r.token_ids)
            row = self.tokens[r.slot]
            row[r.start:end] = r.token_ids
            found = self.lookup(row[:end], r.num_draft)
            row[end:end + len(found)] = found
            self.length[r.slot] = end + len(found)
            drafts.append(found)
        return Proposal(drafts, self._point_masses(rows, drafts))

    def lookup(self, history: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix
        of ``history`` of ``min_n`` .. ``max_n`` tokens; [] if there is none."""
        size = len(history)
        if k <= 0 or size < self.min_n + 1:
            return []
        # Where the last token occurred before: each is the end of a candidate match.
        ends = np.flatnonzero(history[:size - 1] == history[size - 1])
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            cand = ends[ends >= n - 1]
            for back in range(1, n):  # the other n - 1 tokens of the suffix, nearest first
                if not len(cand):
                    break
                cand = cand[history[cand - back] == history[size - 1 - back]]
            if len(cand):
                start = int(cand[-1]) + 1  # the most recent match; its continuation starts here
                period = size - start  # the copy runs past the end into itself, as LZ77 does
                return [int(history[start + (t % period)]) for t in range(k)]
        return []

    def _point_masses(self, rows: list[ProposeRow], drafts: list[list[int]]) -> torch.Tensor | None:
        """[B, K, V] float32: one-hot at each sampled row's drafts (greedy rows zeros); None if
        every row is greedy or drafted nothing."""
        sampled = [i for i, r in enumerate(rows) if not r.sampling.greedy and drafts[i]]
        if not sampled:
            return None
        q = torch.zeros((len(rows), self.max_spec_tokens, self.vocab_size), dtype=torch.float32)
        for i in sampled:
            ids = torch.tensor(drafts[i], dtype=torch.int64)
            q[i, torch.arange(len(ids)), ids] = 1.0
        return q

    def release(self, slots: list[int]) -> None:
        """Forget these slots' tokens (their epochs change on reuse anyway)."""
        for s in slots:
            self.length[s] = 0
            self.epoch[s] = -1
