"""The report of `posttrain compare` (recipes/compare.py runs the rows): comparison.json (`comparison`:
the settings, the start, the offline files, every row's held-out pass@1 and its gain over the start
paired over the same problems, the checker's independence, what the table cannot conclude),
comparison.md (`markdown`), comparison.png (`plot`) and the command's closing lines.

Not `run_comparison.py`, which compares finished run directories link by link for `posttrain
checklist`: this table is one start and many rows scored here on one set of problems.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.evaluation.acceptance import IN_DISTRIBUTION
from posttrain.evaluation.stats import paired_difference_ci


@dataclass
class Outcome:
    """What one row did: the child's wall time and peak RSS, and its acceptance or its one-line error."""

    row: dict[str, Any]
    """The row as comparison.json names it (name, label, family, base, command, flags, links): `compare.describe`."""
    seconds: float = 0.0
    peak_rss_mib: float | None = None
    error: str | None = None
    sets: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Held-out set -> its `evaluate_task` result (in distribution first)."""


@dataclass
class Measured:
    """What the table reports besides its rows: the start, the offline files and the checker."""

    start: str
    """The start's model directory."""
    start_given: bool
    """Whether --start gave it (else the comparison trained it, in `start_seconds`)."""
    start_sets: dict[str, dict[str, Any]]
    """Held-out set -> the start's `evaluate_task` result."""
    start_seconds: float
    provenance: dict[str, dict]
    """The offline files' sidecars by `Row.data` (pairs, unpaired, teacher_sft)."""
    pairs_given: str | None
    """The --pairs file, when given (else pairs.jsonl, sampled from the start)."""
    checked: tuple[bool, str]
    """The held-out checker's independence of the reward (`acceptance.independence`)."""
    seconds: float = 0.0
    """The whole comparison's wall time."""
    teacher: str | None = None
    """The teacher's model directory (--teacher), when given."""
    teacher_sets: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Held-out set -> the teacher's `evaluate_task` result (the same problems as the start's)."""


def paired_gain(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """after - before, paired over the same problems (`stats.paired_difference_ci`)."""
    value, low, high = paired_difference_ci(before["correct"], after["correct"])
    return {"value": value, "ci95": [low, high], "paired": True}


def comparison(settings: dict[str, Any], footer: str, measured: Measured, outcomes: list[Outcome]) -> dict[str, Any]:
    """comparison.json: the `settings` (steps, eval_size, seed, budgets, reward, checker, threads),
    the start on every set, the teacher on every set (None without one), the offline files (their
    sidecars by `Row.data`, the teacher's SFT rows too), each row (command,
    links, wall, peak RSS, every set's pass@1 and paired gain, or its error), the checker's
    independence, the `footer` (what the table cannot conclude)."""
    def point(result: dict[str, Any]) -> dict[str, Any]:
        return {"pass@1": result["pass@1"], "ci95": list(result["pass@1_ci95"]), "n": result["n"]}

    rows = [{**outcome.row, "status": "failed" if outcome.error else "ok", "error": outcome.error, "wall_s": round(outcome.seconds, 1),
             "peak_rss_mib": None if outcome.peak_rss_mib is None else round(outcome.peak_rss_mib, 1),
             "sets": {name: {**point(result), "gain": paired_gain(measured.start_sets[name], result)} for name, result in outcome.sets.items()}}
            for outcome in outcomes]
    independent, why = measured.checked
    provenance, given = measured.provenance, measured.pairs_given
    return {
        "settings": settings,
        "start": {"model": measured.start, "given": measured.start_given, "seconds": round(measured.start_seconds, 1),
                  "sets": {name: point(result) for name, result in measured.start_sets.items()}},
        "pairs": provenance.get("pairs") and {"file": str(given) if given else "pairs.jsonl", "given": given is not None,
                                              **{key: provenance["pairs"].get(key) for key in ("pairs", "prompts", "verifier", "model", "group_size")}},
        "unpaired": provenance.get("unpaired") and {"file": "unpaired.jsonl", **{key: provenance["unpaired"].get(key) for key in (
            "rows", "desirable", "undesirable", "rows_from_mixed_groups", "rows_from_all_correct_groups", "rows_from_all_incorrect_groups",
            "prompts", "verifier", "model", "group_size")}},
        "teacher": measured.teacher and {"model": measured.teacher, "sets": {name: point(result) for name, result in measured.teacher_sets.items()}},
        "teacher_sft": provenance.get("teacher_sft") and {"file": "teacher_sft.jsonl", **{key: provenance["teacher_sft"].get(key) for key in (
            "rows", "completion_tokens", "samples", "prompts", "keep", "model", "group_size")}},
        "rows": rows,
        "checker": {"name": settings["checker"], "independent": independent, "independence_reason": why},
        "footer": footer,
        "seconds": round(measured.seconds, 1),
    }


def cell(result: dict[str, Any]) -> str:
    low, high = result["pass@1_ci95"] if "pass@1_ci95" in result else result["ci95"]
    return f"{result['pass@1']:.3f} [{low:.3f}, {high:.3f}]"


def gain_text(gain: dict[str, Any]) -> str:
    low, high = gain["ci95"]
    return f"{gain['value']:+.3f} [{low:+.3f}, {high:+.3f}]"


def markdown(table: dict[str, Any]) -> str:
    """comparison.md: the main table (in distribution), the shifted sets' gains, the footer."""
    settings, start = table["settings"], table["start"]
    names = list(start["sets"])
    lines = [f"# One start, every method: {settings['steps']} steps each", "",
             f"Start: `{start['model']}`, held-out pass@1 {cell(start['sets'][IN_DISTRIBUTION])} on {start['sets'][IN_DISTRIBUTION]['n']} "
             f"problems. Online rows: {settings['prompts_per_step']} prompts x G = {settings['group_size']} per step, reward "
             f"`{settings['reward']}`; offline rows: {settings['pairs_per_step']} pairs per step from one pairs file"
             + _pairs_text(table["pairs"]) + _unpaired_text(table.get("unpaired")) + ". Held-out checker `integer` "
             f"({'independent of' if table['checker']['independent'] else 'NOT independent of'} the reward: "
             f"{table['checker']['independence_reason']}); gains paired over the same problems, 95% intervals."
             + _teacher_text(table), "",
             "| row | links changed (vs GRPO / DPO, or the row named) | held-out pass@1 | gain over the start (paired) | wall | peak RSS | flags |",
             "|---|---|---|---|---|---|---|"]
    for row in table["rows"]:
        flags = "`" + " ".join(row["flags"]) + "`" if row["flags"] else "(none)"
        if row["status"] == "failed":
            lines.append(f"| {row['label']} | {row['links_text']} | failed: {row['error']} | | {row['wall_s']:.0f} s | | {flags} |")
            continue
        held = row["sets"][IN_DISTRIBUTION]
        lines.append(f"| {row['label']} | {row['links_text']} | {cell(held)} | {gain_text(held['gain'])} | {row['wall_s']:.0f} s "
                     f"| {row['peak_rss_mib']:.0f} MiB | {flags} |")
    lines += ["", "Gain over the start on every held-out set (paired 95% intervals):", "",
              "| row | " + " | ".join(names) + " |", "|---|" + "---|" * len(names),
              "| start (pass@1) | " + " | ".join(cell(start["sets"][name]) for name in names) + " |"]
    if table.get("teacher"):
        lines.append("| teacher (pass@1) | " + " | ".join(cell(table["teacher"]["sets"][name]) for name in names) + " |")
    lines += [f"| {row['label']} | " + " | ".join(gain_text(row["sets"][name]["gain"]) for name in names) + " |"
              for row in table["rows"] if row["status"] == "ok"]
    lines += ["", ("Every row's command is in comparison.json (START, PAIRS, UNPAIRED, TEACHER_SFT, TEACHER and DIR: the start, "
                   "the pairs file, the unpaired rows, the teacher's SFT rows, the teacher, this directory); "
                   "its run directory and log (logs/) are here."), "", f"What this cannot conclude: {table['footer']}",
              "", f"Wall time of the whole comparison: {table['seconds']:.0f} s (the start: {start['seconds']:.0f} s)."]
    return "\n".join(lines)


def _pairs_text(pairs: dict[str, Any] | None) -> str:
    if not pairs:
        return ""
    if pairs["given"]:
        return f" (`{pairs['file']}`, given by --pairs: not sampled from this start by this comparison)"
    return f" ({pairs['pairs']} pairs from {pairs['prompts']} prompts, sampled from the start, labelled by `{pairs['verifier']}`)"


def _teacher_text(table: dict[str, Any]) -> str:
    """The teacher's sentence: its held-out pass@1 (what distillation moves the start towards), its SFT
    rows, and which link each teacher row changed (the point of the three rows)."""
    teacher, rows, settings = table.get("teacher"), table.get("teacher_sft"), table["settings"]
    if not teacher:
        return ""
    text = (f" Teacher `{teacher['model']}`: held-out pass@1 {cell(teacher['sets'][IN_DISTRIBUTION])}, the same problems and "
            "checker. On-policy distillation vs GRPO: the reward link changed (the teacher per token instead of the program, "
            "the same samples drawn). SFT on the teacher's samples vs on-policy distillation: the data link changed (the "
            "teacher's own samples, offline, instead of the student's scored by the teacher), and so the loss (NLL)")
    if rows:
        steps = next((row["steps"] for row in table["rows"] if row["data"] == "teacher_sft"), "?")
        text += (f"; its file holds {rows['rows']} rows ({rows['completion_tokens']} completion tokens) of "
                 f"{settings['teacher_samples']} samples asked for, as many as distillation scores, {settings['sft_heldout_rows']} "
                 f"held out, {settings['sft_batch_size']} a step: {steps} steps")
    return text + "."


def _unpaired_text(unpaired: dict[str, Any] | None) -> str:
    if not unpaired:
        return ""
    return (f"; KTO: {unpaired['rows']} unpaired rows of the same samples ({unpaired['desirable']} desirable, {unpaired['undesirable']} "
            f"undesirable; {unpaired['rows_from_all_correct_groups']} from all-correct and {unpaired['rows_from_all_incorrect_groups']} "
            "from all-incorrect groups, which pairing skips)")


def plot(table: dict[str, Any], path: Path) -> None:
    """comparison.png: each finished row's in-distribution gain with its paired 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from posttrain.runs.plots import save_figure

    rows = [row for row in table["rows"] if row["status"] == "ok"]
    figure, axis = plt.subplots(figsize=(7, 0.4 * max(3, len(rows)) + 1.2))
    for index, row in enumerate(rows):
        gain = row["sets"][IN_DISTRIBUTION]["gain"]
        low, high = gain["ci95"]
        axis.errorbar(gain["value"], index, xerr=[[gain["value"] - low], [high - gain["value"]]], fmt="o", capsize=4,
                      color="tab:blue" if row["family"] == "online" else "tab:orange")
    axis.axvline(0, color="grey", linewidth=1)
    axis.set_yticks(range(len(rows)), [row["label"] for row in rows])
    axis.invert_yaxis()
    axis.set_xlabel("held-out pass@1 gain over the start (paired 95% interval)")
    axis.set_title(f"{table['settings']['steps']} steps from one start (blue: online, orange: offline)")
    axis.grid(alpha=0.3, axis="x")
    save_figure(figure, path)


def closing_lines(out: Path) -> list[str]:
    """The lines the command ends with: every row's in-distribution gain (or failure), then `results: DIR`."""
    table = json.loads((out / "comparison.json").read_text())
    rows = [f"{row['name']} {gain_text(row['sets'][IN_DISTRIBUTION]['gain'])}" if row["status"] == "ok" else f"{row['name']} failed"
            for row in table["rows"]]
    return ["held-out gain over the start (in distribution, paired 95%): " + "; ".join(rows),
            f"results: {out} (the table: {out / 'comparison.md'}, {out / 'comparison.json'}, {out / 'comparison.png'})"]
