"""Logits rules: penalties, logit bias, min_tokens and min_p on a row's logits.

A rule turns the model's logits at one position into the logits the request
samples from. Verification stays lossless because the target's rules are the
ones that count: greedy rows take the argmax of the target's adjusted logits
and sampled rows are accepted against the target's adjusted distribution
(rejection sampling is exact for any draft distribution q). The draft applies
the very same rules to its own logits only so that its proposals match the
target more often.

The rules depend on the request's output so far. A row scores several
positions in one step (the pending token and each draft token); the history
at its j-th position is the output so far plus the row's first j draft tokens,
which is the true history whenever that position's result is used (the
drafts before it were accepted).

Order, as vLLM applies them: min_tokens and logit_bias, then the repetition
penalty (prompt and output tokens: positive logits divided by it, negative
ones multiplied), then the frequency and presence penalties (output tokens
only); min_p, a sampling filter, last (sampled rows only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dspark_ray.engine.interfaces import LogitsRules, SamplingRow


def needs_rules(rows: Sequence[SamplingRow]) -> bool:
    """Whether any row's logits change before sampling."""
    return any(r.rules is not None or (r.min_p > 0.0 and not r.greedy) for r in rows)


def apply_rules(
    logits: torch.Tensor,  # [B, J, V] float32; row b's position j follows its first offset + j drafts
    rows: Sequence[SamplingRow],  # B rows
    drafts: Sequence[Sequence[int]],  # per row: its draft tokens (the first offset + J - 1 are read)
    offset: int = 0,
) -> torch.Tensor:  # [B, J, V], ``logits`` adjusted in place
    for b, row in enumerate(rows):
        if row.rules is not None:
            logits[b] = _adjust(logits[b], row.rules, list(drafts[b])[: offset + logits.shape[1] - 1], offset)
        if row.min_p > 0.0 and not row.greedy:
            logits[b] = min_p_filter(logits[b], row.min_p, row.temperature)
    return logits


def _adjust(
    logits: torch.Tensor,  # [J, V] float32
    rules: LogitsRules,
    drafts: list[int],  # the draft tokens before the last scored position
    offset: int,  # position 0 of ``logits`` follows the first ``offset`` drafts
) -> torch.Tensor:  # [J, V]
    J, V = logits.shape
    device = logits.device
    counts = _counts(rules.output_ids, drafts, offset, J, V).to(device)  # [J, V]
    if rules.min_tokens:
        out = len(rules.output_ids) + offset + torch.arange(J, device=device)  # [J] tokens out before each
        banned = [t for t in rules.stop_ids if t < V]
        if banned:
            early = (out < rules.min_tokens)[:, None]  # [J, 1]
            cols = torch.tensor(banned, device=device)
            logits[:, cols] = torch.where(early, float("-inf"), logits[:, cols])
    bias = [(t, b) for t, b in rules.logit_bias if t < V]
    if bias:
        cols = torch.tensor([t for t, _ in bias], device=device)
        logits[:, cols] += torch.tensor([b for _, b in bias], dtype=logits.dtype, device=device)
    if rules.repetition_penalty != 1.0:
        seen = counts > 0  # [J, V]
        prompt = [t for t in rules.prompt_ids if t < V]
        if prompt:
            seen[:, torch.tensor(prompt, device=device)] = True
        r = rules.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    if rules.frequency_penalty or rules.presence_penalty:
        counts_f = counts.to(logits.dtype)
        logits = logits - rules.frequency_penalty * counts_f - rules.presence_penalty * (counts_f > 0).to(logits.dtype)
    return logits


def _counts(
    output_ids: Sequence[int], drafts: list[int], offset: int, J: int, V: int
) -> torch.Tensor:  # [J, V] int64: occurrences of each id in the history at each position
    out = torch.tensor([t for t in output_ids if t < V], dtype=torch.int64)
    base = torch.bincount(out, minlength=V)[:V]  # [V]
    steps = torch.zeros((offset + J, V), dtype=torch.int64)  # row i: the history after i drafts, minus the output
    for i, t in enumerate(drafts[: offset + J - 1]):
        if 0 <= t < V:
            steps[i + 1:, t] += 1
    return base[None, :] + steps[offset:]


def min_p_filter(
    logits: torch.Tensor,  # [..., V] float32
    min_p: float,
    temperature: float,
) -> torch.Tensor:  # [..., V], ids below the threshold at -inf
    """Drop ids whose probability (after temperature) is below min_p times the most likely id's.

    p_i < min_p * p_max  <=>  (l_i - l_max) / T < ln(min_p), so the filter is a
    threshold on the raw logits and the temperature applied later is unchanged.
    """
    top = logits.max(dim=-1, keepdim=True).values  # [..., 1]
    return logits.masked_fill(logits < top + temperature * math.log(min_p), float("-inf"))
