"""Worker processes of one torch thread each, for the stages that split their rows (answers, states).

On the 2-core development box two one-thread processes beat one two-thread process for the
engine's batched decoding, and keep doing so when other work shares the machine (a two-thread
OpenMP region stalls whenever either core is taken; measured in models/README.md). Each worker
is ``python -m dspark_ray.drafter.workers <kind> <job.json>``: a plain subprocess, so a script
that runs the recipe needs no ``if __name__ == "__main__"`` guard.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dspark_ray.drafter.workdir import say


class WorkerFailed(RuntimeError):
    """A worker process exited with an error; what it finished is kept, and the stage can run again."""


def run_workers(kind: str, jobs: list[dict], folder: Path) -> None:
    """Run one worker per job (``kind``: answers or states) at once and wait for all of them."""
    procs = []
    for i, job in enumerate(jobs):
        job_file = folder / f"{kind}-job{i}.json"
        job_file.write_text(json.dumps(job))
        procs.append(subprocess.Popen([sys.executable, "-m", "dspark_ray.drafter.workers", kind, str(job_file)]))
    codes = [p.wait() for p in procs]
    for i in range(len(jobs)):
        (folder / f"{kind}-job{i}.json").unlink(missing_ok=True)
    failed = [i for i, code in enumerate(codes) if code != 0]
    if failed:
        raise WorkerFailed(f"{kind}: worker(s) {failed} failed (exit codes {[codes[i] for i in failed]}); what they "
                           "finished is kept: run the stage again")


def main(argv: list[str] | None = None) -> int:
    import torch

    from dspark_ray.drafter.config import RecipeConfig

    kind, job_file = (argv if argv is not None else sys.argv[1:])[:2]
    job = json.loads(Path(job_file).read_text())
    torch.set_num_threads(1)
    config = RecipeConfig.from_json(job["config"])
    if kind == "answers":
        from dspark_ray import LLM
        from dspark_ray.drafter.answers import engine_args, generate

        generate(LLM(config.target, None, **engine_args(config)), config, job["rows"], Path(job["out"]), job["label"])
    elif kind == "states":
        from dspark_ray.drafter.states import write_shards

        write_shards(config, Path(job["folder"]), job["shards"])
    else:
        say(f"unknown worker kind {kind!r}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
