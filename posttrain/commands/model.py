"""`posttrain model info SPEC`: load a model and describe it."""

from __future__ import annotations

import json


def register(subparsers) -> None:
    parser = subparsers.add_parser("model", help="inspect models")
    actions = parser.add_subparsers(dest="model_command", metavar="ACTION", parser_class=type(parser))
    info = actions.add_parser(
        "info",
        help="parameter count, vocabulary, special tokens, chat template, where the weights are",
        description="SPEC: tiny, smollm2-135m, a local Hugging Face directory, or a hub id.",
    )
    info.add_argument("spec", metavar="SPEC")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(func=show_info)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def show_info(args) -> int:
    from posttrain.models import describe_model, load_model

    model, tokenizer = load_model(args.spec)
    info = describe_model(args.spec, model, tokenizer)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    width = max(len(key) for key in info)
    for key, value in info.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, int) and not isinstance(value, bool) and value >= 10_000:
            value = f"{value:,}"
        print(f"{key:<{width}}  {value}")
    return 0
