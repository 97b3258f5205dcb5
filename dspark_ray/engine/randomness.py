"""Stateless per-request randomness: every draw is a function of (seed, position, stream).

Deriving generators instead of keeping them means the draft proposer and each
tensor-parallel rank draw identical numbers without sharing state, and a
request's samples do not depend on batch composition, scheduling or
preemption.
"""

from __future__ import annotations

DRAFT_STREAM = 1
VERIFY_STREAM = 2

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def derive_seed(seed: int, position: int, stream: int) -> int:
    """A 63-bit seed for the draws a request makes at ``position`` in ``stream``."""
    return _splitmix64(_splitmix64(_splitmix64(seed) ^ position) ^ stream) >> 1


def uniform(seed: int, position: int, stream: int) -> float:
    """A uniform draw in [0, 1) for ``position`` in ``stream``: the top 53 bits of ``derive_seed``."""
    return (derive_seed(seed, position, stream) >> 10) * 2.0**-53
