"""The worker actors of one replica: a ``TargetShard`` per tensor-parallel rank and a ``DraftWorker``.

Each is a plain class that Ray runs as a named actor in the replica's
placement group. Set-up goes through Ray method calls; the per-step path
(``step``, ``release``, ``propose``) goes through a ``Channel`` that the
replica opens with ``open_channel`` (``dspark_ray.serve.channel`` says why).
Ray method calls run on the actor's main thread and channel calls on the
channel's thread, so both take the worker's lock.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import ray
import torch

from dspark_ray.engine.config import EngineConfig
from dspark_ray.engine.interfaces import Proposal, ProposeRow, TargetStep, VerifyResult
from dspark_ray.model.tp import CollectiveTimer
from dspark_ray.serve.channel import ChannelServer
from dspark_ray.serve.group import join_group, rendezvous_address
from dspark_ray.serve.metrics import ShardMetrics
from dspark_ray.tokenizer import Tokenizer


class _ChannelWorker:
    """Opens channels for the replica: one per call of ``open_channel`` (one per engine lane)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def open_channel(self, authkey: bytes) -> tuple[str, int]:
        """Listen for one connection on this node's IP; returns the address to connect to."""
        return ChannelServer(self, ray.util.get_node_ip_address(), authkey, self.lock).address


class TargetShard(_ChannelWorker):
    """Rank ``rank`` of the target: its shard of the weights, its KV pool, its table."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int, torch_threads: int,
                 replica: str = "") -> None:
        super().__init__()
        torch.set_num_threads(torch_threads)
        self.config, self.rank, self.world_size = config, rank, world_size
        self.runner = None
        self.collectives = CollectiveTimer()
        self.metrics = ShardMetrics(Path(config.model).name, replica or "local", rank)

    def address(self) -> tuple[str, int]:
        """The group's rendezvous address (called on rank 0)."""
        return rendezvous_address()

    def setup(self, master_addr: str, master_port: int) -> int:
        """Join the tensor-parallel group, load this rank's shard; returns KV pool capacity."""
        from dspark_ray.engine.local import make_target_runner
        from dspark_ray.model.tp import TensorParallel

        cfg = self.config
        tp = None
        if self.world_size > 1:
            join_group(cfg.device, master_addr, master_port, self.rank, self.world_size)
            tp = TensorParallel(self.rank, self.world_size, timer=self.collectives)
        self.runner = make_target_runner(cfg, Tokenizer.from_path(cfg.model).vocab_size, tp)
        return self.runner.kv_capacity()

    def step(self, batch: TargetStep) -> tuple[VerifyResult, float]:
        """Verify one step; returns the result and the seconds this rank spent in all-reduces."""
        start = time.perf_counter()
        result = self.runner.step(batch)
        collective = self.collectives.take()
        self.metrics.observe(time.perf_counter() - start, collective)
        return result, collective

    def release(self, slots: list[int]) -> None:
        self.runner.release(slots)

    def kv_free(self) -> int:
        with self.lock:
            return self.runner.kv_free()


class DraftWorker(_ChannelWorker):
    """The draft model, its window cache and kernels."""

    def __init__(self, config: EngineConfig, torch_threads: int) -> None:
        from dspark_ray.engine.local import make_draft_proposer

        super().__init__()
        torch.set_num_threads(torch_threads)
        self.proposer = make_draft_proposer(config, Tokenizer.from_path(config.model).vocab_size)

    def propose(self, rows: list[ProposeRow]) -> Proposal:
        return self.proposer.propose(rows)
