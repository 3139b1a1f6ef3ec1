"""`posttrain <command>`: the command line.

Each command lives in its own module under `posttrain/commands/` and exposes
`register(subparsers)`, which adds its parser and sets `func` (a callable taking the parsed
arguments and returning an exit code). Modules are found automatically, so adding a command never
edits this file.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys

from posttrain import __version__, commands
from posttrain.errors import UserError, file_being_written, write_errno, write_failed


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a single line and exit code 2 (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="posttrain", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=OneLineErrorParser
    )
    for module_info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{commands.__name__}.{module_info.name}")
        module.register(subparsers)
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
