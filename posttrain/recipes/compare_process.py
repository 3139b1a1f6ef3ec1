"""The processes of `posttrain compare` (compare.py): each row, and each offline file it samples
(compare_samples.py), is `sys.executable -m posttrain ...` in a process of its own, so that its wall
time and peak RSS are its own and a failure is one line of the table, not the end of the comparison.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def run_child(arguments: list[str], log: Path, threads: int) -> tuple[float, float | None, str | None]:
    """Run `python -m posttrain ARGUMENTS` with its output in `log`; returns (wall seconds, its peak
    RSS in MiB, its one-line error or None). os.wait4 reads the child's own resource usage."""
    log.parent.mkdir(parents=True, exist_ok=True)
    clock = time.perf_counter()
    with log.open("w") as stream:
        stream.write("$ posttrain " + " ".join(arguments) + "\n")
        stream.flush()
        child = subprocess.Popen([sys.executable, "-m", "posttrain", *arguments], stdout=stream, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - clock
    peak = usage.ru_maxrss / 1024  # KiB on Linux
    return seconds, peak, None if child.returncode == 0 else _error_line(log, child.returncode)


def _error_line(log: Path, code: int) -> str:
    """A failed child's one line: its `posttrain: error:` line, else its last line (a traceback's exception)."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("posttrain: ")]
    line = errors[-1].removeprefix("posttrain: error: ").removeprefix("posttrain: ") if errors else (lines[-1] if len(lines) > 1 else "no output")
    return f"{line} (exit {code}; {log.name})"
