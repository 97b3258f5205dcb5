"""Running the recipe's stages in order, each skipping itself when its record says it is done."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark_ray.drafter import (
    answers,
    card,
    confidence,
    measure,
    prompts,
    states,
    train,
)
from dspark_ray.drafter.config import RecipeConfig
from dspark_ray.drafter.workdir import StageRecord, WorkDir, say


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[RecipeConfig, WorkDir], StageRecord]
    outputs: Callable[[WorkDir], list[Path]]  # what a forced rerun deletes first
    about: str


STAGES: tuple[Stage, ...] = (
    Stage("prompts", prompts.run, lambda w: [w.prompts], "build the prompt set (no download), drop the benchmark's"),
    Stage("answers", answers.run, lambda w: [w.answers], "the target's own answers, greedy and sampled, by the engine"),
    Stage("states", states.run, lambda w: [w.states, w.vocab], "the target's tap states and top-k at every answer token"),
    Stage("sweep", train.run_sweep, lambda w: [w.sweep, w.root / "sweep"], "short runs of other draft shapes"),
    Stage("train", train.run, lambda w: [w.train, w.curve], "distil the block draft; writes the checkpoint folder"),
    Stage("confidence", confidence.run, lambda w: [w.confidence], "fit the confidence head on the trained draft"),
    Stage("measure", measure.run, lambda w: [w.measure], "acceptance by position and batch-1 speed in the engine"),
    Stage("card", card.run, lambda w: [], "the acceptance curve and the model card (<out>/README.md)"),
)
STAGE_NAMES = tuple(s.name for s in STAGES)


class UnknownStage(ValueError):
    """A stage name the recipe does not have."""


def check_names(names: Sequence[str]) -> None:
    bad = [n for n in names if n not in STAGE_NAMES]
    if bad:
        raise UnknownStage(f"unknown stage(s) {bad}; the stages are {', '.join(STAGE_NAMES)}")


def run_recipe(config: RecipeConfig, stages: Sequence[str] | None = None, force: Sequence[str] = ()) -> dict:
    """Run ``stages`` (default: all; the sweep only when the config has shapes to sweep) in the
    recipe's order. A stage already recorded as done is skipped; a ``force``d stage and every
    stage after it are forgotten and their outputs deleted first, so nothing stale survives.
    Returns log.json's stage records."""
    check_names([*(stages or ()), *force])
    wanted = [s for s in STAGES if (stages is None and (s.name != "sweep" or config.sweep))
              or (stages is not None and s.name in stages)]
    work = WorkDir(config)
    if force:
        first = min(STAGE_NAMES.index(f) for f in force)
        for s in STAGES[first:]:
            work.forget(s.name)
            for path in s.outputs(work):
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
    if torch.device(config.device).type == "cpu":
        torch.set_num_threads(config.threads)
    for stage in wanted:
        if work.done(stage.name):
            say(f"{stage.name}: done already (log.json); --force {stage.name} redoes it")
            continue
        say(f"{stage.name}: {stage.about}")
        t0, c0 = time.perf_counter(), time.process_time()
        result = stage.run(config, work)
        entry = work.record(stage.name, time.perf_counter() - t0, result, time.process_time() - c0)
        say(f"{stage.name}: finished in {entry['seconds']:.0f} s ({entry['cpu_seconds']:.0f} CPU-s)")
    return work.read_log()["stages"]
