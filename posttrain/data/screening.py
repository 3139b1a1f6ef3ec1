"""Code problems screened at load, before training: the pre-flight gate (every problem that carries a
reference solution must pass its own tests in the sandbox) and, when asked, the test-strength
filter (training drops problems whose tests accept a trivial program). Both run the checks of
`posttrain.rewards.problem_checks`; the problems they remove are data errors found here, counted in
the run card, so that a verifier-level data error never first appears mid-run.

    record = screen_problems(train, held_out, judge, preflight=True, exclude_weak_tests=False)
    card["links"]["data"]["screening"] = record
"""

from __future__ import annotations

import logging
from typing import Any

from posttrain.data.examples import Task, require_examples, verifier_input
from posttrain.data.files import pick
from posttrain.data.prompts import SHOW_TESTS
from posttrain.rewards.base import Verifier
from posttrain.rewards.problem_checks import check_references, find_weak_tests

logger = logging.getLogger(__name__)

LAYOUTS = {"code": "humaneval", "mbpp": "mbpp", "stdio": "stdio"}
"""The problem layout of each code task kind (`Task.reward_kind`)."""
LISTED = 20
"""Removed problems listed by id in the run card (all are counted)."""


def screen_problems(train: Task, held_out: Task, judge: Verifier, *, preflight: bool = True,
                    exclude_weak_tests: bool = False, workers: int | None = None) -> dict[str, Any] | None:
    """Screen the code problems of `train` and `held_out` in place with `judge` (the task layout's
    code verifier, all-or-nothing, reading code raw: references are programs, not completions): with `preflight`, a problem whose reference solution does not
    pass its tests (or whose tests do not run) is removed from either split; with
    `exclude_weak_tests`, a training problem whose tests accept a lookup table of the prompt's
    examples, a constant, an echo or a catch-all is removed (the held-out split is kept whole, so
    acceptance stays comparable). Returns the run card's record, with what the prompts show
    (`shown_tests_record`), or None for a task that is not code. A split left empty is a UserError."""
    layout = LAYOUTS.get(train.reward_kind)
    shown = shown_tests_record(train, held_out) if layout is not None else None
    if layout is None or not (preflight or exclude_weak_tests or shown):
        return None
    record: dict[str, Any] = {"layout": layout, "judge": judge.name}
    if shown:
        record["shown_tests"] = shown
        if shown["train_only_shown"]:
            logger.warning("%d of %d training problems have no test beyond the one their prompt shows: the training reward "
                           "scores that test alone, which a program returning its asserted value passes (%s)",
                           shown["train_only_shown"], shown["train"],
                           "excluded below by data.exclude_weak_tests" if exclude_weak_tests else "data.exclude_weak_tests: true drops them")
    if preflight:
        rows = [verifier_input(e) for e in [*train.examples, *held_out.examples]]
        report = check_references(judge, rows, workers=workers)
        faulty = {fault.id: fault.reason for fault in report.faults}
        for fault in report.faults:
            logger.warning("data_error %s: %s (removed before training)", fault.id, fault.reason)
        removed = {name: _remove(task, faulty) for name, task in (("train", train), ("heldout", held_out))}
        record["preflight"] = {
            "checked": report.checked, "without_reference": len(rows) - report.checked,
            "data_errors": len(report.faults), "removed": removed,
            "faults": [{"id": f.id, "reason": f.reason} for f in report.faults[:LISTED]],
        }
        logger.info("pre-flight: %d of %d problems carry a reference solution; %d fail their own tests (removed)",
                    report.checked, len(rows), len(report.faults))
    if exclude_weak_tests:
        strength = find_weak_tests(judge, [verifier_input(e) for e in train.examples], layout, workers=workers)
        weak = {weakness.id: weakness.program for weakness in strength.weak}
        for weakness in strength.weak:
            logger.info("weak tests %s: accepted by %s (excluded from training)", weakness.id, weakness.program)
        record["weak_tests"] = {
            "checked": strength.checked, "excluded": _remove(train, weak),
            "problems": [{"id": w.id, "accepted_by": w.program} for w in strength.weak[:LISTED]],
        }
        logger.info("test strength: %d of %d training problems accept a trivial program (excluded)", len(weak), strength.checked)
    require_examples(train)
    require_examples(held_out)
    return record


def shown_tests_record(train: Task, held_out: Task) -> dict[str, Any] | None:
    """What an assert-list task's prompts show (`task_options.show_tests`, `data.prompts.SHOW_TESTS`)
    and what is scored, for the run card: problems whose every test is shown (one test in all) are
    scored on it alone, by the training reward and by the held-out checker alike. None when the
    prompts show no test."""
    policy = train.options.get("show_tests")
    if policy in (None, "none"):
        return None
    counts = {}
    for name, task in (("train", train), ("heldout", held_out)):
        only = [e.id for e in task.examples if e.tests and len(e.metadata.get("shown_tests") or []) >= len(e.tests)]
        counts.update({name: len(task.examples), f"{name}_only_shown": len(only), f"{name}_only_shown_ids": only[:LISTED]})
    return {"policy": policy, "shows": SHOW_TESTS[policy],
            "scored": "the training reward runs the shown tests and every other hidden one (reward_options.tests: half, the "
                      "default; all: every test), so a problem with a hidden test is never scored on its shown tests alone; "
                      "the held-out checker runs all of them",
            **counts}


def _remove(task: Task, ids: dict[str, str]) -> int:
    """Drop the examples whose id is in `ids`; returns how many."""
    before = len(task.examples)
    task.examples = pick(task.examples, [i for i, example in enumerate(task.examples) if example.id not in ids])
    return before - len(task.examples)
