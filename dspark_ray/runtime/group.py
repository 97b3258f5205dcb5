"""Forming a torch.distributed group among Ray actors (target shards, the NCCL probe).

Rank 0 picks the rendezvous address (its node's IP and a free port); every
rank then joins with the same address. NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import socket

import ray
import torch.distributed as dist


def rendezvous_address() -> tuple[str, int]:
    """This node's IP and a free TCP port (call on rank 0)."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def join_group(device: str, master_addr: str, master_port: int, rank: int, world_size: int) -> None:
    """Join the default process group of ``world_size`` ranks."""
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                            rank=rank, world_size=world_size)
