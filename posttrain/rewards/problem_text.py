"""What a code problem's own text shows and implies, read without running anything: the examples
a prompt makes visible (HumanEval's `>>> f(x)` lines, MBPP's assert lines, a stdio description's
Example blocks, CodeContests' public cases), the values the tests it shows assert (`asserted_calls`
of `shown_test_sources`), and the result types its signature and tests expect.
`posttrain.rewards.problem_checks` writes its trivial programs from these, so they use only what a
model sees (the prompt), never a hidden test's value.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_ANNOTATION_TYPES = {"bool": bool, "int": int, "float": float, "str": str, "list": list, "List": list,
                     "tuple": tuple, "Tuple": tuple, "dict": dict, "Dict": dict, "set": set, "Set": set,
                     "None": type(None)}


@dataclass
class VisibleExample:
    """A call shown in a function problem's prompt: `entry_point(*args)` gives `expected`."""

    args: list
    expected: Any


@dataclass
class AssertedCall:
    """A call of the function in a test and the value the assert needs it to return: `args` are
    its literal arguments, None when they are not literals (a name the test's setup defines)."""

    args: list | None
    expected: Any


@dataclass
class VisibleCase:
    """An Example input / output block of a stdio problem's description."""

    stdin: str
    stdout: str


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


_MISSING = object()
def walk_tests(tests: list[str]):
    """Every AST node of each test in `tests` that parses (`ast.walk` order); a test that does not
    parse is skipped."""
    for test in tests:
        try:
            tree = ast.parse(test)
        except SyntaxError:
            continue
        yield from ast.walk(tree)


_WRAPPERS = ("set", "frozenset", "sorted", "list", "tuple", "round", "str", "int", "float")
"""Calls a test wraps the function's result in before comparing (`set(f(x)) == {1, 2}`): returning
the compared value itself passes the comparison for every one of them but `sorted` of an unsorted list."""


def asserted_calls(tests: list[str], entry_point: str) -> list[AssertedCall]:
    """Every call of `entry_point` in the asserts of `tests` whose assert names the value it must
    return: `f(x) == v` or `v == f(x)` (also `is`, and `f(x)` wrapped in one of `_WRAPPERS`),
    `math.isclose(f(x), v)`, `abs(f(x) - v) < eps`, a bare `f(x)` (True), `not f(x)` (False); the
    parts of an `and` each count. A test that does not parse, or a value that is not a literal, is skipped.

    >>> asserted_calls(["assert factorial(5) == 120", "assert is_even(n) and not is_even(3)"], "factorial")
    [AssertedCall(args=[5], expected=120)]
    >>> asserted_calls(["assert is_even(n) and not is_even(3)"], "is_even")
    [AssertedCall(args=None, expected=True), AssertedCall(args=[3], expected=False)]
    """
    calls = []
    for node in walk_tests(tests):
        if isinstance(node, ast.Assert):
            parts = node.test.values if isinstance(node.test, ast.BoolOp) and isinstance(node.test.op, ast.And) else [node.test]
            calls += [call for part in parts if (call := _asserted(part, entry_point)) is not None]
    return calls


def shown_test_sources(row: Mapping[str, Any]) -> list[str]:
    """The tests a problem's prompt shows: those at the row's `shown_tests` indices
    (`data.prompts.SHOW_TESTS`), and every line of its prompt that is an assert statement."""
    tests = test_sources(row)
    shown = [tests[index] for index in row.get("shown_tests") or [] if type(index) is int and 0 <= index < len(tests)]
    for line in (row.get("prompt") or "").splitlines():
        if line.strip().startswith("assert "):
            try:
                ast.parse(line.strip())
            except SyntaxError:
                continue
            shown.append(line.strip())
    return shown


def _asserted(node: ast.expr, entry_point: str) -> AssertedCall | None:
    """The call and its asserted value in one condition (see `asserted_calls`), else None."""
    if (call := _call_args(node, entry_point)) is not _MISSING:
        return AssertedCall(call, True)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) and (call := _call_args(node.operand, entry_point)) is not _MISSING:
        return AssertedCall(call, False)
    pairs: list[tuple[ast.expr, ast.expr]] = []
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        left, right = node.left, node.comparators[0]
        if isinstance(node.ops[0], (ast.Eq, ast.Is)):
            pairs = [(_unwrapped(left), right), (_unwrapped(right), left)]
        elif isinstance(node.ops[0], (ast.Lt, ast.LtE)) and _is_call(left, "abs", 1) and isinstance(left.args[0], ast.BinOp) \
                and isinstance(left.args[0].op, ast.Sub):
            difference = left.args[0]
            pairs = [(difference.left, difference.right), (difference.right, difference.left)]
    elif _is_call(node, "isclose", 2):
        pairs = [(node.args[0], node.args[1]), (node.args[1], node.args[0])]
    for side, other in pairs:
        call, value = _call_args(side, entry_point), _node_literal(other)
        if call is not _MISSING and value is not _MISSING:
            return AssertedCall(call, value)
    return None


def _is_call(node: ast.expr, name: str, arguments: int) -> bool:
    """`name(...)` or `module.name(...)` with at least `arguments` positional arguments."""
    function = getattr(node, "func", None)
    called = function.id if isinstance(function, ast.Name) else function.attr if isinstance(function, ast.Attribute) else None
    return isinstance(node, ast.Call) and called == name and len(node.args) >= arguments


def _unwrapped(node: ast.expr) -> ast.expr:
    """The argument of a `_WRAPPERS` call around it (`round(f(x), 2)` -> `f(x)`), else the node."""
    while any(_is_call(node, name, 1) for name in _WRAPPERS) and isinstance(node.func, ast.Name):
        node = node.args[0]
    return node


def _call_args(node: ast.expr, entry_point: str):
    """The literal arguments of `entry_point(...)` (None when they are not literals), else `_MISSING`."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == entry_point):
        return _MISSING
    if node.keywords or any(isinstance(arg, ast.Starred) for arg in node.args):
        return None
    values = [_node_literal(arg) for arg in node.args]
    return None if any(value is _MISSING for value in values) else values


def _node_literal(node: ast.expr) -> Any:
    """The value of a literal expression that round-trips through repr, else `_MISSING`."""
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _MISSING
    return value if _round_trips(value) else _MISSING


def test_sources(row: Mapping[str, Any]) -> list[str]:
    """The row's test sources: `tests` (a list, or one string), else `test`."""
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


def annotation_types(prompt: str, entry_point: str) -> list[type]:
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


def tested_types(tests: list[str], entry_point: str) -> list[type]:
    """The types of the literal values the tests compare the function's result with (`==`, `is`)."""
    kinds: list[type] = []
    for node in walk_tests(tests):
        if not isinstance(node, ast.Compare) or len(node.ops) != 1 or not isinstance(node.ops[0], (ast.Eq, ast.Is)):
            continue
        for call, other in ((node.left, node.comparators[0]), (node.comparators[0], node.left)):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in (entry_point, "candidate"):
                try:
                    kinds.append(type(ast.literal_eval(other)))
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    pass
    return list(dict.fromkeys(kinds))
