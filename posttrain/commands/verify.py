"""`posttrain verify --verifier NAME --input rows.jsonl`: one verdict per row, in order."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from posttrain.errors import UserError


def register(subparsers) -> None:
    """Add the `verify` command."""
    parser = subparsers.add_parser(
        "verify", help="score completions with a verifier; writes one JSON verdict per input row")
    parser.add_argument("--verifier", required=True,
                        help="math, exact, numeric, format, rg, humaneval, mbpp, io, stdio, "
                             "callable:<dotted.path>, or a sum like 0.9*math+0.1*format")
    parser.add_argument("--input", required=True, type=Path, help="JSONL rows with a 'completion' field")
    parser.add_argument("--output", type=Path, default=None, help="JSONL verdicts (default: stdout)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output file (refused without it)")
    parser.add_argument("--format", choices=("mbpp", "code_contests", "humaneval", "gsm8k", "math"), default=None,
                        help="the rows hold the problem in this public layout (MBPP: text, test_list; CodeContests: "
                             "inputs/outputs or public_tests/private_tests; HumanEval: prompt, test, entry_point; GSM8K: "
                             "answer, its gold after '####', completions read as marked; MATH: solution, its gold boxed)")
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default: CPUs)")
    parser.add_argument("--fraction", action="store_true",
                        help="code rewards are tests passed / total instead of all-or-nothing")
    parser.add_argument("--extraction", default=None,
                        help="answer extraction policy: boxed_or_tags, boxed, tags, hashes ('#### N'), marked (any of "
                             "those), last_number (default: each row's answer_extraction, else boxed_or_tags)")
    parser.add_argument("--timeout", type=float, default=10.0, help="code: seconds per sample (default 10)")
    parser.add_argument("--details", action="store_true", help="also write each verdict's details")
    parser.add_argument("--unsafe-no-sandbox", action="store_true",
                        help="run untrusted code WITHOUT bubblewrap isolation (explicit opt-in)")
    parser.set_defaults(func=handle)


def read_rows(path: Path) -> tuple[list[str], list[dict]]:
    """Completions and examples from a JSONL file; UserError names the line and field."""
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    completions, examples = [], []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise UserError(f"{path} line {number}: not valid JSON ({error.msg})") from None
            if not isinstance(row, dict):
                raise UserError(f"{path} line {number}: a row must be a JSON object")
            if not isinstance(row.get("completion"), str):
                raise UserError(f"{path} line {number}: field 'completion' must be a string")
            completions.append(row["completion"])
            examples.append(row)
    if not examples:
        raise UserError(f"{path}: no rows")
    return completions, examples


GOLD_PROBLEM = "gold_problem"
"""Set by `public_layout` on a row whose gold answer does not parse in its layout (its verdict: data_error)."""


def public_layout(row: dict, layout: str) -> dict:
    """A row in a public layout as the verifiers read it: MBPP's `test_list` as `tests` (with the
    `shown_tests` a training prompt of the layout shows, unless the row names its own), stdin /
    stdout `inputs` / `outputs` (or CodeContests' public / private tests) as `cases`; GSM8K's and
    MATH's gold read from the solution as training reads it, with their answer convention
    (`answer_extraction`), or, when it does not parse, no gold and why in `GOLD_PROBLEM`."""
    from posttrain.data.files import FORMATS, contest_cases, map_row, resolve_columns
    from posttrain.data.prompts import answer_convention, shown_tests
    from posttrain.data.validation import ValidationReport, check_answer

    mapped = contest_cases(map_row(row, {k: v for k, v in resolve_columns(layout, None).items() if k != "prompt"}))
    answer_format = FORMATS[layout]["answer_format"]
    if answer_format is not None:
        report = ValidationReport("row")
        mapped["answer"] = check_answer(report, 0, mapped.get("answer"), answer_format)
        mapped.setdefault("answer_extraction", answer_convention(answer_format).extraction)
        if mapped["answer"] is None:
            mapped[GOLD_PROBLEM] = report.problems[0].reason
    if "inputs" in mapped and "cases" not in mapped:
        inputs, outputs = mapped.pop("inputs"), mapped.pop("outputs", None)
        if isinstance(inputs, list) and isinstance(outputs, list) and len(inputs) == len(outputs):
            mapped["cases"] = [{"stdin": i, "stdout": o} for i, o in zip(inputs, outputs)]
    if layout == "humaneval" and isinstance(mapped.get("tests"), str):
        mapped["test"] = mapped["tests"]
    if FORMATS[layout].get("show_tests") and isinstance(mapped.get("tests"), list) and "shown_tests" not in mapped:
        # the tests a training prompt of this layout shows, so that `reward_options.tests: half` picks as in training
        mapped["shown_tests"] = shown_tests(mapped["tests"], FORMATS[layout]["show_tests"])
    return mapped


def handle(args) -> int:
    """Score every row; write verdicts atomically; print a one-line summary to stderr."""
    from posttrain.rewards import SandboxConfig, SandboxUnavailable, Verdict, get_verifier

    if args.workers is not None and args.workers < 1:
        raise UserError("--workers must be at least 1")
    if args.timeout <= 0:
        raise UserError("--timeout must be positive")
    if args.output is not None:  # before any scoring
        from posttrain.atomic import check_output_file  # here: the CLI starts without torch

        check_output_file(args.output, "--output", args.overwrite)
    try:
        verifier = get_verifier(args.verifier, fraction=args.fraction, extraction=args.extraction,
                                sandbox=SandboxConfig(timeout_s=args.timeout,
                                                      unsafe_no_sandbox=args.unsafe_no_sandbox))
    except ValueError as error:
        raise UserError(f"--verifier/--extraction: {error}") from None
    completions, examples = read_rows(args.input)
    if args.format:
        examples = [public_layout(row, args.format) for row in examples]
    try:
        verdicts = verifier.batch(completions, examples, workers=args.workers)
    except SandboxUnavailable as error:
        raise UserError(str(error), exit_code=3) from None
    except ValueError as error:  # e.g. a callable path that does not import
        raise UserError(f"--verifier: {error}") from None
    verdicts = [Verdict.data_error(f"--format {args.format}: {row[GOLD_PROBLEM]}") if GOLD_PROBLEM in row else verdict
                for row, verdict in zip(examples, verdicts)]
    lines = []
    for verdict in verdicts:
        row = verdict.to_json()
        if not args.details:
            row.pop("details", None)
        lines.append(json.dumps(row) + "\n")
    if args.output is None:
        sys.stdout.writelines(lines)
    else:
        from posttrain.atomic import write_text_atomically  # here: the CLI starts without torch

        write_text_atomically(args.output, "".join(lines))
    statuses = Counter(v.status for v in verdicts)
    rewards = [v.reward for v in verdicts if v.status == "ok"]
    mean = sum(rewards) / len(rewards) if rewards else float("nan")
    unsafe = " [UNSAFE: no sandbox]" if args.unsafe_no_sandbox else ""
    print(f"verify {verifier.name}: {len(verdicts)} rows, " +
          ", ".join(f"{k}={statuses[k]}" for k in ("ok", "infra_error", "data_error")) +
          f", mean reward (ok rows) {mean:.4f}{unsafe}", file=sys.stderr)
    if statuses["data_error"] and not args.format and any("####" in str(row.get("answer", "")) for row in examples):
        print("hint: the gold answers hold '####', as GSM8K's solutions do: --format gsm8k reads the number after it",
              file=sys.stderr)
    return 0
