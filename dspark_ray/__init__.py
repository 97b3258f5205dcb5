"""dspark_ray: speculative-decoding LLM serving on Ray with request-stable slots.

``from dspark_ray import LLM, SamplingParams, StructuredOutput`` is the offline API. Names are
resolved lazily so that bookkeeping modules (the slot registry, the
scheduler) can be imported without torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {"LLM": "dspark_ray.llm", "SamplingParams": "dspark_ray.engine.sampling_params",
            "StructuredOutput": "dspark_ray.engine.structured"}
__all__ = ["LLM", "SamplingParams", "StructuredOutput", "__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dspark_ray' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
