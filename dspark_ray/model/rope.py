"""Rotary position embeddings: the frequencies each ``rope_scaling`` type gives, and how long a
context it supports.

The numbers follow transformers' ``modeling_rope_utils`` (``_compute_*_parameters``), which the
parity tests compare against; the supported context length follows vLLM's ``max_model_len``
derivation. The kinds:

- ``default``: ``1 / theta^(2i/D)``.
- ``linear``: every frequency divided by ``factor`` (position interpolation).
- ``llama3``: Llama 3.1's three bands (long wavelengths slowed by ``factor``, short ones kept,
  the band between interpolated).
- ``yarn``: YaRN (Peng et al. 2023, arXiv 2309.00071): per dimension a blend of the original
  frequency (extrapolation) and the frequency divided by ``factor`` (interpolation), the blend a
  linear ramp between the dimensions that turn ``beta_fast`` and ``beta_slow`` times within the
  original context; and cos/sin multiplied by an attention factor (``attention_factor``, or
  derived from ``factor``, ``mscale`` and ``mscale_all_dim``), which scales q.k by its square.
- ``dynamic`` (dynamic NTK): transformers raises the base ``theta`` with the length of the
  sequence once it grows past ``max_position_embeddings``; up to that length the frequencies are
  exactly the default ones. A KV cache holds keys rotated with the frequencies in force when they
  were written, so past that length a cached decode could not reproduce them (every cached key
  would have to be rotated again at every step). So: default frequencies, and the context capped
  at ``max_position_embeddings`` (``max_context_length``), where that is exact.
"""

from __future__ import annotations

import math

import torch

from dspark_ray.model.config import ModelConfig, RopeScaling
from dspark_ray.model.errors import ContextTooLong


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse frequencies [D/2] in float32, rescaled as ``rope_scaling`` says."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif scaling.kind == "yarn":
        inv_freq = _yarn(head_dim, theta, scaling)
    return inv_freq.float()


def rope_attention_scaling(scaling: RopeScaling) -> float:
    """The factor cos and sin are multiplied by (1.0 except for YaRN)."""
    if scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return _mscale(scaling.factor, scaling.mscale) / _mscale(scaling.factor, scaling.mscale_all_dim)
    return _mscale(scaling.factor)


def max_context_length(cfg: ModelConfig) -> int:
    """The longest context (prompt + output) the model supports, as vLLM derives ``max_model_len``.

    ``max_position_embeddings``, times ``factor`` where the scaling extends the context: linear
    scales it, YaRN scales ``original_max_position_embeddings``; llama3's
    ``max_position_embeddings`` is already the extended length; dynamic NTK is exact only up to
    ``max_position_embeddings`` (module docstring).
    """
    scaling = cfg.rope_scaling
    if scaling.kind == "linear":
        return int(cfg.max_position_embeddings * scaling.factor)
    if scaling.kind == "yarn":
        return int(scaling.original_max_position_embeddings * scaling.factor)
    return cfg.max_position_embeddings


def check_max_context(cfg: ModelConfig, max_context: int) -> None:
    """Raise ContextTooLong if ``max_context`` exceeds what the model supports."""
    limit = max_context_length(cfg)
    if max_context <= limit:
        return
    scaling = cfg.rope_scaling
    if scaling.kind == "linear":
        how = f"max_position_embeddings {cfg.max_position_embeddings} x rope_scaling factor {scaling.factor:g}"
    elif scaling.kind == "yarn":
        how = (f"rope_scaling original_max_position_embeddings {scaling.original_max_position_embeddings} "
               f"x factor {scaling.factor:g}")
    elif scaling.kind == "dynamic":
        how = (f"max_position_embeddings {cfg.max_position_embeddings}; rope_scaling 'dynamic' (NTK) changes "
               "its frequencies with the sequence length beyond that, which a KV cache cannot follow")
    else:
        how = f"max_position_embeddings {cfg.max_position_embeddings}"
    raise ContextTooLong(
        f"max_context {max_context} exceeds the model's context length {limit} ({how}); "
        f"set max_context to at most {limit}"
    )


def _llama3(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept,
    # and the band between is interpolated smoothly.
    old_ctx = scaling.original_max_position_embeddings
    low_wavelen = old_ctx / scaling.low_freq_factor
    high_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    # Dimensions turning more than beta_fast times in the original context keep their frequency
    # (extrapolate), those turning fewer than beta_slow times are divided by `factor`
    # (interpolate), and a linear ramp over dimension indices blends the ones between. In float32
    # and in transformers' order of operations: the blend loses a few float32 ulps, and this way
    # they are the same ones as the reference's (bit for bit).
    def dim_turning(rotations: float) -> float:
        return head_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta)
        )

    low, high = dim_turning(scaling.beta_fast), dim_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)
    keep = 1 - ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return interpolation * (1 - keep) + extrapolation * keep


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
