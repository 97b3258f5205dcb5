"""SamplingParams: what a caller asks of one request's generation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dspark_ray.engine.errors import InvalidRequest

if TYPE_CHECKING:  # imported where it is used: structured.py brings torch and llguidance
    from dspark_ray.engine.structured import StructuredOutput


# The most log-probabilities per position a request may ask for (vLLM's default limit).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings, validated on construction.

    temperature 0 is greedy decoding. ``seed`` makes sampling reproducible: the
    same seed, prompt and params give the same tokens whatever else is in the
    batch. ``speculative`` turns speculation off for this request;
    ``num_speculative_tokens`` lowers its k below the engine's maximum.

    Logits rules, with vLLM's meanings, shape the distribution the request
    samples from (the target's at every verified position and the draft's the
    same way, so speculation stays lossless): ``repetition_penalty`` (> 1
    discourages every token of the prompt and output so far), ``presence_penalty``
    and ``frequency_penalty`` (subtracted once, or once per occurrence, for
    tokens of the output so far), ``logit_bias`` (token id -> added logit,
    within [-100, 100]), ``min_tokens`` (EOS and stop tokens are ruled out
    until that many tokens are out), ``min_p`` (tokens below min_p times the
    most likely one's probability are dropped when sampling).

    ``structured`` (a ``dspark_ray.engine.structured.StructuredOutput``: a
    JSON schema, any JSON object, a regex, a choice or a Lark grammar)
    constrains the output: every token is one the grammar allows, at every
    verified position and in the drafts, and the request ends when the
    grammar is complete.

    Prefix caching: the target reuses the KV of an earlier request's equal
    prefix (in blocks of 16 tokens) instead of computing it; output is the
    same. ``prefix_cache=False`` keeps a request out of the cache (it neither
    reuses nor adds blocks); ``cache_salt`` shares blocks only among requests
    with the same salt (one tenant's prompts cannot be probed by another's
    timings).

    ``logprobs = N`` reports, per output token, its log-probability under the
    target and the N most likely alternatives; ``prompt_logprobs = N`` does the
    same for the prompt (the first token has none). Both are the target
    model's raw distribution (before temperature and the rules above), as
    vLLM reports by default. ``max_tokens = 0`` generates nothing: with
    ``prompt_logprobs`` it scores the prompt.
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
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    min_p: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    n: int = 1
    structured: StructuredOutput | None = None  # the output must match this grammar
    prefix_cache: bool = True  # may reuse (and add to) the target's prefix cache
    cache_salt: str | None = None  # prefix-cache blocks are shared only between equal salts
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
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise InvalidRequest("max_tokens", f"must be an integer >= 0 (0 only scores the prompt), "
                                               f"got {self.max_tokens!r}")
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
        if not _is_int(self.n) or self.n < 1:
            raise InvalidRequest("n", f"must be an integer >= 1, got {self.n!r}")
        self._check_rules()
        self._check_logprobs()
        from dspark_ray.engine.structured import StructuredOutput  # torch and llguidance: only when checked

        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise InvalidRequest("cache_salt", "must be a non-empty string")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidRequest("structured", f"must be a StructuredOutput, got {type(self.structured).__name__}")

    def samples(self) -> list[SamplingParams]:
        """The n single-sample requests these params stand for; sample i of a seeded request uses seed + i,
        so each is reproducible and sample 0 equals the request with n = 1."""
        return [dataclasses.replace(self, n=1, seed=None if self.seed is None else (self.seed + i) % 2**63)
                for i in range(self.n)]

    def _check_rules(self) -> None:
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((int(t), float(b)) for t, b in bias))
        except (TypeError, ValueError) as exc:
            raise InvalidRequest("logit_bias", "must map token ids to numbers") from exc
        object.__setattr__(self, "logit_bias", bias)
        if any(t < 0 for t, _ in bias):
            raise InvalidRequest("logit_bias", "token ids must be >= 0")
        if any(not -100.0 <= b <= 100.0 for _, b in bias):
            raise InvalidRequest("logit_bias", "bias values must be in [-100, 100]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise InvalidRequest(name, f"must be a number in [-2, 2], got {value!r}")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty < float("inf"):
            raise InvalidRequest("repetition_penalty", f"must be a number > 0 (1 is neutral), "
                                                       f"got {self.repetition_penalty!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest("min_p", f"must be a number in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidRequest("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequest("min_tokens", f"min_tokens ({self.min_tokens}) is above max_tokens "
                                               f"({self.max_tokens}); lower it or raise max_tokens")
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or t < 1):
            raise InvalidRequest("truncate_prompt_tokens", f"must be an integer >= 1, got {t!r}")

    def _check_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (not _is_int(n) or not 0 <= n <= MAX_LOGPROBS):
                raise InvalidRequest(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {n!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_rules(self) -> bool:
        """Whether any logits rule (penalty, bias, min_tokens) is set; min_p is a sampling setting."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    """An int or float that is not a bool (NaN passes here and fails every range check)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)
