"""Cores of their own for the worker processes of one machine (``AppConfig.bind_cores``).

NOTE: why. On a CPU box the workers' torch threads, the replicas, Ray and the
clients share a few cores. One worker on two OpenMP threads lost to that:
whenever another process took one of its cores, its thread on the other core
waited at the next barrier (README, Performance). Two replicas, each with a
worker on one torch thread, lose nothing at a barrier, but unbound, the two
threads and everything else migrate between the cores; each bound to a core
of its own, a preempted worker waits only for its own core. Measured served on
the 2-core development VM (bench/served_ab.py, bench/HISTORY.md, sixteenth
session).

How: each worker process claims ``n`` of the CPUs it may run on
(``os.sched_getaffinity``) by holding an exclusive ``flock`` on a file per
CPU in a directory of this machine (``claims_dir``) for its whole life, and
binds its torch thread to them (the OpenMP threads it starts later inherit
that). The kernel drops a dead process's locks, so the cores of a worker that
crashed or was killed are free again at once, with nothing to clean up, and
a worker Ray restarts claims afresh. Claims go from the highest-numbered CPU
down, so one worker leaves CPU 0 (where most interrupts land) to the
replicas, Ray and the clients. A worker that finds fewer than ``n`` CPUs free
takes those it finds; with none it stays unbound (logged): more workers than
cores then share them, as without binding.

Every application on the machine claims in the same directory, so two of
them never bind to the same core either. Do not combine with
``OMP_PROC_BIND``/``OMP_PLACES`` in ``worker_env_vars``: OpenMP would bind its
threads by those instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


def claims_dir() -> Path:
    """This machine's directory of per-CPU claim files (one per user). ``DSPARK_CORES_DIR`` in a worker's
    environment (``worker_env_vars``) gives its application a directory of its own: its workers then
    bind beside another application's rather than around them, as an A/B of two applications that
    run one at a time wants (bench/served_ab.py)."""
    return Path(os.environ.get("DSPARK_CORES_DIR") or Path(tempfile.gettempdir()) / f"dspark-cores-{os.getuid()}")


@dataclass
class CoreClaim:
    """CPUs this process holds, and the open lock files that hold them (kept open until ``release``)."""

    cores: tuple[int, ...] = ()
    _files: list = field(default_factory=list, repr=False)

    def release(self) -> None:
        for f in self._files:
            with contextlib.suppress(OSError):
                f.close()  # closing the file drops its lock
        self._files, self.cores = [], ()


def claim_cores(n: int, directory: Path | None = None) -> CoreClaim:
    """Claim up to ``n`` free CPUs of those this process may run on, highest-numbered first."""
    directory = claims_dir() if directory is None else directory
    directory.mkdir(parents=True, exist_ok=True)
    claim = CoreClaim()
    for cpu in sorted(os.sched_getaffinity(0), reverse=True):
        if len(claim.cores) >= n:
            break
        f = open(directory / f"cpu{cpu}.lock", "a+")  # noqa: SIM115 - held open for the claim's life
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            continue
        claim._files.append(f)
        claim.cores += (cpu,)
    return claim


def bind_current_thread(cores: tuple[int, ...]) -> None:
    """Bind the calling thread (and the threads it starts from now on) to ``cores``."""
    os.sched_setaffinity(0, set(cores))


def bind_process(cores: tuple[int, ...]) -> int:
    """Bind every thread of this process (and so the threads they start) to ``cores``; returns how many
    were bound (a thread that ended meanwhile is skipped; none where the OS has no affinity calls)."""
    if not hasattr(os, "sched_setaffinity"):
        return 0
    bound = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), set(cores))
            bound += 1
        except (ProcessLookupError, FileNotFoundError):
            pass
    return bound


def claim_and_bind(n: int, call_on_torch_thread, directory: Path | None = None) -> CoreClaim:
    """Claim ``n`` CPUs for this worker and bind its torch thread to them (``call_on_torch_thread(fn, *args)``
    runs ``fn`` there); an empty claim when none is free (the worker stays unbound), or where the OS has no
    CPU affinity calls (macOS: Linux only)."""
    if not hasattr(os, "sched_setaffinity"):
        log.warning("bind_cores: this OS cannot bind threads to CPUs (os.sched_setaffinity is Linux only); "
                    "the worker stays unbound")
        return CoreClaim()
    claim = claim_cores(n, directory)
    if not claim.cores:
        log.warning("bind_cores: all %d CPUs of this process are claimed by other workers; this one stays "
                    "unbound", len(os.sched_getaffinity(0)))
        return claim
    if len(claim.cores) < n:
        log.warning("bind_cores: %d of the %d CPUs wanted were free: %s", len(claim.cores), n, claim.cores)
    call_on_torch_thread(bind_current_thread, claim.cores)
    log.info("bind_cores: torch thread bound to CPU %s", ",".join(map(str, claim.cores)))
    return claim
