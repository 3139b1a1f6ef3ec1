"""Checks of the problems themselves, not of the verifier: do a dataset's tests run, does its
reference solution pass them, and do they reject programs that cannot be solutions?

A verifier can be exploit-proof (`posttrain.rewards.audit`) and still reward nonsense when the
problem's tests are weak: a sort whose only test is the example shown in the prompt accepts a
program that returns that example's output. Before training on a code set, `find_weak_tests`
scores a few trivial programs per problem, written only from what a model sees (the prompt):

| program | function layouts (humaneval, mbpp) | stdio |
|---|---|---|
| lookup table | the outputs of the examples visible in the prompt and the values its shown tests assert, keyed on the arguments, else None | the Example blocks' outputs, else nothing |
| asserted values in call order | the shown tests' asserted values, the n-th returned by the n-th call (only when a shown call's arguments are not literals) | - |
| constants | the visible outputs, then 0 / 1 / -1, True / False, "", [], ... of the expected type, then None | the visible outputs, then 0 / 1 / -1 or YES / NO, then empty output |
| identity / echo | the first argument | stdin |
| catch-all | the lookup table inside `try`, `except BaseException`: the type's default | the same |

A problem is weak when any of them scores reward 1 with status ok. The expected type comes from the
visible examples, else HumanEval's return annotation, else the literal expected values of the tests
(only their types: no program ever holds a hidden test's value); reading those from the problem's
text is `posttrain.rewards.problem_text`. The tests a prompt shows (MBPP's first, `shown_tests`, or
assert lines written in the prompt itself) are visible: their asserted values are the cheapest
exploit there is, so they are read per call, by AST, however the assert is written (`asserted_calls`).

Rows are verifier rows, the plain dicts `posttrain.data.examples.verifier_input` builds: `id`,
`prompt`, `tests` / `test`, `entry_point`, `cases` ([{stdin, stdout}]) and every extra column
(`canonical_solution`, `code`, `solution`, ...). This module never imports `posttrain.data`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.rewards.base import Verifier
from posttrain.rewards.code import mbpp_entry_point, normalize_output
from posttrain.rewards.problem_text import (
    VisibleExample,
    annotation_types,
    asserted_calls,
    shown_test_sources,
    test_sources,
    tested_types,
    visible_cases,
    visible_examples,
)
from posttrain.rewards.verdict import Verdict

logger = logging.getLogger(__name__)

LAYOUTS = ("humaneval", "mbpp", "stdio")
"""Completion forms: a body continuing the prompt's signature; a whole program defining the
function; a whole program reading stdin."""
REFERENCE_FIELDS = ("canonical_solution", "code", "solution")
"""Where a row keeps its reference solution (HumanEval, MBPP, stdio sets), first found wins."""
MAX_CONSTANTS = 6
"""Constant programs per problem (visible outputs first, then the type's usual values, then None)."""
TYPE_CONSTANTS: dict[type, list[Any]] = {
    bool: [True, False], int: [0, 1, -1], float: [0.0], str: [""], list: [[]], tuple: [()],
    dict: [{}], set: [set()], type(None): [None],
}
@dataclass
class ProblemFault:
    """A problem that cannot be trusted as it is: `reason` says why (one line)."""

    id: str
    reason: str


@dataclass
class ReferenceReport:
    """`checked`: rows that have a reference solution; `faults`: those whose reference does not
    score 1 with status ok, or whose tests do not run (data_error)."""

    checked: int
    faults: list[ProblemFault]


@dataclass
class Adversary:
    """A trivial program, `completion` in the layout's completion form."""

    name: str
    completion: str


@dataclass
class Weakness:
    """Problem `id` accepts the trivial program called `program` (the first that passed)."""

    id: str
    program: str


@dataclass
class StrengthReport:
    """`checked`: problems tried; `weak`: those some adversary passes; `unscored`: problems where
    an adversary got no ok verdict (tests that do not run, a broken sandbox), so not proven strong."""

    checked: int
    weak: list[Weakness]
    unscored: list[ProblemFault]


# ---------------------------------------------------------------------------------------------
# Reference solutions.
def reference_solution(row: Mapping[str, Any]) -> str | None:
    """The row's reference solution: the first non-empty string of `REFERENCE_FIELDS`, else None.

    >>> reference_solution({"code": "def f():\\n    return 1"}), reference_solution({"code": ""})
    ('def f():\\n    return 1', None)
    """
    for field in REFERENCE_FIELDS:
        value = row.get(field)
        if isinstance(value, str) and value.strip():
            return value
    return None


def check_references(verifier: Verifier, rows: Sequence[Mapping[str, Any]],
                     workers: int | None = None) -> ReferenceReport:
    """Score every row's reference solution as its completion (a HumanEval `canonical_solution` is
    a body continuing the prompt, as a HumanEval completion is; MBPP's `code` and a stdio `solution`
    are whole programs), in one `verifier.batch` call. Rows without a reference are not checked."""
    referenced = [(row, reference) for row in rows if (reference := reference_solution(row)) is not None]
    verdicts = verifier.batch([reference for _, reference in referenced], [row for row, _ in referenced],
                              workers=workers)
    faults = []
    for (row, _), verdict in zip(referenced, verdicts):
        if verdict.status == "data_error":
            faults.append(ProblemFault(str(row.get("id")), f"tests do not run: {verdict.reason}"))
        elif verdict.status != "ok":
            faults.append(ProblemFault(str(row.get("id")), f"reference not scored ({verdict.status}): {verdict.reason}"))
        elif verdict.reward != 1.0:
            faults.append(ProblemFault(str(row.get("id")), f"reference fails its tests: {verdict.reason}"))
    return ReferenceReport(checked=len(referenced), faults=faults)


# ---------------------------------------------------------------------------------------------
# The adversaries.
def adversaries(row: Mapping[str, Any], layout: str) -> list[Adversary]:
    """The trivial programs for one problem, in the order they are reported (see the module
    docstring); each `completion` is in `layout`'s form: humaneval, a body continuing the prompt's
    signature; mbpp, a whole `def <entry_point>(*args, **kwargs)` program; stdio, a whole program.
    No lookup (nor catch-all) program when the prompt shows no example."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "stdio":
        programs = _stdio_adversaries(row)
    else:
        programs = _function_adversaries(row, layout)
    unique, seen = [], set()
    for program in programs:
        if program.completion not in seen:
            seen.add(program.completion)
            unique.append(program)
    return unique


def _function_adversaries(row: Mapping[str, Any], layout: str) -> list[Adversary]:
    entry_point = row.get("entry_point") or mbpp_entry_point(test_sources(row)) or "f"
    examples = visible_examples(row.get("prompt") or "", entry_point)
    asserted = asserted_calls(shown_test_sources(row), entry_point)
    for call in asserted:
        if call.args is not None and all(example.args != call.args for example in examples):
            examples.append(VisibleExample(call.args, call.expected))
    type_values = [value for kind in _expected_types(row, layout, entry_point, examples)
                   for value in TYPE_CONSTANTS.get(kind, [])]
    shown_values = [example.expected for example in examples] + [call.expected for call in asserted if call.args is None]
    constants = _distinct(shown_values[:3] + type_values + [None])[:MAX_CONSTANTS]
    default = type_values[0] if type_values else None
    table = repr([(example.args, example.expected) for example in examples])

    def program(*body: str) -> str:
        if layout == "humaneval":  # the body's first line sees exactly the arguments
            return "\n".join(["    _given = list(locals().values())", *body]) + "\n"
        return "\n".join([f"def {entry_point}(*args, **kwargs):", "    _given = list(args)", *body]) + "\n"

    found = ["    for _args, _value in " + table + ":", "        if _given == _args:", "            return _value"]
    programs = []
    if examples:
        programs.append(Adversary("lookup table of the visible examples", program(*found, "    return None")))
    if any(call.args is None for call in asserted):  # arguments the lookup cannot key on
        values = repr([call.expected for call in asserted])
        programs.append(Adversary("the shown tests' asserted values in call order", program(
            "    _count = globals().setdefault('_asserted_calls', [0])", "    _count[0] += 1",
            f"    return {values}[_count[0] - 1] if _count[0] <= {len(asserted)} else None")))
    programs += [Adversary(f"constant {value!r}", program(f"    return {value!r}")) for value in constants]
    programs.append(Adversary("identity (returns its first argument)", program("    return _given[0] if _given else None")))
    if examples:
        catch_all = program("    try:", *("    " + line for line in found), "        raise LookupError",
                            "    except BaseException:", f"        return {default!r}")
        programs.append(Adversary(f"catch-all (the visible examples, else {default!r})", catch_all))
    return programs


def _expected_types(row, layout: str, entry_point: str, examples: list[VisibleExample]) -> list[type]:
    """The result types: the visible outputs', else HumanEval's return annotation, else the types
    of the literals the tests compare the result with."""
    if examples:
        return list(dict.fromkeys(type(example.expected) for example in examples))
    types = annotation_types(row.get("prompt") or "", entry_point) if layout == "humaneval" else []
    return types or tested_types(test_sources(row), entry_point)


def _distinct(values: list[Any]) -> list[Any]:
    """`values` without repeats, `True` and `1` being different values."""
    seen, distinct = set(), []
    for value in values:
        key = (type(value), repr(value))
        if key not in seen:
            seen.add(key)
            distinct.append(value)
    return distinct


def _stdio_adversaries(row: Mapping[str, Any]) -> list[Adversary]:
    cases = visible_cases(row)
    table = {normalize_output(case.stdin).strip("\n"): case.stdout for case in cases}
    type_values = _stdio_type_values([case.stdout for case in cases] or _tested_outputs(row))
    visible = [case.stdout if case.stdout.endswith("\n") else case.stdout + "\n" for case in cases]
    constants = list(dict.fromkeys(visible[:3] + type_values + [""]))[:MAX_CONSTANTS]
    default = type_values[0] if type_values else ""
    read = ["import sys", "", "def _norm(text):",
            "    return '\\n'.join(line.rstrip() for line in text.replace('\\r\\n', '\\n').split('\\n')).strip('\\n')",
            "", f"_table = {table!r}", "_given = _norm(sys.stdin.read())"]
    programs = []
    if cases:
        programs.append(Adversary("lookup table of the visible examples",
                                  "\n".join([*read, "sys.stdout.write(_table.get(_given, ''))"]) + "\n"))
    for text in constants:
        label = repr(text.rstrip("\n"))  # the verifier ignores trailing blank lines
        programs.append(Adversary(f"constant output {label}", f"import sys\nsys.stdout.write({text!r})\n"))
    programs.append(Adversary("echo (prints its input)", "import sys\nsys.stdout.write(sys.stdin.read())\n"))
    if cases:
        programs.append(Adversary(f"catch-all (the visible examples, else {default!r})", "\n".join(
            [*read, "try:", "    sys.stdout.write(_table[_given])", "except BaseException:",
             f"    sys.stdout.write({default!r})"]) + "\n"))
    return programs


def _tested_outputs(row: Mapping[str, Any]) -> list[str]:
    return [case["stdout"] for case in row.get("cases") or []
            if isinstance(case, Mapping) and isinstance(case.get("stdout"), str)]


def _stdio_type_values(outputs: list[str]) -> list[str]:
    """0 / 1 / -1 when every output is one integer; YES / NO (written as the first output writes
    it) when every output is a yes / no word; else none."""
    words = [normalize_output(text).strip() for text in outputs]
    if words and all(re.fullmatch(r"-?\d+", word) for word in words):
        return ["0\n", "1\n", "-1\n"]
    if words and all(word.lower() in ("yes", "no") for word in words):
        style = str.upper if words[0].isupper() else str.capitalize if words[0][0].isupper() else str.lower
        return [style("yes") + "\n", style("no") + "\n"]
    return []


# ---------------------------------------------------------------------------------------------
# Scoring them.
def find_weak_tests(verifier: Verifier, rows: Sequence[Mapping[str, Any]], layout: str,
                    workers: int | None = None) -> StrengthReport:
    """Score every (row, adversary) pair in one `verifier.batch` call; a row is weak when any
    adversary scores reward 1 with status ok (the first such is reported), unscored when an
    adversary got a verdict other than ok and none passed."""
    programs = [adversaries(row, layout) for row in rows]
    pairs = [(row, program) for row, row_programs in zip(rows, programs) for program in row_programs]
    logger.info("scoring %d trivial programs against %d problems", len(pairs), len(rows))
    verdicts = verifier.batch([program.completion for _, program in pairs], [row for row, _ in pairs],
                              workers=workers)
    weak, unscored, position = [], [], 0
    for row, row_programs in zip(rows, programs):
        row_verdicts: list[Verdict] = verdicts[position:position + len(row_programs)]
        position += len(row_programs)
        passing = [program for program, verdict in zip(row_programs, row_verdicts)
                   if verdict.status == "ok" and verdict.reward == 1.0]
        broken = [(program, verdict) for program, verdict in zip(row_programs, row_verdicts) if verdict.status != "ok"]
        if passing:
            weak.append(Weakness(str(row.get("id")), passing[0].name))
        elif broken:
            program, verdict = broken[0]
            unscored.append(ProblemFault(str(row.get("id")), f"{program.name}: {verdict.status}: {verdict.reason}"))
    return StrengthReport(checked=len(rows), weak=weak, unscored=unscored)


def summary_line(report: StrengthReport, total: int | None = None) -> str:
    """`N of M problems accept a program that only memorises the visible examples, a constant, an
    echo or a catch-all` (M: `total`, default `report.checked`)."""
    total = report.checked if total is None else total
    return (f"{len(report.weak)} of {total} problems accept a program that only memorises the visible "
            "examples, a constant, an echo or a catch-all")
