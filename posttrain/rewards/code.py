"""Code verifiers: HumanEval-format tests, input/expected-output cases, stdin/stdout programs.

The split that makes them hard to fool: the *judge* (this module, in a pool worker) holds the
tests and expected values and never runs candidate code; the *candidate* runs in a sandbox slot
and only ever sees its code and the arguments of each call. Return values come back as typed
plain data and are compared here, type-strictly (`True` is not `1`, `1.0` is not `1`, a subclass
of int never arrives). So stack walking finds nothing, an always-true `__eq__` cannot be sent,
`sys.exit(0)` / `os._exit(0)` / re-exec with `-O` only end the candidate's own process (no
reply is a failure), and printed "PASSED" lines are just output.

HumanEval's `check(candidate)` runs here with `candidate` bound to a proxy that calls into the
sandbox. Its asserts are rewritten (AST) to (a) count passed/total without stopping at the first
failure, and (b) compare with `strict_equal` instead of `==` / `in`.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import textwrap
import time
from collections.abc import Mapping
from typing import Any

from posttrain.rewards._zygote import decode_value
from posttrain.rewards.base import Verifier
from posttrain.rewards.problem_text import walk_tests
from posttrain.rewards.sandbox import SandboxConfig, SandboxSlot, check_isolation
from posttrain.rewards.sandbox_io import CandidateGone, SlotBroken
from posttrain.rewards.verdict import Verdict

CODE_POLICIES = ("auto", "raw", "fenced")
CODE_TESTS = {"all": "all of the row's tests",
              "half": "every other test of the row (the 1st, 3rd, 5th ...; the checker's others stay unseen); of an MBPP "
                      "row whose prompt shows tests, the shown ones and every other hidden one"}
"""Which of a row's tests a code verifier runs (`reward_options.tests`): a held-out checker always
runs all; a training reward that runs half leaves the checker tests it was never rewarded on. An
MBPP row's `shown_tests` (the indices of the tests its prompt shows, `data.prompts.SHOW_TESTS`)
are always run and not counted in the half: a program that returns the shown asserted values must
still pass a hidden test wherever the problem has one."""
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
SLOT_MARGIN_S = 30.0  # pool deadline = sample budget + this (slot start, cleanup)


# ---------------------------------------------------------------------------------------------
# Type-strict comparison.
def strict_equal(left: Any, right: Any) -> bool:
    """`==` that also requires identical types, recursively (bool != int, float != int, NaN != NaN).

    >>> strict_equal([1, (2.0, "a")], [1, (2.0, "a")]), strict_equal(True, 1), strict_equal(1.0, 1)
    (True, False, False)
    """
    if type(left) is not type(right):
        return False
    if type(left) in (list, tuple):
        return len(left) == len(right) and all(strict_equal(a, b) for a, b in zip(left, right))
    if type(left) is dict:
        right_keys = {(type(key), key) for key in right}
        return len(left) == len(right) and all(
            (type(key), key) in right_keys and strict_equal(value, right[key])
            for key, value in left.items()
        )
    if type(left) in (set, frozenset):
        return {(type(x), x) for x in left} == {(type(x), x) for x in right}
    return bool(left == right)


def strict_contains(container: Any, item: Any) -> bool:
    """`item in container` with `strict_equal` for lists, tuples, sets and dict keys."""
    if type(container) in (list, tuple, set, frozenset, dict):
        return any(strict_equal(item, member) for member in container)
    return item in container


# ---------------------------------------------------------------------------------------------
# Extracting the code from a completion.
def extract_code(completion: str, policy: str) -> str:
    """`raw`: the completion as is; `fenced`: the last ```python block (empty if none);
    `auto`: the last fenced block if there is one, else the raw completion."""
    blocks = _FENCE.findall(completion)
    if policy == "raw" or (policy == "auto" and not blocks):
        return completion
    return blocks[-1] if blocks else ""


# ---------------------------------------------------------------------------------------------
# The worker's sandbox slot (one per worker process, rebuilt when the limits change).
_SLOT: SandboxSlot | None = None


def with_slot(config: SandboxConfig, job) -> Verdict:
    """Run `job(slot)` in this worker process's sandbox slot (the code verifiers' and the `python` tool's);
    a broken slot is replaced and the sample retried once, then infra_error."""
    global _SLOT
    for attempt in (1, 2):
        if _SLOT is None or _SLOT.config != config:
            if _SLOT is not None:
                _SLOT.close()
            _SLOT = SandboxSlot(config)
        try:
            return job(_SLOT)
        except SlotBroken as error:
            _SLOT.close()
            _SLOT = None
            if attempt == 2:
                return Verdict.infra_error(f"sandbox failed twice: {error}")
    raise AssertionError("unreachable")


class _CodeVerifier(Verifier):
    in_worker = True
    retry_timeouts = True

    def __init__(self, sandbox: SandboxConfig | None = None, fraction: bool = False,
                 code_policy: str = "auto", tests: str = "all"):
        if code_policy not in CODE_POLICIES:
            raise ValueError(f"code_policy must be one of {CODE_POLICIES}")
        if tests not in CODE_TESTS:
            raise ValueError(f"tests must be one of {', '.join(CODE_TESTS)}, got {tests!r}")
        self.sandbox = sandbox or SandboxConfig()
        self.fraction = fraction
        self.code_policy = code_policy
        self.tests = tests
        self.timeout_s = self.sandbox.timeout_s + SLOT_MARGIN_S

    def prepare(self) -> None:
        """Refuse to run untrusted code without isolation unless explicitly unsafe."""
        if not self.sandbox.unsafe_no_sandbox:
            check_isolation()

    def _reward(self, passed: int, total: int, failure: str) -> Verdict:
        details = {"tests_passed": passed, "tests_total": total}
        if self.fraction:
            return Verdict.ok(passed / total if total else 0.0, failure or "all tests passed", **details)
        if failure or passed != total:
            return Verdict.ok(0.0, failure or f"{total - passed} of {total} tests failed", **details)
        return Verdict.ok(1.0, "all tests passed", **details)

    def runs(self, index: int) -> bool:
        """Whether the row's test number `index` (0-based, in the order they run) is run."""
        return self.tests == "all" or index % 2 == 0

    def selected(self, count: int, shown: list[int]) -> list[int]:
        """The indices of a row's `count` tests that run when its prompt shows those in `shown`:
        all; or under `half` the shown ones and every other hidden one (the hidden 1st, 3rd ...).

        >>> MBPPVerifier(tests="half").selected(4, [0]), MBPPVerifier(tests="half").selected(1, [0])
        ([0, 1, 3], [0])
        """
        hidden = [index for index in range(count) if index not in shown]
        return sorted({*shown, *(index for position, index in enumerate(hidden) if self.runs(position))})

    def implementation(self) -> dict[str, str]:
        """Which of the row's tests it runs; the harness (this class's sandboxed judge) is listed
        apart: a checker that runs tests the reward never ran is an independent check of it even
        through the same harness (`acceptance.independence`), whose own soundness the exploit
        battery (`posttrain audit`) checks."""
        return {"tests": CODE_TESTS[self.tests], "harness": f"{type(self).__module__}.{type(self).__qualname__}"}

    def describe(self) -> dict[str, Any]:
        """Settings for the run card (the sandbox state is part of the reward link)."""
        return {"verifier": self.name, "fraction": self.fraction, "code_policy": self.code_policy, "tests": self.tests,
                "sandbox": "none (--unsafe-no-sandbox)" if self.sandbox.unsafe_no_sandbox else "bubblewrap",
                **dataclasses.asdict(self.sandbox)}


# ---------------------------------------------------------------------------------------------
# Input / expected-output cases for one function.
def _cases(example: Mapping, keys: tuple[str, ...]) -> list[dict] | str:
    """The example's cases, or a data_error reason."""
    cases = example.get("cases")
    if not isinstance(cases, list) or not cases:
        return "field 'cases' must be a non-empty list (an empty test list proves nothing)"
    for index, case in enumerate(cases):
        if not isinstance(case, Mapping) or any(key not in case for key in keys):
            return f"cases[{index}] must be an object with keys {list(keys)}"
    return cases


class IOVerifier(_CodeVerifier):
    """`entry_point(*args)` must return `expected` (type-strict) for every case.

    Row: {"completion", "entry_point", "cases": [{"args": [...], "expected": ...}]}; tuples,
    sets and non-string dict keys are written as tagged objects ({"tuple": [...]}).
    """

    name = "io"

    def score(self, completion: str, example: Mapping) -> Verdict:
        """Run each case in the sandbox and compare its value outside."""
        entry_point = example.get("entry_point")
        if not isinstance(entry_point, str) or not entry_point.isidentifier():
            return Verdict.data_error("field 'entry_point' must be a function name")
        cases = _cases(example, ("args", "expected"))
        if isinstance(cases, str):
            return Verdict.data_error(cases)
        try:
            calls = [(decode_value(case["args"]), decode_value(case["expected"])) for case in cases]
        except (ValueError, TypeError) as error:
            return Verdict.data_error(f"cases: {error}")
        if any(type(args) is not list for args, _ in calls):
            return Verdict.data_error("every case's 'args' must be a list")
        calls = [call for index, call in enumerate(calls) if self.runs(index)]
        code = extract_code(completion, self.code_policy)
        return with_slot(self.sandbox, lambda slot: self._run(slot, code, entry_point, calls))

    def _run(self, slot: SandboxSlot, code: str, entry_point: str, calls: list) -> Verdict:
        passed, failure = 0, ""
        session = None
        try:
            session = slot.open_function(code, entry_point, time.monotonic() + self.sandbox.timeout_s)
            for index, (args, expected) in enumerate(calls):
                kind, value = session.call(args)
                if kind == "value" and strict_equal(value, expected):
                    passed += 1
                elif not failure:
                    failure = f"case {index}: " + (f"raised {value}" if kind == "error" else "wrong value")
                    if not self.fraction:
                        break
        except CandidateGone as gone:
            failure = failure or str(gone)
        finally:
            if session is not None:
                session.close()
        return self._reward(passed, len(calls), failure)


# ---------------------------------------------------------------------------------------------
# stdin / stdout programs.
def normalize_output(text: str) -> str:
    """Stdout as compared: trailing spaces of each line and trailing blank lines are ignored."""
    return "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").split("\n")).rstrip("\n")


class StdioVerifier(_CodeVerifier):
    """Each case runs the program with `stdin`; its stdout must equal `stdout` (normalised).

    Row: {"completion", "cases": [{"stdin": "...", "stdout": "..."}]}.
    """

    name = "stdio"

    def score(self, completion: str, example: Mapping) -> Verdict:
        """Run every case as a fresh process in the sandbox."""
        cases = _cases(example, ("stdin", "stdout"))
        if isinstance(cases, str):
            return Verdict.data_error(cases)
        if any(not isinstance(c["stdin"], str) or not isinstance(c["stdout"], str) for c in cases):
            return Verdict.data_error("every case's 'stdin' and 'stdout' must be strings")
        cases = [case for index, case in enumerate(cases) if self.runs(index)]
        code = extract_code(completion, self.code_policy)
        return with_slot(self.sandbox, lambda slot: self._run(slot, code, cases))

    def _run(self, slot: SandboxSlot, code: str, cases: list) -> Verdict:
        deadline = time.monotonic() + self.sandbox.timeout_s  # one budget for all the cases
        passed, failure = 0, ""
        for index, case in enumerate(cases):
            result = slot.run_program(code, case["stdin"].encode(), deadline)
            output = result.stdout.decode(errors="replace")
            if not result.reason and normalize_output(output) == normalize_output(case["stdout"]):
                passed += 1
                continue
            failure = failure or f"case {index}: " + (result.reason or "wrong output")
            if result.reason.startswith("timed out") or not self.fraction:
                break
        return self._reward(passed, len(cases), failure)


# ---------------------------------------------------------------------------------------------
# HumanEval: prompt + completion, a `check(candidate)` test, an entry point.
class _CandidateFailed(Exception):
    """A call of the candidate raised in the sandbox (the sample fails, even if caught)."""


class _Proxy:
    """Stands for the candidate function inside `check`: each call crosses into the sandbox."""

    def __init__(self, session):
        self.session = session
        self.errors: list[str] = []

    def __call__(self, *args, **kwargs):
        if kwargs:
            args = args + tuple(kwargs.values())  # HumanEval tests never pass keywords; keep order
        kind, value = self.session.call(list(args))
        if kind == "error":
            self.errors.append(value)
            raise _CandidateFailed(value)
        return value


class _StrictAsserts(ast.NodeTransformer):
    """`assert <test>` -> `__judge_assert(lambda: <test>)`, with == / != / in made type-strict."""

    def __init__(self):
        self.asserts = 0

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        self.asserts += 1
        test = _StrictCompare().visit(node.test)
        thunk = ast.Lambda(args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[],
                                              defaults=[]), body=test)
        call = ast.Call(func=ast.Name("__judge_assert", ast.Load()), args=[thunk], keywords=[])
        return ast.copy_location(ast.Expr(call), node)


class _StrictCompare(ast.NodeTransformer):
    _FUNCTIONS = {ast.Eq: ("__judge_eq", False), ast.NotEq: ("__judge_eq", True),
                  ast.In: ("__judge_in", False), ast.NotIn: ("__judge_in", True)}

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        if not all(type(op) in self._FUNCTIONS for op in node.ops):
            return node
        parts, left = [], node.left
        for op, right in zip(node.ops, node.comparators):
            name, negate = self._FUNCTIONS[type(op)]
            first, second = (left, right) if name == "__judge_eq" else (right, left)
            call: ast.expr = ast.Call(ast.Name(name, ast.Load()), [first, second], [])
            parts.append(ast.UnaryOp(ast.Not(), call) if negate else call)
            left = right
        result = parts[0] if len(parts) == 1 else ast.BoolOp(ast.And(), parts)
        return ast.copy_location(result, node)


def _rewrite_test(test: str) -> tuple[ast.Module, int]:
    tree = ast.parse(test)
    rewriter = _StrictAsserts()
    tree = ast.fix_missing_locations(rewriter.visit(tree))
    return tree, rewriter.asserts


def _compile_prompt(prompt: str):
    """The prompt as a module; a prompt that ends at a bare `def` line gets a placeholder body."""
    try:
        return compile(prompt, "<prompt>", "exec")
    except SyntaxError:
        return compile(prompt.rstrip() + "\n    pass\n", "<prompt>", "exec")


class HumanEvalVerifier(_CodeVerifier):
    """HumanEval format: code = prompt + completion; `check(candidate)` must pass all asserts.

    Row: {"completion", "prompt", "test", "entry_point"} (the HumanEval fields).
    """

    name = "humaneval"

    def score(self, completion: str, example: Mapping) -> Verdict:
        """Run `check` here with `candidate` proxied into the sandbox."""
        fields = {key: example.get(key) for key in ("prompt", "test", "entry_point")}
        for key, value in fields.items():
            if not isinstance(value, str) or not value.strip():
                return Verdict.data_error(f"field {key!r} must be a non-empty string")
        try:
            tree, asserts = _rewrite_test(fields["test"])
        except SyntaxError as error:
            return Verdict.data_error(f"field 'test' does not parse: {error.msg} (line {error.lineno})")
        if asserts == 0:
            return Verdict.data_error("field 'test' has no assert: an empty test proves nothing")
        judge: dict[str, Any] = {"__name__": "__judge__"}
        try:  # the prompt's helpers (e.g. `poly`, `encode_cyclic`) are used by some tests
            exec(_compile_prompt(fields["prompt"]), judge)
            exec(compile(tree, "<test>", "exec"), judge)
        except Exception as error:  # noqa: BLE001 - dataset text that does not run
            return Verdict.data_error(f"prompt/test does not run: {type(error).__name__}: {error}")
        if not callable(judge.get("check")):
            return Verdict.data_error("field 'test' does not define check(candidate)")
        body = extract_code(completion, self.code_policy)
        code = fields["prompt"] + body if body == completion else fields["prompt"] + "\n" + body
        return with_slot(self.sandbox, lambda slot: self._run(slot, code, fields["entry_point"], judge))

    def _run(self, slot: SandboxSlot, code: str, entry_point: str, judge: dict, every_assert: bool = False) -> Verdict:
        counts = {"passed": 0, "total": 0, "reached": 0}

        def judge_assert(thunk) -> None:
            counts["reached"] += 1
            if not (every_assert or self.runs(counts["reached"] - 1)):
                return  # a test this verifier leaves to the checker (`tests: half`)
            counts["total"] += 1
            try:
                held = bool(thunk())
            except CandidateGone:
                raise
            except Exception:  # noqa: BLE001 - e.g. abs(None - 1): the assert did not hold
                held = False
            counts["passed"] += held

        judge.update(__judge_assert=judge_assert, __judge_eq=strict_equal, __judge_in=strict_contains)
        session, failure, proxy = None, "", None
        started = time.monotonic()
        try:
            session = slot.open_function(code, entry_point, started + self.sandbox.timeout_s)
            proxy = _Proxy(session)
            judge[entry_point] = proxy  # some tests call the function by name (HumanEval/33)
            judge["check"](proxy)
        except CandidateGone as gone:
            failure = str(gone)
            counts["total"] += 1  # the assert that was running when it went
        except _CandidateFailed as error:
            failure = f"candidate raised {error}"
        except Exception as error:  # noqa: BLE001 - the test broke on the candidate's output
            failure = f"test raised {type(error).__name__}: {error}"[:300]
        finally:
            if session is not None:
                session.close()
        if proxy is not None and proxy.errors and not failure:
            failure = f"candidate raised {proxy.errors[0]}"
        if proxy is not None and session.calls == 0 and not failure:
            return Verdict.data_error("field 'test' never calls the candidate")
        verdict = self._reward(counts["passed"], counts["total"], failure)
        verdict.details["time_s"] = round(time.monotonic() - started, 4)
        return verdict


def mbpp_entry_point(tests: list[str]) -> str | None:
    """The function an MBPP-style test list calls: the first called name in its asserts that is not
    a builtin (`assert remove_Occ("hello", "l") == "heo"` -> `remove_Occ`); None if there is none."""
    import builtins

    for node in walk_tests(tests):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not hasattr(builtins, node.func.id):
            return node.func.id
    return None


def _mbpp_setup(example: Mapping) -> str | Verdict:
    """The judge's preamble from MBPP's `test_imports` (a list of import lines the asserts need,
    e.g. `import math`) and `test_setup_code` (a string); data_error when they are not text."""
    imports = example.get("test_imports") or []
    setup = example.get("test_setup_code") or ""
    if isinstance(imports, str):
        imports = [imports]
    if not isinstance(imports, list) or not all(isinstance(line, str) for line in imports) or not isinstance(setup, str):
        return Verdict.data_error("fields 'test_imports' (a list of strings) / 'test_setup_code' (a string) have the wrong type")
    return "".join(line.strip() + "\n" for line in imports if line.strip()) + (setup.strip() + "\n" if setup.strip() else "")


class MBPPVerifier(HumanEvalVerifier):
    """MBPP format: a natural-language prompt (never executed), the completion's code (the last
    fenced block by default) defines the function, and each assert of `tests` (MBPP's `test_list`)
    must hold. The asserts run in the judge, outside the sandbox, against a proxy of the candidate's
    function (type-strict comparisons, as for HumanEval); `entry_point` is taken from the tests when
    the row does not name it.

    MBPP's `test_imports` and `test_setup_code` run in the judge before the asserts.

    Row: {"completion", "tests": ["assert f(1) == 2", ...], "entry_point" (optional),
    "test_imports" (optional), "test_setup_code" (optional)}.
    """

    name = "mbpp"

    def score(self, completion: str, example: Mapping) -> Verdict:
        tests = example.get("tests")
        if isinstance(tests, str):
            tests = [tests]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
            return Verdict.data_error("field 'tests' must be a non-empty list of assert lines (an empty test list proves nothing)")
        entry_point = example.get("entry_point") or mbpp_entry_point(tests)
        if not isinstance(entry_point, str) or not entry_point.isidentifier():
            return Verdict.data_error("no function name: the tests call none, and the row names no 'entry_point'")
        shown = example.get("shown_tests") or []
        if not isinstance(shown, list) or not all(type(index) is int and 0 <= index < len(tests) for index in shown):
            return Verdict.data_error(f"field 'shown_tests' must list indices of the {len(tests)} tests, got {shown!r}")
        if shown:  # chosen by test here, so `_run` runs every assert of the chosen ones
            tests = [tests[index] for index in self.selected(len(tests), shown)]
        setup = _mbpp_setup(example)
        if isinstance(setup, Verdict):
            return setup
        source = setup + "def check(candidate):\n" + "".join(
            textwrap.indent(test.strip(), "    ") + "\n" for test in tests)
        try:
            tree, asserts = _rewrite_test(source)
        except SyntaxError as error:
            return Verdict.data_error(f"field 'tests' does not parse: {error.msg} (line {error.lineno})")
        if asserts == 0:
            return Verdict.data_error("field 'tests' has no assert: an empty test proves nothing")
        judge: dict[str, Any] = {"__name__": "__judge__"}
        try:
            exec(compile(tree, "<tests>", "exec"), judge)
        except Exception as error:  # noqa: BLE001 - dataset text that does not run
            return Verdict.data_error(f"tests do not run: {type(error).__name__}: {error}")
        code = extract_code(completion, self.code_policy)
        return with_slot(self.sandbox, lambda slot: self._run(slot, code, entry_point, judge, every_assert=bool(shown)))
