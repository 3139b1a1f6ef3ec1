"""A run directory read back, as the checklist and the comparison of runs read it: its card, its
results section and metrics rows (`Run`, `read_run`), how far it got (`Progress`), its held-out
eval files (`eval_file`) and each held-out set's change from its first evaluation to its last
(`set_change`: paired over the same problems, else Newcombe's interval).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.errors import UserError
from posttrain.evaluation.acceptance import IN_DISTRIBUTION
from posttrain.evaluation.stats import unpaired_difference_ci
from posttrain.runs.directory import read_jsonl
from posttrain.runs.results import IN_DISTRIBUTION_FILES, results


@dataclass(frozen=True)
class Progress:
    """How far a run got: `last_step` logged in metrics.jsonl (None: none), the steps it was set to
    run (`planned`; None: not recorded), whether its card holds the end record (`ended`: the
    results section, written when a run ends or is stopped) and whether a checkpoint exists."""

    last_step: int | None
    planned: int | None
    ended: bool
    checkpointed: bool = False

    @property
    def finished(self) -> bool:
        return self.ended and (self.planned is None or (self.last_step or 0) >= self.planned)

    @property
    def where(self) -> str:
        """'last step 3 of 30, no end record' (or 'no step logged', 'stopped')."""
        of = f" of {self.planned}" if self.planned is not None else ""
        where = "no step logged" if self.last_step is None else f"last step {self.last_step}{of}"
        return f"{where}, {'no end record' if not self.ended else 'stopped'}"

    def text(self, recipe: str, path: Path) -> str | None:
        """The line said before an unfinished run's answers: 'unfinished: last step 3 of 30, no end
        record (the run died or is still running); ...'; None for a finished run."""
        if self.finished:
            return None
        why = "the run died or is still running" if not self.ended else "it ended before its last step"
        resume = f"; `posttrain {recipe} --resume {path}` continues it from its last checkpoint" if self.checkpointed else ""
        return f"unfinished: {self.where} ({why}){resume}; only what its record supports is answered"


@dataclass
class Run:
    """A run directory read back: its card, results section and metrics rows."""

    path: Path
    card: dict[str, Any]
    results: dict[str, Any]
    rows: list[dict[str, Any]]

    def link(self, name: str) -> dict[str, Any]:
        value = self.card.get("links", {}).get(name)
        return value if isinstance(value, dict) else {}

    @property
    def recipe(self) -> str:
        return str(self.card.get("run", {}).get("recipe", "?"))

    @property
    def seed(self) -> Any:
        return self.card.get("run", {}).get("seed")

    @property
    def start_model(self) -> Any:
        run = self.card.get("run", {})
        return run.get("model") or run.get("config", {}).get("model")

    @property
    def progress(self) -> Progress:
        """How far the run got (its last logged step against `max_steps`, or rounds x steps per round)."""
        run = self.card.get("run", {})
        config = run.get("config") if isinstance(run.get("config"), dict) else {}
        planned = config.get("max_steps")
        if planned is None and isinstance(run.get("rounds"), int) and isinstance(run.get("steps_per_round"), int):
            planned = run["rounds"] * run["steps_per_round"]
        steps = [row["step"] for row in self.rows if isinstance(row.get("step"), int)]
        checkpoints = self.path / "checkpoints"
        return Progress(max(steps) if steps else None, planned if isinstance(planned, int) else None, "results" in self.card,
                        checkpoints.is_dir() and any(checkpoints.glob("step-*")))


def read_run(run_dir: str | Path, card: dict[str, Any] | None = None) -> Run:
    """The run in `run_dir` (its run_card.json, or `card` when given: the card of a run being
    closed). A directory without a readable run card is one UserError line."""
    path = Path(run_dir)
    if card is None:
        card_path = path / "run_card.json"
        if not path.is_dir():
            raise UserError(f"{path}: no such run directory")
        if not card_path.is_file():
            raise UserError(f"{path}: not a run directory (no run_card.json)")
        try:
            card = json.loads(card_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise UserError(f"{card_path}: unreadable ({error})") from None
        if not isinstance(card, dict) or not isinstance(card.get("run"), dict) or not isinstance(card.get("links"), dict):
            raise UserError(f"{card_path}: not a run card (no run and links sections)")
    found = card.get("results") or results(path)  # a card written before its run ended has no results yet
    return Run(path, card, found, read_jsonl(path / "metrics.jsonl"))


def eval_file(run: Run, name: str, step: int) -> dict[str, Any] | None:
    """Held-out set `name`'s eval file at `step` (summary and rows), None when absent or unreadable."""
    stems = IN_DISTRIBUTION_FILES if name == IN_DISTRIBUTION else (f"{name}-step",)
    for stem in stems:
        path = run.path / "eval" / f"{stem}-{step:06d}.json"
        if path.is_file():
            try:
                found = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                return None
            return found if isinstance(found, dict) else None
    return None


@dataclass
class Change:
    """A held-out set's pass@1 from its first evaluation to its last, the change's 95% interval
    and how it was computed."""

    start: dict[str, Any]
    end: dict[str, Any]
    value: float
    low: float | None
    high: float | None
    method: str  # "paired over N problems" | "unpaired (Newcombe)" | "no interval"

    @property
    def direction(self) -> str:
        """carried (interval above 0), reversed (below 0), flat (spans 0), unknown (no interval)."""
        if self.low is None:
            return "unknown"
        return "carried" if self.low > 0 else "reversed" if self.high < 0 else "flat"

    def text(self) -> str:
        """'+0.300 [+0.256, +0.344] paired over 500 problems, pass@1 0.656 (step 0) -> 0.956 (step 50)'."""
        interval = "" if self.low is None else f" [{self.low:+.3f}, {self.high:+.3f}]"
        return (f"{self.value:+.3f}{interval} {self.method}, pass@1 {self.start['pass@1']:.3f} (step {self.start['step']}) "
                f"-> {self.end['pass@1']:.3f} (step {self.end['step']})")

    def numbers(self) -> dict[str, Any]:
        """The change as JSON."""
        return {"change": self.value, "ci95": None if self.low is None else [self.low, self.high], "method": self.method,
                "start": self.start["pass@1"], "end": self.end["pass@1"], "start_step": self.start["step"], "end_step": self.end["step"]}


def set_change(run: Run, name: str) -> Change | None:
    """Set `name`'s change (None: evaluated once or never, or without a pass@1)."""
    entry = run.results.get("sets", {}).get(name)
    if not entry or "change" not in entry or entry["start"]["pass@1"] is None or entry["end"]["pass@1"] is None:
        return None
    start, end, change = entry["start"], entry["end"], entry["change"]
    if change.get("ci95") and change.get("paired"):
        return Change(start, end, change["value"], *change["ci95"], method=f"paired over {_scored_both(run, name, start, end)} problems")
    if None not in (start["ci95"] or [None]) and None not in (end["ci95"] or [None]):
        value, low, high = unpaired_difference_ci(start["pass@1"], start["ci95"], end["pass@1"], end["ci95"])
        return Change(start, end, value, low, high, method="unpaired (Newcombe; the evaluations scored different problems)")
    return Change(start, end, change["value"], None, None, method="no interval recorded")


def _scored_both(run: Run, name: str, start: dict, end: dict) -> str:
    """How many problems both evaluations scored ('?' when the eval files are gone)."""
    first, last = eval_file(run, name, start["step"]), eval_file(run, name, end["step"])
    if not first or not last:
        return "?"
    pairs = zip(first.get("summary", {}).get("correct", []), last.get("summary", {}).get("correct", []))
    return str(sum(a is not None and b is not None for a, b in pairs))
