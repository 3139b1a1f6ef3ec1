"""Command lines for tests that change a default flag: the command line refuses a key given twice."""

from __future__ import annotations


def with_flags(args: list[str], *flags: str) -> list[str]:
    """`args` with each `--key value` pair of `flags` set: its value replaced where `args` has the key,
    else added (the command line refuses a key given twice)."""
    args = list(args)
    for key, value in zip(flags[::2], flags[1::2]):
        if key in args:
            args[args.index(key) + 1] = value
        else:
            args += [key, value]
    return args
