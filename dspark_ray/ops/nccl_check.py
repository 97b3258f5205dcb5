"""``dspark nccl-check``: all-reduce bandwidth between the boxes, the way the target shards use it.

Two ways, the first available wins:

1. nccl-tests' ``all_reduce_perf`` on PATH (and ``mpirun``): one process per
   host of the Ray cluster (or ``--hosts``), one GPU each, through mpirun. Its
   own table is printed as is.
2. A torch.distributed probe: one Ray actor per rank in a placement group
   built like the target shards' (one bundle per rank; STRICT_SPREAD puts one
   per box), NCCL on CUDA, gloo on CPU, timing ``all_reduce`` of float32
   buffers of each size.

Bandwidths are nccl-tests' (its doc/PERFORMANCE.md), so both read the same:

    algbw = S / t                  S: bytes per rank, t: seconds per all-reduce
    busbw = algbw * 2 (n - 1) / n  what each link carries in a ring all-reduce;
                                   compare it with the link speed
"""

from __future__ import annotations

import os
import shlex
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass

ALL_REDUCE_PERF = "all_reduce_perf"


@dataclass(frozen=True)
class BandwidthRow:
    size_bytes: int
    seconds: float  # per all-reduce, mean over iterations and ranks

    @property
    def algbw_gbs(self) -> float:
        return self.size_bytes / self.seconds / 1e9

    def busbw_gbs(self, world_size: int) -> float:
        return self.algbw_gbs * 2 * (world_size - 1) / world_size


@dataclass(frozen=True)
class ProbeResult:
    backend: str
    world_size: int
    nodes: list[str]  # node IP of each rank
    rows: list[BandwidthRow]

    def table(self) -> str:
        """nccl-tests style: size, count, time, algbw, busbw per message size."""
        n = self.world_size
        lines = [
            f"# dspark nccl-check: torch.distributed all_reduce probe, backend {self.backend}, float32, {n} ranks",
            "# " + ", ".join(f"rank {r} on {ip}" for r, ip in enumerate(self.nodes)),
            f"# {'size(B)':>12} {'count':>12} {'time(us)':>12} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}",
        ]
        for row in self.rows:
            lines.append(f"  {row.size_bytes:>12} {row.size_bytes // 4:>12} {row.seconds * 1e6:>12.1f} "
                         f"{row.algbw_gbs:>12.3f} {row.busbw_gbs(n):>12.3f}")
        avg = statistics.mean(r.busbw_gbs(n) for r in self.rows)
        peak = max(r.busbw_gbs(n) for r in self.rows)
        lines.append(f"# Avg bus bandwidth: {avg:.3f} GB/s, peak {peak:.3f} GB/s")
        return "\n".join(lines)


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    """min, min*factor, ... up to max (whole float32 elements, at least one)."""
    if min_bytes < 4 or max_bytes < min_bytes or factor < 2:
        raise ValueError("need 4 <= min_bytes <= max_bytes and factor >= 2")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size - size % 4)
        size *= factor
    return sizes


class ProbeRank:
    """One rank of the probe (a Ray actor): joins the group, times all-reduces."""

    def __init__(self, rank: int, world_size: int, device: str) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device

    def address(self) -> tuple[str, int]:
        from dspark_ray.runtime.group import rendezvous_address

        return rendezvous_address()

    def setup(self, master_addr: str, master_port: int) -> str:
        """Join the process group; returns this rank's node IP."""
        import ray

        from dspark_ray.runtime.group import join_group

        join_group(self.device, master_addr, master_port, self.rank, self.world_size)
        return ray.util.get_node_ip_address()

    def run(self, sizes: list[int], warmup: int, iters: int) -> list[float]:
        """Seconds per all-reduce for each size."""
        import torch
        import torch.distributed as dist

        cuda = self.device == "cuda"
        times = []
        for size in sizes:
            buf = torch.ones(max(1, size // 4), dtype=torch.float32, device=self.device)
            for _ in range(warmup):
                dist.all_reduce(buf)
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(buf)
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) / iters)
        return times

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def run_probe(world_size: int, device: str, sizes: list[int], *, placement_strategy: str = "PACK",
              cpus_per_rank: float = 0.5, warmup: int = 5, iters: int = 20, timeout_s: float = 600) -> ProbeResult:
    """The torch.distributed probe on the connected Ray cluster (``ray.init`` first)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpu = 1 if device == "cuda" else 0
    bundles = [{"CPU": cpus_per_rank, **({"GPU": 1} if gpu else {})} for _ in range(world_size)]
    pg = placement_group(bundles, strategy=placement_strategy, name="dspark:nccl-check")
    ranks = []
    try:
        ray.get(pg.ready(), timeout=timeout_s)
        cls = ray.remote(ProbeRank)
        ranks = [cls.options(num_cpus=cpus_per_rank, num_gpus=gpu, scheduling_strategy=PlacementGroupSchedulingStrategy(
                     pg, placement_group_bundle_index=r)).remote(r, world_size, device) for r in range(world_size)]
        addr, port = ray.get(ranks[0].address.remote(), timeout=timeout_s)
        nodes = ray.get([r.setup.remote(addr, port) for r in ranks], timeout=timeout_s)
        per_rank = ray.get([r.run.remote(sizes, warmup, iters) for r in ranks], timeout=timeout_s)
        ray.get([r.close.remote() for r in ranks], timeout=timeout_s)
    finally:
        for actor in ranks:
            ray.kill(actor, no_restart=True)
        remove_placement_group(pg)
    rows = [BandwidthRow(size, statistics.mean(t[i] for t in per_rank)) for i, size in enumerate(sizes)]
    return ProbeResult("nccl" if gpu else "gloo", world_size, nodes, rows)


def all_reduce_perf_command(hosts: list[str], min_bytes: int, max_bytes: int, binary: str,
                            mpirun: str = "mpirun", iters: int = 20, warmup: int = 5) -> list[str]:
    """mpirun with one rank (one GPU) per host, passing the NCCL/UCX environment through."""
    passed = sorted(k for k in os.environ if k.startswith(("NCCL_", "UCX_")))
    cmd = [mpirun, "-np", str(len(hosts)), "-H", ",".join(f"{h}:1" for h in hosts), "--bind-to", "none"]
    for key in passed:
        cmd += ["-x", key]
    cmd += [binary, "-b", str(min_bytes), "-e", str(max_bytes), "-f", "2", "-g", "1",
            "-n", str(iters), "-w", str(warmup)]
    return cmd


def find_all_reduce_perf() -> tuple[str, str] | None:
    """(all_reduce_perf, mpirun) paths when both are on PATH."""
    binary, mpirun = shutil.which(ALL_REDUCE_PERF), shutil.which("mpirun")
    return (binary, mpirun) if binary and mpirun else None


def cluster_hosts() -> list[str]:
    """The addresses of the alive nodes of the connected Ray cluster."""
    import ray

    return sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]})


def run_all_reduce_perf(cmd: list[str]) -> int:
    print("# " + shlex.join(cmd), flush=True)
    return subprocess.call(cmd)


def parse_size(text: str) -> int:
    """'8', '1K', '64M', '1G' (powers of 1024, as nccl-tests reads -b/-e)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def connect(address: str | None, num_cpus: int) -> str:
    """Join the Ray cluster at ``address`` (or RAY_ADDRESS, or the one on this machine), else start one."""
    import ray

    if ray.is_initialized():
        return "the Ray cluster this process is connected to"
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
        return f"the Ray cluster at {address}"
    try:
        ray.init(address="auto", log_to_driver=False)
        return "the Ray cluster on this machine"
    except ConnectionError:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        return "a local Ray started for this check"


def check(*, address: str | None, ranks: int, device: str, placement_strategy: str, min_bytes: int,
          max_bytes: int, factor: int, iters: int, warmup: int, hosts: list[str] | None, probe: bool) -> int:
    """``dspark nccl-check``: prints the bandwidth table; returns the exit status."""
    tools = None if probe else find_all_reduce_perf()
    if tools is not None and device != "cpu":
        if not hosts:
            connect(address, num_cpus=ranks)
            hosts = cluster_hosts()
        binary, mpirun = tools
        return run_all_reduce_perf(all_reduce_perf_command(hosts, min_bytes, max_bytes, binary, mpirun,
                                                           iters=iters, warmup=warmup))
    where = connect(address, num_cpus=ranks)
    import ray

    if device == "auto":
        device = "cuda" if ray.cluster_resources().get("GPU", 0) >= ranks else "cpu"
    reason = "--probe" if probe else "--device cpu" if tools else f"{ALL_REDUCE_PERF} and mpirun are not both on PATH"
    print(f"# {reason}: torch.distributed probe on {where}, {ranks} ranks, {placement_strategy}", flush=True)
    result = run_probe(ranks, device, message_sizes(min_bytes, max_bytes, factor),
                       placement_strategy=placement_strategy, warmup=warmup, iters=iters)
    print(result.table())
    return 0
