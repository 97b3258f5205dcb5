"""`dspark nccl-check`: the torch.distributed probe between two placed Ray actors (gloo on CPU), the
bandwidth arithmetic, and the all_reduce_perf route with stand-in binaries on PATH."""

from __future__ import annotations

import os
import stat

import pytest
import ray

from dspark_ray.cli import main
from dspark_ray.ops.nccl_check import BandwidthRow, all_reduce_perf_command, message_sizes, parse_size, run_probe


@pytest.fixture(scope="module")
def local_ray():
    if ray.is_initialized():  # someone else's connection in this process: use it, leave it running
        yield
        return
    ray.init(num_cpus=2, object_store_memory=100 * 1024 * 1024, include_dashboard=False,
             namespace="dspark-test-nccl-check", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_bandwidth_is_nccl_tests_arithmetic():
    row = BandwidthRow(size_bytes=1_000_000_000, seconds=0.5)
    assert row.algbw_gbs == 2.0
    assert row.busbw_gbs(2) == 2.0  # 2 (n-1) / n = 1
    assert row.busbw_gbs(8) == pytest.approx(3.5)
    assert message_sizes(1024, 65536, 4) == [1024, 4096, 16384, 65536]
    assert [parse_size(s) for s in ("8", "1K", "64M", "1G", "2kb")] == [8, 1024, 64 << 20, 1 << 30, 2048]
    with pytest.raises(ValueError):
        message_sizes(1024, 512)


@pytest.mark.ray
def test_probe_between_two_placed_actors(local_ray):
    result = run_probe(2, "cpu", [1024, 65536], warmup=1, iters=3)
    assert result.backend == "gloo" and result.world_size == 2 and len(result.nodes) == 2
    assert [r.size_bytes for r in result.rows] == [1024, 65536]
    assert all(r.seconds > 0 and r.busbw_gbs(2) == r.algbw_gbs > 0 for r in result.rows)
    table = result.table()
    assert "algbw(GB/s)" in table and "busbw(GB/s)" in table and "Avg bus bandwidth" in table
    assert ray.util.placement_group_table() == {} or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


@pytest.mark.ray
def test_command_runs_the_probe_when_nccl_tests_is_missing(local_ray, capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["nccl-check", "--min-bytes", "4K", "--max-bytes", "16K", "--iters", "2", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "all_reduce_perf and mpirun are not both on PATH" in out and "backend gloo" in out
    assert len([line for line in out.splitlines() if line and not line.startswith("#")]) == 2  # 4K, 16K


def test_all_reduce_perf_across_hosts_through_mpirun(tmp_path, capsys, monkeypatch):
    log = tmp_path / "mpirun.args"
    for name, body in (("mpirun", f'echo "$@" > {log}\n'), ("all_reduce_perf", "exit 1\n")):
        path = tmp_path / name
        path.write_text(f"#!/bin/sh\n{body}")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("NCCL_IB_HCA", "rocep1s0f0,roceP2p1s0f0")
    assert main(["nccl-check", "--hosts", "spark1,spark2", "--min-bytes", "8", "--max-bytes", "1G"]) == 0
    args = log.read_text().split()
    assert args[:4] == ["-np", "2", "-H", "spark1:1,spark2:1"]
    assert ["-x", "NCCL_IB_HCA"] == args[args.index("-x"):args.index("-x") + 2]
    assert args[args.index(str(tmp_path / "all_reduce_perf")) + 1:] == [
        "-b", "8", "-e", str(1 << 30), "-f", "2", "-g", "1", "-n", "20", "-w", "5"]
    assert "mpirun" in capsys.readouterr().out  # the command is printed before it runs


def test_mpirun_command_passes_the_nccl_environment(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "enp1s0f0np0")
    cmd = all_reduce_perf_command(["a", "b"], 8, 1024, "/opt/nccl-tests/build/all_reduce_perf")
    assert "NCCL_SOCKET_IFNAME" in cmd and cmd[cmd.index("NCCL_SOCKET_IFNAME") - 1] == "-x"
    assert cmd[:5] == ["mpirun", "-np", "2", "-H", "a:1,b:1"]
