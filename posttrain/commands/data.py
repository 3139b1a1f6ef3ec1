"""`posttrain data check`: validate a prompt or preference JSONL file and print every bad row."""

from __future__ import annotations


def register(subparsers) -> None:
    parser = subparsers.add_parser("data", help="inspect data files")
    actions = parser.add_subparsers(dest="data_command", metavar="ACTION", parser_class=type(parser))
    check = actions.add_parser(
        "check",
        help="validate a JSONL file: rows read, rows bad, each bad row as FILE:LINE: field: reason",
        description="Exit 0 when every row is valid, 1 when any row is bad.",
    )
    check.add_argument("file", metavar="FILE")
    check.add_argument("--kind", choices=("prompts", "preference"), default="prompts", help="default: prompts")
    check.add_argument(
        "--answer-format", choices=("math", "number", "text"), default="math",
        help="prompts: how `answer` must parse (default: math, as math-verify reads it)",
    )
    check.add_argument("--model", metavar="SPEC", help="tokenizer for the prompt-length check (with --max-prompt-tokens)")
    check.add_argument("--max-prompt-tokens", type=int, metavar="N", help="longest prompt, after the chat template")
    check.add_argument("--system-prompt", help="shared system prompt counted in prompt lengths")
    check.set_defaults(func=check_file)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def check_file(args) -> int:
    from posttrain.data import validate_preference_file, validate_prompt_file

    tokenizer = None
    if args.model and args.max_prompt_tokens is not None:
        from posttrain.models import load_model

        _, tokenizer = load_model(args.model)
    lengths = {"tokenizer": tokenizer, "max_prompt_tokens": args.max_prompt_tokens, "system_prompt": args.system_prompt}
    if args.kind == "prompts":
        _, report = validate_prompt_file(args.file, answer_format=args.answer_format, **lengths)
    else:
        _, report = validate_preference_file(args.file, **lengths)
    for line in report.lines():
        print(line)
    print(report.summary())
    if tokenizer is None:
        print("prompt lengths not checked (give --model SPEC and --max-prompt-tokens N)")
    return 1 if report.problems else 0
