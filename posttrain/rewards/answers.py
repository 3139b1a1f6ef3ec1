"""Answer verifiers: `math` (math-verify equivalence), `exact` and `numeric` match, `choice`
(a multiple-choice letter).

Row fields: `answer` (the gold answer) and, for a verifier built without an extraction policy, the
row's own `answer_extraction` (`extract.ROW_POLICY`). All of them extract the completion's final
answer with an explicit policy (`extract.py`); several different final answers or a hedge (`3 or 4`, `±3`, a
list where the gold is one value) score 0; an empty or unparseable gold answer is data_error.

math-verify enforces its timeouts with SIGALRM, so it only works in a main thread (elsewhere it
silently returns False): `MathVerifier` always runs in a pool worker, with math-verify's own
timeouts inside and the pool's hard kill outside (sympy evaluating `9^{9^{9^9}}` in C ignores
signals). A candidate answer that exhausts that deadline scores 0 ("too costly to verify").
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from posttrain.rewards.base import Verifier
from posttrain.rewards.extract import AUTO, check_policy, extract_answer, hedge, row_policy
from posttrain.rewards.pool import WorkerGone
from posttrain.rewards.verdict import Verdict


def _gold(example: Mapping) -> str | None:
    gold = example.get("answer")
    if isinstance(gold, bool) or not isinstance(gold, (str, int, float)):
        return None
    gold = str(gold).strip()
    return gold or None


class _AnswerVerifier(Verifier):
    def __init__(self, extraction: str | None = None):
        self.extraction = check_policy(extraction)
        """`extract.POLICIES`, or None: each row's own (`extract.row_policy`)."""

    def score(self, completion: str, example: Mapping) -> Verdict:
        """Extract, reject hedges, then `compare` (which subclasses implement)."""
        gold = _gold(example)
        if gold is None:
            return Verdict.data_error("field 'answer' (the gold answer) is missing or empty")
        gold_value = self.parse_gold(gold)
        if gold_value is None:
            return Verdict.data_error(f"gold answer {gold[:60]!r} cannot be parsed by {self.name}")
        policy, problem = row_policy(self.extraction, example)
        if policy is None:
            return Verdict.data_error(problem)
        found = extract_answer(completion, policy)
        details = {"extraction": policy, "extracted": found.answer}
        if found.answer is None:
            return Verdict.ok(0.0, found.reason, **details)
        hedged = hedge(found.answer, gold)
        if hedged:
            return Verdict.ok(0.0, f"hedged answer: {hedged}", **details)
        equal, reason = self.compare(found.answer, gold_value)
        return Verdict.ok(1.0 if equal else 0.0, reason, **details)

    def parse_gold(self, gold: str) -> Any:
        """The gold answer in comparable form, or None if it cannot be parsed."""
        return gold

    def compare(self, answer: str, gold: Any) -> tuple[bool, str]:
        """(equal?, reason)."""
        raise NotImplementedError

    comparison = ""
    """The comparison's implementation (for `implementation`)."""

    def implementation(self) -> dict[str, str]:
        """Our answer extraction (extract.py, whatever the policy) and this class's comparison."""
        return {"extraction": "posttrain.rewards.extract", "comparison": self.comparison}

    def describe(self) -> dict[str, Any]:
        """Settings for the run card."""
        return {"verifier": self.name, "extraction": self.extraction or AUTO}


def normalize_text(text: str) -> str:
    """For exact match: surrounding `$`, `\\text{}`, whitespace runs and a final period are ignored."""
    text = re.sub(r"\\text\{([^{}]*)\}", r"\1", text)
    return re.sub(r"\s+", " ", text).strip().strip("$").strip().rstrip(".").strip()


class ExactVerifier(_AnswerVerifier):
    """The extracted answer equals the gold answer after `normalize_text` (case-sensitive)."""

    name = "exact"
    comparison = "normalised string equality (answers.normalize_text)"

    def compare(self, answer: str, gold: str) -> tuple[bool, str]:
        """String equality after normalisation."""
        equal = normalize_text(answer) == normalize_text(gold)
        return equal, "exact match" if equal else "different answer"


_NUMERIC = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][-+]?\d+)?|-?\.\d+(?:[eE][-+]?\d+)?")


def parse_number(text: str) -> Fraction | None:
    """An exact rational from `12`, `-3.5`, `1,234`, `2e3`, `3/4`, `\\frac{3}{4}`; else None.

    >>> parse_number(r"\\frac{3}{4}"), parse_number("1,234"), parse_number("nan")
    (Fraction(3, 4), Fraction(1234, 1), None)
    """
    text = normalize_text(text).replace(" ", "")
    fraction = re.fullmatch(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}", text) or re.fullmatch(r"([^/]+)/([^/]+)", text)
    if fraction:
        top, bottom = parse_number(fraction.group(1)), parse_number(fraction.group(2))
        return top / bottom if top is not None and bottom else None
    if not _NUMERIC.fullmatch(text) or len(text) > 100:
        return None
    return Fraction(text.replace(",", ""))


class NumericVerifier(_AnswerVerifier):
    """The extracted number equals the gold number within `rel_tol` / `abs_tol`."""

    name = "numeric"
    comparison = "exact rationals then a tolerance (answers.parse_number)"

    def __init__(self, extraction: str | None = None, rel_tol: float = 1e-9, abs_tol: float = 1e-9):
        super().__init__(extraction)
        self.rel_tol, self.abs_tol = rel_tol, abs_tol

    def parse_gold(self, gold: str) -> Fraction | None:
        """Gold must be a number."""
        return parse_number(gold)

    def compare(self, answer: str, gold: Fraction) -> tuple[bool, str]:
        """Exact rationals, then a tolerance (no NaN or infinity can parse)."""
        value = parse_number(answer)
        if value is None:
            return False, "answer is not a number"
        equal = value == gold or math.isclose(float(value), float(gold), rel_tol=self.rel_tol,
                                              abs_tol=self.abs_tol)
        return equal, "numbers match" if equal else "different number"

    def describe(self) -> dict[str, Any]:
        """Settings for the run card."""
        return {**super().describe(), "rel_tol": self.rel_tol, "abs_tol": self.abs_tol}


_CHOICE = re.compile(r"(?:(?:option|answer|choice)\s*:?\s*)?\(?([A-Za-z])\)?(?:[.:)]\s.*|[.:)])?", re.IGNORECASE | re.DOTALL)


def choice_letter(text: str) -> str | None:
    """The option letter an answer names, upper-cased, or None: `B`, `(b)`, `B.`, `B)`,
    `B: Paris`, `Option B`, `\\text{(B)}` -> `B`; `A cat`, `AB`, `42` -> None."""
    match = _CHOICE.fullmatch(normalize_text(text))
    return match.group(1).upper() if match else None


class ChoiceVerifier(_AnswerVerifier):
    """Multiple choice: the extracted answer names the gold option letter (`choice_letter`, case
    ignored, `(B)` / `B.` / `B: text` accepted); naming two options is a hedge and scores 0."""

    name = "choice"
    comparison = "option letter (answers.choice_letter)"

    def parse_gold(self, gold: str) -> str | None:
        """Gold must be one letter (`B`, `(B)`)."""
        return choice_letter(gold)

    def compare(self, answer: str, gold: str) -> tuple[bool, str]:
        """Letter equality."""
        letter = choice_letter(answer)
        if letter is None:
            return False, "answer names no option letter"
        return letter == gold, "same option" if letter == gold else f"option {letter}, not {gold}"


class MathVerifier(_AnswerVerifier):
    """math-verify equivalence (`1/2` == `\\frac{1}{2}` == `0.5`), in a worker process."""

    name = "math"
    comparison = "math_verify.verify"
    in_worker = True
    timeout_s = 8.0
    inner_timeout_s = 2  # math-verify's own (SIGALRM) parse / compare timeouts, each

    def parse_gold(self, gold: str) -> Any:
        """Parse with math-verify; [] (unparseable) means data_error."""
        from math_verify import parse

        parsed = parse(_as_latex(gold), parsing_timeout=self.inner_timeout_s)
        # math-verify falls back to the raw string when nothing parses: that is not a gold answer
        return parsed if any(not isinstance(item, str) for item in parsed) else None

    def compare(self, answer: str, gold: Any) -> tuple[bool, str]:
        """math_verify.verify(gold, answer)."""
        from math_verify import parse, verify

        parsed = parse(_as_latex(answer), parsing_timeout=self.inner_timeout_s)
        if not any(not isinstance(item, str) for item in parsed):
            return False, "answer cannot be parsed"
        equal = verify(gold, parsed, timeout_seconds=self.inner_timeout_s)
        return bool(equal), "equivalent" if equal else "not equivalent"

    def on_worker_failure(self, error: Exception) -> Verdict:
        """A missed deadline is the candidate's doing (an answer too costly to evaluate)."""
        if isinstance(error, WorkerGone) and error.timed_out:
            return Verdict.ok(0.0, f"answer too costly to verify (over {self.timeout_s:g} s)")
        return super().on_worker_failure(error)


def _as_latex(answer: str) -> str:
    return answer if "$" in answer else f"${answer}$"
