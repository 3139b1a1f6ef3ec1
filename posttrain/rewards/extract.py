"""Answer extraction: one explicit, recorded policy per verifier (see docs/rewards.md).

Policies (the name is recorded in every verdict's details as `extraction`):

| policy          | takes                                               | several different answers |
|-----------------|-----------------------------------------------------|---------------------------|
| `boxed`         | the contents of every `\\boxed{...}` / `\\fbox{...}`  | score 0                   |
| `tags`          | the contents of every `<answer>...</answer>`        | score 0                   |
| `boxed_or_tags` | `boxed` if any box, else `tags` (the default)       | score 0                   |
| `hashes`        | the number after every `####` (GSM8K's final line), | score 0                   |
|                 | to the end of its line: `$`, thousands commas and a |                           |
|                 | final `.` dropped, anything else there scores 0     |                           |
| `marked`        | every `hashes`, `boxed` and `tags` answer together  | score 0                   |
|                 | (GSM8K files' default, `data.prompts.CONVENTIONS`)  |                           |
| `last_number`   | the last number in the text (opt-in, lenient)       | n/a                       |

There is no silent fallback from a policy to "last number in the text": an answer that only
appears in the reasoning scores 0. The same answer boxed twice is one answer. A verifier built
without a policy (`extraction=None`, `AUTO`) takes each row's own: `answer_extraction`, which a data
file's rows carry from their gold format's convention (`#### N` for GSM8K), else `DEFAULT_POLICY`.
"""

from __future__ import annotations

import dataclasses
import re

POLICIES = ("boxed_or_tags", "boxed", "tags", "hashes", "marked", "last_number")
DEFAULT_POLICY = "boxed_or_tags"
ABOUT = {"boxed_or_tags": "\\boxed{} if any, else <answer>", "boxed": "\\boxed{}", "tags": "<answer>",
         "hashes": "'#### N' (GSM8K's final line)", "marked": "'#### N', \\boxed{} or <answer>",
         "last_number": "the last number in the text (lenient)"}
"""Each policy in a few words, for `posttrain data check` and the warnings."""
ROW_POLICY = "answer_extraction"
"""The row field (a data file's rows carry it: `data.prompts.CONVENTIONS`) naming the policy of a
verifier built without one."""
AUTO = "auto"
"""What `describe()` records for a verifier built without a policy: each row's `ROW_POLICY`, else
`DEFAULT_POLICY` (the policy a verdict used is in its details)."""
MAX_ANSWER_CHARS = 500  # longer "answers" are not answers; also bounds the cost of parsing them

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_HEDGES = (
    (re.compile(r"\bor\b|\\lor\b|\\vee\b", re.IGNORECASE), "'or' in the answer"),
    (re.compile(r"\beither\b|\bmaybe\b|\bpossibly\b|\bperhaps\b|\bnot sure\b", re.IGNORECASE),
     "a hedge word in the answer"),
    (re.compile(r"\\pm|\\mp|±"), "a ± in the answer"),
    (re.compile(r"[,;]"), "a list where the gold answer is one value"),
)


@dataclasses.dataclass
class Extraction:
    """`answer` is None when nothing usable was found; `reason` says why."""

    answer: str | None
    reason: str
    policy: str


def _boxed(text: str) -> list[str]:
    """Contents of each \\boxed{...}, with nested braces matched."""
    answers = []
    for match in _BOX_OPEN.finditer(text):
        depth, start = 1, match.end()
        for index in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[index], 0)
            if depth == 0:
                answers.append(text[start:index])
                break
    return answers


def _normalize(answer: str) -> str:
    answer = re.sub(r"\s+", " ", answer).strip()
    return answer.strip("$").strip().rstrip(".").strip()


def _one(candidates: list[str], what: str, policy: str) -> Extraction:
    distinct = list(dict.fromkeys(_normalize(c) for c in candidates))
    if not distinct:
        return Extraction(None, f"no {what}", policy)
    if len(distinct) > 1:
        return Extraction(None, f"{len(distinct)} different final answers", policy)
    if not distinct[0]:
        return Extraction(None, f"empty {what}", policy)
    if len(distinct[0]) > MAX_ANSWER_CHARS:
        return Extraction(None, f"answer longer than {MAX_ANSWER_CHARS} characters", policy)
    return Extraction(distinct[0], "", policy)


def _hashes(text: str) -> tuple[list[str], str]:
    """(the number after each `####`, to the end of its line, with `$`, thousands commas and a
    final `.` dropped; why not, when one of them is not a number)."""
    numbers = []
    for found in _HASHES.findall(text):
        number = found.strip().replace("$", "").rstrip(".").strip()
        if not _NUMBER.fullmatch(number):
            return [], f"'####' followed by {found.strip()[:40]!r}, not a number"
        numbers.append(number.replace(",", ""))
    return numbers, ""


def extract_answer(text: str, policy: str = DEFAULT_POLICY) -> Extraction:
    """Extract the final answer of `text` under `policy` (one of POLICIES).

    >>> extract_answer(r"so \\boxed{\\frac{1}{2}}.").answer
    '\\\\frac{1}{2}'
    >>> extract_answer(r"\\boxed{3} or maybe \\boxed{4}").reason
    '2 different final answers'
    >>> extract_answer("3 + 4 = 7\\n#### 7", "hashes").answer, extract_answer("#### 7 apples", "marked").reason
    ('7', "'####' followed by '7 apples', not a number")
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown extraction policy {policy!r}; choose from {POLICIES}")
    if policy == "last_number":
        numbers = _NUMBER.findall(text)
        return Extraction(numbers[-1].replace(",", "") if numbers else None,
                          "" if numbers else "no number", policy)
    if policy in ("hashes", "marked"):
        numbers, problem = _hashes(text)
        if problem:
            return Extraction(None, problem, policy)
        if policy == "hashes":
            return _one(numbers, "'#### N' final answer", policy)
        return _one(numbers + _boxed(text) + _TAG.findall(text), "'#### N', \\boxed{} or <answer>", policy)
    boxes = _boxed(text) if policy in ("boxed", "boxed_or_tags") else []
    if boxes or policy == "boxed":
        return _one(boxes, "\\boxed{} answer", policy)
    return _one(_TAG.findall(text), "<answer> tag" if policy == "tags" else "\\boxed{} or <answer>", policy)


def check_policy(policy: str | None) -> str | None:
    """`policy` if it is one of POLICIES or None (`AUTO`: each row's); else ValueError."""
    if policy is not None and policy not in POLICIES:
        raise ValueError(f"unknown extraction policy {policy!r}; choose from {', '.join(POLICIES)}")
    return policy


def row_policy(policy: str | None, example) -> tuple[str | None, str]:
    """(the policy to read `example`'s completion with, or None and why the row's own is unusable):
    `policy` when a verifier was built with one, else the row's `ROW_POLICY`, else `DEFAULT_POLICY`."""
    if policy is not None:
        return policy, ""
    own = example.get(ROW_POLICY) or DEFAULT_POLICY
    if own not in POLICIES:
        return None, f"field {ROW_POLICY!r}: unknown extraction policy {own!r} (known: {', '.join(POLICIES)})"
    return own, ""


def hedge(answer: str, gold: str) -> str | None:
    """Why `answer` hedges between several values, or None. A pattern the gold answer itself
    contains (a list, a ±) is allowed."""
    answer = re.sub(r"(?<=\d),(?=\d{3}\b)", "", answer)  # 1,234 is one number
    for pattern, reason in _HEDGES:
        if pattern.search(answer) and not pattern.search(gold):
            return reason
    return None
