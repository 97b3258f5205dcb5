"""The speculative-decoding engine: scheduler, runners, verification and the step loop."""

from dspark_ray.engine.config import ConfigError, EngineConfig
from dspark_ray.engine.engine import Engine
from dspark_ray.engine.errors import InvalidRequest
from dspark_ray.engine.outputs import CompletionOutput, RequestOutput, SpecSummary
from dspark_ray.engine.sampling_params import SamplingParams

__all__ = [
    "CompletionOutput",
    "ConfigError",
    "Engine",
    "EngineConfig",
    "InvalidRequest",
    "RequestOutput",
    "SamplingParams",
    "SpecSummary",
]
