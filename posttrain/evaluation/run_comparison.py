"""Runs compared side by side, the comparison half of the seed's checklist before any conclusion
(`checklist` answers a run's own questions; this module compares runs and prints both for
`posttrain checklist`: `check_runs`, `unmet`, `text`).

Comparing runs (`compare`): each run against the first, link by link (which of data, reward, loss
changed, and other settings), the same held-out sets scored by the same checker (read from the eval
files' problems and checker, not the card's words) or a refusal, and the paired difference of their
held-out gains over the same problems.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from posttrain.evaluation.acceptance import IN_DISTRIBUTION
from posttrain.evaluation.checklist import COMPARISON_QUESTIONS, NO, YES, Answer, Checklist, cell, checklist
from posttrain.evaluation.run_record import Run, eval_file, read_run
from posttrain.evaluation.stats import paired_difference_ci

LINKS = ("data", "reward", "loss")
"""The links a comparison tells apart; the fourth, acceptance, must be the same to compare at all."""
NAMES = {"data": "data link", "reward": "reward link", "loss": "loss link", "other": "other settings", "start": "start model"}
"""What a comparison calls each row it tells apart (the three links, then what lies outside them)."""
OTHER_SETTINGS = ("max_steps", "optim", "lora_rank", "lora_alpha", "batch_size", "reward_options")
"""Top-level config sections outside the four links that change what a run learns; compared where both runs have them."""


MISSING = object()


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as dotted keys: {"group": {"scale": "group"}} -> {"group.scale": "group"}."""
    if not isinstance(value, dict) or not value:
        return {prefix: value} if prefix else {}
    flat: dict[str, Any] = {}
    for key, inner in value.items():
        flat.update(flatten(inner, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def link_view(run: Run, link: str) -> dict[str, Any]:
    """What a comparison compares of `link`: the data and loss links as the card states them; the
    reward as the verifier describes itself (an online run's training reward, a preference run's
    labeller: so GRPO and DPO on the same program's verdicts have the same reward link); `other`,
    the `OTHER_SETTINGS` of the run's config; `start`, the model it started from."""
    if link == "reward":
        reward = run.link("reward")
        described = run.link("acceptance").get("training_reward") or reward.get("verifier_settings")
        return described if isinstance(described, dict) else {k: v for k, v in reward.items() if k not in ("passed_as", "resolved_from")}
    if link == "other":
        config = run.card.get("run", {}).get("config", {})
        return {key: config[key] for key in OTHER_SETTINGS if key in config}
    if link == "start":
        return {"model": run.start_model}
    return run.link(link)


def link_summary(run: Run, link: str) -> str:
    """A link in a few words, for the side-by-side table."""
    view = link_view(run, link)
    if link == "data":
        options = view.get("options")
        source = view.get("source") or ("SFT rows (imitation)" if view.get("kind") == "SFT rows" else "gold answers (imitation)")
        return f"{source}; task {view.get('task')}" + (f" {json.dumps(options)}" if options else "")
    if link == "reward":
        return str(view.get("verifier") or view.get("kind") or json.dumps(view))
    if link == "loss":
        return str(view.get("algorithm") or view.get("objective") or "?")
    if link == "start":
        return str(view["model"])
    return ", ".join(f"{key}: {value}" for key, value in flatten(view).items() if key.startswith(("optim.lr", "max_steps"))) or "-"


@dataclass
class LinkRow:
    """One link of two runs side by side: each run's summary and the settings that differ."""

    link: str
    base: str
    other: str
    changes: list[str]

    @property
    def same(self) -> bool:
        return not self.changes

    def state(self, limit: int = 4) -> str:
        """'same', or what changed: the summaries when they differ (the table shows both), else the settings."""
        if self.same:
            return "same"
        if self.link == "acceptance":
            return f"changed: {self.changes[0]}"
        if self.base != self.other and self.link != "other":
            return "changed"
        return "changed: " + "; ".join(self.changes[:limit]) + (f"; +{len(self.changes) - limit} more" if len(self.changes) > limit else "")


def link_rows(base: Run, other: Run) -> list[LinkRow]:
    """data, reward, loss, the other settings both runs have, and the start model, each compared."""
    rows = []
    for link in (*LINKS, "other", "start"):
        left, right = link_view(base, link), link_view(other, link)
        if link == "other":
            left, right = ({key: value for key, value in view.items() if key in left and key in right} for view in (left, right))
        left, right = flatten(left), flatten(right)
        changes = [f"{key}: {left.get(key, '-')} -> {right.get(key, '-')}" for key in sorted(set(left) | set(right))
                   if left.get(key, MISSING) != right.get(key, MISSING)]
        rows.append(LinkRow(link, link_summary(base, link), link_summary(other, link), changes))
    return rows


@dataclass
class SetRow:
    """One held-out set of two runs: comparable (the same problems, the same checker) or why not,
    and the paired difference (other - base) of their gains, or of their final scores when a run
    has no start evaluation of those problems."""

    name: str
    comparable: bool
    reason: str
    numbers: dict[str, Any] = field(default_factory=dict)

    def cells(self) -> tuple[str, str]:
        """The row as (figure, detail), shown by `comparison_markdown` and `text`: ("-0.054 [-0.080,
        -0.028]", "gain (end - start), paired over 500 problems"), or ("refused", the reason)."""
        if not self.comparable:
            return "refused", self.reason
        low, high = self.numbers["ci95"]
        return (f"{self.numbers['difference']:+.3f} [{low:+.3f}, {high:+.3f}]",
                f"{self.numbers['measure']}, paired over {self.numbers['n']} problems")


def _problems(found: dict[str, Any]) -> list:
    return [(row.get("id"), row.get("prompt")) for row in found.get("rows", []) if isinstance(row, dict)]


def _correct(found: dict[str, Any] | None) -> list | None:
    return (found or {}).get("summary", {}).get("correct")


def compare_set(base: Run, other: Run, name: str) -> SetRow:
    """Set `name` of both runs read from their eval files: refused when the problems or the checker
    differ; else the paired difference of the gains (start to end) over the same problems."""
    points = [run.results["sets"][name] for run in (base, other)]
    ends = [eval_file(run, name, point["end"]["step"]) for run, point in zip((base, other), points)]
    if None in ends or None in map(_correct, ends):
        return SetRow(name, False, "an eval file with its per-problem scores is missing")
    if ends[0]["summary"].get("checker") != ends[1]["summary"].get("checker"):
        return SetRow(name, False, f"scored by different checkers ({json.dumps(ends[0]['summary'].get('checker'))} vs "
                                   f"{json.dumps(ends[1]['summary'].get('checker'))})")
    if _problems(ends[0]) != _problems(ends[1]) or len(_correct(ends[0])) != len(_correct(ends[1])):
        return SetRow(name, False, f"different problems ({len(_correct(ends[0]))} vs {len(_correct(ends[1]))}, "
                                   "or the same number in another order or with other prompts)")
    starts = [eval_file(run, name, point["start"]["step"]) if "change" in point else None for run, point in zip((base, other), points)]
    if all(start and _problems(start) == _problems(ends[0]) for start in starts):
        before, after = ([None if None in (s, e) else e - s for s, e in zip(_correct(start), _correct(end))]
                         for start, end in zip(starts, ends))
        measure = "gain (end - start)"
    else:
        before, after, measure = _correct(ends[0]), _correct(ends[1]), "final pass@1"
    try:
        value, low, high = paired_difference_ci(before, after)
    except ValueError:
        return SetRow(name, False, "no problem was scored by both runs")
    scored = sum(a is not None and b is not None for a, b in zip(before, after))
    starts_equal = all(starts) and _correct(starts[0]) == _correct(starts[1])
    return SetRow(name, True, f"the same {len(_problems(ends[0]))} problems, the same checker", {
        "measure": measure, "difference": value, "ci95": [low, high], "n": scored, "same_start_scores": starts_equal,
        "base_end": points[0]["end"]["pass@1"], "other_end": points[1]["end"]["pass@1"]})


@dataclass
class Comparison:
    """`other` against `base`: the links side by side, each common held-out set, the answers and the verdict."""

    base: Run
    other: Run
    links: list[LinkRow]
    sets: list[SetRow]
    only_in_one: list[str]
    answers: dict[str, Answer]
    verdict: str

    def record(self) -> dict[str, Any]:
        """The comparison as JSON (--json)."""
        return {"base": str(self.base.path), "other": str(self.other.path),
                "links": [{"link": row.link, "base": row.base, "other": row.other, "same": row.same, "changes": row.changes}
                          for row in self.links],
                "sets": [asdict(row) for row in self.sets], "sets_in_one_run_only": self.only_in_one,
                "answers": [answer.record() for answer in self.answers.values()], "verdict": self.verdict}


def compare(base: Run, other: Run) -> Comparison:
    """`other` compared with `base`: which links changed, whether their held-out sets can be
    compared, the paired difference on each, and a verdict that refuses to attribute a difference
    to one link when several changed."""
    links = link_rows(base, other)
    names = [name for name in base.results.get("sets", {}) if name in other.results.get("sets", {})]
    only = sorted(set(base.results.get("sets", {})) ^ set(other.results.get("sets", {})))
    sets = [compare_set(base, other, name) for name in names]
    refused = [row for row in sets if not row.comparable]
    main = next((row for row in sets if row.name == IN_DISTRIBUTION), None)
    if main is None or refused:
        comparable = Answer("comparable", NO, f"{IN_DISTRIBUTION} is not held out by both runs" if main is None
                            else "; ".join(f"{row.name}: {row.reason}" for row in refused))
    else:
        comparable = Answer("comparable", YES, "; ".join(f"{row.name}: {row.reason}" for row in sets)
                            + (f"; held out by one run only: {', '.join(only)}" if only else ""))
    links.insert(len(LINKS), LinkRow("acceptance", _acceptance_summary(base), _acceptance_summary(other),
                                     [] if comparable.answer == YES else [comparable.detail]))
    changed = [row.link for row in links if not row.same and row.link in LINKS]
    confounds = [row for row in links if not row.same and row.link in ("other", "start")]
    differing = [NAMES[row.link] + ("" if row.link in LINKS else f" ({', '.join(row.changes[:3])})") for row in links
                 if not row.same and row.link != "acceptance"]
    if len(changed) == 1 and not confounds:
        attributable = Answer("attributable", YES, f"only the {NAMES[changed[0]]} differs", {"changed": changed})
    elif not differing:
        attributable = Answer("attributable", NO, "nothing differs but the seed: the difference measures run-to-run noise",
                              {"changed": changed})
    else:
        attributable = Answer("attributable", NO, _joined(differing) + " differ",
                              {"changed": changed, "other": [row.link for row in confounds]})
    answers = {"comparable": comparable, "attributable": attributable}
    return Comparison(base, other, links, sets, only, answers, comparison_verdict(base, other, answers, main, differing))


def _acceptance_summary(run: Run) -> str:
    """The checker and the held-out sets of a run, from its card."""
    acceptance = run.link("acceptance")
    checker = acceptance.get("checker_resolved") or (acceptance.get("checker_settings") or {}).get("verifier") or acceptance.get("checker")
    return f"checker {checker}; sets: {', '.join(run.results.get('sets', {})) or 'none'}"


def _joined(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def comparison_verdict(base: Run, other: Run, answers: dict[str, Answer], main: SetRow | None, differing: list[str]) -> str:
    """One sentence: refused, or the paired difference and whether one link explains it."""
    if answers["comparable"].answer != YES:
        return f"Refused: the two runs' held-out numbers cannot be compared ({answers['comparable'].detail})."
    numbers = main.numbers
    low, high = numbers["ci95"]
    clear = "higher" if low > 0 else "lower" if high < 0 else "not clearly different"
    difference = (f"{other.path.name} - {base.path.name} in {numbers['measure']} on {IN_DISTRIBUTION}: {numbers['difference']:+.3f} "
                  f"[{low:+.3f}, {high:+.3f}] paired over {numbers['n']} problems ({clear})")
    if answers["attributable"].answer == YES:
        return f"Only the {differing[0]} changed: {difference}, attributable to it (one seed each)."
    if not differing:
        return f"Nothing but the seed differs: {difference}, which measures run-to-run noise."
    return (f"The {_joined(differing)} differ: {difference}; the comparison cannot attribute it to one of them "
            "(change one link at a time).")


def seed_groups(runs: list[Run]) -> dict[Path, list]:
    """Each run's seeds: those of the given runs whose links, other settings and start all equal its own."""
    def signature(run: Run) -> str:
        views = {link: link_view(run, link) for link in (*LINKS, "other", "start")}
        views["acceptance"] = {key: value for key, value in run.link("acceptance").items() if key != "human_review"}
        return json.dumps(views, sort_keys=True, default=str)

    signatures = {run.path: signature(run) for run in runs}
    return {run.path: [other.seed for other in runs if signatures[other.path] == signatures[run.path]] for run in runs}


def check_runs(run_dirs: list[str | Path]) -> tuple[list[Checklist], list[Comparison]]:
    """`posttrain checklist`: every run's checklist (its seeds counted among the runs given) and,
    for two or more runs, each later run compared with the first."""
    runs = [read_run(path) for path in run_dirs]
    seeds = seed_groups(runs)
    return [checklist(run, seeds[run.path]) for run in runs], [compare(runs[0], run) for run in runs[1:]]


def unmet(checklists: list[Checklist], comparisons: list[Comparison], required: list[str]) -> list[str]:
    """'RUN: NAME (ANSWER)' for every required answer that is not yes (a comparison question with
    one run given counts as not measured)."""
    found = []
    for name in required:
        if name in COMPARISON_QUESTIONS and not comparisons:
            found.append(f"{name} (not measured: one run, nothing to compare)")
        for entry in checklists:
            if name in entry.answers and entry.answers[name].answer != YES:
                found.append(f"{entry.run.path}: {name} ({entry.answers[name].answer})")
        for comparison in comparisons:
            if name in comparison.answers and comparison.answers[name].answer != YES:
                found.append(f"{comparison.other.path} vs {comparison.base.path}: {name} ({comparison.answers[name].answer})")
    return found


def comparison_markdown(comparison: Comparison) -> list[str]:
    """A comparison as markdown: the links side by side (changed ones in bold), each held-out set's
    paired difference or refusal, the answers and the verdict."""
    base, other = comparison.base.path.name, comparison.other.path.name
    lines = [f"| link | {base} | {other} | |", "|---|---|---|---|"]
    for row in comparison.links:
        lines.append(f"| {row.link} | {cell(row.base)} | {cell(row.other)} | {'same' if row.same else '**' + cell(row.state()) + '**'} |")
    lines += ["", f"| held-out set | {other} - {base} (95% CI) | |", "|---|---|---|"]
    for row in comparison.sets:
        figure, detail = row.cells()
        lines.append(f"| {row.name} | {figure} | {cell(detail)} |")
    lines += [""] + [f"- {answer.question}: **{answer.answer}** ({cell(answer.detail)})" for answer in comparison.answers.values()]
    return lines + ["", f"**Verdict.** {comparison.verdict}", ""]


def text(checklists: list[Checklist], comparisons: list[Comparison]) -> str:
    """The command's plain-text output: each run's answers, one a line, and its verdict; then each comparison."""
    lines = []
    for entry in checklists:
        lines.append(f"{entry.run.path} ({entry.run.recipe}, seed {entry.run.seed})")
        lines += [f"  {entry.unfinished}"] if entry.unfinished else []
        lines += [f"  {number}. {answer.question:<52} {answer.answer:<13} {answer.detail}"
                  for number, answer in enumerate(entry.answers.values(), 1)]
        lines += [f"  verdict: {entry.verdict}", ""]
    for comparison in comparisons:
        lines.append(f"{comparison.other.path} vs {comparison.base.path}")
        for row in comparison.links:
            lines.append(f"  {row.link:<10} {row.base[:44]:<44} | {row.other[:44]:<44} {row.state().replace('changed', 'CHANGED', 1)}")
        for row in comparison.sets:
            figure, detail = row.cells()
            lines.append(f"  held-out {row.name}: {figure} ({detail})")
        lines += [f"  {answer.question:<52} {answer.answer:<13} {answer.detail}" for answer in comparison.answers.values()]
        lines += [f"  verdict: {comparison.verdict}", ""]
    return "\n".join(lines).rstrip() + "\n"
