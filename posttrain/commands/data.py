"""`posttrain data check`: validate a prompt, preference or SFT file and print every bad row.

    posttrain data check --kind prompt gsm8k-train.parquet --format gsm8k
    posttrain data check --kind sft conversations.jsonl
    posttrain data check --kind preference prefs.parquet --format trl_preference
"""

from __future__ import annotations

import json

from posttrain.errors import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser("data", help="inspect data files")
    actions = parser.add_subparsers(dest="data_command", metavar="ACTION", parser_class=type(parser))
    check = actions.add_parser(
        "check",
        help="validate a data file: rows read, rows bad, each bad row as FILE:ROW: field: reason",
        description="Exit 0 when every row is valid, 1 when any row is bad.",
    )
    check.add_argument("file", metavar="FILE")
    check.add_argument("--kind", choices=("prompt", "prompts", "preference", "sft"), default="prompt",
                       help="prompt (default; `prompts` is the same), preference or sft")
    check.add_argument(
        "--answer-format", choices=("math", "number", "text", "gsm8k", "boxed"), default=None,
        help="prompt: how `answer` must parse (default: the format's, else math, as math-verify reads it)",
    )
    # --data.format etc. as the recipes spell them, so that a training error's advice works here too.
    check.add_argument("--format", "--data.format", dest="format", default=None,
                       help="a public layout (prompt: gsm8k | math | trl_prompt ...; sft: trl_sft; preference: trl_preference)")
    check.add_argument("--columns", "--data.columns", dest="columns", default=None, help="our column names -> the file's, as JSON")
    check.add_argument("--split", "--data.split", dest="split", default=None, help="the split of a saved or cached dataset")
    check.add_argument("--model", metavar="SPEC", help="tokenizer for the prompt-length check (with --max-prompt-tokens)")
    check.add_argument("--max-prompt-tokens", type=int, metavar="N", help="longest prompt, after the chat template")
    check.add_argument("--system-prompt", help="shared system prompt counted in prompt lengths")
    check.add_argument("--instruction", default=None,
                       help="prompt: the text appended to every prompt with a gold answer, as task_options.instruction "
                            "(default: the gold format's, e.g. gsm8k: where the '#### N' answer goes; '' for none)")
    check.set_defaults(func=check_file)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def convention_lines(answer_format: str | None, data_format: str | None, instruction: str | None) -> list[str]:
    """How an answer file's completions are read and what its prompts say of it
    (`data.prompts.answer_convention`), for `data check`."""
    from posttrain.data.prompts import INSTRUCTION_SETTING, answer_convention, resolve_answer_format
    from posttrain.rewards.extract import ABOUT

    gold_format = resolve_answer_format(answer_format, data_format)
    convention = answer_convention(gold_format, instruction)
    lines = [f"answers read as {convention.extraction} ({ABOUT[convention.extraction]}), the gold format {gold_format}'s, "
             "by the reward and the checker (reward_options.extraction to change)"]
    if convention.instruction is None:
        return lines + [f"no instruction appended to the prompts ({INSTRUCTION_SETTING} to add one)"]
    return lines + [f"appended to every prompt ({INSTRUCTION_SETTING} to change, '' for none):",
                    *("  " + line for line in convention.instruction.splitlines())]


def check_file(args) -> int:
    from posttrain.data import validate_preference_file, validate_prompt_file

    tokenizer = None
    if args.model and args.max_prompt_tokens is not None:
        from posttrain.models import load_model

        _, tokenizer = load_model(args.model)
    lengths = {"tokenizer": tokenizer, "max_prompt_tokens": args.max_prompt_tokens, "system_prompt": args.system_prompt}
    try:
        columns = json.loads(args.columns) if args.columns else None
    except json.JSONDecodeError as error:
        raise UserError(f"--columns: not JSON ({error.msg})") from None
    if args.kind in ("prompt", "prompts"):
        parsed, report = validate_prompt_file(args.file, answer_format=args.answer_format, data_format=args.format,
                                              columns=columns, source_split=args.split, instruction=args.instruction, **lengths)
    elif args.kind == "sft":
        from posttrain.data.sft_data import load_sft_rows

        _, report = load_sft_rows(args.file, data_format=args.format, columns=columns, source_split=args.split, strict=False,
                                  allow_empty=True, **lengths)
    else:
        _, report = validate_preference_file(args.file, data_format=args.format, columns=columns, source_split=args.split, **lengths)
    for line in report.lines():
        print(line)
    print(report.summary())
    if args.kind in ("prompt", "prompts") and any(example.answer is not None for _, example in parsed):
        print(*convention_lines(args.answer_format, args.format, args.instruction), sep="\n")
    if report.hint:
        print(report.hint)
    if tokenizer is None:
        print("prompt lengths not checked (give --model SPEC and --max-prompt-tokens N)")
    return 1 if report.problems else 0
