"""The run directory (DESIGN.md): what every recipe writes, in one place.

    runs/<name>/
      config.yaml        the resolved config
      run_card.md/.json  the four links and every loss setting (see `card.py`)
      metrics.jsonl      one JSON line per step
      samples.jsonl      prompts, completions, verdicts with reasons
      checkpoints/       atomic (see `checkpoint.py`)
      eval/              held-out results
      plots/*.png        curves, refreshed at each evaluation
      tensorboard/ wandb/ trackio/ mlruns/   the trackers of `report_to` (see `trackers.py`)

A new run refuses a directory that already holds a run (use `--resume` or another `--output-dir`).
On resume, lines of metrics.jsonl and samples.jsonl past the checkpoint's step are dropped, so a
resumed run's files equal those of an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

from posttrain.distributed import World
from posttrain.errors import UserError
from posttrain.runs.trackers import make_trackers

logger = logging.getLogger(__name__)


class RunDirectory:
    """Paths and append-only logs of one run.

    Args:
        path: the run directory.
        resume: False for a new run (the directory must be absent or empty), True to continue one.
        writer: False on torchrun ranks other than 0: nothing is created or written (logging calls
            do nothing, no tracker is made); the paths still name rank 0's directory.
        trackers: names of the experiment trackers that also get each metrics line and the samples
            (`runs/trackers.py`: tensorboard, wandb, trackio, mlflow), all writing into this directory.
            Their packages are imported here, before anything is created: a missing one is a
            one-line error. Each starts on the first logged line, with config.yaml and
            run_card.json as they are then; `close()` ends them.
    """

    def __init__(self, path: str | Path, resume: bool = False, writer: bool = True, trackers: Sequence[str] = ()):
        self.path, self.writer = Path(path), writer
        self._trackers, self._started = make_trackers(trackers, self.path) if writer else [], False
        if resume:
            if not (self.path / "config.yaml").is_file():
                raise UserError(f"{self.path}: not a run directory (no config.yaml) - nothing to resume")
        if not writer:
            return
        if not resume and self.path.exists() and any(self.path.iterdir()):
            raise UserError(f"{self.path}: already holds a run; pass --resume {self.path} or choose another --output-dir")
        for sub in ("checkpoints", "eval", "plots"):
            (self.path / sub).mkdir(parents=True, exist_ok=True)

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def eval_dir(self) -> Path:
        return self.path / "eval"

    @property
    def plots(self) -> Path:
        return self.path / "plots"

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one line `{"step": step, ...}` to metrics.jsonl (non-finite floats become null);
        the trackers get its numbers."""
        if not self.writer:
            return
        _append(self.path / "metrics.jsonl", {"step": step, **metrics})
        for tracker in self._started_trackers():
            tracker.log(step, metrics)

    def log_samples(self, step: int, rows: Iterable[dict[str, Any]]) -> None:
        """Append sample rows (prompt, completion, verdict, reason...) tagged with the step; the
        trackers get them as one table."""
        if not self.writer:
            return
        rows = [{"step": step, **row} for row in rows]
        for row in rows:
            _append(self.path / "samples.jsonl", row)
        if rows:
            for tracker in self._started_trackers():
                tracker.log_samples(step, [_clean(row) for row in rows])

    def close(self) -> None:
        """End the trackers' runs (a W&B run finished, an MLflow run terminated); call once, at the end."""
        if self._started:
            for tracker in self._trackers:
                tracker.close()
        self._trackers, self._started = [], False

    def _started_trackers(self) -> list:
        """The trackers, started on the first call with the run's name, config.yaml and run_card.json."""
        if self._trackers and not self._started:
            config_file, card_file = self.path / "config.yaml", self.path / "run_card.json"
            config = yaml.safe_load(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
            card = json.loads(card_file.read_text(encoding="utf-8")) if card_file.is_file() else {}
            for tracker in self._trackers:
                tracker.start(self.path.name, config or {}, card)
            self._started = True
        return self._trackers

    def read_metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path / "metrics.jsonl")

    def truncate_logs(self, step: int) -> None:
        """Drop log lines of steps after `step` (they were written after the checkpoint we resume from)."""
        if not self.writer:
            return
        for name in ("metrics.jsonl", "samples.jsonl"):
            path = self.path / name
            if path.is_file():
                kept = [row for row in read_jsonl(path) if row.get("step", 0) <= step]
                path.write_text("".join(json.dumps(row) + "\n" for row in kept))


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _append(path: Path, row: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(_clean(row)) + "\n")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines log; a torn last line (a crash mid-write) is ignored."""
    rows = []
    path = Path(path)
    if not path.is_file():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("%s: ignoring a torn line", path)
    return rows


def default_output_dir(recipe: str, world: World | None = None) -> str:
    """runs/<recipe>-<time>; under torchrun rank 0's name on every rank."""
    return (world or World()).broadcast(str(Path("runs") / f"{recipe}-{time.strftime('%Y%m%d-%H%M%S')}"))
