"""Cores of their own for worker processes (dspark_ray/runtime/cores.py, AppConfig.bind_cores): claims held
by real processes through real file locks, the binding read back from the kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from dspark_ray.runtime.cores import bind_current_thread, claim_and_bind, claim_cores

CPUS = sorted(os.sched_getaffinity(0))

HOLDER = """
import sys, time
from pathlib import Path
from dspark_ray.runtime.cores import claim_cores
claim = claim_cores(int(sys.argv[1]), Path(sys.argv[2]))
print(",".join(map(str, claim.cores)), flush=True)
time.sleep(600)
"""


def holder(n: int, directory) -> tuple[subprocess.Popen, tuple[int, ...]]:
    """Another process holding a claim of ``n`` CPUs (until it is killed); the CPUs it got."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(n), str(directory)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    return proc, tuple(int(c) for c in line.split(",")) if line else ()


def test_claims_go_highest_first_and_never_overlap_between_processes(tmp_path):
    proc, theirs = holder(1, tmp_path)
    try:
        assert theirs == (CPUS[-1],)  # the highest-numbered CPU first: CPU 0 stays with everything else
        mine = claim_cores(len(CPUS), tmp_path)
        assert mine.cores == tuple(sorted(CPUS[:-1], reverse=True))  # all the others, none of theirs
        mine.release()
        again = claim_cores(1, tmp_path)
        assert again.cores == ((CPUS[-2],) if len(CPUS) > 1 else ())  # released: free again
        again.release()
    finally:
        proc.kill()
        proc.wait()


def test_a_dead_process_s_cores_are_free_at_once(tmp_path):
    proc, theirs = holder(len(CPUS), tmp_path)
    assert sorted(theirs) == CPUS
    assert claim_cores(1, tmp_path).cores == ()  # every CPU held
    proc.kill()  # as a crashed worker: nothing cleans up but the kernel
    proc.wait()
    claim = claim_cores(1, tmp_path)
    assert claim.cores == (CPUS[-1],)
    claim.release()


def test_the_torch_thread_is_bound_and_the_rest_of_the_process_is_not(tmp_path):
    """claim_and_bind binds the thread it is given (a worker's torch thread), which is where OpenMP starts
    its threads from; the process's other threads keep every CPU."""
    seen: dict[str, set[int]] = {}

    def on_thread(fn, *args):  # a stand-in for TorchThread.call: runs fn on a thread of its own
        out = []
        t = threading.Thread(target=lambda: (out.append(fn(*args)), seen.__setitem__("bound",
                                                                                     os.sched_getaffinity(0))))
        t.start()
        t.join()
        return out[0]

    claim = claim_and_bind(1, on_thread, tmp_path)
    try:
        assert claim.cores == (CPUS[-1],) and seen["bound"] == {CPUS[-1]}
        assert sorted(os.sched_getaffinity(0)) == CPUS  # this thread: untouched
    finally:
        claim.release()


def test_a_worker_that_finds_no_free_cpu_stays_unbound(tmp_path, caplog):
    proc, _ = holder(len(CPUS), tmp_path)
    try:
        called = []
        with caplog.at_level("WARNING"):
            claim = claim_and_bind(1, lambda fn, *a: called.append(fn), tmp_path)
        assert claim.cores == () and called == [] and "stays unbound" in caplog.text
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs")
def test_a_bound_thread_runs_only_on_its_cpu():
    where: list[int] = []

    def run() -> None:
        bind_current_thread((CPUS[-1],))
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            where.append(os.sched_getcpu() if hasattr(os, "sched_getcpu") else _cpu_now())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert where and set(where) == {CPUS[-1]}


def _cpu_now() -> int:
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def test_a_draft_worker_with_bind_cores_binds_its_torch_thread(tmp_path, monkeypatch, shipped_target,
                                                                shipped_draft):
    """The real worker class (in this process): its torch thread is bound to the CPU it claimed."""
    from dspark_ray.engine.config import EngineConfig
    from dspark_ray.runtime import cores
    from dspark_ray.runtime.workers import DraftWorker

    monkeypatch.setattr(cores, "claims_dir", lambda: tmp_path)
    config = EngineConfig(model=str(shipped_target), draft=str(shipped_draft), capacity=4, max_context=128)
    worker = DraftWorker(config, torch_threads=1, bind_cores=True)
    try:
        assert worker.bound_cores() == (CPUS[-1],)
        assert worker.torch.call(os.sched_getaffinity, 0) == {CPUS[-1]}
        assert sorted(os.sched_getaffinity(0)) == CPUS
        assert claim_cores(1, tmp_path).cores == ((CPUS[-2],) if len(CPUS) > 1 else ())
    finally:
        worker.cores.release()


def test_an_application_can_claim_in_a_directory_of_its_own(tmp_path, monkeypatch):
    """DSPARK_CORES_DIR (a worker's env, set through worker_env_vars) puts an application's claims apart: two
    applications measured one at a time (bench/served_ab.py) each bind all the cores."""
    from dspark_ray.runtime import cores

    proc, theirs = holder(len(CPUS), tmp_path / "a")  # application A holds every CPU in its directory
    try:
        assert sorted(theirs) == CPUS
        monkeypatch.setenv("DSPARK_CORES_DIR", str(tmp_path / "b"))
        assert cores.claims_dir() == tmp_path / "b"
        claim = claim_cores(1)  # the default directory, now B's
        assert claim.cores == (CPUS[-1],)
        claim.release()
        monkeypatch.delenv("DSPARK_CORES_DIR")
        assert cores.claims_dir().name == f"dspark-cores-{os.getuid()}"
    finally:
        proc.kill()
        proc.wait()


BIND_PROCESS = r"""
import os, threading, time, json
from dspark_ray.runtime.cores import bind_process
stop = threading.Event()
threads = [threading.Thread(target=stop.wait) for _ in range(3)]
for t in threads:
    t.start()
cpu = max(os.sched_getaffinity(0))
bound = bind_process((cpu,))
later = threading.Thread(target=stop.wait)  # started after: inherits its creator's binding
later.start()
seen = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
stop.set()
print(json.dumps({"cpu": cpu, "bound": bound, "seen": seen}))
"""


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to tell a binding from none")
def test_bind_process_binds_every_thread_and_the_threads_started_after():
    """AppConfig.bind_replica's binding: every thread of the process, not only the caller (sched_setaffinity
    on Linux binds one thread), and threads started later inherit it."""
    import json

    out = subprocess.run([sys.executable, "-c", BIND_PROCESS], capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(out.stdout)
    assert result["bound"] >= 4  # the main thread and the three others
    assert len(result["seen"]) >= 5
    assert all(cpus == [result["cpu"]] for cpus in result["seen"].values()), result

