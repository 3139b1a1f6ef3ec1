"""The run directory (DESIGN.md): what every recipe writes, in one place.

    runs/<name>/
      config.yaml        the resolved config
      run_card.md/.json  the four links and every loss setting (see `card.py`)
      metrics.jsonl      one JSON line per step
      samples.jsonl      prompts, completions, verdicts with reasons
      checkpoints/       atomic (see `checkpoint.py`)
      eval/              held-out results
      plots/*.png        curves, refreshed at each evaluation

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
from typing import Any, Iterable

from posttrain.distributed import World
from posttrain.errors import UserError

logger = logging.getLogger(__name__)


class RunDirectory:
    """Paths and append-only logs of one run.

    Args:
        path: the run directory.
        resume: False for a new run (the directory must be absent or empty), True to continue one.
        writer: False on torchrun ranks other than 0: nothing is created or written (logging calls
            do nothing); the paths still name rank 0's directory.
        tensorboard: also write each metrics line as TensorBoard scalars in `tensorboard/` (for
            watching a run live: `tensorboard --logdir runs`).
    """

    def __init__(self, path: str | Path, resume: bool = False, writer: bool = True, tensorboard: bool = False):
        self.path, self.writer, self._board, self._board_class = Path(path), writer, None, None
        if tensorboard and writer:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UserError("tensorboard: true needs the tensorboard package (pip install tensorboard)") from None
            self._board_class = SummaryWriter  # the writer itself is made on the first metrics line
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
        """Append one line `{"step": step, ...}` to metrics.jsonl (non-finite floats become null)."""
        if not self.writer:
            return
        _append(self.path / "metrics.jsonl", {"step": step, **metrics})
        if self._board_class is not None:
            if self._board is None:
                self._board = self._board_class(log_dir=str(self.path / "tensorboard"))
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self._board.add_scalar(key, value, step)
            self._board.flush()

    def log_samples(self, step: int, rows: Iterable[dict[str, Any]]) -> None:
        """Append sample rows (prompt, completion, verdict, reason...) tagged with the step."""
        if not self.writer:
            return
        for row in rows:
            _append(self.path / "samples.jsonl", {"step": step, **row})

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
