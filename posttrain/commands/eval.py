"""`posttrain eval`: held-out acceptance of any model or checkpoint, with an independent checker.

    posttrain eval --model runs/grpo-x/checkpoints/step-000050/model --task arithmetic --output-dir runs/eval-x

The held-out split is the one a training run with the same --task, --task-options, --seed and
--eval-size kept apart (it depends on nothing else), so scores are comparable across runs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from posttrain.errors import UserError

logger = logging.getLogger(__name__)


def handle(args) -> int:
    from posttrain.evaluation.acceptance import default_checker, evaluate_task, heldout_split
    from posttrain.rewards.registry import RewardOptions, as_verifier
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
    name = args.checker or default_checker(held_out)
    if name is None:
        raise UserError(f"--checker: task {args.task} has no default checker for kind {held_out.reward_kind!r}; name one")
    reward_options = RewardOptions(timeout_s=args.timeout, memory_mb=args.memory_mb, extraction=args.extraction)
    # A bad checker name or option fails before anything is written.
    checker = as_verifier(None, name, reward_options, args.unsafe_no_sandbox, for_checker=True, setting="--checker")
    if args.unsafe_no_sandbox:
        logger.warning("UNSAFE: --unsafe-no-sandbox: model-written code runs WITHOUT the bubblewrap sandbox "
                       "(resource limits only). Use this only on a machine you can lose.")
    checker.prepare()
    placement = resolve(Hardware(device=args.device, precision=args.precision))
    model, tokenizer = load_model(args.model, dtype=placement.param_dtype, device=placement.device)
    output_dir.mkdir(parents=True, exist_ok=True)
    with placement.autocast():
        summary = evaluate_task(
            model, tokenizer, held_out, checker=checker, k=args.k, temperature=args.temperature,
            max_new_tokens=args.max_new_tokens, seed=args.seed, system_prompt=args.system_prompt,
            output_path=output_dir / "eval.json",
        )
    summary["hardware"] = placement.describe()
    summary["unsafe_no_sandbox"] = args.unsafe_no_sandbox
    (output_dir / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "correct"}, indent=1) + "\n")
    low, high = summary["pass@1_ci95"]
    if args.unsafe_no_sandbox:
        print("UNSAFE: model-written code ran WITHOUT the bubblewrap sandbox (--unsafe-no-sandbox)")
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
    parser.add_argument("--timeout", type=float, default=10.0, help="code checkers: seconds per completion (as reward_options.timeout_s)")
    parser.add_argument("--memory-mb", type=int, default=1024, help="code checkers: address-space limit (as reward_options.memory_mb)")
    parser.add_argument("--extraction", default=None, help="answer extraction policy, or a code checker's auto | fenced | raw (as reward_options.extraction)")
    parser.add_argument("--unsafe-no-sandbox", action="store_true",
                        help="run model-written code WITHOUT the bubblewrap sandbox (as unsafe_no_sandbox; not isolated!)")
    parser.add_argument("--hardware.device", dest="device", default="auto", help="auto | cpu | cuda | cuda:N (as in the recipes' hardware section)")
    parser.add_argument("--hardware.precision", dest="precision", default="auto", help="auto | fp32 | bf16-mixed | bf16")
    parser.set_defaults(func=handle)
