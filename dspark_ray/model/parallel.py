"""Tensor-parallel building blocks: a rank's group, the sharded linears, and the slice each holds.

``TensorParallel`` is one rank's place in the group (and its all-reduce);
``ColumnParallelLinear``, ``RowParallelLinear`` and ``ExpertShard`` are what
``tp.shard`` puts in a model's place; ``shard_slice`` says which slice of a
checkpoint tensor a rank's module holds, which the loaders (safetensors, FP8,
GGUF blocks) read. The transform itself, and why it slices the way it does,
is ``dspark_ray/model/tp.py``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dspark_ray.model.layers import Linear


class CollectiveTimer:
    """Time this rank spends in all-reduces, summed until ``take()`` (the shard exports it per step).

    On CUDA the all-reduce is asynchronous, so it is timed with CUDA events and
    read after the step's results reached the host; on CPU (gloo) it blocks and
    the wall clock is exact. Either way it includes waiting for slower ranks.
    """

    def __init__(self) -> None:
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def time(self, y: torch.Tensor):
        if y.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - t0

    def take(self) -> float:
        """Seconds in collectives since the last call."""
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1000
            self._events.clear()
        seconds, self._seconds = self._seconds, 0.0
        return seconds


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    world_size: int
    group: Any = None  # a torch.distributed ProcessGroup; None = the default group
    timer: CollectiveTimer | None = field(default=None, compare=False)  # times the all-reduces if set

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside 0..{self.world_size - 1}")

    def all_reduce(self, y: torch.Tensor) -> None:
        """Sum ``y`` over the ranks, in place (timed when a timer is set)."""
        if self.timer is None:
            dist.all_reduce(y, group=self.group)
        else:
            with self.timer.time(y):
                dist.all_reduce(y, group=self.group)


class ColumnParallelLinear(Linear):
    """Holds rows [rank*out/w, (rank+1)*out/w) of the weight; output stays sharded."""

    def __init__(self, full: nn.Linear, tp: TensorParallel) -> None:
        out = full.out_features // tp.world_size
        super().__init__(full.in_features, out, bias=full.bias is not None, device=full.weight.device,
                         dtype=full.weight.dtype)
        self.tp = tp


class RowParallelLinear(Linear):
    """Holds columns [rank*in/w, (rank+1)*in/w); partial outputs are all-reduced."""

    def __init__(self, full: nn.Linear, tp: TensorParallel) -> None:
        inp = full.in_features // tp.world_size
        super().__init__(inp, full.out_features, bias=full.bias is not None, device=full.weight.device,
                         dtype=full.weight.dtype)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gemm(x) if self.gemm is not None else F.linear(x, self.weight)
        if self.tp.world_size > 1:
            self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y


class ExpertShard(nn.Linear):
    """One expert projection's slice: rows (``dim`` 0, gate/up) or columns (``dim`` 1, down) of the
    checkpoint's weight. It only holds the slice; ``SparseMoE`` computes with it and all-reduces."""

    def __init__(self, full: nn.Linear, tp: TensorParallel, dim: int) -> None:
        out = full.out_features // tp.world_size if dim == 0 else full.out_features
        inp = full.in_features // tp.world_size if dim == 1 else full.in_features
        super().__init__(inp, out, bias=False, device=full.weight.device, dtype=full.weight.dtype)
        self.tp, self.dim = tp, dim


def shard_slice(model: nn.Module, param_name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
    """The slice of checkpoint tensor ``param_name`` (full ``shape``) this rank holds, or None if whole."""
    module_name, _, kind = param_name.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(module, ColumnParallelLinear):
        dim = 0
    elif isinstance(module, ExpertShard):
        dim = module.dim
    elif isinstance(module, RowParallelLinear) and kind == "weight":
        dim = 1
    else:
        return None
    tp = module.tp
    size = shape[dim] // tp.world_size
    index = [slice(None)] * len(shape)
    index[dim] = slice(tp.rank * size, (tp.rank + 1) * size)
    return tuple(index)
