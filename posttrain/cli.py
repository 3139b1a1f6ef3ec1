"""`posttrain <command>`: the command line.

The training recipes (sft, grpo, ppo, dpo, demo) are rows of one table,
`posttrain.commands._recipe.RECIPES`; every other command lives in its own module under
`posttrain/commands/` and exposes `register(subparsers)`, which adds its parser and sets `func` (a
callable taking the parsed arguments and returning an exit code). Modules are found automatically,
so adding a command never edits this file.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys
from typing import Callable

from posttrain import __version__, commands
from posttrain.commands._recipe import RECIPES
from posttrain.errors import UserError, file_being_written, write_errno, write_failed


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a single line and exit code 2 (no usage dump).

    `deferred(parser)`, if given, adds what needs a heavy import (a recipe's config fields in the
    epilog, explain's loss names); it is called once, the first time the parser parses or shows its
    help, so that `posttrain --help` and every other command start without importing torch.
    """

    def __init__(self, *args, deferred: Callable[[argparse.ArgumentParser], None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._deferred = deferred

    def _add_deferred(self) -> None:
        if self._deferred is not None:
            deferred, self._deferred = self._deferred, None
            deferred(self)

    def parse_known_args(self, args=None, namespace=None):
        self._add_deferred()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._add_deferred()
        return super().format_help()

    def format_usage(self) -> str:
        self._add_deferred()
        return super().format_usage()

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="posttrain", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=OneLineErrorParser
    )
    registrars = {recipe.command: recipe.register for recipe in RECIPES}
    for module_info in pkgutil.iter_modules(commands.__path__):
        if not module_info.name.startswith("_"):
            registrars[module_info.name] = importlib.import_module(f"{commands.__name__}.{module_info.name}").register
    for name in sorted(registrars):  # `posttrain --help` lists the commands in this order
        registrars[name](subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Recipe commands take any config field as `--key value`; every other command is strict.
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as error:  # a stop asked by a signal is not an error: "posttrain: stopped by SIGTERM at step N; ..."
        print(f"posttrain: {error}" if getattr(error, "signum", None) else f"posttrain: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print("posttrain: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`posttrain ... | head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as error:  # a disk full or failing where no writer of ours caught it: one line too
        if write_errno(error) is None:
            raise
        failure = write_failed(error, file_being_written(error))
        print(f"posttrain: error: {failure}", file=sys.stderr)
        return failure.exit_code


if __name__ == "__main__":
    sys.exit(main())
