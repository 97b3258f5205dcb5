"""A recipe worker process: ``python -m dspark_ray.drafter <stage> <job.json>`` (workers.run_workers)."""

from __future__ import annotations

import sys

from dspark_ray.drafter import answers, states
from dspark_ray.drafter.workers import read_job

JOBS = {"answers": answers.run_job, "states": states.run_job}


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 2 or args[0] not in JOBS:
        print(f"usage: python -m dspark_ray.drafter {{{','.join(JOBS)}}} JOB.json (the recipe starts these itself; "
              "run the recipe with `dspark train-drafter`)", file=sys.stderr)
        return 2
    JOBS[args[0]](read_job(args[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
