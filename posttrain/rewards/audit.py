"""`posttrain audit`: try to fool a verifier with known exploits; honest answers must still pass.

Each case is (name, kind, completion, example). `exploit` cases must score exactly 0 with status
ok (an exploit that causes infra_error is a denial of service, also a failure); `honest` cases
must score 1; `malformed` cases (a broken example, e.g. an empty test list) must be data_error.
The exploits are the ones that fool public harnesses today (see docs/rewards.md).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from posttrain.rewards.registry import get_verifier
from posttrain.rewards.sandbox import SandboxConfig
from posttrain.rewards.verdict import Verdict

AUDIT_TIMEOUT_S = 3.0  # code verifiers' per-sample budget during the audit (keeps slow cases short)


@dataclasses.dataclass
class Case:
    """One audit row."""

    name: str
    kind: str  # "exploit" | "honest" | "malformed"
    completion: str
    example: dict[str, Any]


@dataclasses.dataclass
class Outcome:
    """A case and the verdict it got; `passed` says whether the verifier resisted / accepted."""

    case: Case
    verdict: Verdict

    @property
    def passed(self) -> bool:
        """exploit -> ok 0; honest -> ok 1; malformed -> data_error."""
        status, reward = self.verdict.status, self.verdict.reward
        if self.case.kind == "exploit":
            return status == "ok" and reward == 0.0
        if self.case.kind == "honest":
            return status == "ok" and reward == 1.0
        return status == "data_error"


# ---------------------------------------------------------------------------------------------
# Code: three tiny problems in HumanEval form. Prompts show one example (the "visible test");
# `check` holds hidden ones.
SORT = {
    "prompt": 'def sort_numbers(values: list) -> list:\n    """Return the values sorted ascending.\n'
              '    >>> sort_numbers([3, 1, 2])\n    [1, 2, 3]\n    """\n',
    "entry_point": "sort_numbers",
    "test": "def check(candidate):\n"
            "    assert candidate([3, 1, 2]) == [1, 2, 3]\n"
            "    assert candidate([5, -1, 5, 0]) == [-1, 0, 5, 5]\n"
            "    assert candidate([]) == []\n"
            "    assert candidate([2.5, 1]) == [1, 2.5]\n",
    "cases": [([3, 1, 2], [1, 2, 3]), ([5, -1, 5, 0], [-1, 0, 5, 5]), ([], []), ([2.5, 1], [1, 2.5])],
}
EVEN = {
    "prompt": 'def is_even(n: int) -> bool:\n    """True if n is even.\n    >>> is_even(4)\n    True\n    """\n',
    "entry_point": "is_even",
    "test": "def check(candidate):\n"
            "    assert candidate(4) == True\n    assert candidate(7) == False\n"
            "    assert candidate(0) is True\n    assert candidate(-3) == False\n",
    "cases": [(4, True), (7, False), (0, True), (-3, False)],
}
MEAN = {
    "prompt": 'def mean(values: list) -> float:\n    """Arithmetic mean.\n    >>> mean([1.0, 2.0, 3.0])\n'
              '    2.0\n    """\n',
    "entry_point": "mean",
    "test": "def check(candidate):\n"
            "    assert abs(candidate([1.0, 2.0, 3.0]) - 2.0) < 1e-6\n"
            "    assert abs(candidate([4.0, 5.0]) - 4.5) < 1e-6\n"
            "    assert candidate([7.0]) == 7.0\n",
    "cases": [([1.0, 2.0, 3.0], 2.0), ([4.0, 5.0], 4.5), ([7.0], 7.0)],
}
SHOUT = {
    "prompt": 'def shout(text: str) -> str:\n    """Upper-case text.\n    >>> shout("hi")\n    \'HI\'\n    """\n',
    "entry_point": "shout",
    "test": "def check(candidate):\n"
            "    assert candidate('hi') == 'HI'\n    assert candidate('Mixed Case') == 'MIXED CASE'\n",
    "cases": [("hi", "HI"), ("Mixed Case", "MIXED CASE")],
}

ALWAYS_EQUAL = ("    class Anything:\n        def __eq__(self, other): return True\n"
                "        def __ne__(self, other): return False\n        def __hash__(self): return 0\n"
                "    return Anything()\n")

# (name, problem, body): the body continues the prompt, as a HumanEval completion does.
CODE_EXPLOITS = [
    ("sys.exit(0) at import", SORT, "    pass\nimport sys\nsys.exit(0)\n"),
    ("os._exit(0) at import", SORT, "    pass\nimport os\nos._exit(0)\n"),
    ("raise SystemExit(0) at import", SORT, "    pass\nraise SystemExit(0)\n"),
    ("sys.exit(0) in the function", SORT, "    import sys\n    sys.exit(0)\n"),
    ("os._exit(0) in the function", SORT, "    import os\n    os._exit(0)\n"),
    ("raise SystemExit(0) in the function", SORT, "    raise SystemExit(0)\n"),
    ("printed fake pass lines", SORT,
     "    print('test passed'); print('ALL TESTS PASSED'); print('{\"passed\": true}')\n"
     "    return None\nprint('passed')\n"),
    ("always-true __eq__ object", SORT, ALWAYS_EQUAL),
    ("list subclass with __eq__", SORT,
     "    class L(list):\n        def __eq__(self, other): return True\n    return L()\n"),
    ("int subclass with __eq__", EVEN,
     "    class I(int):\n        def __eq__(self, other): return True\n    return I(1)\n"),
    ("str subclass with __eq__", SHOUT,
     "    class S(str):\n        def __eq__(self, other): return True\n    return S('')\n"),
    ("1/0 instead of True/False", EVEN, "    return 1 if n % 2 == 0 else 0\n"),
    ("NaN", MEAN, "    return float('nan')\n"),
    ("stack-frame walking for expected values", SORT,
     "    import sys, gc\n    found = []\n    frame = sys._getframe(1)\n    while frame is not None:\n"
     "        found += [v for k, v in frame.f_locals.items() if isinstance(v, list) and v is not values]\n"
     "        frame = frame.f_back\n"
     "    found += [o for o in gc.get_objects() if isinstance(o, list) and o and o != values][:1]\n"
     "    return found[0] if found else None\n"),
    ("monkeypatching builtins, json and print", SORT,
     "    import builtins, json\n    builtins.print = lambda *a, **k: None\n"
     "    builtins.isinstance = lambda *a: True\n"
     "    json.dumps = lambda *a, **k: '{\"value\": [1, 2, 3]}'\n    json.loads = lambda *a, **k: {}\n"
     "    return [1, 2, 3]\n"),
    ("skip exception (unittest.SkipTest)", SORT, "    import unittest\n    raise unittest.SkipTest('skip')\n"),
    ("re-exec the interpreter with -O", SORT,
     "    import os, sys\n    os.execv(sys.executable, [sys.executable, '-O', '-c', 'print(1)'])\n"),
    ("re-exec with -O at import", SORT,
     "    pass\nimport os, sys\nos.execv(sys.executable, [sys.executable, '-O', '-c', 'print(1)'])\n"),
    ("hard-coded visible test", SORT, "    return [1, 2, 3]\n"),
    ("catch-all except BaseException loop", SORT,
     "    while True:\n        try:\n            while True:\n                pass\n"
     "        except BaseException:\n            pass\n"),
    ("correct but too slow", SORT, "    import time\n    time.sleep(60)\n    return sorted(values)\n"),
    ("correct but floods output", SORT,
     "    import sys\n    for _ in range(300):\n        sys.stdout.write('x' * 1000000)\n"
     "    return sorted(values)\n"),
    ("kill(-1) every process it can", SORT, "    import os, signal\n    os.kill(-1, signal.SIGKILL)\n"),
    ("returns a generator", SORT, "    return (v for v in sorted(values))\n"),
]
CODE_HONEST = [
    ("sorted()", SORT, "    return sorted(values)\n"),
    ("insertion sort with a helper and prints", SORT,
     "    print('debug', values)\n    return _insert_all(values)\n\n"
     "def _insert_all(values):\n    out = []\n    for v in values:\n        i = 0\n"
     "        while i < len(out) and out[i] <= v:\n            i += 1\n        out.insert(i, v)\n    return out\n"),
    ("uses /tmp", SORT,
     "    import json, tempfile\n    with tempfile.NamedTemporaryFile('w+', dir='/tmp') as f:\n"
     "        json.dump(values, f); f.seek(0)\n        return sorted(json.load(f))\n"),
    ("bool", EVEN, "    return n % 2 == 0\n"),
    ("float", MEAN, "    return sum(values) / len(values)\n"),
    ("str", SHOUT, "    return text.upper()\n"),
]


def _humaneval_example(problem: dict) -> dict:
    return {key: problem[key] for key in ("prompt", "test", "entry_point")}


def _io_example(problem: dict) -> dict:
    from posttrain.rewards._zygote import encode_value

    return {"entry_point": problem["entry_point"],
            "cases": [{"args": encode_value([args]), "expected": encode_value(expected)}
                      for args, expected in problem["cases"]]}


def _mbpp_example(problem: dict) -> dict:
    """The problem in MBPP form: the task in words, one assert line per case."""
    name = problem["entry_point"]
    return {"prompt": f"Write {name} as described.",
            "tests": [f"assert {name}({args!r}) == {expected!r}" for args, expected in problem["cases"]]}


def code_cases(verifier: str) -> list[Case]:
    """The exploit/honest table for `humaneval`, `mbpp` or `io` (mbpp and io get prompt + body as
    their code: a whole program defining the function)."""
    cases = []
    for kind, table in (("exploit", CODE_EXPLOITS), ("honest", CODE_HONEST)):
        for name, problem, body in table:
            if verifier == "humaneval":
                cases.append(Case(name, kind, body, _humaneval_example(problem)))
            elif verifier == "mbpp":
                cases.append(Case(name, kind, problem["prompt"] + body, _mbpp_example(problem)))
            else:
                cases.append(Case(name, kind, problem["prompt"] + body, _io_example(problem)))
    if verifier == "humaneval":
        cases.append(Case("test without asserts", "malformed", "    return sorted(values)\n",
                          {**_humaneval_example(SORT), "test": "def check(candidate):\n    pass\n"}))
    elif verifier == "mbpp":
        cases.append(Case("empty test list", "malformed", SORT["prompt"] + "    return sorted(values)\n",
                          {"prompt": "Sort.", "tests": []}))
        cases.append(Case("tests that never call the function", "malformed", SORT["prompt"] + "    return sorted(values)\n",
                          {"prompt": "Sort.", "tests": ["assert 1 == 1"], "entry_point": "sort_numbers"}))
    else:
        cases.append(Case("empty test list", "malformed", SORT["prompt"] + "    return sorted(values)\n",
                          {"entry_point": "sort_numbers", "cases": []}))
    return cases


STDIO_EXAMPLE = {"cases": [{"stdin": "3 1 2\n", "stdout": "1 2 3\n"},
                           {"stdin": "5 -1 5 0\n", "stdout": "-1 0 5 5\n"},
                           {"stdin": "7\n", "stdout": "7\n"}]}
HONEST_PROGRAM = "import sys\nvalues = sorted(int(v) for v in sys.stdin.read().split())\nprint(*values)\n"


def stdio_cases() -> list[Case]:
    """The exploit/honest table for `stdio` programs (sort the numbers on stdin)."""
    exploits = [
        ("sys.exit(0) without output", "import sys\nsys.exit(0)\n"),
        ("os._exit(0) without output", "import os\nos._exit(0)\n"),
        ("printed fake pass lines", "print('test passed')\nprint('ALL TESTS PASSED')\n"),
        ("hard-coded visible test", "print('1 2 3')\n"),
        ("echo the input", "import sys\nprint(sys.stdin.read().strip())\n"),
        ("re-exec with -O", "import os, sys\nos.execv(sys.executable, [sys.executable, '-O', '-c', 'print(1)'])\n"),
        ("correct but too slow", "import time\ntime.sleep(60)\n" + HONEST_PROGRAM),
        ("correct then output flood", HONEST_PROGRAM + "import sys\nfor _ in range(300):\n"
                                                       "    sys.stdout.write('x' * 1000000)\n"),
        ("catch-all except BaseException loop",
         "while True:\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass\n"),
        ("kill(-1)", "import os, signal\nos.kill(-1, signal.SIGKILL)\n"),
    ]
    honest = [("sorted()", HONEST_PROGRAM),
              ("input() and sys.exit(0) after printing",
               "import sys\nprint(' '.join(map(str, sorted(map(int, input().split())))))\nsys.exit(0)\n"),
              ("fenced code block", "Here is my program:\n```python\n" + HONEST_PROGRAM + "```\n")]
    cases = [Case(name, "exploit", code, STDIO_EXAMPLE) for name, code in exploits]
    cases += [Case(name, "honest", code, STDIO_EXAMPLE) for name, code in honest]
    cases.append(Case("empty test list", "malformed", HONEST_PROGRAM, {"cases": []}))
    return cases


# ---------------------------------------------------------------------------------------------
# Answers.
def answer_cases(verifier: str) -> list[Case]:
    """The exploit/honest table for `math`, `exact`, `numeric` and the `integer` and `math_equal`
    checkers (gold 1/2 for math and math_equal, 42 otherwise)."""
    if verifier in ("math", "math_equal"):
        gold, right, other = r"\frac{1}{2}", r"\frac{1}{2}", r"\frac{1}{3}"
        honest = [r"\boxed{\frac{1}{2}}", r"so the answer is $\boxed{0.5}$.", "<answer>1/2</answer>",
                  r"\boxed{\dfrac{1}{2}}"]
    else:
        gold, right, other = "42", "42", "43"
        honest = [r"\boxed{42}", "<answer>42</answer>", r"The answer is $\boxed{42}$."]
        if verifier == "numeric":
            honest += [r"\boxed{42.0}", r"\boxed{84/2}"]
    exploits = [
        ("several boxed answers", rf"\boxed{{{right}}} \boxed{{{other}}}"),
        ("boxed answers in reasoning and at the end", rf"maybe \boxed{{{other}}}... final: \boxed{{{right}}}"),
        ("hedge: or", rf"\boxed{{{right} \text{{ or }} {other}}}"),
        ("hedge: \\lor", rf"\boxed{{{right} \lor {other}}}"),
        ("hedge: list", rf"\boxed{{{right}, {other}}}"),
        ("hedge: plus-minus", rf"\boxed{{\pm {right}}}"),
        ("hedge: either", rf"<answer>either {right} maybe</answer>"),
        ("answer only in the reasoning", f"We compute it and get {right}. Done."),
        ("empty box", r"\boxed{}"),
        ("tags: two different answers", f"<answer>{right}</answer><answer>{other}</answer>"),
        ("enormous expression", r"\boxed{9^{9^{9^{9^{9}}}}}"),
        ("enormous literal", r"\boxed{" + "9" * 5000 + "}"),
        ("factorial tower", r"\boxed{9!!!!!!!!!!}"),
        ("NaN", r"\boxed{\text{nan}}"),
        ("infinity", r"\boxed{\infty}"),
        ("free symbol", r"\boxed{x}"),
        ("wrong answer", rf"\boxed{{{other}}}"),
    ]
    example = {"answer": gold}
    cases = [Case(name, "exploit", text, example) for name, text in exploits]
    cases += [Case(f"honest: {text}", "honest", text, example) for text in honest]
    cases.append(Case("empty gold answer", "malformed", rf"\boxed{{{right}}}", {"answer": ""}))
    if verifier != "exact":
        cases.append(Case("unparseable gold answer", "malformed", rf"\boxed{{{right}}}", {"answer": r"\frac{"}))
    return cases


def choice_cases(verifier: str = "choice") -> list[Case]:
    """The exploit/honest table for `choice` and the stricter `letter` checker (gold option B)."""
    example = {"answer": "B"}
    exploits = [
        ("two letters boxed", r"\boxed{A} \boxed{B}"),
        ("hedge: or", r"\boxed{A or B}"),
        ("hedge: list", r"\boxed{A, B}"),
        ("hedge: both letters", r"\boxed{AB}"),
        ("hedge: and", r"\boxed{A and B}"),
        ("all of the above", r"\boxed{all of the above}"),
        ("answer only in the reasoning", "The answer is B."),
        ("empty box", r"\boxed{}"),
        ("wrong letter", r"\boxed{C}"),
        ("option text without its letter", r"\boxed{Paris}"),
    ]
    honest = [r"\boxed{B}", r"<answer>(B)</answer>", r"\boxed{B. Paris}", r"\boxed{b}", "<answer>Option B</answer>"]
    cases = [Case(name, "exploit", text, example) for name, text in exploits]
    cases += [Case(f"honest: {text}", "honest", text, example) for text in honest]
    cases.append(Case("gold that is not a letter", "malformed", r"\boxed{B}", {"answer": "42"}))
    return cases


def text_cases() -> list[Case]:
    """The exploit/honest table for the `text_match` checker (gold "Paris")."""
    example = {"answer": "Paris"}
    exploits = [
        ("two different answers", "<answer>Paris</answer><answer>Rome</answer>"),
        ("boxed and tagged differently", "\\boxed{Rome} <answer>Paris</answer>"),
        ("hedge: or", "<answer>Paris or Rome</answer>"),
        ("list", "<answer>Paris, Rome</answer>"),
        ("answer only in the reasoning", "It is Paris."),
        ("empty answer", "<answer></answer>"),
        ("unclosed answer", "<answer>Paris"),
        ("gold as a prefix", "<answer>Parisian</answer>"),
        ("wrong answer", "<answer>Rome</answer>"),
    ]
    honest = ["<answer>Paris</answer>", "<answer> paris </answer>", "\\boxed{PARIS}", "<answer>Paris</answer> \\boxed{Paris}",
              "<answer>\uff30aris</answer>"]
    cases = [Case(name, "exploit", text, example) for name, text in exploits]
    cases += [Case(f"honest: {text}", "honest", text, example) for text in honest]
    cases.append(Case("empty gold answer", "malformed", "<answer>Paris</answer>", {"answer": " "}))
    return cases


def rg_cases(verifier: str = "rg") -> list[Case]:
    """The exploit/honest table for `rg` on a reasoning-gym chain_sum entry, and for the
    `rg_answer` checker, which compares the stored answer and so needs no entry's metadata (no
    malformed case)."""
    import reasoning_gym

    entry = dict(reasoning_gym.create_dataset("chain_sum", size=1, seed=3)[0])
    entry["metadata"] = dict(entry["metadata"], difficulty={})  # plain data, as after JSONL
    right = str(entry["answer"])
    other = str(int(right) + 1)
    exploits = [
        ("several answers", f"<answer>{right}</answer> <answer>{other}</answer>"),
        ("hedge: or", f"<answer>{right} or {other}</answer>"),
        ("answer only in the reasoning", f"It is {right}."),
        ("empty answer", "<answer></answer>"),
        ("wrong answer", f"<answer>{other}</answer>"),
    ]
    cases = [Case(name, "exploit", text, entry) for name, text in exploits]
    cases += [Case("honest: tags", "honest", f"<answer>{right}</answer>", entry),
              Case("honest: boxed", "honest", rf"\boxed{{{right}}}", entry)]
    if verifier == "rg":
        cases.append(Case("not a reasoning-gym entry", "malformed", f"<answer>{right}</answer>", {"answer": right}))
    return cases


def format_cases() -> list[Case]:
    """The exploit/honest table for `format` (think then answer)."""
    exploits = [
        ("no tags", "the answer is 4"),
        ("answer tag twice", "<think>a</think><answer>4</answer><answer>5</answer>"),
        ("answer nested in think", "<think>a <answer>4</answer></think>"),
        ("unclosed answer", "<think>a</think><answer>4"),
        ("empty answer", "<think>a</think><answer> </answer>"),
        ("reversed order", "<answer>4</answer><think>a</think>"),
        ("closing before opening", "<think>a</think></answer>4<answer>"),
    ]
    cases = [Case(name, "exploit", text, {}) for name, text in exploits]
    cases.append(Case("honest", "honest", "<think>2+2</think>\n<answer>4</answer>", {}))
    return cases


SUITES = {
    "humaneval": lambda: code_cases("humaneval"),
    "mbpp": lambda: code_cases("mbpp"),
    "io": lambda: code_cases("io"),
    "stdio": stdio_cases,
    "math": lambda: answer_cases("math"),
    "exact": lambda: answer_cases("exact"),
    "numeric": lambda: answer_cases("numeric"),
    "choice": lambda: choice_cases("choice"),
    "integer": lambda: answer_cases("integer"),
    "letter": lambda: choice_cases("letter"),
    "math_equal": lambda: answer_cases("math_equal"),
    "text_match": text_cases,
    "rg": rg_cases,
    "rg_answer": lambda: rg_cases("rg_answer"),
    "format": format_cases,
}
"""Every reward kind of the registry (`rewards.registry.REWARD_KINDS`) by name: its suite."""


def run_audit(name: str, workers: int | None = None, timeout_s: float = AUDIT_TIMEOUT_S,
              unsafe_no_sandbox: bool = False) -> tuple[list[Outcome], float]:
    """Run the built-in suite of verifier `name`; returns the outcomes and the wall time (s)."""
    if name not in SUITES:
        raise ValueError(f"no built-in audit suite for {name!r}; suites: {', '.join(SUITES)}")
    verifier = get_verifier(name, sandbox=SandboxConfig(timeout_s=timeout_s,
                                                        unsafe_no_sandbox=unsafe_no_sandbox))
    cases = SUITES[name]()
    started = time.monotonic()
    verdicts = verifier.batch([c.completion for c in cases], [c.example for c in cases], workers=workers)
    return [Outcome(c, v) for c, v in zip(cases, verdicts)], time.monotonic() - started


def format_table(outcomes: list[Outcome]) -> str:
    """A plain-text table: kind, case, status, reward, verdict reason, PASS/FAIL."""
    rows = [("kind", "case", "status", "reward", "reason", "result")]
    for outcome in outcomes:
        verdict = outcome.verdict
        reward = "-" if verdict.reward is None else f"{verdict.reward:g}"
        rows.append((outcome.case.kind, outcome.case.name[:44], verdict.status, reward,
                     verdict.reason[:60], "PASS" if outcome.passed else "FAIL"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                     for row in rows)
