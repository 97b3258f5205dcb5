"""WorkDir: the recipe's scratch folder, which stage outputs exist, and the JSON log of each stage.

Every stage writes its output under the work folder and, last, records itself in ``log.json``
(tokens, wall time, counts); a stage whose record is there is done and skips itself, unless
forced. A stage interrupted half way has no record and runs again: the ones that take long
(answers, states, train) keep partial progress of their own and go on from it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dspark_ray.drafter.config import RecipeConfig


@dataclass(frozen=True)
class StageRecord:
    """What a finished stage reports: tokens it produced or consumed, and any counts worth a card."""

    tokens: int = 0
    details: dict | None = None


class WorkDir:
    """Paths of every stage's output under ``config.work`` and the log they are recorded in."""

    def __init__(self, config: RecipeConfig) -> None:
        self.config = config
        self.root = config.work
        self.root.mkdir(parents=True, exist_ok=True)
        self.log_file = self.root / "log.json"
        self.prompts = self.root / "prompts.jsonl"
        self.answers = self.root / "answers.jsonl"
        self.states = self.root / "states"
        self.vocab = self.root / "vocab.json"
        self.sweep = self.root / "sweep.json"
        self.train = self.root / "train"
        self.curve = self.root / "curve.csv"
        self.confidence = self.root / "confidence.json"
        self.measure = self.root / "measure.json"

    # -- the log

    def read_log(self) -> dict:
        if not self.log_file.is_file():
            return {"stages": {}}
        return json.loads(self.log_file.read_text())

    def done(self, stage: str) -> bool:
        return stage in self.read_log()["stages"]

    def record(self, stage: str, seconds: float, result: StageRecord, cpu_seconds: float = 0.0) -> dict:
        """``seconds`` of wall time; ``cpu_seconds`` of this process's CPU time (all its threads: on a
        machine shared with other work, wall time grows and CPU time much less)."""
        log = self.read_log()
        entry = {"seconds": round(seconds, 1), "cpu_seconds": round(cpu_seconds, 1), "tokens": int(result.tokens),
                 **(result.details or {}),
                 "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
        log["stages"][stage] = entry
        log["config"] = self.config.to_json()
        self.write_json(self.log_file, log)
        return entry

    def forget(self, stage: str) -> None:
        log = self.read_log()
        if log["stages"].pop(stage, None) is not None:
            self.write_json(self.log_file, log)

    def seconds_spent(self) -> float:
        return sum(s["seconds"] for s in self.read_log()["stages"].values())

    # -- files

    @staticmethod
    def write_json(path: Path, data) -> None:
        """Written to a temporary file, then renamed: a file is whole or absent."""
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)

    @staticmethod
    def read_jsonl(path: Path) -> list[dict]:
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    @staticmethod
    def write_jsonl(path: Path, rows: list[dict]) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, path)


def say(message: str) -> None:
    """Progress on stderr, with the time (the recipe's only chatter)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
