"""A run's results, read back from its own files: every held-out set from its first evaluation to
its last (pass@1 with Wilson intervals, and the change with a paired interval where both
evaluations scored the same problems), the other held-out metrics (preference accuracy, NLL), and
what training saw (reward, loss). `results` is the run card's "results" section, written when the
run ends; `summary_lines` are the three lines a run ends with (held-out, training signal, where
the results are); `runs.card` renders the section.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from posttrain.evaluation.acceptance import IN_DISTRIBUTION
from posttrain.evaluation.stats import paired_difference_ci
from posttrain.runs.card import OTHER, TRAINING, set_line, span_text
from posttrain.runs.directory import read_jsonl

IN_DISTRIBUTION_FILES = ("step", "task-step")
"""Its eval file names' stems: the online and SFT recipes' `step-N.json`, DPO's `task-step-N.json`."""


def results(run_dir: str | Path) -> dict[str, Any]:
    """The card's results section of the run in `run_dir`, from metrics.jsonl and eval/:
    `sets` (name -> start, end: {step, pass@1, ci95}, and change: {value, ci95, paired}),
    `heldout` (the other held-out metrics, start and end) and `training` (reward and loss, first
    and last logged step). A set evaluated once has no change."""
    run_dir = Path(run_dir)
    rows = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    names = dict.fromkeys(key.split("/")[1] for row in rows for key in row
                          if key.startswith("heldout/") and key.endswith("/pass@1") and key.count("/") == 2)
    sets = {}
    for name in names:
        key = f"heldout/{name}/pass@1"
        evaluated = [row for row in rows if row.get(key) is not None]
        if not evaluated:
            continue
        first, last = evaluated[0], evaluated[-1]
        entry = {"start": _point(first, name), "end": _point(last, name)}
        if last["step"] != first["step"]:
            entry["change"] = _change(run_dir / "eval", name, first, last)
        sets[name] = entry
    return {"sets": sets,
            "heldout": {key: _span(rows, key) for key in OTHER if _span(rows, key)},
            "training": {key: _span(rows, key, skip_step_zero=True) for key in TRAINING if _span(rows, key, skip_step_zero=True)}}


def _point(row: dict[str, Any], name: str) -> dict[str, Any]:
    prefix = f"heldout/{name}/pass@1"
    return {"step": row["step"], "pass@1": row[prefix], "ci95": [row.get(f"{prefix}_low"), row.get(f"{prefix}_high")]}


def _change(eval_dir: Path, name: str, first: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    """end - start with the paired 95% interval when both eval files hold the same problems' scores."""
    key = f"heldout/{name}/pass@1"
    before, after = _correct(eval_dir, name, first["step"]), _correct(eval_dir, name, last["step"])
    if before is not None and after is not None and len(before) == len(after):
        value, low, high = paired_difference_ci(before, after)
        return {"value": value, "ci95": [low, high], "paired": True}
    return {"value": last[key] - first[key], "ci95": None, "paired": False}


def _correct(eval_dir: Path, name: str, step: int) -> list | None:
    """The per-problem scores (1, 0, None) set `name` had at `step`, from its eval file (None: none found)."""
    stems = IN_DISTRIBUTION_FILES if name == IN_DISTRIBUTION else (f"{name}-step",)
    for stem in stems:
        path = eval_dir / f"{stem}-{step:06d}.json"
        if path.is_file():
            try:
                return json.loads(path.read_text())["summary"]["correct"]
            except (json.JSONDecodeError, KeyError, TypeError):
                return None
    return None


def _span(rows: list[dict[str, Any]], key: str, skip_step_zero: bool = False) -> dict[str, Any] | None:
    """`key` at its first and last logged step (None: never logged), each with its interval
    (`ci95`, from `key`_low / _high) and tie count (`ties`, from `key`_ties) when the row logs them."""
    logged = [row for row in rows if row.get(key) is not None and not (skip_step_zero and row["step"] == 0)]
    if not logged:
        return None
    return {"start": _logged_point(logged[0], key), "end": _logged_point(logged[-1], key)}


def _logged_point(row: dict[str, Any], key: str) -> dict[str, Any]:
    point = {"step": row["step"], "value": row[key]}
    if row.get(f"{key}_low") is not None and row.get(f"{key}_high") is not None:
        point["ci95"] = [row[f"{key}_low"], row[f"{key}_high"]]
    if row.get(f"{key}_ties") is not None:
        point["ties"] = row[f"{key}_ties"]
    return point


def summary_lines(run_dir: str | Path) -> list[str]:
    """The three lines a finished run prints, from its card: held-out (each set, start -> end with
    intervals), the training signal (reward or loss, unscorable rows, groups without signal), and
    where the results are (`results: DIR`, with its run card)."""
    run_dir = Path(run_dir)
    card = json.loads((run_dir / "run_card.json").read_text()) if (run_dir / "run_card.json").is_file() else {}
    found = card.get("results") or results(run_dir)
    held = [set_line(name, entry) for name, entry in found["sets"].items()]
    held += [f"{OTHER[key]} {span_text(span)}" for key, span in found["heldout"].items()]
    lines = ["held-out: " + ("; ".join(held) if held else "not evaluated")]
    training = [f"{TRAINING[key]} {span_text(span)}" for key, span in found["training"].items()]
    signal = card.get("training_signal")
    if signal and signal.get("rows"):
        training.append(f"unscorable rows {signal['infra_error_rate']:.1%} infra, {signal['data_error_rate']:.1%} data")
        if signal.get("zero_variance_group_fraction") is not None:
            training.append(f"groups without reward variance {signal['zero_variance_group_fraction']:.1%}")
        training.append(f"{signal['steps_without_reward_signal']} of {signal['steps']} steps without reward signal")
    lines.append("training: " + ("; ".join(training) if training else "no step logged"))
    lines.append(f"results: {run_dir} (the run card: {run_dir / 'run_card.md'})")
    return lines
