"""AppConfig: the Serve application's settings, as written in deploy/*.yaml `args:`.

Every field has a description; validation errors say how to fix the value.
``engine_config()`` turns it into the engine's internal frozen dataclass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dspark_ray.engine.config import EngineConfig

REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_path(value: str) -> str:
    """Relative checkpoint paths are taken from the repository root (where the shipped pair lives)."""
    p = Path(value).expanduser()
    if not p.is_absolute() and not p.exists() and (REPO_ROOT / p).exists():
        p = REPO_ROOT / p
    return str(p)


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(
        "models/shakespeare-target",
        description="Local folder of the target checkpoint (Hugging Face format). Relative paths are "
        "resolved against the working directory, then the repository root.",
    )
    draft: str | None = Field(
        "models/shakespeare-draft",
        description="Local folder of the draft checkpoint; it must share the target's tokenizer. "
        "null serves the target alone.",
    )
    served_model_name: str | None = Field(
        None, description="The name clients put in `model`; defaults to the target folder's name."
    )
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="Target shards (one Ray actor each).")
    num_speculative_tokens: int = Field(4, ge=0, le=16, description="Most draft tokens verified per step (k).")
    draft_window: int = Field(32, ge=1, description="Positions the draft attends to (its ring cache size minus k).")
    capacity: int = Field(64, ge=1, description="Request slots shared by all replicas of the application.")
    max_context: int = Field(512, ge=2, description="Prompt plus output tokens per request.")
    kv_pool_tokens: int | None = Field(
        None, description="Target KV pool per replica in tokens; null sizes it from capacity and max_context."
    )
    max_num_seqs: int = Field(32, ge=1, description="Requests in one engine step.")
    max_num_batched_tokens: int = Field(
        4096, ge=1, description="Target tokens fed per step. Decode rows go first; prompts take the rest and "
        "a longer one is prefilled in chunks over several steps, so running streams keep their pace.",
    )
    max_queued_requests: int = Field(
        256, ge=1, description="Requests waiting for a slot per replica before new ones get 503 + Retry-After."
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Placement of the target shards: STRICT_SPREAD puts one per node (two boxes)."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and activations; auto = float32 on CPU, the checkpoint's dtype on CUDA."
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="cpu uses gloo for collectives, cuda uses NCCL.")
    cpus_per_shard: float = Field(0.5, ge=0, description="CPUs reserved per target shard and for the proposer.")
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads in each shard and the proposer.")
    slot_admission_timeout_s: float = Field(
        30.0, gt=0, description="How long admissions wait for the slot manager during an outage."
    )
    worker_call_timeout_s: float = Field(
        120.0, gt=0, description="Deadline for one step's call to a target shard or the draft worker; a worker "
        "that has not answered by then is treated as failed (the target is rebuilt, the draft skipped).",
    )
    target_recovery_timeout_s: float = Field(
        300.0, gt=0, description="After a target shard fails, how long requests in flight wait for the rebuilt "
        "target (they then resume where they were) before they end with an error.",
    )
    pipeline: bool = Field(
        True, description="Draft one half of the batch while the target verifies the other (engine/engine.py: "
        "pipelined steps); false runs draft and verification of the whole batch one after the other.",
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse the target KV of equal prompt prefixes (blocks of 16 tokens: system prompts, "
        "chat history) instead of computing them again; output is unchanged. Requests opt out with "
        "prefix_cache: false and keep tenants apart with cache_salt.",
    )
    tool_call_parser: str | None = Field(
        "hermes", description="How the model writes tool calls, for tool_choice auto: hermes "
        "(<tool_call>{...}</tool_call>: Hermes, Qwen 2.5/3, the shipped pair's template) or llama3_json; null "
        "turns tool_choice auto off (required and named calls work without a parser).",
    )
    reasoning_parser: str | None = Field(
        None, description="For models that think between <think> and </think>: think, deepseek_r1 or qwen3; "
        "their reasoning is returned as reasoning_content, apart from content. null: none.",
    )
    max_request_bytes: int = Field(1_000_000, ge=1024, description="Largest accepted HTTP request body.")
    api_key: str | None = Field(
        None, description="If set, the OpenAI routes require `Authorization: Bearer <api_key>`."
    )

    @field_validator("model", "draft")
    @classmethod
    def _checkpoint_exists(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = Path(resolve_path(value))
        if not (path / "config.json").is_file():
            raise ValueError(
                f"no checkpoint at {value!r} (looked for {path / 'config.json'}); give a local folder with "
                "config.json, *.safetensors and tokenizer.json"
            )
        return str(path)

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_parser(cls, value: str | None) -> str | None:
        from dspark_ray.serve.tool_parsers import TOOL_PARSERS

        if value is not None and value not in TOOL_PARSERS:
            raise ValueError(f"unknown tool_call_parser {value!r}; one of {', '.join(sorted(TOOL_PARSERS))} or null")
        return value

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, value: str | None) -> str | None:
        from dspark_ray.serve.reasoning import REASONING_PARSERS

        if value is not None and value not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning_parser {value!r}; one of {', '.join(sorted(REASONING_PARSERS))} "
                             "or null")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> AppConfig:
        if self.device == "cuda" and self.cpus_per_shard > 4:
            raise ValueError("cpus_per_shard above 4 on cuda wastes CPUs; the GPU does the work")
        if self.kv_pool_tokens is not None and self.kv_pool_tokens < self.max_context + self.num_speculative_tokens:
            raise ValueError(
                f"kv_pool_tokens must be at least max_context + num_speculative_tokens "
                f"({self.max_context + self.num_speculative_tokens}); raise it or lower max_context"
            )
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            draft=self.draft,
            num_speculative_tokens=self.num_speculative_tokens,
            draft_window=self.draft_window,
            capacity=self.capacity,
            max_context=self.max_context,
            kv_pool_tokens=self.kv_pool_tokens,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            dtype=self.dtype,
            device=self.device,
            pipeline=self.pipeline,
            enable_prefix_caching=self.enable_prefix_caching,
        )
