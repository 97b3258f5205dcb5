"""EngineConfig: the engine's internal settings (frozen, validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass

from dspark_ray.model.checkpoint import locate


# ``draft: ngram``: prompt-lookup drafting from the request's own tokens, no draft model
# (engine/ngram_proposer.py).
NGRAM = "ngram"


def is_ngram(draft: str | None) -> bool:
    """Whether ``draft`` names prompt-lookup drafting rather than a draft checkpoint."""
    return draft == NGRAM


class ConfigError(ValueError):
    """An engine setting is out of range; the message says how to fix it."""


@dataclass(frozen=True)
class EngineConfig:
    # The target: a checkpoint folder, a .gguf file or package:<distribution>/<file>
    # (model/checkpoint.py); kept as the local path it names.
    model: str
    draft: str | None = None  # the draft, named the same ways, or "ngram"; None = no speculation
    num_speculative_tokens: int = 4  # the most draft tokens verified per step (k)
    # Choose each step's k from acceptance and measured costs (engine/adaptive.py); False: always k.
    adaptive_speculation: bool = True
    # A step of more requests than this (running and waiting, up to max_num_seqs) verifies no drafts
    # for the requests that adapt to the batch (greedy and unseeded sampled ones): on a box where the
    # step is compute-bound, speculation at a large batch costs more than it brings. None: no limit.
    # (vLLM's speculative_disable_by_batch_size is the same idea.)
    speculation_max_batch: int | None = None
    # With adaptive speculation and a DSpark draft that has a confidence head: each row verifies its
    # block only as far as the head expects it to be accepted (adaptive.confident_drafts).
    confidence_verification: bool = True
    draft_window: int = 32  # positions the draft attends to (its ring cache holds window + k)
    # draft "ngram": the longest and shortest suffix of a request's tokens looked up in its history.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    capacity: int = 64  # request slots 1..capacity (row 0 is padding)
    max_context: int = 1024  # prompt + output tokens per request
    # Target KV pool size. None: on CUDA what the device has left after the weights (memory_utilization,
    # engine/memory_budget.py), at most every slot at full context; on CPU capacity * max_context / 4
    # (kv_tokens), at least max_context + k.
    kv_pool_tokens: int | None = None
    max_num_seqs: int = 32  # requests per step
    max_num_batched_tokens: int = 4096  # target tokens fed per step
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto (float32 on CPU, checkpoint dtype on CUDA)
    # The draft's own dtype (None: dtype; "auto": bfloat16 on CPUs with native bfloat16, else float32,
    # on CUDA the checkpoint's; dtypes.draft_runtime_dtype). Output does not depend on it (the target
    # verifies every token), only acceptance and the draft's speed do.
    draft_dtype: str | None = "auto"
    device: str = "cpu"  # where the models run: cpu (collectives over gloo) or cuda (NCCL)
    # GGUF weights: "auto" keeps the file's blocks where a kernel reads them (model/quantized.py),
    # "int8" too with int8 activations for Q8_0/Q4_0/Q4_1 (faster, not bit-faithful), "none"
    # dequantizes every weight into dtype at load.
    quantization: str = "auto"
    # Overlap one half of the batch's draft with the other half's verification when the
    # draft and the target run in other processes (Engine docstring); no effect in process.
    pipeline: bool = True
    # The draft drafts a one-row greedy proposal's successor while the target verifies it, in the
    # draft's idle time (engine/draft_proposer.py); only a draft in its own process has that time.
    draft_ahead: bool = False
    # Automatic prefix caching in the target's KV pool (dspark_ray/slots/prefix_cache.py).
    enable_prefix_caching: bool = True
    # CUDA: the share of each GPU's memory this replica may use (weights, KV pool, workspace).
    memory_utilization: float = 0.9
    # CUDA: the independent draft's one-token drafting passes replayed as CUDA graphs at padded batch
    # sizes (engine/draft_proposer.py); no effect on CPU.
    cuda_graphs: bool = True
    # CPU: the target's and the independent draft's forward passes compiled by torch.compile, their
    # elementwise ops fused (dspark_ray/model/compiled.py); graphs are built at load time. Tensor
    # parallel 1 only.
    compile_model: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", str(locate(self.model)))
        if self.draft is not None and not is_ngram(self.draft):
            object.__setattr__(self, "draft", str(locate(self.draft)))
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                              f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.compile_model and self.device != "cpu":
            raise ConfigError(f"compile_model is for device cpu (CUDA runs CUDA graphs), got device {self.device!r}")
        if self.speculation_max_batch is not None and self.speculation_max_batch < 1:
            raise ConfigError(f"speculation_max_batch must be at least 1 (or None), got {self.speculation_max_batch}")
        if self.num_speculative_tokens < 0 or self.num_speculative_tokens > 16:
            raise ConfigError(f"num_speculative_tokens must be in 0..16, got {self.num_speculative_tokens}")
        if self.draft_window < 1:
            raise ConfigError(f"draft_window must be >= 1, got {self.draft_window}")
        if self.capacity < 1:
            raise ConfigError(f"capacity must be >= 1, got {self.capacity}")
        if self.max_context < 2:
            raise ConfigError(f"max_context must be >= 2, got {self.max_context}")
        if self.quantization not in ("auto", "int8", "none"):
            raise ConfigError(f"quantization must be auto, int8 or none, got {self.quantization!r}")
        if self.draft_dtype not in (None, "auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"draft_dtype must be float32, bfloat16, float16, auto or None, got {self.draft_dtype!r}")
        if not 0 < self.memory_utilization <= 1:
            raise ConfigError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.kv_pool_tokens is not None and self.kv_pool_tokens < self.max_context + self.num_speculative_tokens:
            raise ConfigError(
                f"kv_pool_tokens ({self.kv_pool_tokens}) must hold one full request: at least "
                f"max_context + num_speculative_tokens = {self.max_context + self.num_speculative_tokens}"
            )

    @property
    def spec_tokens(self) -> int:
        """k actually used: 0 without a draft."""
        return self.num_speculative_tokens if self.draft else 0

    @property
    def kv_tokens(self) -> int:
        if self.kv_pool_tokens is not None:
            return self.kv_pool_tokens
        return max(self.capacity * self.max_context // 4, self.max_context + self.num_speculative_tokens)
