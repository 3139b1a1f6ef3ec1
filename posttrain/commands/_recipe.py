"""The recipe commands (sft, grpo, ppo, dpo, demo): one table, `RECIPES`, from which `posttrain/cli.py`
registers each; and the command-line glue of every command whose settings are a config dataclass
(the recipes, and `pairs`, which is not a training recipe: `config_command`).

Every such command takes `--config FILE` and any config field as `--key value` (dotted for
sections); a recipe command also takes `--output-dir DIR`, `--max-steps N`, `--seed N` and
`--resume DIR`. The module defining the settings is imported only when its command runs or shows
--help, so other commands start without torch's heavier dependencies. (Skipped by command discovery: its name starts with an underscore.)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from posttrain.errors import UserError

RESUMABLE_OVERRIDES = {"max_steps"}


def resolve_config(config_cls, args: argparse.Namespace, command: str | None = None):
    """Build a recipe config from `--config`, the common flags and `--key value` overrides.

    With `--resume DIR` the config is the run's own `config.yaml`; only `--max-steps` may change,
    unless `--resume-changed-config` is given: then any `--key value` applies, and the recipe
    records the changes that alter the data order or the loss in the run card (`runs/faults.py`).
    A resume is refused in one line when DIR is a run of another recipe than `command` (its run
    card says which) or `--output-dir` names another directory.
    """
    from posttrain.config import build_config, parse_overrides  # here: posttrain.config imports torch (hardware)

    overrides = parse_overrides(list(getattr(args, "overrides", []) or []), once=True)
    for name, value in vars(args).items():  # a recipe's bare switches (`posttrain demo --tools`)
        if name.startswith("switch_") and value:
            overrides[name.removeprefix("switch_")] = True
    for flag in ("output_dir", "max_steps", "seed"):
        if getattr(args, flag, None) is not None:
            if flag in overrides:  # `--max-steps 2 --max_steps 1`: argparse took the one, the overrides the other
                raise UserError(f"--{flag.replace('_', '-')} {getattr(args, flag)} and --{flag} {overrides[flag]} set the same key; give it once")
            overrides[flag] = getattr(args, flag)
    if args.resume:
        changed = set(_dotted(overrides)) - RESUMABLE_OVERRIDES - {"output_dir"}
        if args.config or (changed and not getattr(args, "resume_changed_config", False)):
            raise UserError(
                f"--resume continues a run with its own config.yaml; only --max-steps may change "
                f"(got {', '.join(sorted(changed)) or '--config'}; --resume-changed-config accepts other --key value changes)"
            )
        run_dir = Path(args.resume)
        if command == "demo":  # a demo goes on by its own command, which demo.json keeps (recipes/stages.py)
            raise UserError(f"the demo has no --resume: {_demo_goes_on(run_dir)}")
        if not (run_dir / "config.yaml").is_file():
            raise UserError(f"{run_dir}: not a run directory (no config.yaml) - nothing to resume")
        if overrides.get("output_dir") is not None and Path(overrides["output_dir"]).resolve() != run_dir.resolve():
            raise UserError(f"--resume {run_dir} continues the run in {run_dir}; --output-dir {overrides['output_dir']} "
                            "names another directory: give one of them")
        recipe = _recipe_of(run_dir)
        if command is not None and recipe is not None and recipe != command:
            raise UserError(f"{run_dir} is a {recipe} run; resume it with: posttrain {recipe} --resume {run_dir}")
        # The run's own config.yaml as the file, the flags over it key by key (a section's other keys stay).
        return build_config(config_cls, run_dir / "config.yaml", {**overrides, "output_dir": str(run_dir)})
    return build_config(config_cls, args.config, overrides)


class Once(argparse.Action):
    """An argparse flag that may be given once: a second `--max-steps` is an error, not a silent win."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            raise argparse.ArgumentError(self, f"given twice ({getattr(namespace, self.dest)}, then {values}); give it once")
        setattr(namespace, self.dest, values)


def _demo_goes_on(out: Path) -> str:
    """What goes on with the demo in `out`: its own command again (kept in its demo.json)."""
    try:
        command = json.loads((out / "demo.json").read_text())["command"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{out} holds no stopped demo (no demo.json); run posttrain demo --output-dir {out} with the settings it had"
    return f"run its own command again, which keeps its finished stages: {command}"


def _recipe_of(run_dir: Path) -> str | None:
    """The recipe that made the run in `run_dir`, as its run card records it (None without a readable card)."""
    try:
        recipe = json.loads((run_dir / "run_card.json").read_text(encoding="utf-8"))["run"]["recipe"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return recipe if isinstance(recipe, str) else None


def _dotted(tree: dict, prefix: str = "") -> list[str]:
    """The dotted keys of nested overrides: {"optim": {"lr": 1}} -> ["optim.lr"]."""
    keys = []
    for key, value in tree.items():
        keys += _dotted(value, f"{prefix}{key}.") if isinstance(value, dict) and value else [f"{prefix}{key}"]
    return keys


def settings_factory(module: str, config: str):
    """The config class or defaults function `config` names: an attribute of `module`, or
    "other.module:name". Imported on call."""
    where, _, name = config.rpartition(":")
    return getattr(importlib.import_module(where or module), name)


def config_command(subparsers, name: str, module: str, help_text: str, config: str = "Config",
                   description: str | None = None) -> argparse.ArgumentParser:
    """Add `posttrain NAME --config FILE --key value ...`: any field of the settings named `config` in
    `module` (a dataclass, or a function returning the defaults) as `--key value`, dotted for
    sections, and a --help that lists them. The caller adds its own flags and `func`.

    `module` is imported only when the command is parsed or its --help shown (the epilog is the
    parser's `deferred` part, `posttrain.cli.OneLineErrorParser`), so that every other command
    starts without importing torch, transformers and peft.
    """
    parser = subparsers.add_parser(
        name, help=help_text, description=description or help_text, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        deferred=lambda parser: setattr(parser, "epilog", fields_epilog(settings_factory(module, config))),
    )
    parser.add_argument("--config", action=Once, help="YAML file, or a preset shipped with posttrain by name (--config tiny-grpo); its keys override the defaults")
    parser.set_defaults(accepts_overrides=True)
    return parser


def fields_epilog(settings) -> str:
    """The --help epilog of a config command: every field of `settings` (a config class or a
    defaults function), its docstring and its default, and its short flags (a `FLAGS` table)."""
    from posttrain.config import describe_fields  # here: posttrain.config imports torch (hardware)

    fields = describe_fields(settings)
    width = max(len(key) for key, _, _ in fields)
    text = "config fields (as --key value, or in the YAML file):\n" + "\n".join(
        f"  {key:<{width}}  {doc} [default {default}]" for key, default, doc in fields
    )
    flags = getattr(settings, "FLAGS", {})  # short flags: `posttrain eval --task X` sets data.task
    if flags:
        text += "\n\nshort flags (each sets the key after it):\n" + "\n".join(
            f"  {'--' + short.replace('_', '-'):<{width}}  --{key}" for short, key in flags.items())
    return text


@dataclass(frozen=True)
class Recipe:
    """One training command, `posttrain <command>`: its module defines `run(config, resume=False)`;
    `settings` names the config class or a function returning the command's defaults, in `module`
    or as "other.module:name" (two commands may share a recipe with different defaults: grpo and
    ppo). Nothing is imported until the command runs or its --help is shown."""

    command: str
    module: str
    help: str
    settings: str = "Config"
    new_directory: bool = True
    """A new run needs a new or empty --output-dir (`runs/directory.check_new_run`), checked before
    any work; False: the command replaces its own earlier output (the demo) and checks only the kind."""
    switches: tuple[str, ...] = ()
    """Boolean config fields that are also bare flags: `--tools` is `--tools true`."""

    def register(self, subparsers) -> None:
        """Add `posttrain <command>` with the common flags; other `--key value` pairs override config fields."""
        parser = config_command(subparsers, self.command, self.module, self.help, self.settings)
        parser.add_argument("--output-dir", action=Once, help="run directory (default: runs/<recipe>-<time>)")
        parser.add_argument("--max-steps", action=Once, type=int, help="training steps")
        parser.add_argument("--seed", action=Once, type=int, help="random seed")
        parser.add_argument("--resume", action=Once, metavar="DIR", help="continue the run in DIR from its newest complete checkpoint")
        parser.add_argument("--resume-changed-config", action="store_true",
                            help="with --resume: accept --key value changes that alter the data order or the loss (recorded in the run card)")
        for switch in self.switches:
            parser.add_argument(f"--{switch.replace('_', '-')}", dest=f"switch_{switch}", action="store_true",
                                help=f"the same as --{switch} true")
        parser.set_defaults(func=self.run)

    def run(self, args: argparse.Namespace) -> int:
        """The command's `func`: build the config, run the recipe, print its three-line summary
        (held-out, training, where the results are; `runs.results.summary_lines`)."""
        from posttrain.atomic import output_path_problem
        from posttrain.runs.directory import check_new_run
        from posttrain.runs.training_state import check_unfinished

        loaded = importlib.import_module(self.module)
        settings = resolve_config(settings_factory(self.module, self.settings), args, self.command)
        if args.resume:  # a finished run is one line before any work (the recipe's open_run asks again)
            check_unfinished(args.resume, settings.max_steps)
        # Before any work, so that a bad --output-dir never costs the model's loading; under torchrun rank 0
        # alone asks (another rank could see the directory rank 0 has just made).
        if settings.output_dir and not args.resume and os.environ.get("RANK", "0") == "0":
            if self.new_directory:
                check_new_run(settings.output_dir)
            elif (problem := output_path_problem(settings.output_dir, directory=True)) is not None:
                raise UserError(f"--output-dir {settings.output_dir}: {problem}")
        extra = {"resume_changed_config": True} if args.resume_changed_config else {}
        run_dir = loaded.run(settings, resume=bool(args.resume), **extra)
        if os.environ.get("RANK", "0") != "0":  # under torchrun rank 0 alone speaks
            return 0
        report = Path(run_dir) / "report.md"
        if report.is_file():  # the demo: its report holds every stage
            print(f"report: {report}")
        else:
            from posttrain.runs.results import summary_lines

            print("\n".join(summary_lines(run_dir)))
        return 0


RECIPES = (
    Recipe("demo", "posttrain.recipes.demo",
           "the main job: SFT -> GRPO vs pairs+DPO on the tiny model, with held-out acceptance and a report "
           "(--tools: SFT on tool transcripts, then GRPO with an add tool)",
           new_directory=False, switches=("tools",)),
    Recipe("dpo", "posttrain.recipes.dpo", "DPO family: pairwise preference loss against a frozen reference",
           settings="posttrain.recipes.dpo_config:Config"),
    Recipe("grpo", "posttrain.recipes.online", "GRPO: group-relative advantages, clipped surrogate, no critic",
           settings="posttrain.recipes.online_config:grpo_config"),
    Recipe("iterative-dpo", "posttrain.recipes.iterative_dpo", "rounds of sample -> label -> pairs -> DPO from the current policy, in one run directory"),
    Recipe("ppo", "posttrain.recipes.online", "PPO with a learned critic: GAE, clipped surrogate, clipped value loss",
           settings="posttrain.recipes.online_config:ppo_config"),
    Recipe("rm", "posttrain.recipes.rm", "reward model: a scalar head trained on preference pairs (Bradley-Terry), exported for --reward rm:DIR"),
    Recipe("sft", "posttrain.recipes.sft", "supervised fine-tuning: masked NLL on response tokens"),
)
"""Every training command. `posttrain demo` runs SFT, then GRPO and pairs + DPO from the same start."""
