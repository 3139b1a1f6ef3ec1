"""Checks of the problems, not the verifier (`posttrain.rewards.problem_checks`, `posttrain audit
--data`): the examples a prompt shows, the trivial programs written from them, which fixture
problems those programs pass (the weak ones, known by construction), wrong reference solutions,
and the command's exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.data.examples import verifier_input
from posttrain.data.prompts import validate_prompt_file
from posttrain.data.tasks import humaneval_examples
from posttrain.rewards import get_verifier
from posttrain.rewards.problem_checks import (
    StrengthReport,
    Weakness,
    adversaries,
    check_references,
    find_weak_tests,
    reference_solution,
    summary_line,
)
from posttrain.rewards.problem_text import (
    AssertedCall,
    VisibleCase,
    VisibleExample,
    asserted_calls,
    description_cases,
    shown_test_sources,
    visible_cases,
    visible_examples,
)
from posttrain.rewards.sandbox import check_isolation

DATA = Path(__file__).parent / "data"
WEAK_MBPP = DATA / "weak_tests.jsonl"
WEAK_STDIO = DATA / "weak_stdio.jsonl"
ROOT = Path(__file__).parent.parent


def sandbox_available() -> bool:
    try:
        check_isolation()
        return True
    except Exception:  # noqa: BLE001
        return False


needs_sandbox = pytest.mark.skipif(not sandbox_available(), reason="needs bubblewrap (installed by .ci/run)")


def rows_of(path: Path, data_format: str, columns: dict | None = None) -> list[dict]:
    parsed, report = validate_prompt_file(path, data_format=data_format, columns=columns)
    assert not report.problems, report.lines()
    return [verifier_input(example) for _, example in parsed]


# ---------------------------------------------------------------------------------------------
# What a prompt shows (pure).
@pytest.mark.parametrize("text, expected", [
    (">>> f([3, 1])\n    [1, 3]\n", [VisibleExample([[3, 1]], [1, 3])]),                # doctest, result below
    (">>> f('a') == 'b'", [VisibleExample(["a"], "b")]),                                  # HumanEval/162's form
    ("f(1) ==> 2\nf(2) => 3\nf(3) -> 4\nf(4) ➞ 5", [VisibleExample([n], n + 1) for n in range(1, 5)]),
    ("f(148, 412) should return 16.", [VisibleExample([148, 412], 16)]),                  # 16, not 16.0
    ("f('5 apples', 19) ->19 - 5 - 6 = 8", [VisibleExample(["5 apples", 19], 8)]),       # the worked result
    ("f(1, 4) => true", [VisibleExample([1, 4], True)]),
    ("assert f((3, 4), [5]) == (4, 5)", [VisibleExample([(3, 4), [5]], (4, 5))]),         # MBPP's visible test
    (">>> round(f([1, 2]), 2)\n    -0.5", []),                                            # wrapped: not f's output
    ("f(a) => False\nx = f(1)\ndef f(x):\nnot f(2) == True", []),                         # not literals / not examples
    ("f(1) == 2\nf(1) == 3", [VisibleExample([1], 2)]),                                   # first result of an argument list wins
])
def test_visible_examples(text, expected):
    assert visible_examples(text, "f") == expected


@pytest.mark.parametrize("test, expected", [
    ("assert f(5) == 120", [AssertedCall([5], 120)]),                                     # MBPP's usual form
    ("assert 120 == f(5)", [AssertedCall([5], 120)]),                                     # reversed
    ("assert f((3, 4), [5]) == (4, 5)", [AssertedCall([(3, 4), [5]], (4, 5))]),
    ("assert f(2) is None", [AssertedCall([2], None)]),
    ("assert f(4)", [AssertedCall([4], True)]),                                           # truthy: True passes
    ("assert not f(3)", [AssertedCall([3], False)]),
    ("assert set(f([1, 2, 2])) == {1, 2}", [AssertedCall([[1, 2, 2]], {1, 2})]),           # wrapped: set({1, 2}) == {1, 2}
    ("assert round(f(2), 2) == 1.41", [AssertedCall([2], 1.41)]),
    ("assert math.isclose(f(1.0), 2.5, rel_tol=0.001)", [AssertedCall([1.0], 2.5)]),
    ("assert abs(f(2) - 4.0) < 1e-6", [AssertedCall([2], 4.0)]),
    ("assert f(1) == 2 and f(2) == 3", [AssertedCall([1], 2), AssertedCall([2], 3)]),     # each part of an and
    ("assert f(X) == 3", [AssertedCall(None, 3)]),                                        # a name from the setup code
    ("assert f(1) != 2", []),                                                             # no value to return
    ("assert len(f(3)) == 3", []),                                                        # len is not a wrapper
    ("assert g(1) == 2", []),                                                             # another function
    ("assert f(1) == [x for x in y]", []),                                                # not a literal
    ("assert f(1 == 2", []),                                                              # does not parse
])
def test_asserted_calls(test, expected):
    assert asserted_calls([test], "f") == expected


def test_shown_test_sources_are_the_shown_indices_and_the_prompts_assert_lines():
    row = {"prompt": "Sort.\n\nYour code should pass this test:\n\nassert f([2, 1]) == [1, 2]\nassert broken(",
           "tests": ["assert f([2, 1]) == [1, 2]", "assert f([]) == []"], "shown_tests": [0]}
    assert shown_test_sources(row) == ["assert f([2, 1]) == [1, 2]", "assert f([2, 1]) == [1, 2]"]
    assert shown_test_sources({**row, "prompt": "Sort.", "shown_tests": [5]}) == []  # an index out of range shows nothing


def test_adversaries_read_the_asserted_values_of_the_shown_tests():
    """factorial's one test, shown: the lookup table keys 5 on 120 (the regex over the prompt is not
    needed: the row's shown test is read by AST); a call whose argument is a setup-code name gets
    the call-order program (the n-th call returns the n-th asserted value)."""
    row = {"id": "fact", "prompt": "Write a function to compute the factorial of n.", "tests": ["assert factorial(5) == 120"],
           "shown_tests": [0]}
    lookup = adversaries(row, "mbpp")[0]
    assert lookup.name == "lookup table of the visible examples" and "[([5], 120)]" in lookup.completion
    hidden = adversaries({**row, "shown_tests": []}, "mbpp")
    assert [p.name for p in hidden] == ["constant 0", "constant 1", "constant -1", "constant None",
                                        "identity (returns its first argument)"]  # the old audit's programs: none passes
    named = adversaries({**row, "tests": ["assert factorial(N) == 120"]}, "mbpp")
    assert [p.name for p in named][:2] == ["the shown tests' asserted values in call order", "constant 120"]
    namespace: dict = {}
    exec(named[0].completion, namespace)
    assert (namespace["factorial"](5), namespace["factorial"](5)) == (120, None)  # the first call only


def test_description_cases_of_a_code_contests_statement():
    """The statement's own Input / Output sections describe the format; the cases follow `Examples`."""
    text = ("Print the largest.\n\nInput\n\nThe first line holds n.\n\nOutput\n\nOne integer.\n\nExamples\n\n"
            "Input\n\n3\n1 7 2\n\nOutput\n\n7\n\nInput\n\n1\n5\n\nOutput\n\n5\n\nNote\n\nIn the first example 7 > 2.\n")
    assert description_cases(text) == [VisibleCase("3\n1 7 2\n", "7\n"), VisibleCase("1\n5\n", "5\n")]
    assert description_cases("Print hello.") == []
    assert visible_cases({"prompt": text, "public_tests": {"input": ["1\n"], "output": ["1\n"]}}) == [VisibleCase("1\n", "1\n")]


def test_reference_solution_fields_in_order():
    assert reference_solution({"canonical_solution": "    return 1\n", "code": "x"}) == "    return 1\n"
    assert reference_solution({"code": "  ", "solution": "print(1)"}) == "print(1)"
    assert reference_solution({"solutions": {"language": [3], "solution": ["print(1)"]}}) is None


def test_adversaries_are_written_from_the_prompt_only():
    """mbpp: whole programs named after the entry point; the expected type (bool) comes from the
    visible example, and no program holds a hidden test's arguments (13, 2)."""
    row = {"id": "p", "prompt": "Is n prime? assert is_prime(7) == True", "tests": ["assert is_prime(13) == True",
                                                                                   "assert is_prime(2) == True"]}
    programs = adversaries(row, "mbpp")
    assert [p.name for p in programs] == ["lookup table of the visible examples", "constant True", "constant False",
                                          "constant None", "identity (returns its first argument)",
                                          "catch-all (the visible examples, else True)"]
    assert all(p.completion.startswith("def is_prime(*args, **kwargs):") for p in programs)
    assert not any("13" in p.completion for p in programs)
    unseen = adversaries({**row, "prompt": "Is n prime?"}, "mbpp")  # no example: no lookup, types from the tests
    assert [p.name for p in unseen] == ["constant True", "constant False", "constant None",
                                        "identity (returns its first argument)"]


def test_humaneval_adversaries_compile_for_all_164_prompts():
    """Every program is a body that continues its prompt into valid Python (cheap: no sandbox)."""
    rows = [verifier_input(example) for example in humaneval_examples()]
    for row in rows:
        for program in adversaries(row, "humaneval"):
            compile(row["prompt"] + program.completion, row["id"], "exec")
    with_lookup = sum(any(p.name.startswith("lookup") for p in adversaries(row, "humaneval")) for row in rows)
    assert with_lookup == 140  # 24 prompts show no example in a form we read (see docs/rewards.md)


def test_summary_line():
    report = StrengthReport(checked=8, weak=[Weakness("a", "constant True")], unscored=[])
    assert summary_line(report) == ("1 of 8 problems accept a program that only memorises the visible examples, "
                                    "a constant, an echo or a catch-all")
    assert summary_line(report, 10).startswith("1 of 10 problems accept a program that ")


# ---------------------------------------------------------------------------------------------
# The fixtures, in the sandbox.
@needs_sandbox
def test_weak_mbpp_problems_and_the_wrong_reference():
    rows = rows_of(WEAK_MBPP, "mbpp")
    verifier = get_verifier("mbpp")
    strength = find_weak_tests(verifier, rows, "mbpp", workers=2)
    assert strength.checked == 8 and strength.unscored == []
    assert {w.id: w.program for w in strength.weak} == {
        "sort_visible_only": "lookup table of the visible examples",       # its only test is the visible one
        "prime_all_true": "constant True",                                  # every test expects True
        "next_prime_identity": "identity (returns its first argument)",     # every test's input is already prime
        "count_primes_catch_all": "catch-all (the visible examples, else 0)",  # the visible one, then zeros
    }
    references = check_references(verifier, rows, workers=2)
    assert references.checked == 8
    assert [(f.id, f.reason) for f in references.faults] == [
        ("max_of_three_wrong_reference", "reference fails its tests: 1 of 3 tests failed")]


@needs_sandbox
def test_weak_stdio_problems():
    rows = rows_of(WEAK_STDIO, "code_contests", {"id": "name"})
    verifier = get_verifier("stdio")
    strength = find_weak_tests(verifier, rows, "stdio", workers=2)
    assert {w.id: w.program for w in strength.weak} == {
        "maximum_public_only": "lookup table of the visible examples",  # no private tests
        "even_all_yes": "constant output 'YES'",                          # every private answer is YES
        "dedupe_echo": "echo (prints its input)",                         # no test word has a repeated letter
    }
    assert check_references(verifier, rows, workers=2).faults == []


@needs_sandbox
def test_humaneval_rows_and_tests_that_do_not_run():
    """A body that continues the prompt: the canonical solution and the adversaries alike."""
    add = {"id": "add", "entry_point": "add", "canonical_solution": "    return x + y\n",
           "prompt": 'def add(x: int, y: int) -> int:\n    """Sum.\n    >>> add(2, 3)\n    5\n    """\n',
           "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"}
    strong = {**add, "id": "add_strong", "test": add["test"] + "    assert candidate(1, 1) == 2\n    assert candidate(0, 7) == 7\n"}
    never = {"id": "never", "entry_point": "odd", "canonical_solution": "    return n % 2 == 1\n",
             "prompt": 'def odd(n: int) -> bool:\n    """True for odd n."""\n',  # no example: the type from `-> bool`
             "test": "def check(candidate):\n    assert candidate(2) == False\n    assert candidate(4) == False\n"}
    broken = {**add, "id": "broken", "test": "def check(candidate):\n    candidate(1, 2)\n"}  # no assert
    verifier = get_verifier("humaneval")
    rows = [add, strong, never, broken]
    strength = find_weak_tests(verifier, rows, "humaneval", workers=2)
    assert [(w.id, w.program) for w in strength.weak] == [("add", "lookup table of the visible examples"),
                                                          ("never", "constant False")]
    assert [f.id for f in strength.unscored] == ["broken"]
    faults = check_references(verifier, rows, workers=2).faults
    assert [(f.id, f.reason.split(":")[0]) for f in faults] == [("broken", "tests do not run")]


# ---------------------------------------------------------------------------------------------
# The command.
def audit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posttrain", "audit", *args, "--workers", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@needs_sandbox
def test_audit_data_command_exit_codes(tmp_path):
    weak = audit("--data", str(WEAK_MBPP), "--format", "mbpp")
    assert weak.returncode == 1, weak.stderr
    lines = weak.stdout.splitlines()
    assert lines[0] == "max_of_three_wrong_reference: reference fails its tests: 1 of 3 tests failed"
    assert "sort_visible_only: accepted by lookup table of the visible examples" in lines
    assert lines[-1] == ("4 of 8 problems accept a program that only memorises the visible examples, "
                         "a constant, an echo or a catch-all")
    strong_rows = [line for line in WEAK_MBPP.read_text().splitlines()
                   if json.loads(line)["task_id"] in ("count_vowels", "add", "reverse")]
    strong = tmp_path / "strong.jsonl"
    strong.write_text("\n".join(strong_rows) + "\n")
    passed = audit("--data", str(strong), "--format", "mbpp")
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert passed.stdout.splitlines()[-1].startswith("0 of 3 problems accept a program that ")
    missing = audit("--data", str(tmp_path / "missing.jsonl"), "--format", "mbpp")
    assert missing.returncode == 2 and "no such file" in missing.stderr


SINGLE_TESTS = DATA / "mbpp_single_tests.jsonl"  # an MBPP-layout file of three problems with one test each (issue 27, item 3)


@needs_sandbox
def test_audit_data_flags_single_test_problems_once_their_test_is_shown(tmp_path):
    """The user's file: the prompts show each problem's one test (data.format mbpp's show_tests
    first), so a lookup of the asserted value passes all three. Before, the prompt was the task text
    alone and only `is_even`, which the constant True passes, was found; `--show-tests none` is that
    prompt, and gives that answer still."""
    path = SINGLE_TESTS
    shown = audit("--data", str(path), "--format", "mbpp")
    assert shown.returncode == 1, shown.stderr
    assert shown.stdout.splitlines()[:3] == [f"{name}: accepted by lookup table of the visible examples"
                                             for name in ("even", "factorial", "add_numbers")]
    assert shown.stdout.splitlines()[-1].startswith("3 of 3 problems accept a program that ")
    hidden = audit("--data", str(path), "--format", "mbpp", "--show-tests", "none")
    assert hidden.stdout.splitlines()[0] == "even: accepted by constant True"
    assert hidden.stdout.splitlines()[-1].startswith("1 of 3 problems accept a program that ")
    refused = audit("--data", str(path), "--format", "mbpp", "--show-tests", "all")
    assert refused.returncode == 2 and "--show-tests all: every test would be shown" in refused.stderr


@needs_sandbox
def test_call_order_program_passes_a_shown_test_on_a_setup_name():
    """`assert total(ITEMS) == 6` with ITEMS from test_setup_code: no literal to key on, so the
    call-order program (the first call returns 6) passes it when it is the only test, and fails when
    a hidden test follows (its second call gets None)."""
    row = {"id": "total", "prompt": "Sum the items.", "tests": ["assert total(ITEMS) == 6"], "shown_tests": [0],
           "test_setup_code": "ITEMS = [1, 2, 3]", "code": "def total(items):\n    return sum(items)"}
    strong = {**row, "id": "total_strong", "tests": row["tests"] + ["assert total([4]) == 4"]}
    strength = find_weak_tests(get_verifier("mbpp"), [row, strong], "mbpp", workers=2)
    assert [(w.id, w.program) for w in strength.weak] == [("total", "the shown tests' asserted values in call order")]
    assert strength.unscored == []


def test_audit_data_bad_input_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"task_id": 1, "text": "no tests here"}) + "\n")
    assert main(["audit", "--data", str(bad), "--format", "mbpp"]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    assert main(["audit", "--data", str(WEAK_MBPP)]) == 2  # a file needs its --format
    assert "--format" in capsys.readouterr().err
    assert main(["audit", "--data", str(WEAK_MBPP), "--format", "mbpp", "--columns", "[1]"]) == 2
    assert main(["audit", "--verifier", "math", "--format", "mbpp"]) == 2
    with pytest.raises(SystemExit) as both:
        main(["audit", "--verifier", "math", "--data", str(WEAK_MBPP)])
    assert both.value.code == 2
