"""Log-probabilities reported to the caller: the target's raw distribution.

Reported values come from the target's logits before temperature, penalties
and filters (vLLM's default, ``raw_logprobs``), so a token's log-probability
is that of the model itself, the same whether speculation is on or off: the
verify pass already scores every position a row emits, and the emitted
token at the row's j-th position is read off the logits at j.
"""

from __future__ import annotations

import torch

from dspark_ray.engine.outputs import TokenLogprob


def token_logprobs(
    logits: torch.Tensor,  # [N, V] float, the raw logits that predicted each token
    token_ids: list[int],  # N tokens
    top: int,  # alternatives to report per position (0: only the token's own)
) -> list[TokenLogprob]:
    """Each token's log-probability, rank and the ``top`` most likely ids at its position."""
    if not token_ids:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    ids = torch.tensor(token_ids, device=lp.device)[:, None]  # [N, 1]
    chosen = lp.gather(1, ids)  # [N, 1]
    ranks = (lp > chosen).sum(dim=-1) + 1  # [N]
    chosen, ranks = chosen[:, 0].tolist(), ranks.tolist()
    if top > 0:
        values, indices = lp.topk(top, dim=-1)  # [N, top]
        tops = [tuple(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    else:
        tops = [()] * len(token_ids)
    return [TokenLogprob(t, c, r, tp) for t, c, r, tp in zip(token_ids, chosen, ranks, tops)]
