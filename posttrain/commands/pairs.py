"""`posttrain pairs --model M --task T --group-size G --out pairs.jsonl`: preference pairs from
verified samples (see posttrain/recipes/pairs.py)."""

from __future__ import annotations

import json

from posttrain.errors import UserError


def register(subparsers) -> None:
    """Add the `pairs` command."""
    parser = subparsers.add_parser(
        "pairs", help="sample G answers per prompt, score them with a verifier, write (correct, incorrect) pairs",
        description="Sample G answers per training prompt, score them with the task's verifier, and write "
                    "(correct, incorrect) preference pairs plus a .meta.json provenance sidecar.",
    )
    parser.add_argument("--model", required=True, help="tiny | smollm2-135m | a Hugging Face directory | a hub id")
    parser.add_argument("--task", required=True, help="arithmetic | rg:<dataset> | humaneval | a JSONL prompt file")
    parser.add_argument("--task-options", default="{}", help='task options as JSON, e.g. \'{"digits": 2}\'')
    parser.add_argument("--group-size", type=int, default=8, help="G answers sampled per prompt (default 8)")
    parser.add_argument("--out", required=True, help="output pairs file (.jsonl); the sidecar is <name>.meta.json")
    parser.add_argument("--max-prompts", type=int, default=256, help="training prompts to sample (default 256)")
    parser.add_argument("--eval-size", type=int, default=200,
                        help="held-out problems kept out of sampling, as in the DPO run that evaluates on them (default 200)")
    parser.add_argument("--verifier", default=None, help="labelling verifier (default: the task's, e.g. exact for arithmetic)")
    parser.add_argument("--pairs-per-prompt", type=int, default=1, help="at most this many pairs per prompt (default 1)")
    parser.add_argument("--correct-threshold", type=float, default=1.0, help="reward >= this is correct (default 1.0)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k sampling (default 0: off)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="completion budget (default 32)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    parser.add_argument("--system-prompt", default=None, help="system prompt for chat models")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per generation call (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the task split and the sampling (default 0)")
    parser.set_defaults(func=handle)


def handle(args) -> int:
    from posttrain.recipes.pairs import PairSettings, build_pairs, provenance_path

    try:
        options = json.loads(args.task_options)
    except json.JSONDecodeError as error:
        raise UserError(f"--task-options: not valid JSON ({error.msg})") from None
    if not isinstance(options, dict):
        raise UserError("--task-options: must be a JSON object")
    settings = PairSettings(
        model=args.model, task=args.task, out=args.out, group_size=args.group_size, task_options=options,
        max_prompts=args.max_prompts, eval_size=args.eval_size, verifier=args.verifier,
        pairs_per_prompt=args.pairs_per_prompt, correct_threshold=args.correct_threshold,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
        stop_strings=list(args.stop), system_prompt=args.system_prompt, batch_size=args.batch_size, seed=args.seed,
    )
    result = build_pairs(settings)
    print(
        f"{result['pairs']} pairs from {result['prompts_paired']} of {result['prompts']} prompts "
        f"(skipped: {result['prompts_skipped_all_correct']} all correct, {result['prompts_skipped_all_incorrect']} all incorrect, "
        f"{result['prompts_skipped_unscored']} unscored; verdict errors: {result['verdict_errors']})"
    )
    print(f"labels: verifier {result['verifier']} on samples of model {result['model']} (G={result['group_size']}, seed {result['seed']})")
    print(f"wrote {args.out} and {provenance_path(args.out)}")
    return 0
