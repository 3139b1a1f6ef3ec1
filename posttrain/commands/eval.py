"""`posttrain eval`: held-out acceptance of any model or checkpoint, with an independent checker.

    posttrain eval --model runs/grpo-x/checkpoints/step-000050/model --task arithmetic --output-dir runs/eval-x

The held-out split is the one a training run with the same --task, --task-options, --seed and
--eval-size kept apart (it depends on nothing else), so scores are comparable across runs. The
settings are the recipes' own sections (`evaluation/settings.EvalConfig`): any of their keys as
`--key value` (`--data.task`, `--acceptance.checker`, `--reward_options.timeout_s`,
`--hardware.device`) or in a `--config` YAML file; the short flags (`--task`, `--checker`, `--k`,
`--timeout` ...) set the same keys.
"""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.commands._recipe import config_command
from posttrain.errors import UserError

SETTINGS = "posttrain.evaluation.settings"


def handle(args) -> int:
    from posttrain.atomic import output_path_problem, write_text_atomically
    from posttrain.config import build_config, nest_flags, parse_overrides
    from posttrain.data.context import PromptSet, check_prompts_fit
    from posttrain.data.prompts import convention_record
    from posttrain.evaluation.acceptance import default_checker, evaluate_task, heldout_checker, heldout_split
    from posttrain.evaluation.settings import EvalConfig
    from posttrain.runs.skeleton import warn_if_unsafe
    from posttrain.hardware import resolve
    from posttrain.models import load_model
    from posttrain.rollout.engines import engine_card, make_engine
    from posttrain.rollout.episodes import make_sampler

    overrides = nest_flags(parse_overrides(list(args.overrides or []), once=True), EvalConfig.FLAGS)
    if args.unsafe_no_sandbox:
        overrides["unsafe_no_sandbox"] = True
    config = build_config(EvalConfig, args.config, overrides)
    data, acceptance = config.data, config.acceptance
    output_dir = Path(config.output_dir)
    problem = output_path_problem(output_dir, directory=True)
    if problem is not None:
        raise UserError(f"--output-dir {output_dir}: {problem}")
    if output_dir.exists() and any(output_dir.iterdir()) and not args.overwrite:
        raise UserError(f"--output-dir {output_dir}: not empty; pass --overwrite to replace its eval.json and summary.json, "
                        "or choose another --output-dir")
    held_out = heldout_split(data.task, data.eval_size, config.seed, data.load_options())
    name = acceptance.checker or default_checker(held_out)
    if name is None:
        raise UserError(f"acceptance.checker: task {data.task} has no default checker for kind {held_out.reward_kind!r}; name one")
    # A bad checker name or option fails before anything is written.
    checker = heldout_checker(name, held_out, config.reward_options, config.unsafe_no_sandbox)
    warn_if_unsafe(config.unsafe_no_sandbox)
    placement = resolve(config.hardware)
    model, tokenizer = load_model(config.model, dtype=placement.param_dtype, device=placement.device)
    sampler = make_sampler(config.tools, tokenizer, config.reward_options.sandbox(config.unsafe_no_sandbox), make_engine(config.rollout))
    check_prompts_fit(model, tokenizer, [PromptSet("held-out", held_out.examples, acceptance.max_new_tokens, "acceptance.max_new_tokens")],
                      system_prompt=data.system_prompt, tools=getattr(sampler, "tools", None))
    output_dir.mkdir(parents=True, exist_ok=True)
    with placement.autocast():
        summary = evaluate_task(
            model, tokenizer, held_out, checker=checker, k=acceptance.k, temperature=acceptance.temperature,
            max_new_tokens=acceptance.max_new_tokens, seed=config.seed, system_prompt=data.system_prompt,
            output_path=output_dir / "eval.json", sampler=sampler,
        )
    summary["hardware"] = placement.describe()
    summary["engine"] = engine_card(config.rollout)
    if config.tools.enabled:
        summary["tools"] = {"names": list(config.tools.names), "max_turns": config.tools.max_turns}
    summary["unsafe_no_sandbox"] = config.unsafe_no_sandbox
    if held_out.rows_bad:  # data.strict false: the file's bad rows were dropped before the split
        summary.update(rows_bad=held_out.rows_bad, rows_bad_reasons=held_out.rows_bad_reasons)
    convention = convention_record(held_out)  # a data file's: how its answers were read, what its prompts said of it
    if convention:
        summary["answer_convention"] = {**convention, "extraction_used": config.reward_options.extraction or convention["answer_extraction"]}
    write_text_atomically(output_dir / "summary.json", json.dumps({k: v for k, v in summary.items() if k != "correct"}, indent=1) + "\n")
    low, high = summary["pass@1_ci95"]
    if config.unsafe_no_sandbox:
        print("UNSAFE: model-written code ran WITHOUT the bubblewrap sandbox (--unsafe-no-sandbox)")
    print(f"{config.model} on {data.task} held-out ({summary['n']} problems, checker {summary['checker'].get('verifier')}):")
    print(f"  pass@1 {summary['pass@1']:.3f}  95% CI [{low:.3f}, {high:.3f}]  (greedy"
          + (f", tools {', '.join(config.tools.names)}: {summary['episodes']['turns/mean']:.2f} turns and "
             f"{summary['episodes']['tools/calls']:.2f} calls per problem)" if config.tools.enabled else ")"))
    if acceptance.k > 1:
        low, high = summary[f"pass@{acceptance.k}_ci95"]
        print(f"  pass@{acceptance.k} {summary[f'pass@{acceptance.k}']:.3f}  95% CI [{low:.3f}, {high:.3f}]  (temperature {acceptance.temperature})")
    if convention:
        print(f"  final answer read as {summary['answer_convention']['extraction_used']}: none found in {summary['unextracted']} "
              f"of {summary['problems']} completions" + ("" if convention["instruction"] else "; no instruction in the prompts"))
    print(f"results: {output_dir}")
    return 0


def register(subparsers) -> None:
    parser = config_command(subparsers, "eval", SETTINGS, "held-out acceptance of a model or checkpoint", config="EvalConfig",
                            description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[2])
    parser.add_argument("--unsafe-no-sandbox", action="store_true",
                        help="run model-written code WITHOUT the bubblewrap sandbox (as unsafe_no_sandbox; not isolated!)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty --output-dir, replacing its eval.json and summary.json (refused without it)")
    parser.set_defaults(func=handle)
