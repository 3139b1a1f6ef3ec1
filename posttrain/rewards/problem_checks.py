"""Checks of the problems themselves, not of the verifier: do a dataset's tests run, does its
reference solution pass them, and do they reject programs that cannot be solutions?

A verifier can be exploit-proof (`posttrain.rewards.audit`) and still reward nonsense when the
problem's tests are weak: a sort whose only test is the example shown in the prompt accepts a
program that returns that example's output. Before training on a code set, `find_weak_tests`
scores a few trivial programs per problem, written only from what a model sees (the prompt):

| program | function layouts (humaneval, mbpp) | stdio |
|---|---|---|
| lookup table | the outputs of the examples visible in the prompt, else None | the Example blocks' outputs, else nothing |
| constants | the visible outputs, then 0 / 1 / -1, True / False, "", [], ... of the expected type, then None | the visible outputs, then 0 / 1 / -1 or YES / NO, then empty output |
| identity / echo | the first argument | stdin |
| catch-all | the lookup table inside `try`, `except BaseException`: the type's default | the same |

A problem is weak when any of them scores reward 1 with status ok. The expected type comes from the
visible examples, else HumanEval's return annotation, else the literal expected values of the tests
(only their types: no program ever holds a hidden test's value).

Rows are verifier rows, the plain dicts `posttrain.data.examples.verifier_input` builds: `id`,
`prompt`, `tests` / `test`, `entry_point`, `cases` ([{stdin, stdout}]) and every extra column
(`canonical_solution`, `code`, `solution`, ...). This module never imports `posttrain.data`.
"""

from __future__ import annotations

import ast
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.rewards.base import Verifier
from posttrain.rewards.code import mbpp_entry_point, normalize_output
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
_ANNOTATION_TYPES = {"bool": bool, "int": int, "float": float, "str": str, "list": list, "List": list,
                     "tuple": tuple, "Tuple": tuple, "dict": dict, "Dict": dict, "set": set, "Set": set,
                     "None": type(None)}


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


@dataclass
class VisibleExample:
    """A call shown in a function problem's prompt: `entry_point(*args)` gives `expected`."""

    args: list
    expected: Any


@dataclass
class VisibleCase:
    """An Example input / output block of a stdio problem's description."""

    stdin: str
    stdout: str


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
# What the prompt shows.
_SEPARATOR = re.compile(r"^\s*(?:#\s*)?(?:==>|=>|->|➞|==|=|should\s+return|returns?|is)\s*", re.IGNORECASE)
_REJECTED_PREFIX = re.compile(r"(?:[.([{,=+\-*/%<>!~&|^@]|\b(?:not|def|return|lambda|in|and|or|if|else|yield|await))$")


def visible_examples(text: str, entry_point: str) -> list[VisibleExample]:
    """Calls of `entry_point` with literal arguments and a literal result shown in `text`, in the
    forms prompts use: `>>> f(1)` with the result on the next line, `f(1) == 2`, `f(1) ==> 2`,
    `f(1) ➞ 2`, `f(1) should return 2`, `assert f(1) == 2` (MBPP's "should pass these tests").
    A wrapped call (`round(f(x), 2)`) or a non-literal is skipped; the first result of an argument
    list wins.

    >>> visible_examples('>>> add(2, 3)\\n5\\n    add(1, 1) ==> 2\\nassert add(0, 0) == 0', 'add')
    [VisibleExample(args=[2, 3], expected=5), VisibleExample(args=[1, 1], expected=2), VisibleExample(args=[0, 0], expected=0)]
    """
    lines = text.splitlines()
    examples: list[VisibleExample] = []
    for index, line in enumerate(lines):
        for match in re.finditer(rf"(?<![\w.]){re.escape(entry_point)}\s*\(", line):
            before = re.sub(r"^\s*(?:>>>|[*-]\s)?", "", line[:match.start()]).strip()
            if before.count("(") != before.count(")") or _REJECTED_PREFIX.search(before):
                continue
            end = _closing_paren(line, match.end() - 1)
            args = _literal_args(line[match.start():end + 1]) if end is not None else None
            if args is None:
                continue
            rest = line[end + 1:].strip()
            separator = _SEPARATOR.match(rest)
            if separator:
                expected = _literal(rest[separator.end():])
            elif (not rest or rest.startswith("#")) and line.lstrip().startswith(">>>"):
                output = _output_lines(lines[index + 1:])  # a multi-line repr, else its first line
                expected = _literal(" ".join(output))
                expected = _literal(output[0]) if expected is _MISSING and output else expected
            else:
                continue
            if expected is not _MISSING and all(example.args != args for example in examples):
                examples.append(VisibleExample(args, expected))
    return examples


def visible_cases(row: Mapping[str, Any]) -> list[VisibleCase]:
    """A stdio problem's visible cases: its `public_cases` ([{stdin, stdout}]) or CodeContests'
    `public_tests` ({input: [...], output: [...]}) when the row still has them, else the Example /
    Sample blocks of its description (`Input` ... `Output` ... pairs after an `Example(s)` header)."""
    if isinstance(row.get("public_cases"), list):
        return [VisibleCase(case["stdin"], case["stdout"]) for case in row["public_cases"]
                if isinstance(case, Mapping) and isinstance(case.get("stdin"), str) and isinstance(case.get("stdout"), str)]
    public = row.get("public_tests")
    if isinstance(public, Mapping) and isinstance(public.get("input"), list) and isinstance(public.get("output"), list):
        return [VisibleCase(stdin, stdout) for stdin, stdout in zip(public["input"], public["output"])
                if isinstance(stdin, str) and isinstance(stdout, str)]
    return description_cases(row.get("prompt") or "")


_EXAMPLE_HEADER = re.compile(r"^\s*(?:examples?|samples?|sample tests?)\s*\d*\s*:?\s*$", re.IGNORECASE)
_INPUT_HEADER = re.compile(r"^\s*(?:sample\s+|example\s+)?input\s*\d*\s*:?\s*$", re.IGNORECASE)
_OUTPUT_HEADER = re.compile(r"^\s*(?:sample\s+|example\s+)?output\s*\d*\s*:?\s*$", re.IGNORECASE)
_END_HEADER = re.compile(r"^\s*(?:notes?|explanations?|constraints)\s*\d*\s*:?\s*$", re.IGNORECASE)


def description_cases(text: str) -> list[VisibleCase]:
    """Input / Output block pairs after the first `Example(s)` header, or from the first
    `Sample Input` header when there is none (the statement's own Input / Output sections, which
    come before, describe the format and are not cases).

    >>> description_cases("Print a+b.\\n\\nInput\\n\\nTwo integers.\\n\\nExample\\n\\nInput\\n\\n1 2\\n\\nOutput\\n\\n3\\n")
    [VisibleCase(stdin='1 2\\n', stdout='3\\n')]
    """
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _EXAMPLE_HEADER.match(line)), None)
    if start is None:
        start = next((i for i, line in enumerate(lines) if re.match(r"^\s*sample\s+input", line, re.IGNORECASE)), None)
    if start is None:
        return []
    cases, block, stdin = [], None, None
    for line in lines[start:] + ["Input"]:  # a final header flushes the last pair
        if _INPUT_HEADER.match(line) or _END_HEADER.match(line):
            if stdin is not None and block is not None:
                cases.append(VisibleCase(stdin, _block_text(block)))
            stdin, block = None, [] if _INPUT_HEADER.match(line) else None
            if _END_HEADER.match(line):
                break
        elif _OUTPUT_HEADER.match(line) and block is not None and stdin is None:
            stdin, block = _block_text(block), []
        elif block is not None:
            block.append(line)
    return cases


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
    entry_point = row.get("entry_point") or mbpp_entry_point(_test_sources(row)) or "f"
    examples = visible_examples(row.get("prompt") or "", entry_point)
    type_values = [value for kind in _expected_types(row, layout, entry_point, examples)
                   for value in TYPE_CONSTANTS.get(kind, [])]
    constants = _distinct([example.expected for example in examples][:3] + type_values + [None])[:MAX_CONSTANTS]
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
    types = _annotation_types(row.get("prompt") or "", entry_point) if layout == "humaneval" else []
    return types or _tested_types(_test_sources(row), entry_point)


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


# ---------------------------------------------------------------------------------------------
# Parsing helpers.
_MISSING = object()


def _test_sources(row: Mapping[str, Any]) -> list[str]:
    tests = row.get("tests")
    if isinstance(tests, str):
        return [tests]
    if isinstance(tests, list):
        return [test for test in tests if isinstance(test, str)]
    return [row["test"]] if isinstance(row.get("test"), str) else []


def _closing_paren(text: str, opening: int) -> int | None:
    """Index of the parenthesis closing the one at `opening` (quotes respected), else None."""
    depth, quote = 0, None
    for index in range(opening, len(text)):
        char = text[index]
        if quote:
            if char == quote and text[index - 1] != "\\":
                quote = None
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return index
    return None


def _literal_args(call: str) -> list | None:
    """The positional arguments of `f(...)` when all are literals, else None."""
    try:
        node = ast.parse(call, mode="eval").body
        if not isinstance(node, ast.Call) or node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            return None
        args = [ast.literal_eval(arg) for arg in node.args]
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None
    return args if all(_round_trips(arg) for arg in args) else None


def _literal(text: str) -> Any:
    """The literal a result text starts with (`16.` at a sentence end is 16; `-> 19 - 5 - 6 = 8`
    is 8; a trailing comment or `(explanation)` is dropped), else `_MISSING`."""
    text = text.strip()
    candidates = [text.rstrip(" ."), text, text.split(" #")[0], re.split(r"\s+\(|\s{2,}|\.\s", text)[0],
                  text.rsplit(" = ", 1)[-1]]
    for candidate in candidates:
        candidate = candidate.strip().rstrip(",")
        if candidate in ("true", "false"):
            candidate = candidate.capitalize()
        try:
            value = ast.literal_eval(candidate)
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            continue
        if _round_trips(value):
            return value
    return _MISSING


def _round_trips(value: Any) -> bool:
    """True when `repr(value)` reads back as the same value and type (no NaN, inf, objects)."""
    try:
        again = ast.literal_eval(repr(value))
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return False
    return type(again) is type(value) and repr(again) == repr(value)


def _output_lines(lines: list[str]) -> list[str]:
    """A doctest's expected output: the lines after `>>>` up to a blank line, a prompt or the
    docstring's end."""
    taken = []
    for line in lines:
        stripped = line.strip()
        if not stripped or stripped.startswith(">>>") or stripped.startswith(('"""', "'''")):
            break
        taken.append(stripped)
    return taken


def _block_text(lines: list[str]) -> str:
    while lines and not lines[0].strip():
        lines = lines[1:]
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return "\n".join(lines) + "\n"


def _annotation_types(prompt: str, entry_point: str) -> list[type]:
    """The return annotation of `entry_point` in a HumanEval prompt, as types (`Optional[int]`:
    int and None; `List[str]`: list); [] when there is none."""
    try:
        tree = ast.parse(prompt)
    except SyntaxError:
        try:
            tree = ast.parse(prompt.rstrip() + "\n    pass\n")
        except SyntaxError:
            return []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == entry_point and node.returns is not None:
            names = re.findall(r"\w+", ast.unparse(node.returns))
            if names and names[-1] == "typing":
                names = names[1:]
            first = names[0] if names else ""
            if first == "Optional" and len(names) > 1:
                return [kind for kind in (_ANNOTATION_TYPES.get(names[1]), type(None)) if kind]
            return [_ANNOTATION_TYPES[first]] if first in _ANNOTATION_TYPES else []
    return []


def _tested_types(tests: list[str], entry_point: str) -> list[type]:
    """The types of the literal values the tests compare the function's result with (`==`, `is`)."""
    kinds: list[type] = []
    for test in tests:
        try:
            tree = ast.parse(test)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare) or len(node.ops) != 1 or not isinstance(node.ops[0], (ast.Eq, ast.Is)):
                continue
            for call, other in ((node.left, node.comparators[0]), (node.comparators[0], node.left)):
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in (entry_point, "candidate"):
                    try:
                        kinds.append(type(ast.literal_eval(other)))
                    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                        pass
    return list(dict.fromkeys(kinds))
