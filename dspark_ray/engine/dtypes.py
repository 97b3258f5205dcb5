"""The dtypes the target and the draft run in: a config's ``dtype``/``draft_dtype`` resolved for its device.

Read by whatever builds a model (``local.make_target_runner``,
``local.make_draft_proposer``) and by what plans its memory
(``memory_budget.memory_plan``), so both count the same bytes.
"""

from __future__ import annotations

import torch

from dspark_ray.engine.config import EngineConfig


def runtime_dtype(dtype: str, device: str) -> str:
    """'auto' means float32 on CPU (bf16 matmuls are slow and lossy there), else the checkpoint's."""
    if dtype != "auto":
        return dtype
    return "float32" if torch.device(device).type == "cpu" else "auto"


def native_bf16_cpu() -> bool:
    """This CPU multiplies bfloat16 natively (AVX512-BF16 or AMX): there a bfloat16 matmul reads half
    the bytes of a float32 one at no extra cost; elsewhere it is emulated and slower than float32."""
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in ("_is_avx512_bf16_supported",
                                                                         "_is_amx_tile_supported"))


def draft_runtime_dtype(config: EngineConfig) -> str:
    """The draft's dtype. ``draft_dtype`` None: the target's (``dtype``). "auto" on CPU: bfloat16 where
    the CPU has native bfloat16, else float32 (the draft's weights are read once per draft token,
    and on the 2-core development box a bfloat16 draft made served concurrency-1 throughput 1.13x,
    README); on CUDA, the checkpoint's. Output never depends on it: every token is verified."""
    if config.draft_dtype is None:
        return runtime_dtype(config.dtype, config.device)
    if config.draft_dtype == "auto" and torch.device(config.device).type == "cpu":
        return "bfloat16" if native_bf16_cpu() else "float32"
    return runtime_dtype(config.draft_dtype, config.device)
