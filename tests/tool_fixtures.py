"""User tools for tests/test_tools.py, importable by path (`tests.tool_fixtures:multiply`) so
they run in the worker pool like a user's `module:function`."""

from __future__ import annotations

import os
import signal
import time


def multiply(x: float, y: float) -> float:
    """Multiply two numbers.

    Args:
        x: The first factor.
        y: The second factor.
    """
    return x * y


def lookup(key: str, limit: int = 2) -> dict:
    """Look a key up.

    Args:
        key: The key.
        limit: How many values.
    """
    return {"key": key, "values": list(range(limit))}


def nothing() -> None:
    """Return nothing."""
    return None


def fail(message: str) -> str:
    """Raise a ValueError.

    Args:
        message: The error's message.
    """
    raise ValueError(message)


def sleepy(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


def stubborn(seconds: float) -> str:
    """Sleep with SIGALRM blocked, as code stuck in C would be: only the pool's hard deadline stops it.

    Args:
        seconds: How long to sleep.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    try:
        time.sleep(seconds)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
    return "awake"


def crash(status: int) -> str:
    """End the worker process at once, as a segfault would.

    Args:
        status: The exit status.
    """
    os._exit(status)


def add(a: int, b: int) -> int:
    """A second tool named add.

    Args:
        a: One.
        b: Two.
    """
    return a + b


def undocumented(x: int) -> int:
    """No Args section: no schema."""
    return x
