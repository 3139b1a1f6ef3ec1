"""Verifiers by name, and weighted composition.

Names: `math`, `exact`, `numeric`, `choice`, `integer`, `letter`, `text_match`, `math_equal` and `rg_answer` (checkers), `format`, `rg`, `humaneval`, `mbpp`, `io`, `stdio`,
`callable:<dotted.path>`, and sums of them such as `0.9*math+0.1*format` (a missing weight is 1).
`as_verifier` turns what a recipe was given (a Verifier, a plain callable, or nothing and a name)
into one verifier.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from posttrain.errors import UserError
from posttrain.rewards.answers import ChoiceVerifier, ExactVerifier, MathVerifier, NumericVerifier
from posttrain.rewards.base import Verifier
from posttrain.rewards.checkers import IntegerChecker, LetterChecker, MathChecker, StoredAnswerChecker, TextMatchChecker
from posttrain.rewards.code import CODE_POLICIES, CODE_TESTS, HumanEvalVerifier, IOVerifier, MBPPVerifier, StdioVerifier
from posttrain.rewards.custom import CallableVerifier, FunctionVerifier
from posttrain.rewards.format import FormatVerifier
from posttrain.rewards.gym import ReasoningGymVerifier
from posttrain.rewards.sandbox import SandboxConfig
from posttrain.rewards.verdict import Verdict

CODE_VERIFIERS = {"humaneval": HumanEvalVerifier, "mbpp": MBPPVerifier, "io": IOVerifier, "stdio": StdioVerifier}
ANSWER_VERIFIERS = {"math": MathVerifier, "exact": ExactVerifier, "numeric": NumericVerifier,
                    "choice": ChoiceVerifier, "rg": ReasoningGymVerifier}
CHECKERS = {"integer": IntegerChecker, "letter": LetterChecker, "text_match": TextMatchChecker, "math_equal": MathChecker,
            "rg_answer": StoredAnswerChecker}
"""Checkers written apart from the training rewards (posttrain/rewards/checkers.py)."""
NAMES = (*ANSWER_VERIFIERS, *CHECKERS, "format", *CODE_VERIFIERS)


class WeightedSum(Verifier):
    """reward = sum of weight * component reward; each component's value is kept in details.

    Any component's infra_error or data_error makes the whole verdict that status (a sum with a
    missing term is not the same reward).
    """

    def __init__(self, components: Sequence[tuple[float, Verifier]]):
        if not components:
            raise ValueError("a weighted sum needs at least one component")
        self.components = list(components)
        self.name = "+".join(f"{weight:g}*{verifier.name}" for weight, verifier in self.components)

    def batch(self, completions: Sequence[str], examples: Sequence[Mapping[str, Any]],
              workers: int | None = None) -> list[Verdict]:
        """Score with every component, then combine per row."""
        columns = [verifier.batch(completions, examples, workers) for _, verifier in self.components]
        verdicts = []
        for row in zip(*columns):
            parts = {verifier.name: verdict.reward for (_, verifier), verdict in zip(self.components, row)}
            broken = [(verifier.name, verdict) for (_, verifier), verdict in zip(self.components, row)
                      if verdict.status != "ok"]
            if broken:
                name, verdict = broken[0]
                verdicts.append(Verdict(None, verdict.status, f"{name}: {verdict.reason}", {"components": parts}))
                continue
            total = sum(weight * verdict.reward for (weight, _), verdict in zip(self.components, row))
            reasons = "; ".join(f"{v.name}: {verdict.reason}" for (_, v), verdict in zip(self.components, row))
            verdicts.append(Verdict.ok(total, reasons, components=parts))
        return verdicts

    def score(self, completion: str, example: Mapping) -> Verdict:
        """One row (see `batch`)."""
        return self.batch([completion], [example])[0]

    def implementation(self) -> dict[str, str]:
        """Every part of every term."""
        return {f"{key} ({verifier.name})": value for _, verifier in self.components for key, value in verifier.implementation().items()}

    def describe(self) -> dict[str, Any]:
        """Settings for the run card."""
        return {"verifier": self.name,
                "components": [{"weight": w, **v.describe()} for w, v in self.components]}


def get_verifier(name: str, *, sandbox: SandboxConfig | None = None, fraction: bool = False,
                 extraction: str | None = None, tests: str = "all") -> Verifier:
    """Build a verifier from its name (see the module docstring).

    `sandbox` sets the limits of code verifiers (and `unsafe_no_sandbox`); `fraction` makes
    code rewards passed/total instead of all-or-nothing; `extraction` overrides the answer
    extraction policy of math/exact/numeric/rg; `tests` which of a row's tests code verifiers run
    (`CODE_TESTS`: all, half).
    """
    name = name.strip()
    if "+" in name or "*" in name:
        components = []
        for term in name.split("+"):
            match = re.fullmatch(r"\s*(?:([0-9.eE-]+)\s*\*)?\s*(\S+?)\s*", term)
            if not match:
                raise ValueError(f"cannot read verifier term {term!r} in {name!r}")
            weight = float(match.group(1)) if match.group(1) else 1.0
            components.append((weight, get_verifier(match.group(2), sandbox=sandbox, fraction=fraction,
                                                    extraction=extraction, tests=tests)))
        return WeightedSum(components)
    if name.startswith("callable:"):
        return CallableVerifier(name.partition(":")[2])
    if name in CODE_VERIFIERS:
        return CODE_VERIFIERS[name](sandbox=sandbox, fraction=fraction, tests=tests)
    if name in ANSWER_VERIFIERS:
        return ANSWER_VERIFIERS[name](**({"extraction": extraction} if extraction else {}))
    if name in CHECKERS:
        return CHECKERS[name]()
    if name == "format":
        return FormatVerifier()
    raise ValueError(f"unknown verifier {name!r}; choose from {', '.join(NAMES)}, "
                     "callable:<dotted.path> or a weighted sum like 0.9*math+0.1*format")


@dataclass(frozen=True)
class RewardOptions:
    """A recipe's `reward_options` section: the settings of the verifier it builds by name."""

    timeout_s: float = 10.0
    """Code verifiers: wall-clock seconds for one completion (all its tests)."""
    memory_mb: int = 1024
    """Code verifiers: the candidate's address-space limit."""
    partial_credit: bool = False
    """Code verifiers: reward = tests passed / total instead of all-or-nothing (training reward only)."""
    extraction: str | None = None
    """Answer verifiers: how the answer is taken from a completion (None: the verifier's default); code verifiers: auto | fenced | raw."""
    tests: str = "half"
    """Code verifiers as the training reward: `half` runs every other test of each problem (the 1st,
    3rd ...), so that the held-out checker, which always runs all of them, holds tests the policy was
    never rewarded on (an independent check); `all` trains on every test (the run card then says the
    checker is not independent)."""

    def __post_init__(self):
        if self.tests not in CODE_TESTS:
            raise UserError(f"reward_options.tests: one of {', '.join(CODE_TESTS)}, got {self.tests!r}")
        if self.timeout_s <= 0 or self.memory_mb < 64:
            raise UserError(f"reward_options: timeout_s must be > 0 and memory_mb >= 64, got {self.timeout_s}, {self.memory_mb}")

    def sandbox(self, unsafe_no_sandbox: bool = False) -> SandboxConfig:
        return SandboxConfig(timeout_s=self.timeout_s, memory_mb=self.memory_mb, unsafe_no_sandbox=unsafe_no_sandbox)


def as_verifier(reward: Verifier | Callable[[str, dict], Any] | None, name: str, options: RewardOptions | None = None,
                unsafe_no_sandbox: bool = False, *, for_checker: bool = False, setting: str | None = None) -> Verifier:
    """The reward a recipe scores with: a `Verifier` as is; a plain callable `fn(completion,
    example)` as a `FunctionVerifier` (in this process, named `python:<qualname>`); otherwise
    (None) the verifier called `name` with `options` (a held-out checker, `for_checker`, never takes
    partial credit), whose ValueError becomes a one-line `UserError` naming `setting` (default
    `reward`, or `acceptance.checker` for a checker)."""
    if isinstance(reward, Verifier):
        return reward
    if callable(reward):
        return FunctionVerifier(reward)
    options = options or RewardOptions()
    try:
        verifier = get_verifier(name, sandbox=options.sandbox(unsafe_no_sandbox),
                                fraction=options.partial_credit and not for_checker,
                                extraction=None if _is_code(name) else options.extraction,
                                tests="all" if for_checker else options.tests)
    except (ValueError, TypeError) as error:
        raise UserError(f"{setting or ('acceptance.checker' if for_checker else 'reward')}: {error}") from None
    if options.extraction and _is_code(name):
        if options.extraction not in CODE_POLICIES:
            raise UserError(f"reward_options.extraction {options.extraction!r}: a code verifier takes one of {', '.join(CODE_POLICIES)}")
        verifier.code_policy = options.extraction
    return verifier


def _is_code(name: str) -> bool:
    return name.strip() in CODE_VERIFIERS
