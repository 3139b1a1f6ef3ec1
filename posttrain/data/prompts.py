"""Prompt files: one example per row, for online training and evaluation. JSONL (one object per
line), or any file `posttrain.data.files` reads (Parquet, CSV, JSON, Arrow, a `save_to_disk`
directory, a cached dataset name), with the user's columns mapped to ours (`columns`, `data_format`).

Schema (after the mapping; blank JSONL lines are skipped):

    prompt       string, the user's text                        } exactly one of the two
    messages     list of {"role", "content"} chat messages      } (a list `prompt`, TRL's
                                                                  conversational form, is messages)
    answer       string or number: the gold answer              } at least one of the two
    choices      optional list of option texts (multiple choice): shown after the prompt as
                 `A. ...` lines; a number `answer` is then a 0-based index into them
    tests        list of Python test sources (or one string)    }
    entry_point  optional string: the function the tests call
    id           optional string or number, unique in the file (default: "<file name>:<line>")
    metadata     optional object; any other field is kept in metadata too

A row with a gold answer also gets its gold format's answer convention (`CONVENTIONS`): the
instruction appended to its prompt that says where the final answer goes (GSM8K: `#### N`; MATH:
`\\boxed{}`; `task_options.instruction` replaces it, `""` turns it off) and the extraction policy
the reward and the checker read the completion with (`metadata.answer_extraction`, which
`reward_options.extraction` overrides).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from posttrain.data.examples import Example, Task, require_examples
from posttrain.data.files import FORMATS, RowTable, RowView, check_columns, contest_cases, map_row, resolve_columns
from posttrain.data.validation import (
    ANSWER_FORMATS,
    ValidationReport,
    check_answer,
    check_entry_point,
    check_messages,
    check_prompt_length,
    check_tests,
    check_text,
    type_name,
)
from posttrain.errors import UserError

KNOWN_FIELDS = {"prompt", "messages", "answer", "tests", "entry_point", "id", "metadata", "choices"}
REWARD_KINDS = {"math": "math", "gsm8k": "math", "boxed": "math", "number": "math", "text": "text", "choice": "choice"}
"""The task kind (and so the default training reward and held-out checker) of each gold format:
numbers and math expressions are compared by math-verify; free text exactly; option letters by
the `choice` verifier."""
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class AnswerConvention:
    """Where a gold format's completions put their final answer."""

    extraction: str
    """The extraction policy the reward and the checker read a completion with
    (`rewards.extract.POLICIES`); every row carries it as `metadata.answer_extraction`."""
    instruction: str | None = None
    """Appended to every prompt (after a blank line), saying where the answer goes; None: nothing."""


CONVENTIONS = {
    # No example number in it: a small model copies the example's number as its answer (docs/data.md).
    "gsm8k": AnswerConvention("marked", "Solve the problem step by step. Then write the final answer on the last line "
                                        "as '#### <number>'."),
    "boxed": AnswerConvention("boxed_or_tags", "Solve the problem step by step, and put the final answer in \\boxed{}."),
}
"""The answer convention of each gold format (`ANSWER_FORMATS`) with one: GSM8K's gold follows
`####`, so its completions may end `#### N` as well as box or tag it (`marked`); MATH's is boxed.
Any other gold format has `DEFAULT_CONVENTION`, and its prompts stay the file's own."""
DEFAULT_CONVENTION = AnswerConvention("boxed_or_tags")
INSTRUCTION_SETTING = "task_options.instruction"


def answer_convention(answer_format: str, instruction: str | bool | None = None) -> AnswerConvention:
    """The convention of `answer_format` (`CONVENTIONS`), its instruction replaced by
    `instruction` when that is given: a text, or `""` / false for none. Anything else is one
    UserError line.

    >>> answer_convention("gsm8k", "").instruction is None, answer_convention("number").extraction
    (True, 'boxed_or_tags')
    """
    convention = CONVENTIONS.get(answer_format, DEFAULT_CONVENTION)
    if instruction is None:
        return convention
    if instruction is not False and not isinstance(instruction, str):
        raise UserError(f"{INSTRUCTION_SETTING}: the text appended to every prompt ('' for none), got {type_name(instruction)}")
    return AnswerConvention(convention.extraction, (instruction or "").strip() or None)
SHOW_TESTS = {"first": "the task, then its first test: the function's name and one call, as the MBPP paper's prompt "
                       "(arXiv:2108.07732) shows its tests; the others stay unseen",
              "none": "the task text only"}
"""Which tests the prompt of an assert-list problem (MBPP's layout) shows (`task_options.show_tests`;
default: the data format's, `first` for `mbpp`, else `none`). The shown tests' indices go into the
example's metadata as `shown_tests`, so that a training reward that runs half of the tests runs
the shown ones *and* half of the others (`rewards.code`): shown tests are never the only ones
scored, except on a problem that has no other (its one test is then scored, and `posttrain audit
--data` / `data.exclude_weak_tests` find it: a lookup of the shown value passes it). `all` is
refused: every problem would be scored on what its prompt shows alone."""


def code_kind(examples, data_format: str | None) -> str | None:
    """The code layout of a task, which decides its default reward and checker: `stdio` (cases of
    stdin / stdout), `mbpp` (assert lines, the prompt in words), `code` (HumanEval's
    check(candidate) after a code prompt); None for answer tasks."""
    layout = _Layout()
    for example in examples:
        layout.see(example)
    return layout.kind(data_format)


class _Layout:
    """What `code_kind` needs to know of a task, gathered one example at a time."""

    def __init__(self):
        self.cases = self.tested = self.check = False

    def see(self, example: Example) -> None:
        self.cases = self.cases or "cases" in example.metadata
        if example.tests:
            self.tested = True
            self.check = self.check or any("def check(" in test for test in example.tests)

    def kind(self, data_format: str | None) -> str | None:
        if self.cases:
            return "stdio"
        if not self.tested:
            return None
        return "mbpp" if data_format == "mbpp" or not self.check else "code"


def convention_record(task: Task) -> dict:
    """How `task`'s answers are read and what its prompts say of it, as loading recorded them in
    its options (`answer_extraction`, `instruction`), for a run card or an eval summary; {} for a
    task without an answer convention (arithmetic, reasoning-gym, code)."""
    return {key: task.options[key] for key in ("answer_extraction", "instruction") if key in task.options}


def resolve_show_tests(show_tests: str | None, data_format: str | None, setting: str = "task_options.show_tests") -> str:
    """The tests an assert-list problem's prompt shows (`SHOW_TESTS`): explicit, else the named
    layout's, else `none`; an unknown value (or `all`) is one UserError line naming `setting`."""
    if show_tests is None:
        return (FORMATS.get(data_format) or {}).get("show_tests") or "none"
    if show_tests == "all":
        raise UserError(f"{setting} all: every test would be shown, so the shown tests would be the only ones "
                        "scored (a program returning the asserted values passes them); choose first or none")
    if show_tests not in SHOW_TESTS:
        raise UserError(f"{setting}: one of {', '.join(SHOW_TESTS)}, got {show_tests!r}")
    return show_tests


def resolve_answer_format(answer_format: str | None, data_format: str | None) -> str:
    """The declared gold format: explicit, else the named layout's, else `math`."""
    if answer_format is not None:
        if answer_format not in ANSWER_FORMATS:
            raise UserError(f"answer_format: unknown {answer_format!r} (choose from {', '.join(ANSWER_FORMATS)})")
        return answer_format
    return (FORMATS.get(data_format) or {}).get("answer_format") or "math"


def validate_prompt_file(
    path: str | Path,
    *,
    answer_format: str | None = None,
    data_format: str | None = None,
    columns: dict | None = None,
    source_split: str | None = None,
    tokenizer=None,
    max_prompt_tokens: int | None = None,
    system_prompt: str | None = None,
    use_chat_template: bool | None = None,
    show_tests: str | None = None,
    instruction: str | bool | None = None,
) -> tuple[list[tuple[int, Example]], ValidationReport]:
    """Read and check the whole file; returns `(row number, Example)` for every valid row and the
    report of every problem in the others.

    answer_format: how `answer` must parse (`math`, `number`, `text`, `gsm8k`, `boxed`; see
    `check_answer`); None: the format's (gsm8k: gsm8k, math: boxed), else `math`.
    data_format, columns: a named public layout and/or an explicit mapping of our column names to
    the file's (`posttrain.data.files`); a mapped column the file lacks is a UserError.
    source_split: the split of a saved or cached dataset with several.
    show_tests: which tests an assert-list problem's prompt shows (`SHOW_TESTS`; None: the format's).
    instruction: appended to the prompt of every row with a gold answer (`answer_convention`;
    None: the gold format's, `""` none).
    tokenizer + max_prompt_tokens: also report prompts longer than the limit after the chat template.
    """
    table = RowTable(path, source_split)
    parsed = _scan(table, ValidationReport(str(path)), answer_format=answer_format, data_format=data_format, columns=columns,
                   tokenizer=tokenizer, max_prompt_tokens=max_prompt_tokens, system_prompt=system_prompt,
                   use_chat_template=use_chat_template, show_tests=show_tests, instruction=instruction)
    return [(line, example) for _, line, example in parsed.rows], parsed.report


@dataclass
class _Scan:
    rows: Iterator[tuple[int, int, Example]]
    """A generator: `report` and `layout` are complete once it is exhausted."""
    report: ValidationReport
    layout: _Layout
    parse: Callable[[int, dict], Example | None]


def _scan(table: RowTable, report: ValidationReport, *, answer_format=None, data_format=None, columns=None, tokenizer=None,
          max_prompt_tokens=None, system_prompt=None, use_chat_template=None, show_tests=None, instruction=None) -> _Scan:
    """The validation pass over `table`: `rows` yields `(handle, row number, Example)` for every
    valid row (exhaust it before reading `report` or `layout`); `parse` turns a row of the
    table into its Example again."""
    answer_format = resolve_answer_format(answer_format, data_format)
    mapping = resolve_columns(data_format, columns)
    check_columns(table.source, table.columns, mapping)
    layout = _Layout()
    parse = _PromptParser(table.source, mapping, answer_format, resolve_show_tests(show_tests, data_format),
                          answer_convention(answer_format, instruction))

    def rows():
        first_line_of_id: dict[str, int] = {}
        for handle, line, row in table.scan(report):
            example = parse(line, row, report)
            if example is None:
                continue
            if example.id in first_line_of_id:
                report.add(line, "id", f"duplicate id {example.id!r} (first on line {first_line_of_id[example.id]})")
                continue
            first_line_of_id[example.id] = line
            if check_prompt_length(report, line, example.prompt_input, tokenizer, max_prompt_tokens,
                                   system_prompt=system_prompt, use_chat_template=use_chat_template):
                layout.see(example)
                yield handle, line, example

    return _Scan(rows(), report, layout, parse)


@dataclass
class _PromptParser:
    """One row of a prompt file as its Example (a picklable `RowView.parse`)."""

    source: str
    mapping: dict
    answer_format: str
    show_tests: str = "none"
    convention: AnswerConvention = DEFAULT_CONVENTION

    def __post_init__(self):
        self.file_name = Path(self.source).name

    def __call__(self, line: int, row: dict, into: ValidationReport | None = None) -> Example | None:
        return parse_prompt_row(into or ValidationReport(self.source), line, contest_cases(map_row(row, self.mapping)),
                                self.file_name, self.answer_format, self.show_tests, self.convention)


def load_prompt_file(path: str | Path, *, strict: bool = True, split: str = "all", **checks) -> Task:
    """A prompt file as a Task, validated first (see `validate_prompt_file` for `checks`). The
    examples are a `RowView`: row handles into the file, each example parsed again when read, so
    a large file is not held as Python objects.

    strict: any bad row stops with a UserError listing every problem; strict=False drops bad rows
    and records their number in `Task.rows_bad`. An empty result is a UserError either way.
    """
    table = RowTable(path, checks.get("source_split"))
    keep = ("answer_format", "data_format", "columns", "tokenizer", "max_prompt_tokens", "system_prompt", "use_chat_template",
            "show_tests", "instruction")
    scan = _scan(table, ValidationReport(str(path)), **{key: value for key, value in checks.items() if key in keep})
    handles, numbers = array("q"), array("q")
    for handle, line, _ in scan.rows:  # each Example checked, then dropped
        handles.append(handle)
        numbers.append(line)
    scan.report.enforce(strict)
    examples = RowView(table, handles, numbers, scan.parse)
    answer_format = resolve_answer_format(checks.get("answer_format"), checks.get("data_format"))
    options = {"answer_format": answer_format}
    for key, option in (("data_format", "format"), ("columns", "columns"), ("source_split", "split")):
        if checks.get(key):
            options[option] = checks[key]
    kind = scan.layout.kind(checks.get("data_format")) or REWARD_KINDS[answer_format]
    if kind == "mbpp":
        options["show_tests"] = scan.parse.show_tests
    if kind in ("math", "text", "choice"):  # an answer task: how its answers are read, and what its prompts say of it
        options["answer_extraction"] = scan.parse.convention.extraction
        options["instruction"] = scan.parse.convention.instruction
    task = Task(name=str(path), split=split, examples=examples, reward_kind=kind, rows_bad=scan.report.rows_bad, options=options,
                rows_bad_reasons=scan.report.reasons())
    require_examples(task)
    return task


def check_cases(report: ValidationReport, line: int, inputs, outputs) -> list[dict] | None:
    """stdin / stdout cases from parallel `inputs` / `outputs` lists of strings (non-empty, equal lengths)."""
    for name, value in (("inputs", inputs), ("outputs", outputs)):
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            report.add(line, name, f"wrong type: expected a list of strings, got {type_name(value)}")
            return None
    if not inputs:
        report.add(line, "inputs", "empty case list (an empty test list proves nothing)")
        return None
    if len(inputs) != len(outputs):
        report.add(line, "outputs", f"{len(outputs)} outputs for {len(inputs)} inputs")
        return None
    return [{"stdin": stdin, "stdout": stdout} for stdin, stdout in zip(inputs, outputs)]


def check_choices(report: ValidationReport, line: int, value, answer_format: str) -> list[str] | None:
    """Multiple-choice options: 2 to 26 non-empty strings, under the `choice` gold format."""
    if answer_format != "choice":
        report.add(line, "choices", f"options given but the gold format is {answer_format!r}: set "
                                    "task_options {answer_format: choice} (or data.format mmlu)")
        return None
    if not isinstance(value, list) or not all(isinstance(item, str) and item.strip() for item in value):
        report.add(line, "choices", f"wrong type: expected a list of non-empty strings, got {type_name(value)}")
        return None
    if not 2 <= len(value) <= len(LETTERS):
        report.add(line, "choices", f"{len(value)} options (need 2 to {len(LETTERS)})")
        return None
    return value


def _with_options(prompt: str | None, messages: list[dict] | None, options: list[str]):
    """The prompt (or the last user message) followed by the lettered options."""
    return _appended(prompt, messages, "\n\n" + "\n".join(f"{LETTERS[i]}. {option.strip()}" for i, option in enumerate(options)))


def shown_tests(tests: list[str], show_tests: str) -> list[int]:
    """The indices of `tests` a prompt shows under `show_tests` (`SHOW_TESTS`); none of a
    HumanEval `check(candidate)` test, whose prompt is the signature and its docstring.

    >>> shown_tests(["assert f(1) == 2", "assert f(2) == 3"], "first"), shown_tests(["assert f(1) == 2"], "none")
    ([0], [])
    """
    if show_tests == "none" or any("def check(" in test for test in tests):
        return []
    return [0]


def _with_tests(prompt: str | None, messages: list[dict] | None, tests: list[str]):
    """The prompt (or the last user message) followed by the shown tests, in the MBPP paper's words."""
    heading = "Your code should pass this test:" if len(tests) == 1 else "Your code should pass these tests:"
    return _appended(prompt, messages, f"\n\n{heading}\n\n" + "\n".join(test.strip() for test in tests))


def _appended(prompt: str | None, messages: list[dict] | None, block: str):
    """The prompt, or a copy of the messages whose last user message (else the last one) ends with `block`."""
    if prompt is not None:
        return prompt + block, messages
    if messages:
        last = max(i for i, message in enumerate(messages) if message.get("role") == "user") \
            if any(message.get("role") == "user" for message in messages) else len(messages) - 1
        messages = [dict(message) for message in messages]
        messages[last]["content"] = str(messages[last]["content"]) + block
    return prompt, messages


def parse_prompt_row(report: ValidationReport, line: int, row: dict, file_name: str, answer_format: str,
                     show_tests: str = "none", convention: AnswerConvention = DEFAULT_CONVENTION):
    """One row as an Example, or None after reporting each of its problems; an assert-list row's
    prompt ends with the tests `show_tests` shows (`SHOW_TESTS`), their indices in `metadata.shown_tests`;
    a row with a gold answer's with `convention`'s instruction, its policy in `metadata.answer_extraction`."""
    ok = True
    prompt = messages = answer = tests = entry_point = options = None
    if "prompt" in row and "messages" in row:
        report.add(line, "prompt", "give `prompt` or `messages`, not both")
        ok = False
    elif "prompt" in row and isinstance(row["prompt"], list):  # TRL's conversational prompt: chat messages
        ok = check_messages(report, line, "prompt", row["prompt"])
        messages = row["prompt"]
    elif "prompt" in row:
        ok = check_text(report, line, "prompt", row["prompt"])
        prompt = row["prompt"]
    elif "messages" in row:
        ok = check_messages(report, line, "messages", row["messages"])
        messages = row["messages"]
    else:
        report.add(line, "prompt", "missing field (need `prompt` or `messages`)")
        ok = False
    if "answer" not in row and "tests" not in row and "inputs" not in row:
        report.add(line, "answer", "missing field (need `answer`, `tests`, or `inputs` and `outputs`)")
        ok = False
    cases = None
    if "inputs" in row or "outputs" in row:
        cases = check_cases(report, line, row.get("inputs"), row.get("outputs"))
        ok = ok and cases is not None
    gold, gold_checked = row.get("answer"), "answer" in row
    if "choices" in row:
        options = check_choices(report, line, row["choices"], answer_format)
        if options is None:
            ok, gold_checked = False, False  # the gold names an option of a list that is not there
        else:
            prompt, messages = _with_options(prompt, messages, options)
            if isinstance(gold, int) and not isinstance(gold, bool):
                if not 0 <= gold < len(options):
                    report.add(line, "answer", f"option index {gold} out of range for {len(options)} choices")
                    ok, gold_checked = False, False
                else:
                    gold = LETTERS[gold]
    if gold_checked:
        answer = check_answer(report, line, gold, answer_format)
        ok = ok and answer is not None
        if answer is not None and options is not None and LETTERS.index(answer) >= len(options):
            report.add(line, "answer", f"option {answer} but only {len(options)} choices")
            ok = False
    if "tests" in row:
        tests = check_tests(report, line, row["tests"])
        ok = ok and tests is not None
    if "entry_point" in row:
        ok = check_entry_point(report, line, row["entry_point"]) and ok
        entry_point = row["entry_point"]
    row_id = row.get("id", f"{file_name}:{line}")
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
        report.add(line, "id", f"wrong type: expected a string or number, got {type_name(row_id)}")
        ok = False
    metadata = row.get("metadata", {})
    if not isinstance(metadata, dict):
        report.add(line, "metadata", f"wrong type: expected an object, got {type_name(metadata)}")
        ok = False
    if not ok:
        return None
    extra = {key: value for key, value in row.items() if key not in KNOWN_FIELDS | {"inputs", "outputs"}}
    if cases is not None:
        extra["cases"] = cases
    shown = shown_tests(tests, show_tests) if tests else []
    if shown:
        prompt, messages = _with_tests(prompt, messages, [tests[i] for i in shown])
        extra["shown_tests"] = shown
    if answer is not None:
        extra["answer_extraction"] = convention.extraction
        if convention.instruction:
            prompt, messages = _appended(prompt, messages, "\n\n" + convention.instruction)
    return Example(
        id=str(row_id), prompt=prompt, messages=messages, answer=answer, tests=tests,
        entry_point=entry_point, metadata={**metadata, **extra, "source": file_name, "line": line},
    )
