"""`posttrain eval`: held-out acceptance of any model or checkpoint, with an independent checker.

    posttrain eval --model runs/grpo-x/checkpoints/step-000050/model --task arithmetic --output-dir runs/eval-x

The held-out split is the one a training run with the same --task, --task-options, --seed and
--eval-size kept apart (it depends on nothing else), so scores are comparable across runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.errors import UserError


def handle(args) -> int:
    from posttrain.evaluation.acceptance import evaluate_task, heldout_split, resolve_checker
    from posttrain.data.files import task_load_options
    from posttrain.hardware import Hardware, resolve
    from posttrain.models import load_model

    try:
        options = json.loads(args.task_options)
    except json.JSONDecodeError as error:
        raise UserError(f"--task-options: not JSON ({error.msg})") from None
    if not isinstance(options, dict):
        raise UserError("--task-options must be a JSON object, e.g. '{\"digits\": 2}'")
    try:
        columns = json.loads(args.columns) if args.columns else None
    except json.JSONDecodeError as error:
        raise UserError(f"--columns: not JSON ({error.msg})") from None
    if columns is not None and not isinstance(columns, dict):
        raise UserError("--columns must be a JSON object, e.g. '{\"prompt\": \"question\"}'")
    options = task_load_options(options, args.format, columns, args.split)
    if args.k < 1 or args.eval_size < 1 or args.max_new_tokens < 1:
        raise UserError("--k, --eval-size and --max-new-tokens must be at least 1")
    output_dir = Path(args.output_dir)
    if output_dir.exists() and any(output_dir.iterdir()):
        raise UserError(f"{output_dir}: not empty; choose another --output-dir")
    held_out = heldout_split(args.task, args.eval_size, args.seed, options)
    try:
        resolve_checker(held_out, args.checker)  # a bad checker name fails before anything is written
    except ValueError as error:
        raise UserError(f"--checker: {error}") from None
    placement = resolve(Hardware(device=args.device, precision=args.precision))
    model, tokenizer = load_model(args.model, dtype=placement.param_dtype, device=placement.device)
    output_dir.mkdir(parents=True, exist_ok=True)
    with placement.autocast():
        summary = evaluate_task(
            model, tokenizer, held_out, checker=args.checker, k=args.k, temperature=args.temperature,
            max_new_tokens=args.max_new_tokens, seed=args.seed, system_prompt=args.system_prompt,
            output_path=output_dir / "eval.json",
        )
    summary["hardware"] = placement.describe()
    (output_dir / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "correct"}, indent=1) + "\n")
    low, high = summary["pass@1_ci95"]
    print(f"{args.model} on {args.task} held-out ({summary['n']} problems, checker {summary['checker'].get('verifier')}):")
    print(f"  pass@1 {summary['pass@1']:.3f}  95% CI [{low:.3f}, {high:.3f}]  (greedy)")
    if args.k > 1:
        low, high = summary[f"pass@{args.k}_ci95"]
        print(f"  pass@{args.k} {summary[f'pass@{args.k}']:.3f}  95% CI [{low:.3f}, {high:.3f}]  (temperature {args.temperature})")
    print(f"results: {output_dir}")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="held-out acceptance of a model or checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model spec or checkpoint directory")
    parser.add_argument("--task", required=True, help="arithmetic | rg:<dataset> | humaneval | a data file (.jsonl .parquet .csv .json .arrow) | a saved dataset directory | a cached owner/name")
    parser.add_argument("--task-options", default="{}", help="task options as JSON, e.g. '{\"digits\": 2}'")
    parser.add_argument("--format", default=None, help="a data file's public layout: gsm8k | math | trl_prompt (as data.format)")
    parser.add_argument("--columns", default=None, help="our column names -> the file's, as JSON (as data.columns)")
    parser.add_argument("--split", default=None, help="the split of a saved or cached dataset (as data.split)")
    parser.add_argument("--checker", default=None, help="verifier name (default: the task's strict checker)")
    parser.add_argument("--k", type=int, default=1, help="also report pass@k from k samples per problem")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature for pass@k")
    parser.add_argument("--eval-size", type=int, default=200, help="held-out problems")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="the training run's seed (it chose the split)")
    parser.add_argument("--system-prompt", default=None)
    parser.add_argument("--output-dir", required=True, help="where eval.json and summary.json go")
    parser.add_argument("--hardware.device", dest="device", default="auto", help="auto | cpu | cuda | cuda:N (as in the recipes' hardware section)")
    parser.add_argument("--hardware.precision", dest="precision", default="auto", help="auto | fp32 | bf16-mixed | bf16")
    parser.set_defaults(func=handle)
