"""SamplingParams: what a caller asks of one request's generation."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidRequest(ValueError):
    """A request parameter is out of range. ``field`` names the offending input."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings, validated on construction.

    temperature 0 is greedy decoding. ``seed`` makes sampling reproducible: the
    same seed, prompt and params give the same tokens whatever else is in the
    batch. ``speculative`` turns speculation off for this request;
    ``num_speculative_tokens`` lowers its k below the engine's maximum.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filtering
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    speculative: bool = True
    num_speculative_tokens: int | None = None
    skip_special_tokens: bool = True
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        stop_ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(stop, (list, tuple)):
            raise InvalidRequest("stop", f"must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(stop_ids, (list, tuple)):
            raise InvalidRequest("stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(stop_ids))
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequest("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequest("temperature", f"must be a number in [0, 2] (0 is greedy), got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest("top_p", f"must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequest("top_k", f"must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**63):
            raise InvalidRequest("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop", "stop strings must be non-empty strings")
        if len(self.stop) > 16:
            raise InvalidRequest("stop", f"at most 16 stop strings, got {len(self.stop)}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids", "must be non-negative integer token ids")
        k = self.num_speculative_tokens
        if k is not None and (not _is_int(k) or k < 0):
            raise InvalidRequest("num_speculative_tokens", f"must be an integer >= 0, got {k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    """An int or float that is not a bool (NaN passes here and fails every range check)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)
