"""`posttrain audit`: two checks before training on a reward.

    posttrain audit --verifier NAME                       the exploit suite; non-zero exit if the verifier is fooled
    posttrain audit --data PATH_OR_NAME --format LAYOUT   the dataset's tests: do its reference solutions pass,
                                                          and do they reject trivial programs?
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from posttrain.errors import UserError

DATA_LAYOUTS = {"mbpp": "mbpp", "humaneval": "humaneval", "code_contests": "stdio"}
"""--format -> the completion layout (and the verifier) of its problems."""
DATA_TIMEOUT_S = 10.0  # per-sample budget under --data: reference solutions take real time


def list_suites(parser) -> None:
    """--verifier's help: every verifier with an audit suite, read from the suites' table
    (`rewards.audit.SUITES`; imported when the command parses or shows its help, not before)."""
    from posttrain.rewards.audit import SUITES

    for action in parser._actions:
        if action.dest == "verifier":
            action.help = f"the verifier whose suite runs: {', '.join(SUITES)}"


def register(subparsers) -> None:
    """Add the `audit` command."""
    parser = subparsers.add_parser(
        "audit", help="try to fool a verifier with known exploits (each must score 0) and honest "
                      "answers (each must score 1); or, with --data, check a code dataset's tests", deferred=list_suites)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--verifier", help="the verifier whose suite runs")
    mode.add_argument("--data", help="a code data file (.jsonl .parquet .csv .json .arrow), a saved dataset "
                                     "directory, a cached owner/name, or humaneval (the packaged set)")
    parser.add_argument("--format", "--data.format", dest="format", choices=tuple(DATA_LAYOUTS), default=None,
                        help="--data's layout: mbpp (text, test_list, code), humaneval (prompt, test, entry_point, "
                             "canonical_solution) or code_contests (description, public/private tests)")
    parser.add_argument("--columns", "--data.columns", dest="columns", default=None, help="--data: our column names -> the file's, as JSON (as data.columns)")
    parser.add_argument("--split", "--data.split", dest="split", default=None, help="--data: the split of a saved or cached dataset (as data.split)")
    parser.add_argument("--show-tests", default=None,
                        help="--data --format mbpp: which tests the prompts show, as task_options.show_tests in training "
                             "(first, the format's default, or none); the programs read what is shown")
    parser.add_argument("--record", metavar="RUN_DIR", default=None,
                        help="--verifier: also write the outcome to RUN_DIR/audit.json, where `posttrain checklist` reads it "
                             "(the run's training reward audited: passed or not); --verifier must be the run's training reward")
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default: CPUs)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="per-sample budget of code verifiers in seconds (default 3; 10 with --data)")
    parser.add_argument("--unsafe-no-sandbox", action="store_true",
                        help="run code without bubblewrap (not isolated!)")
    parser.set_defaults(func=handle)


def handle(args) -> int:
    """--verifier: the exploit table; --data: the dataset's references and test strength."""
    if args.workers is not None and args.workers < 1:
        raise UserError("--workers must be at least 1")
    if args.timeout is not None and args.timeout <= 0:
        raise UserError("--timeout must be positive")
    if args.data is not None:
        if args.record:
            raise UserError("--record goes with --verifier (a run's training reward), not --data")
        return audit_data(args)
    if args.format or args.columns or args.split or args.show_tests:
        raise UserError("--format, --columns, --split and --show-tests go with --data, not --verifier")
    if args.record:
        check_record(Path(args.record), args.verifier)
    return audit_verifier(args)


def check_record(run_dir: Path, verifier: str) -> None:
    """--record RUN_DIR takes only an audit of the run's own training reward (the one the
    checklist's audit question asks about): another verifier's would replace it and answer nothing.
    One UserError line otherwise, before the suite runs."""
    from posttrain.evaluation.checklist import audited_reward
    from posttrain.evaluation.run_record import read_run

    if not (run_dir / "run_card.json").is_file():
        raise UserError(f"--record {run_dir}: not a run directory (no run_card.json)")
    run = read_run(run_dir)
    reward = audited_reward(run)
    if reward is None:
        raise UserError(f"--record {run_dir}: the {run.recipe} run has no training reward to audit")
    if verifier != reward:
        raise UserError(f"--record {run_dir}: the run was trained on the reward {reward}, not {verifier}; record its own: "
                        f"posttrain audit --verifier {reward} --record {run_dir}")


def audit_verifier(args) -> int:
    """Run the suite, print the table, return 1 if any case failed."""
    from posttrain.rewards.audit import AUDIT_TIMEOUT_S, SUITES, format_table, run_audit
    from posttrain.rewards.sandbox import SandboxUnavailable

    if args.verifier not in SUITES:
        raise UserError(f"--verifier: no built-in audit suite for {args.verifier!r} "
                        f"(suites: {', '.join(SUITES)})")
    try:
        outcomes, seconds = run_audit(args.verifier, workers=args.workers,
                                      timeout_s=args.timeout or AUDIT_TIMEOUT_S,
                                      unsafe_no_sandbox=args.unsafe_no_sandbox)
    except SandboxUnavailable as error:
        raise UserError(str(error), exit_code=3) from None
    print(format_table(outcomes))
    failed = [o for o in outcomes if not o.passed]
    counts = {kind: sum(o.case.kind == kind for o in outcomes) for kind in ("exploit", "honest", "malformed")}
    print(f"\naudit {args.verifier}: {len(outcomes) - len(failed)}/{len(outcomes)} passed "
          f"({counts['exploit']} exploits, {counts['honest']} honest, {counts['malformed']} malformed) "
          f"in {seconds:.1f} s" + (" [UNSAFE: no sandbox]" if args.unsafe_no_sandbox else ""))
    for outcome in failed:
        print(f"FAILED: {outcome.case.kind} {outcome.case.name!r} -> {outcome.verdict.status} "
              f"{outcome.verdict.reward} ({outcome.verdict.reason})")
    if args.record:
        record_audit(Path(args.record), args.verifier, outcomes, counts, seconds, args.unsafe_no_sandbox)
    return 1 if failed else 0


AUDIT_RECORD = "audit.json"
"""The file `posttrain audit --verifier X --record RUN_DIR` writes in a run directory."""


def record_audit(run_dir: Path, verifier: str, outcomes, counts: dict, seconds: float, unsafe: bool) -> None:
    """RUN_DIR/audit.json: which verifier's suite ran, when, how many cases passed, each failure."""
    import datetime

    from posttrain.atomic import write_text_atomically

    failed = [o for o in outcomes if not o.passed]
    record = {"verifier": verifier, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "cases": len(outcomes), "passed": len(outcomes) - len(failed), **counts, "seconds": round(seconds, 1),
              "unsafe_no_sandbox": unsafe,
              "failures": [{"kind": o.case.kind, "name": o.case.name, "status": o.verdict.status, "reward": o.verdict.reward,
                            "reason": o.verdict.reason} for o in failed]}
    write_text_atomically(run_dir / AUDIT_RECORD, json.dumps(record, indent=1) + "\n")
    print(f"recorded: {run_dir / AUDIT_RECORD}")
    refresh_checklist(run_dir)


def refresh_checklist(run_dir: Path) -> None:
    """The run card's checklist section (written when the run ended) answered again from what the
    run directory holds now, when the card has one."""
    from posttrain.atomic import write_text_atomically
    from posttrain.evaluation.checklist import card_section
    from posttrain.runs.card import render_markdown

    card_path = run_dir / "run_card.json"
    card = json.loads(card_path.read_text())
    if "checklist" in card:
        card["checklist"] = card_section(run_dir, card)
        write_text_atomically(card_path, json.dumps(card, indent=2, default=str) + "\n")
        write_text_atomically(run_dir / "run_card.md", render_markdown(card))


def audit_data(args) -> int:
    """Print `ID: accepted by <program>` per weak problem, `ID: reference fails ...` / `ID: tests do
    not run ...` per reference fault, then the summary line; 1 if any, 0 if none, 2 on bad input."""
    from posttrain.data.prompts import resolve_show_tests
    from posttrain.rewards import SandboxConfig, SandboxUnavailable, get_verifier
    from posttrain.rewards.problem_checks import check_references, find_weak_tests, summary_line

    if args.format is None:
        if args.data != "humaneval" or Path(args.data).exists():
            raise UserError(f"--data {args.data}: give its layout with --format ({' | '.join(DATA_LAYOUTS)})")
        args.format = "humaneval"
    layout = DATA_LAYOUTS[args.format]
    if args.show_tests is not None and args.format != "mbpp":
        raise UserError(f"--show-tests goes with --format mbpp (a {args.format} prompt shows its own examples)")
    resolve_show_tests(args.show_tests, args.format, setting="--show-tests")
    rows = load_rows(args.data, args.format, parse_columns(args.columns), args.split, args.show_tests)
    verifier = get_verifier(layout, sandbox=SandboxConfig(timeout_s=args.timeout or DATA_TIMEOUT_S,
                                                          unsafe_no_sandbox=args.unsafe_no_sandbox))
    started = time.monotonic()
    try:
        references = check_references(verifier, rows, workers=args.workers)
        strength = find_weak_tests(verifier, rows, layout, workers=args.workers)
    except SandboxUnavailable as error:
        raise UserError(str(error), exit_code=3) from None
    seconds = time.monotonic() - started
    for fault in references.faults:
        print(f"{fault.id}: {fault.reason}")
    for weakness in strength.weak:
        print(f"{weakness.id}: accepted by {weakness.program}")
    for fault in strength.unscored:
        print(f"{fault.id}: not scored: {fault.reason}")
    passed = references.checked - len(references.faults)
    print(f"references: {passed} of {references.checked} pass their tests ({len(rows) - references.checked} "
          f"problems have none); {len(rows)} problems checked in {seconds:.1f} s"
          + (" [UNSAFE: no sandbox]" if args.unsafe_no_sandbox else ""))
    print(summary_line(strength, len(rows)))
    return 1 if strength.weak or strength.unscored or references.faults else 0


def parse_columns(text: str | None) -> dict | None:
    """--columns as a mapping (a one-line UserError otherwise)."""
    if not text:
        return None
    try:
        columns = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(f"--columns: not JSON ({error.msg})") from None
    if not isinstance(columns, dict):
        raise UserError("--columns must be a JSON object, e.g. '{\"id\": \"name\"}'")
    return columns


def load_rows(data: str, data_format: str, columns: dict | None, split: str | None, show_tests: str | None = None) -> list[dict]:
    """Verifier rows of every problem in `data` (every row must be valid: a bad one is a UserError
    naming its line), their prompts as training shows them (`show_tests`: None, the format's), or
    of the packaged HumanEval for `humaneval`."""
    from posttrain.data.examples import verifier_input
    from posttrain.data.prompts import validate_prompt_file

    if data == "humaneval" and not Path(data).exists():
        from posttrain.data.tasks import humaneval_examples

        if data_format != "humaneval":
            raise UserError(f"--data humaneval is in the humaneval layout, not {data_format}")
        if columns or split:
            raise UserError("--columns and --split go with a data file, not the packaged humaneval")
        examples = humaneval_examples()
    else:
        parsed, report = validate_prompt_file(data, data_format=data_format, columns=columns, source_split=split,
                                              show_tests=show_tests)
        report.enforce(strict=True, setting=None)  # audit has no data.strict: every problem must be fixed
        examples = [example for _, example in parsed]
    if not examples:
        raise UserError(f"{data}: no problems")
    return [verifier_input(example) for example in examples]
