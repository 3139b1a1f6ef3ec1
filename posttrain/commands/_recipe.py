"""Command-line glue shared by the commands whose settings are a config dataclass (sft, grpo, ppo,
dpo, demo, and pairs, which is not a training recipe).

Every such command takes `--config FILE` and any config field as `--key value` (dotted for
sections); a recipe command also takes `--output-dir DIR`, `--max-steps N`, `--seed N` and
`--resume DIR`. The module defining the settings is imported only when its command runs or shows
--help, so other commands start without torch's heavier dependencies. (Skipped by command discovery: its name starts with an underscore.)
"""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path

from posttrain.config import build_config, describe_fields, load_yaml, parse_overrides
from posttrain.errors import UserError

RESUMABLE_OVERRIDES = {"max_steps"}


def resolve_config(config_cls, args: argparse.Namespace):
    """Build a recipe config from `--config`, the common flags and `--key value` overrides.

    With `--resume DIR` the config is the run's own `config.yaml`; only `--max-steps` may change,
    unless `--resume-changed-config` is given: then any `--key value` applies, and the recipe
    records the changes that alter the data order or the loss in the run card (`runs/faults.py`).
    """
    overrides = parse_overrides(list(getattr(args, "overrides", []) or []))
    for flag in ("output_dir", "max_steps", "seed"):
        if getattr(args, flag, None) is not None:
            overrides[flag] = getattr(args, flag)
    if args.resume:
        changed = set(_dotted(overrides)) - RESUMABLE_OVERRIDES - {"output_dir"}
        if args.config or (changed and not getattr(args, "resume_changed_config", False)):
            raise UserError(
                f"--resume continues a run with its own config.yaml; only --max-steps may change "
                f"(got {', '.join(sorted(changed)) or '--config'}; --resume-changed-config accepts other --key value changes)"
            )
        run_dir = Path(args.resume)
        if not (run_dir / "config.yaml").is_file():
            raise UserError(f"{run_dir}: not a run directory (no config.yaml) - nothing to resume")
        saved = load_yaml(run_dir / "config.yaml")
        return build_config(config_cls, None, {**saved, **overrides, "output_dir": str(run_dir)})
    return build_config(config_cls, args.config, overrides)


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

    `module` is imported only when --help is shown (or by the caller's `func`), so that every other
    command starts without importing torch, transformers and peft.
    """

    class ConfigParser(subparsers._parser_class):  # the CLI's one-line-error parser, plus a lazy epilog
        def format_help(self) -> str:
            fields = describe_fields(settings_factory(module, config))
            width = max(len(key) for key, _, _ in fields)
            self.epilog = "config fields (as --key value, or in the YAML file):\n" + "\n".join(
                f"  {key:<{width}}  {doc} [default {default}]" for key, default, doc in fields
            )
            return super().format_help()

    parser = subparsers.add_parser(
        name, help=help_text, description=description or help_text, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.__class__ = ConfigParser
    parser.add_argument("--config", help="YAML preset; its keys override the defaults")
    parser.set_defaults(accepts_overrides=True)
    return parser


def register_recipe(subparsers, name: str, module: str, help_text: str, config: str = "Config") -> None:
    """Add `posttrain NAME` with the common flags; other `--key value` pairs override config fields.

    `module` (e.g. "posttrain.recipes.sft") must define `run(config, resume=False)`; `config` names
    its config class or a function returning the command's default config, in `module` or as
    "other.module:name" (two commands may share a recipe with different defaults: grpo and ppo).
    It is imported only when the command runs or its --help is shown (see `config_command`).
    """
    parser = config_command(subparsers, name, module, help_text, config)
    parser.add_argument("--output-dir", help="run directory (default: runs/<recipe>-<time>)")
    parser.add_argument("--max-steps", type=int, help="training steps")
    parser.add_argument("--seed", type=int, help="random seed")
    parser.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its newest complete checkpoint")
    parser.add_argument("--resume-changed-config", action="store_true",
                        help="with --resume: accept --key value changes that alter the data order or the loss (recorded in the run card)")

    def handler(args) -> int:
        loaded = importlib.import_module(module)
        settings = resolve_config(settings_factory(module, config), args)
        extra = {"resume_changed_config": True} if args.resume_changed_config else {}
        run_dir = loaded.run(settings, resume=bool(args.resume), **extra)
        if os.environ.get("RANK", "0") != "0":  # under torchrun rank 0 alone speaks
            return 0
        report = Path(run_dir) / "report.md"
        print(f"report: {report}" if report.is_file() else f"results: {run_dir}")
        return 0

    parser.set_defaults(func=handler)
