"""Validation of data files: every bad row reported as `FILE:LINE: field: reason`.

A loader reads the whole file, collects every problem in a `ValidationReport`, and only then decides:
strict (the default) stops with the report's first rows, how many more and a hint at the layout
the rows need; `strict=False` drops the bad rows, logs how many, and keeps their count and their
reasons, counted by kind (`ValidationReport.reasons`), for the run card's data link. Nothing here trains or tokenises on behalf of the caller except the optional prompt-length
check, which needs the model's tokenizer.
"""

from __future__ import annotations

import keyword
import logging
import re
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from posttrain.errors import UserError

logger = logging.getLogger(__name__)

MAX_REPORTED_ROWS = 5
"""A UserError lists this many problems, then how many more (`posttrain data check` lists them all)."""
CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class BadRow:
    """One problem in one row."""

    source: str
    line: int
    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.field}: {self.reason}"


@dataclass
class ValidationReport:
    """Rows read from one source and every problem found in them."""

    source: str
    rows_read: int = 0
    problems: list[BadRow] = field(default_factory=list)
    hint: str | None = None
    """What the rows' layout needs (`data.files.layout_hint`), set by the reader when a row lacked one of our fields."""

    def add(self, line: int, field_name: str, reason: str) -> None:
        self.problems.append(BadRow(self.source, line, field_name, reason))

    @property
    def bad_lines(self) -> set[int]:
        return {problem.line for problem in self.problems}

    @property
    def rows_bad(self) -> int:
        return len(self.bad_lines)

    def lines(self) -> list[str]:
        """`FILE:LINE: field: reason`, one per problem, in file order."""
        return [str(p) for p in sorted(self.problems, key=lambda p: p.line)]

    def summary(self) -> str:
        return f"{self.source}: {self.rows_read} rows read, {self.rows_bad} bad"

    def dropped(self, prefix: str = "") -> dict[str, Any]:
        """A run card's record of the bad rows (dropped when not strict): `{prefix}rows_bad` and
        `{prefix}rows_bad_reasons` (`reasons`)."""
        return {f"{prefix}rows_bad": self.rows_bad, f"{prefix}rows_bad_reasons": self.reasons()}

    def reasons(self) -> dict[str, int]:
        """Bad rows per kind of problem (`reason_kind`), most common first: what `strict: false`
        dropped, for a run card. A row with two problems of one kind counts once for it."""
        counts = Counter(kind for _, kind in dict.fromkeys((problem.line, reason_kind(problem)) for problem in self.problems))
        return dict(counts.most_common())

    def enforce(self, strict: bool, setting: str | None = "data.strict") -> None:
        """strict: UserError listing the first MAX_REPORTED_ROWS problems, how many more, and the
        `hint`, if any row is bad; its advice names `setting` (None: the caller has none). Not
        strict: log and go on (the caller drops `bad_lines`)."""
        if not self.problems:
            return
        if strict:
            listed = self.lines()
            more = len(listed) - MAX_REPORTED_ROWS
            listed = listed[:MAX_REPORTED_ROWS] + ([f"... and {more} more (posttrain data check lists them all)"] if more > 0 else [])
            advice = f"fix them, or set {setting} false to drop bad rows" if setting else "fix them"
            raise UserError(f"{self.summary()} ({advice}):\n" + "\n".join(listed + ([self.hint] if self.hint else [])))
        logger.warning("%s; dropping the bad rows (%s false)", self.summary(), setting or "strict")
        for line in self.lines():
            logger.debug("%s", line)


def reason_kind(problem: BadRow) -> str:
    """`field: reason` without the row's own values, so that problems of one kind count together:
    list indices, quoted values, numbers (not a setting's `=N`) and a parenthesised tail left out.
    "prompt: 1059 tokens, longer than max_prompt_tokens=1024" -> "prompt: N tokens, longer than
    max_prompt_tokens=1024"; "answer: unparseable gold answer 'x': not a number" -> "answer:
    unparseable gold answer ...: not a number"."""
    reason = re.sub(r"'[^']*'|\"[^\"]*\"", "...", problem.reason.split(" (")[0])
    reason = re.sub(r"(?<![=\d])\d+", "N", reason)
    field_name = re.sub(r"\[\d+\]", "[i]", problem.field)
    return f"{field_name}: {reason}"


def type_name(value) -> str:
    """JSON's name for a Python value's type (`string`, `number`, `list`, ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}.get(type(value), type(value).__name__)


def check_text(report: ValidationReport, line: int, name: str, value) -> bool:
    """A required non-empty string field; reports and returns False otherwise."""
    if not isinstance(value, str):
        report.add(line, name, f"wrong type: expected a string, got {type_name(value)}")
        return False
    if not value.strip():
        report.add(line, name, "empty or whitespace-only")
        return False
    return True


def check_messages(report: ValidationReport, line: int, name: str, value, *, roles=CHAT_ROLES) -> bool:
    """A non-empty list of `{"role", "content"}` objects with known roles and non-empty content."""
    if not isinstance(value, list):
        report.add(line, name, f"wrong type: expected a list of {{role, content}} messages, got {type_name(value)}")
        return False
    if not value:
        report.add(line, name, "empty message list")
        return False
    ok = True
    for index, message in enumerate(value):
        where = f"{name}[{index}]"
        if not isinstance(message, dict):
            report.add(line, where, f"wrong type: expected an object, got {type_name(message)}")
            ok = False
            continue
        if message.get("role") not in roles:
            report.add(line, f"{where}.role", f"expected one of {', '.join(roles)}, got {message.get('role')!r}")
            ok = False
        if message.get("tool_calls") is not None:
            ok = check_tool_calls(report, line, f"{where}.tool_calls", message["tool_calls"], message.get("role")) and ok
            if message.get("content") in (None, ""):
                continue  # a turn of tool calls only
        ok = check_text(report, line, f"{where}.content", message.get("content")) and ok
    return ok


def check_tool_calls(report: ValidationReport, line: int, name: str, value, role) -> bool:
    """An assistant message's `tool_calls` (the transformers / TRL chat format): a non-empty list of
    `{"type": "function", "function": {"name": str, "arguments": object or JSON object text}}`
    (the `function` level may be left out)."""
    import json

    if role != "assistant":
        report.add(line, name, f"only assistant messages make tool calls, this one is {role!r}")
        return False
    if not isinstance(value, list) or not value:
        report.add(line, name, f"wrong type: expected a non-empty list of calls, got {type_name(value)}")
        return False
    ok = True
    for index, call in enumerate(value):
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            report.add(line, f"{name}[{index}]", "expected {\"function\": {\"name\": ..., \"arguments\": {...}}}")
            ok = False
            continue
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as error:
                report.add(line, f"{name}[{index}].arguments", f"not JSON: {error}")
                ok = False
                continue
        if not isinstance(arguments, dict):
            report.add(line, f"{name}[{index}].arguments", f"wrong type: expected an object, got {type_name(arguments)}")
            ok = False
    return ok


ANSWER_FORMATS = ("math", "number", "text", "gsm8k", "boxed", "choice")
"""How a gold `answer` is written (see `check_answer`)."""


def check_answer(report: ValidationReport, line: int, value, answer_format: str) -> str | None:
    """The gold answer as a string, or None after reporting why it cannot be used.

    answer_format: `math` (math-verify must parse it, as the math verifier will), `number` (a
    decimal number, commas allowed), `text` (any non-empty string), `gsm8k` (the number after the
    last `####`: `parse_gsm8k_gold`), `boxed` (the last `\\boxed{...}` of a solution: `last_boxed`),
    `choice` (one option letter, `B` or `(B)`, stored upper-cased; a row's `choices` turns a 0-based
    index into its letter before this check).
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        report.add(line, "answer", f"wrong type: expected a string or number, got {type_name(value)}")
        return None
    answer = str(value)
    if not answer.strip():
        report.add(line, "answer", "empty or whitespace-only")
        return None
    if answer_format == "gsm8k":
        gold = parse_gsm8k_gold(answer)
        if gold is None:
            report.add(line, "answer", f"unparseable GSM8K gold: no number after '####' in {_tail(answer)!r}")
        return gold
    if answer_format == "boxed":
        gold = last_boxed(answer)
        if gold is None:
            report.add(line, "answer", f"unparseable MATH gold: no \\boxed{{...}} in {_tail(answer)!r}")
        return gold
    if answer_format == "choice":
        match = re.fullmatch(r"\(?([A-Za-z])\)?", answer.strip())
        if match is None:
            report.add(line, "answer", f"unparseable multiple-choice gold {answer!r}: not one option letter")
            return None
        return match.group(1).upper()
    if answer_format == "number" and not _is_number(answer):
        report.add(line, "answer", f"unparseable gold answer {answer!r}: not a number")
        return None
    if answer_format == "math" and not isinstance(value, (int, float)) and not _math_parses(answer):
        report.add(line, "answer", f"unparseable gold answer {answer!r}: math-verify finds no expression")
        return None
    return answer


def parse_gsm8k_gold(text: str) -> str | None:
    """GSM8K's gold: the text after the last `####`, with thousands commas, a `$` and a trailing
    `.` removed, as GSM8K graders do; None unless that is a number. `"... #### 1,234."` -> `"1234"`."""
    if "####" not in text:
        return None
    gold = text.rsplit("####", 1)[1].strip().replace(",", "").replace("$", "").rstrip(".").strip()
    return gold if _is_number(gold) else None


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced; None if
    there is none or it is empty. `"so \\boxed{\\frac{1}{2}}."` -> `"\\frac{1}{2}"`."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    index = text.index("{", start) + 1
    depth, begin = 1, index
    while index < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        index += 1
    content = text[begin:index - 1].strip() if depth == 0 else ""
    return content or None


def _tail(text: str, width: int = 60) -> str:
    return text if len(text) <= width else "..." + text[-width:]


def check_tests(report: ValidationReport, line: int, value) -> list[str] | None:
    """A non-empty list of non-empty test source strings (a single string counts as one test)."""
    tests = [value] if isinstance(value, str) else value
    if not isinstance(tests, list):
        report.add(line, "tests", f"wrong type: expected a list of strings, got {type_name(value)}")
        return None
    if not tests:
        report.add(line, "tests", "empty test list")
        return None
    ok = all([check_text(report, line, f"tests[{i}]", test) for i, test in enumerate(tests)])
    return tests if ok else None


def check_entry_point(report: ValidationReport, line: int, value) -> bool:
    if not isinstance(value, str):
        report.add(line, "entry_point", f"wrong type: expected a string, got {type_name(value)}")
        return False
    if not value.isidentifier() or keyword.iskeyword(value):
        report.add(line, "entry_point", f"{value!r} is not a Python identifier")
        return False
    return True


def check_prompt_length(report: ValidationReport, line: int, prompt, tokenizer, max_prompt_tokens, **render) -> bool:
    """Prompt tokens (after the chat template) must not exceed `max_prompt_tokens` (None: no limit)."""
    if tokenizer is None or max_prompt_tokens is None:
        return True
    from posttrain.data.tokenize import encode_prompt

    length = len(encode_prompt(tokenizer, prompt, **render))
    if length > max_prompt_tokens:
        report.add(line, "prompt", f"{length} tokens, longer than max_prompt_tokens={max_prompt_tokens}")
        return False
    return True


def _is_number(text: str) -> bool:
    try:
        float(text.replace(",", "").strip())
        return True
    except ValueError:
        return False


def _math_parses(text: str) -> bool:
    from math_verify import parse

    # math-verify's timeout uses SIGALRM, which only works in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    return bool(parse(text, parsing_timeout=timeout))
