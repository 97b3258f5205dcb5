"""The worker actors of one replica: a ``TargetShard`` per tensor-parallel rank and a ``DraftWorker``.

Each is a plain class that Ray runs as a named actor in the replica's
placement group. Set-up goes through Ray method calls; the per-step path
(``step``, ``release``, ``propose``) goes through a ``Channel`` that the
replica opens with ``open_channel`` (``dspark_ray.serve.channel`` says why).

All of a worker's torch work, from loading the model to every step, runs on
one thread of its own (``TorchThread``), whichever thread the request came in
on (Ray's for method calls, the channel's for steps). Measured on the 2-core
development box with 2 torch threads: the same engine steps run 1.6-1.8x
slower when a second thread drives torch's OpenMP pool in a process whose
other thread already used it; so every call is handed to that one thread,
which also serialises them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
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


class TorchThread:
    """The one thread that runs a worker's torch calls, one at a time, in arrival order."""

    def __init__(self, torch_threads: int, name: str = "dspark-torch") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        self.call(torch.set_num_threads, torch_threads)

    def run(self, fn: Callable, *args) -> tuple[object, float]:
        """``fn(*args)`` on the torch thread, and the seconds it took there (not counting the wait)."""
        done: Future = Future()
        self._jobs.put((fn, args, done))
        return done.result()

    def call(self, fn: Callable, *args):
        return self.run(fn, *args)[0]

    def _loop(self) -> None:
        while True:
            fn, args, done = self._jobs.get()
            start = time.perf_counter()
            try:
                value = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                done.set_exception(exc)
            else:
                done.set_result((value, time.perf_counter() - start))


class _ChannelWorker:
    """Opens channels for the replica (one per call of ``open_channel``); owns the torch thread."""

    def __init__(self, torch_threads: int) -> None:
        self.torch = TorchThread(torch_threads)

    def open_channel(self, authkey: bytes) -> tuple[str, int]:
        """Listen for one connection on this node's IP; returns the address to connect to."""
        return ChannelServer(self, ray.util.get_node_ip_address(), authkey, self.torch.run).address


class TargetShard(_ChannelWorker):
    """Rank ``rank`` of the target: its shard of the weights, its KV pool, its table."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int, torch_threads: int,
                 replica: str = "") -> None:
        super().__init__(torch_threads)
        self.config, self.rank, self.world_size = config, rank, world_size
        self.runner = None
        self.collectives = CollectiveTimer()
        self.metrics = ShardMetrics(Path(config.model).name, replica or "local", rank)

    def address(self) -> tuple[str, int]:
        """The group's rendezvous address (called on rank 0)."""
        return rendezvous_address()

    def setup(self, master_addr: str, master_port: int) -> int:
        """Join the tensor-parallel group, load this rank's shard; returns KV pool capacity."""
        return self.torch.call(self._setup, master_addr, master_port)

    def _setup(self, master_addr: str, master_port: int) -> int:
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
        return self.torch.call(self.runner.kv_free)


class DraftWorker(_ChannelWorker):
    """The draft model, its window cache and kernels."""

    def __init__(self, config: EngineConfig, torch_threads: int) -> None:
        from dspark_ray.engine.local import make_draft_proposer

        super().__init__(torch_threads)
        self.proposer = self.torch.call(make_draft_proposer, config, Tokenizer.from_path(config.model).vocab_size)

    def propose(self, rows: list[ProposeRow]) -> Proposal:
        return self.proposer.propose(rows)
