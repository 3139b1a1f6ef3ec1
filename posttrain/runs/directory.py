"""The run directory: what every recipe writes, in one place (docs/metrics.md reads each file).

    runs/<name>/
      config.yaml        the resolved config
      run_card.md/.json  the four links and every loss setting (see `card.py`)
      metrics.jsonl      one JSON line per step
      samples.jsonl      prompts, completions, verdicts with reasons
      checkpoints/       atomic (see `checkpoint.py`)
      eval/              held-out results
      plots/*.png        curves, refreshed at each evaluation
      tensorboard/ wandb/ trackio/ mlruns/   the trackers of `report_to` (see `trackers.py`)

A new run refuses a directory that already holds a run (use `--resume` or another `--output-dir`), any
other non-empty directory, and a path that is a file or under one (`check_new_run`: the CLI asks it
before any work, the run again when it opens the directory).
metrics.jsonl and samples.jsonl are append-only: each call's lines go in one write, whole or not at
all (a failed write is cut back off and raised as a one-line `WriteFailed`). On resume, lines past the
checkpoint's step are dropped, and a torn line (a crash mid-write) with a warning, so a resumed run's
files equal those of an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import yaml

from posttrain.atomic import output_path_problem, write_text_atomically
from posttrain.distributed import World
from posttrain.errors import UserError, write_failed
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
        if not resume:
            check_new_run(self.path)
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
        if rows:
            _append(self.path / "samples.jsonl", *rows)
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
        """Drop log lines of steps after `step` (they were written after the checkpoint we resume from)
        and any torn line (a crash mid-write; `read_jsonl` warns about it); each file is replaced whole."""
        if not self.writer:
            return
        for name in ("metrics.jsonl", "samples.jsonl"):
            path = self.path / name
            if path.is_file():
                kept = [line for line, row in _whole_lines(path) if row.get("step", 0) <= step]
                write_text_atomically(path, "".join(line + "\n" for line in kept))


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _append(path: Path, *rows: dict[str, Any]) -> None:
    """Append `rows` as JSON lines in one write to an O_APPEND descriptor, so that they land whole or
    not at all: a write that fails (or stops short) is cut back off and raised as a one-line error."""
    data = "".join(json.dumps(_clean(row)) + "\n" for row in rows).encode("utf-8")
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    except OSError as error:
        raise write_failed(error, path) from error
    try:
        start = os.fstat(descriptor).st_size
        written = 0
        while written < len(data):  # after a short write (the disk filled mid-line) the next one says why
            count = os.write(descriptor, data[written:])
            if count == 0:
                raise OSError(errno.EIO, "write wrote nothing")
            written += count
    except OSError as error:
        with contextlib.suppress(OSError):
            os.ftruncate(descriptor, start)
        raise write_failed(error, path) from error
    finally:
        os.close(descriptor)


def _whole_lines(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(line, row) for each line of `path` that is a whole JSON object; warns about each other one."""
    # Our lines are ASCII (json.dumps escapes the rest): a replaced byte is in a torn line, never a whole one.
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            yield line, row
        elif line.strip():
            logger.warning("%s: line %d is not a whole JSON row (torn by a crash mid-write?): ignored", path, number)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines log; a torn line (a crash mid-write) is ignored with a warning."""
    path = Path(path)
    return [row for _, row in _whole_lines(path)] if path.is_file() else []


def check_new_run(path: str | Path) -> None:
    """A new run's directory must be absent or empty, and makeable (not a file, nor under one): else
    one UserError line, which says --resume when it holds a run."""
    path = Path(path)
    problem = output_path_problem(path, directory=True)
    if problem is not None:
        raise UserError(f"--output-dir {path}: {problem}")
    if path.exists() and any(path.iterdir()):
        if (path / "config.yaml").is_file():
            raise UserError(f"{path}: already holds a run; pass --resume {path} or choose another --output-dir")
        raise UserError(f"--output-dir {path}: not empty (a run starts in a new or empty directory); choose another --output-dir")


def default_output_dir(recipe: str, world: World | None = None) -> str:
    """runs/<recipe>-<time>; under torchrun rank 0's name on every rank."""
    return (world or World()).broadcast(str(Path("runs") / f"{recipe}-{time.strftime('%Y%m%d-%H%M%S')}"))
