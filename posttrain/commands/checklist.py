"""`posttrain checklist`: the evaluation checklist before any conclusion, for runs and their comparison.

    posttrain checklist runs/grpo                          each question: yes / no / not measured, the verdict
    posttrain checklist runs/grpo runs/dpo                 and the links side by side, the paired difference
    posttrain checklist runs/grpo --json --require independent,interval,heldout    for a CI: exit 1 unless yes

Every answer is read from the run directory (run_card.json, metrics.jsonl, eval/); nothing is
recomputed (docs/checklist.md). A run that has not finished (it died, was stopped or is still
running) is said first, and only the answers its record supports stand.
"""

from __future__ import annotations

import json
import sys

from posttrain.errors import UserError


def required_names(text: str | None) -> list[str]:
    """--require's comma-separated question names, each known (one UserError line otherwise)."""
    from posttrain.evaluation.checklist import COMPARISON_QUESTIONS, QUESTIONS

    names = [name.strip() for name in (text or "").split(",") if name.strip()]
    known = [*QUESTIONS, *COMPARISON_QUESTIONS]
    for name in names:
        if name not in known:
            raise UserError(f"--require: unknown question {name!r} (known: {', '.join(known)})")
    return names


def handle(args) -> int:
    """Print every run's checklist and the comparisons (text or --json); 1 when a --require'd
    answer is not yes."""
    from posttrain.evaluation.run_comparison import check_runs, text, unmet

    required = required_names(args.require)
    checklists, comparisons = check_runs(args.run_dirs)
    if args.json:
        print(json.dumps({"runs": [entry.record() for entry in checklists],
                          "comparisons": [comparison.record() for comparison in comparisons],
                          "required": required, "unmet": unmet(checklists, comparisons, required)}, indent=1, default=str))
    else:
        print(text(checklists, comparisons), end="")
    failed = unmet(checklists, comparisons, required)
    if failed:
        print("posttrain checklist: required answers that are not yes: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


def register(subparsers) -> None:
    """Add the `checklist` command."""
    parser = subparsers.add_parser("checklist", help="the evaluation checklist before any conclusion (held-out, independent checker, gain interval, ...) "
                                                "for runs and their comparison: yes / no / not measured",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories; two or more: each compared with the first")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--require", default=None, metavar="NAMES",
                        help="comma-separated questions that must be yes, else exit 1: heldout, independent, interval, shifted, audit, "
                             "alarms, review, signal, seeds; comparable, attributable (comparisons)")
    parser.set_defaults(func=handle)
