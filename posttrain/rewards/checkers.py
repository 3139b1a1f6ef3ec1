"""Held-out checkers written apart from the training rewards, so that acceptance does not inherit a
reward's bugs (the seed: changing the problems while keeping the same flawed checking logic is not
independent). Nothing here imports `extract.py` or the answer verifiers: each checker reads the
completion with its own parser and compares with its own rule.

    integer   the completion's final answer, its `<answer>` elements (read by the standard library's
              HTML parser, not a regular expression) and `\\boxed{}` contents (braces counted here),
              all one text, holds exactly an integer (`int()` of the stripped text, so a hedge, a
              list or any extra word fails) equal to the gold integer
    letter    the same final answer, which must name one option letter (`B`, `(b)`, `B. text`,
              `Option B`; read character by character, not by the `choice` reward's regular
              expression), equal to the gold letter
    text_match the same final answer equal to the gold text after Unicode NFKC, case folding and
              whitespace runs collapsed (the `exact` reward is case-sensitive and strips `$`,
              `\\text{}` and a final period with regular expressions)
    math_equal the same final answer, normalised (`math_normal_form`) and equal as text, or read by
              our own small LaTeX reader into sympy and equal by `simplify(a - b) == 0` (the `math`
              reward is math-verify's parser and `verify`)
    rg_answer a reasoning-gym answer equal to the entry's stored answer (folded text or the same
              decimal), where the dataset's own scorer is that same rule (the `rg` reward calls
              reasoning-gym's scorer on `extract.py`'s answer)

"The final answer" is read under an extraction policy of the same names as the rewards' (`POLICIES`,
each read here by its own code): `boxed_or_tags` (the default: <answer> elements and `\\boxed{}`
contents together), `boxed`, `tags`, `hashes` (the text after each `####` to the end of its line,
GSM8K's final answer), `marked` (all three together), `last_number`. A checker built without one
takes each row's own (`answer_extraction`: a data file's rows carry their gold format's convention).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from html.parser import HTMLParser
from typing import Any

from posttrain.rewards.base import Verifier
from posttrain.rewards.latex import LatexReader, bracketed_items, math_normal_form
from posttrain.rewards.pool import WorkerGone
from posttrain.rewards.verdict import Verdict

MAX_ANSWER_CHARS = 200
"""Longer answer elements are not an integer answer (and never reach `int()`, whose cost grows)."""


class _AnswerElements(HTMLParser):
    """The text of every top-level <answer> element of a completion, and whether one is unclosed."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.answers: list[str] = []
        self._depth, self._text = 0, []

    def handle_starttag(self, tag, attrs):
        if tag == "answer":
            self._depth += 1
            if self._depth == 1:
                self._text = []

    def handle_endtag(self, tag):
        if tag == "answer" and self._depth:
            self._depth -= 1
            if self._depth == 0:
                self.answers.append("".join(self._text))

    def handle_data(self, data):
        if self._depth:
            self._text.append(data)

    @property
    def unclosed(self) -> bool:
        return self._depth > 0


def answer_elements(completion: str) -> tuple[list[str], bool]:
    """(the texts of the completion's <answer> elements, whether one is left unclosed)."""
    parser = _AnswerElements()
    parser.feed(completion)
    parser.close()
    return parser.answers, parser.unclosed


def boxed_contents(completion: str) -> list[str]:
    """The contents of every `\\boxed{...}` of a completion, read by counting braces (a box left
    open reads as its text to the end)."""
    contents, start = [], completion.find("\\boxed{")
    while start >= 0:
        depth, index = 1, start + len("\\boxed{")
        begin = index
        while index < len(completion) and depth:
            depth += 1 if completion[index] == "{" else -1 if completion[index] == "}" else 0
            index += 1
        contents.append(completion[begin:index - 1] if depth == 0 else completion[begin:])
        start = completion.find("\\boxed{", index)
    return contents


def _integer(text: str) -> int | None:
    """`int(text)` for an optional sign and ASCII digits only (no spaces inside, `_`, `1e3`, `٤`)."""
    text = text.strip()
    digits = text[1:] if text[:1] in ("+", "-") else text
    if not digits or len(text) > MAX_ANSWER_CHARS or not (digits.isascii() and digits.isdigit()):
        return None
    return int(text)


POLICIES = ("boxed_or_tags", "boxed", "tags", "hashes", "marked", "last_number")
"""The extraction policies, by the rewards' names (`extract.POLICIES`; a test keeps them equal)."""
DEFAULT_POLICY = "boxed_or_tags"
ROW_POLICY = "answer_extraction"
"""The row field naming a row's own policy (`extract.ROW_POLICY`)."""
_MARKS = {"boxed_or_tags": ("tags", "boxed"), "boxed": ("boxed",), "tags": ("tags",), "hashes": ("hashes",),
          "marked": ("tags", "boxed", "hashes")}
_WHAT = {"boxed_or_tags": "no <answer> element or \\boxed{}", "boxed": "no \\boxed{}", "tags": "no <answer> element",
         "hashes": "no '#### N' final answer", "marked": "no '#### N', <answer> element or \\boxed{}"}


def _without_thousands(text: str) -> str:
    """`1,234,567` as `1234567` (every comma followed by three digits); other text unchanged."""
    groups = text.split(",")
    if len(groups) > 1 and all(len(group) == 3 and group.isdigit() for group in groups[1:]):
        return "".join(groups)
    return text


def _digit(char: str) -> bool:
    return char.isascii() and char.isdigit()


def _plain_number(text: str) -> bool:
    """An optional `-`, ASCII digits and at most one `.` between digits: `12`, `-3.5`; not `1e3`, `.5`, `3 apples`."""
    whole, _, fraction = (text[1:] if text.startswith("-") else text).partition(".")
    return all(_digit(char) for char in whole + fraction) and bool(whole) and (bool(fraction) or "." not in text)


def hash_answers(completion: str) -> list[str]:
    """The text after the first `####` of every line that has one, to the end of that line:
    stripped, `$` signs, a final period and thousands commas dropped (how GSM8K writes its gold).
    `final_answer` takes them only when each is a plain number."""
    answers = []
    for line in completion.splitlines():
        start = line.find("####")
        if start >= 0:
            answer = line[start + 4:].replace("$", "").strip()
            answers.append(_without_thousands(answer[:-1].strip() if answer.endswith(".") else answer))
    return answers


def last_number(completion: str) -> str | None:
    """The last number of the text, read character by character: the last run of ASCII digits with
    `,` or `.` between digits, a `-` just before it kept; of a run that is not one number (`3,4`,
    `1.2.3`) its last part (`4`, `3`); thousands commas dropped (`1,234` -> `1234`)."""
    end = len(completion)
    while end and not _digit(completion[end - 1]):
        end -= 1
    if not end:
        return None
    start = end - 1
    while start and (_digit(completion[start - 1]) or (completion[start - 1] in ",." and start > 1 and _digit(completion[start - 2]))):
        start -= 1
    run = completion[start:end]
    whole, point, fraction = (run.rsplit(".", 1)[1] if run.count(".") > 1 else run).partition(".")
    if "," in fraction:
        whole, point, fraction = fraction.rsplit(",", 1)[1], "", ""
    whole = _without_thousands(whole).rsplit(",", 1)[-1]
    number = whole + point + fraction
    at_start = run.replace(",", "") == number  # the number is the whole run: a `-` before it is its sign
    return ("-" if at_start and start and completion[start - 1] == "-" else "") + number


def final_answer(completion: str, policy: str = DEFAULT_POLICY) -> tuple[str | None, str]:
    """The completion's one final answer under `policy` (`POLICIES`), or None and why not: every
    answer the policy's marks give (<answer> elements, \\boxed{} contents, `hash_answers`),
    stripped, must be the same text; `last_number` takes the text's last number."""
    if policy == "last_number":
        number = last_number(completion)
        return (number, "") if number is not None else (None, "no number")
    marks = _MARKS[policy]
    answers: list[str] = []
    if "tags" in marks:
        elements, unclosed = answer_elements(completion)
        if unclosed:
            return None, "an <answer> element is not closed"
        answers += elements
    if "boxed" in marks:
        answers += boxed_contents(completion)
    if "hashes" in marks:
        hashed = hash_answers(completion)
        wrong = next((answer for answer in hashed if not _plain_number(answer)), None)
        if wrong is not None:
            return None, f"'####' followed by {wrong[:40]!r}, not a number"
        answers += hashed
    distinct = sorted({answer.strip() for answer in answers})
    if not distinct:
        return None, _WHAT[policy]
    if len(distinct) > 1:
        return None, f"{len(distinct)} different answers"
    return distinct[0], ""


def _letter(text: str) -> str | None:
    """The option letter an answer names, read character by character: an optional `option` /
    `answer` / `choice` word (and `:`), then `B` or `(B)` (ASCII, case ignored), then nothing, or
    `.` `)` `:` and any text (`B. Paris`). `B`, `(b) Paris`, `Option B` -> `B`; `A cat`, `AB` -> None."""
    text = text.strip()
    for word in ("option", "answer", "choice"):
        if text.lower().startswith(word) and len(text) > len(word) and not text[len(word)].isalpha():
            text = text[len(word):].lstrip(" :")
            break
    if text[:1] == "(":
        if len(text) < 3 or text[2] != ")" or (len(text) > 3 and not text[3].isspace()):
            return None
        letter = text[1]
    else:
        letter = text[:1]
        rest = text[1:]
        if rest and rest[0] not in ".):":
            return None
    return letter.upper() if letter.isascii() and letter.isalpha() else None


EXTRACTION = ("html.parser <answer> elements, counted-brace \\boxed{}, line-read '####' and a character-scanned last number "
              "(posttrain.rewards.checkers)")
"""How every checker here reads the final answer (`final_answer`), for `implementation()`."""


class _FinalAnswerChecker(Verifier):
    """The checkers' one shape: parse the gold (data_error if it does not parse), read the
    completion's `final_answer` under the checker's extraction policy, else the row's own (0 with
    the reason if there is none), parse it (0 if it does not parse), compare. Subclasses give
    `parse_gold`, `parse_answer`, `compare` and `comparison`."""

    comparison = ""
    """The comparison's implementation (for `implementation`)."""

    def __init__(self, extraction: str | None = None):
        if extraction is not None and extraction not in POLICIES:
            raise ValueError(f"unknown extraction policy {extraction!r}; choose from {', '.join(POLICIES)}")
        self.extraction = extraction
        """One of `POLICIES`, or None: each row's own (`ROW_POLICY`), else `DEFAULT_POLICY`."""

    def parse_gold(self, gold: Any) -> tuple[Any, str]:
        """(the gold in comparable form, or None and why it cannot be used)."""
        raise NotImplementedError

    def parse_answer(self, answer: str) -> tuple[Any, str]:
        """(the final answer in comparable form, or None and why it scores 0)."""
        return answer, ""

    def compare(self, value: Any, gold: Any) -> tuple[bool, str]:
        """(equal?, reason)."""
        raise NotImplementedError

    def score(self, completion: str, example: Mapping) -> Verdict:
        gold, problem = self.parse_gold(example.get("answer"))
        if gold is None:
            return Verdict.data_error(problem)
        policy = self.extraction or example.get(ROW_POLICY) or DEFAULT_POLICY
        if policy not in POLICIES:
            return Verdict.data_error(f"field {ROW_POLICY!r}: unknown extraction policy {policy!r} (known: {', '.join(POLICIES)})")
        answer, why = final_answer(completion, policy)
        if answer is None:
            return Verdict.ok(0.0, why, extraction=policy, extracted=None)
        details = {"extraction": policy, "extracted": answer[:MAX_ANSWER_CHARS]}
        value, problem = self.parse_answer(answer)
        if value is None:
            return Verdict.ok(0.0, problem, **details)
        equal, reason = self.compare(value, gold)
        return Verdict.ok(1.0 if equal else 0.0, reason, **details)

    def implementation(self) -> dict[str, str]:
        """How it reads and compares (for the run card's independence check)."""
        return {"extraction": EXTRACTION, "comparison": self.comparison}

    def describe(self) -> dict[str, Any]:
        """Settings for the run card (`extraction`: the policy, or `auto`: each row's own)."""
        return {"verifier": self.name, "extraction": self.extraction or "auto", "implementation": self.implementation()}


class IntegerChecker(_FinalAnswerChecker):
    """Exact integer answers, read apart from the training rewards (see the module docstring).

    Row: {"completion", "answer": an integer (or its decimal string)}. An empty or non-integer gold
    is data_error; no answer, two different ones, an unclosed element, or a non-integer answer
    scores 0 with the reason.
    """

    name = "integer"
    comparison = "int() equality"

    def parse_gold(self, gold: Any) -> tuple[int | None, str]:
        value = None if isinstance(gold, bool) else (gold if isinstance(gold, int) else _integer(str(gold or "")))
        return value, f"gold answer {str(gold)[:60]!r} is not an integer"

    def parse_answer(self, answer: str) -> tuple[int | None, str]:
        return _integer(answer), f"answer {answer[:40]!r} is not an integer"

    def compare(self, value: int, gold: int) -> tuple[bool, str]:
        return value == gold, "same integer" if value == gold else "different integer"


class LetterChecker(_FinalAnswerChecker):
    """Multiple-choice answers, read apart from the `choice` reward (see the module docstring).

    Row: {"completion", "answer": one option letter, `B` or `(B)`}. Another gold is data_error.
    Two different final answers (`\\boxed{A} \\boxed{B}`), a hedge (`A or B`, `A, B`) or option
    text without its letter score 0.
    """

    name = "letter"
    comparison = "option letter read character by character (checkers._letter)"

    def parse_gold(self, gold: Any) -> tuple[str | None, str]:
        return _letter(str(gold or "")), f"gold answer {str(gold)[:60]!r} is not one option letter"

    def parse_answer(self, answer: str) -> tuple[str | None, str]:
        return _letter(answer), f"answer {answer[:40]!r} is not one option letter"

    def compare(self, value: str, gold: str) -> tuple[bool, str]:
        return value == gold, "same option" if value == gold else f"option {value}, not {gold}"


def _folded(text: str) -> str:
    """NFKC, case-folded, whitespace runs as one space, stripped."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


class TextMatchChecker(_FinalAnswerChecker):
    """Free-text answers, read apart from the `exact` reward (see the module docstring).

    Row: {"completion", "answer": the gold text}. An empty gold is data_error.
    """

    name = "text_match"
    comparison = "NFKC case-folded text (checkers._folded)"

    def parse_gold(self, gold: Any) -> tuple[str | None, str]:
        usable = not isinstance(gold, bool) and isinstance(gold, (str, int, float)) and _folded(str(gold))
        return (_folded(str(gold)) if usable else None), "field 'answer' (the gold text) is missing or empty"

    def compare(self, value: str, gold: str) -> tuple[bool, str]:
        equal = _folded(value) == gold
        return equal, "same text" if equal else "different text"


class MathChecker(_FinalAnswerChecker):
    """Math answers (numbers, fractions, roots, expressions, tuples, intervals), read apart from
    the `math` reward: the final answer as `final_answer` reads it, normalised by
    `math_normal_form`, then equal as text, or read by our own LaTeX reader (`latex.LatexReader`, no
    math-verify) and equal by `sympy.simplify(a - b) == 0`, item by item for tuples and intervals
    (same brackets). A hedge (`41 or 42`), two answers, or anything the reader cannot read scores 0.
    Runs in a worker (sympy on `9^{9^{9^9}}` ignores signals): a missed deadline scores 0.

    Row: {"completion", "answer": the gold (number or LaTeX)}. An empty gold, or one the reader
    cannot read (a whole GSM8K solution, `#### 33`), is data_error: no answer could equal it.
    """

    name = "math_equal"
    comparison = "posttrain.rewards.latex reader + sympy.simplify(a - b) == 0"
    in_worker = True
    timeout_s = 8.0

    def parse_gold(self, gold: Any) -> tuple[str | None, str]:
        usable = not isinstance(gold, bool) and isinstance(gold, (str, int, float)) and str(gold).strip()
        if not usable:
            return None, "field 'answer' (the gold answer) is missing or empty"
        normal = math_normal_form(str(gold))
        try:
            for item in bracketed_items(normal)[1]:
                LatexReader(item).read()
        except (ValueError, ZeroDivisionError, TypeError) as error:
            return None, f"gold answer {str(gold)[:60]!r} cannot be read as math ({str(error)[:60]})"
        return normal, ""

    def parse_answer(self, answer: str) -> tuple[str | None, str]:
        if len(answer) > MAX_ANSWER_CHARS:
            return None, f"answer longer than {MAX_ANSWER_CHARS} characters"
        return math_normal_form(answer), ""

    def compare(self, value: str, gold: str) -> tuple[bool, str]:
        if value == gold:
            return True, "same answer"
        (brackets, items), (gold_brackets, gold_items) = bracketed_items(value), bracketed_items(gold)
        if brackets != gold_brackets or len(items) != len(gold_items):
            return False, "different shape (count of items or brackets)"
        import sympy

        for item, gold_item in zip(items, gold_items):
            try:
                left, right = LatexReader(item).read(), LatexReader(gold_item).read()
            except (ValueError, ZeroDivisionError, TypeError) as error:
                return False, f"cannot read as math: {error}"[:120]
            difference = sympy.simplify(left - right)
            if difference != 0:
                return False, "not equal"
        return True, "equal by sympy"

    def on_worker_failure(self, error: Exception) -> Verdict:
        """A missed deadline is the candidate's doing (an answer too costly to evaluate)."""
        if isinstance(error, WorkerGone) and error.timed_out:
            return Verdict.ok(0.0, f"answer too costly to check (over {self.timeout_s:g} s)")
        return super().on_worker_failure(error)


def _decimal(text: str):
    """The exact value of a plain decimal number (`-3`, `2.50`), else None."""
    from fractions import Fraction

    body = text[1:] if text[:1] in "+-" else text
    whole, _, part = body.partition(".")
    if not body or not (whole + part).isascii() or not (whole + part).isdigit() or len(body) > MAX_ANSWER_CHARS:
        return None
    return Fraction(text)


class StoredAnswerChecker(TextMatchChecker):
    """reasoning-gym answers checked against the entry's stored answer, apart from reasoning-gym's
    scorer and our extraction: the final answer equal to the stored one as `text_match` compares
    text, or as the same decimal number (`2.50` = `2.5`). Right only for datasets whose own
    scorer is "equal to the stored answer" (`posttrain.rewards.gym.scores_stored_answer`); the
    default checker of the others stays the dataset's scorer.

    Row: {"completion", "answer": the entry's answer}.
    """

    name = "rg_answer"
    comparison = "stored answer: NFKC case-folded text or the same decimal (checkers.StoredAnswerChecker)"

    def compare(self, value: str, gold: str) -> tuple[bool, str]:
        left, right = _decimal(_folded(value)), _decimal(gold)
        if left is not None and right is not None:
            return left == right, "same number" if left == right else "different number"
        return super().compare(value, gold)
