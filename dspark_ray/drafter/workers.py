"""Worker processes of one torch thread each, for the stages that split their rows (answers, states).

On the 2-core development box two one-thread processes beat one two-thread process for the
engine's batched decoding, and keep doing so when other work shares the machine (a two-thread
OpenMP region stalls whenever either core is taken). A worker is ``python -m dspark_ray.drafter
<stage> <job.json>`` (dspark_ray/drafter/__main__.py runs the stage's ``run_job``): a plain
subprocess, so a script that runs the recipe needs no ``if __name__ == "__main__"`` guard.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


class WorkerFailed(RuntimeError):
    """A worker process exited with an error; what it finished is kept, and the stage can run again."""


def run_workers(stage: str, jobs: list[dict], folder: Path) -> None:
    """Run one worker of ``stage`` per job, all at once, and wait for every one."""
    name = stage
    procs = []
    for i, job in enumerate(jobs):
        job_file = folder / f"{name}-job{i}.json"
        job_file.write_text(json.dumps(job))
        procs.append(subprocess.Popen([sys.executable, "-m", "dspark_ray.drafter", stage, str(job_file)]))
    codes = [p.wait() for p in procs]
    for i in range(len(jobs)):
        (folder / f"{name}-job{i}.json").unlink(missing_ok=True)
    failed = [i for i, code in enumerate(codes) if code != 0]
    if failed:
        raise WorkerFailed(f"{name}: worker(s) {failed} failed (exit codes {[codes[i] for i in failed]}); what they "
                           "finished is kept: run the stage again")


def read_job(job_file: str | Path) -> dict:
    """In a worker: its job (one torch thread from here on)."""
    import torch

    torch.set_num_threads(1)
    return json.loads(Path(job_file).read_text())
