"""The engine's memory budget: the planner's verdict for an ``EngineConfig``, and the CUDA KV pool.

``memory_plan`` turns an engine's settings into the planner's terms
(dspark_ray/model/memory.py). On CUDA the target runner asks ``check_fits``
before it reads a weight (a deployment that cannot fit is refused with the
plan's numbers and what would fit) and ``cuda_pool_tokens`` after: the KV
pool then takes what the device has left, less this replica's other needs,
up to what every slot at full context needs. On CPU the pool keeps its sizing
from the slots (``EngineConfig.kv_tokens``); the serving layer checks the
plan against the host's memory when it validates its config (AppConfig).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dspark_ray.engine.config import EngineConfig, is_ngram
from dspark_ray.engine.dtypes import draft_runtime_dtype, runtime_dtype
from dspark_ray.model.memory import (
    SLOT_POOL_SHARE,
    Checkpoint,
    MemoryPlan,
    MemoryPlanError,
    Placement,
    Workload,
    available_host_memory,
    checkpoint_name,
    plan,
    pool_tokens_after_load,
    read_config,
)
from dspark_ray.model.parallel import TensorParallel


def memory_plan(config: EngineConfig, tensor_parallel_size: int = 1, nodes: int = 1, memory_bytes: int | None = None,
                memory_utilization: float | None = None) -> MemoryPlan:
    """The plan of one replica with ``config`` on ``tensor_parallel_size`` ranks over ``nodes`` nodes.

    ``memory_bytes``: one device's memory (None: measured here: the first GPU's total on CUDA, the
    host's available memory on CPU). ``memory_utilization`` None: the config's.
    """
    device = torch.device(config.device).type
    if memory_bytes is None and device == "cuda":
        memory_bytes = torch.cuda.mem_get_info(torch.device(config.device))[1]
    elif memory_bytes is None:
        memory_bytes = available_host_memory()
    placement = Placement(tensor_parallel_size, nodes, memory_bytes,
                          config.memory_utilization if memory_utilization is None else memory_utilization,
                          device)
    target = Checkpoint.of(read_config(config.model), device, runtime_dtype(config.dtype, config.device),
                           _planned(config.quantization), name=checkpoint_name(config.model))
    draft = None
    if config.draft and config.spec_tokens > 0 and not is_ngram(config.draft):  # prompt lookup: no weights
        draft = Checkpoint.of(read_config(config.draft), device, draft_runtime_dtype(config),
                              _planned(config.quantization), name=checkpoint_name(config.draft))
    workload = Workload(config.capacity, config.max_context, config.num_speculative_tokens, config.draft_window,
                        config.max_num_seqs, config.max_num_batched_tokens, config.kv_pool_tokens,
                        SLOT_POOL_SHARE if device == "cpu" else None, config.draft_ahead)
    return plan(target, placement, workload, draft)


def _planned(quantization: str) -> str:
    """The planner's name for what the loader keeps: int8 keeps the same blocks as auto."""
    return "auto" if quantization == "int8" else quantization


def check_fits(config: EngineConfig, tp: TensorParallel | None) -> MemoryPlan:
    """CUDA, before loading: this rank's plan against its GPU's memory; raises ``MemoryPlanError``
    (with the numbers and what would fit) if not even one full-context request fits."""
    world = tp.world_size if tp is not None else 1
    result = memory_plan(config, world, world)
    if not result.fits:
        raise MemoryPlanError(result)
    return result


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device.

    On an integrated GPU that shares the host's memory (the GB10 of a DGX
    Spark), cudaMemGetInfo's free is the kernel's MemFree, which counts the
    page cache (such as the checkpoint just read) as used although the kernel
    hands it back on demand; there the host's MemAvailable is what is free.
    """
    free, total = torch.cuda.mem_get_info(device)
    if getattr(torch.cuda.get_device_properties(device), "is_integrated", False):
        free = min(max(free, available_host_memory()), total)
    return free, total


def cuda_pool_tokens(config: EngineConfig, result: MemoryPlan, tp: TensorParallel | None) -> int:
    """CUDA, after loading this rank's weights: the KV pool's tokens (``kv_pool_tokens`` if set).

    What the device has free, less what the plan leaves to others and this
    rank's workspace, table and runtime (and the draft on rank 0's device,
    which loads after the target), at most every slot at full context; the
    smallest over the ranks, so that all keep the same pool. Raises
    ``MemoryPlanError`` if that is less than one full-context request.
    """
    if config.kv_pool_tokens is not None:
        return config.kv_pool_tokens
    device = torch.device(config.device)
    free, total = device_memory(device)
    rank0 = tp is None or tp.rank == 0
    tokens = pool_tokens_after_load(result, free, total, draft_pending=rank0 and result.draft is not None)
    if tp is not None and tp.world_size > 1:
        agreed = torch.tensor([tokens], dtype=torch.int64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=tp.group)
        tokens = int(agreed.item())
    if tokens < result.request_tokens:
        raise MemoryPlanError(result, f"after loading the weights the device has {free / 1e9:.2f} GB free of "
                              f"{total / 1e9:.2f} GB, room for {max(tokens, 0):,} KV tokens on the tightest rank, "
                              f"fewer than one full-context request ({result.request_tokens:,}); free the device "
                              "(other processes), lower max_context or raise memory_utilization. The plan: ")
    return tokens
