"""The one exception type for user mistakes, and its kind for files that cannot be written.

A `UserError` is a bad config key, file, row, field or argument. The CLI prints it as one line
(`posttrain: error: ...`) and exits with `exit_code`, never with a traceback. A `WriteFailed` is a
file of ours that could not be written (disk full, file too large, read-only...):
`cannot write PATH: <reason> (<free> free on <mount point>)`, exit code 74 (sysexits' EX_IOERR).
"""

from __future__ import annotations

import errno
import io
import os
import re
import shutil
from pathlib import Path

# What a full, quota-limited, size-limited, failing or read-only filesystem answers to a write.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS})


class UserError(Exception):
    """A mistake in what the user gave us; its message names the file, row, field or argument."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


class WriteFailed(UserError):
    """`path` could not be written because of `reason`; the message adds the space left on its filesystem."""

    def __init__(self, path: str | Path | None, reason: str):
        self.path = Path(path) if path is not None else None
        mount, free = free_space(self.path if self.path is not None else Path.cwd())
        named = str(path) if path is not None else "a file (the error names none)"
        super().__init__(f"cannot write {named}: {reason} ({format_bytes(free)} free on {mount})", exit_code=74)


def write_errno(error: BaseException) -> int | None:
    """The errno of `DISK_ERRNOS` behind `error`: an OSError's, one in its chain (torch's zip writer
    raises a RuntimeError whose context is the OSError of a file object), or Rust's "(os error N)"
    (safetensors); None if there is none."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in DISK_ERRNOS:
            return error.errno
        found = re.search(r"\(os error (\d+)\)", str(error))
        if found and int(found.group(1)) in DISK_ERRNOS:
            return int(found.group(1))
        error = error.__cause__ or error.__context__
    return None


def write_failed(error: BaseException, path: str | Path | None) -> WriteFailed:
    """The one-line error for `error` raised while writing `path` (an OSError's own file name wins)."""
    number = write_errno(error)
    if isinstance(error, OSError):
        path = error.filename or path
        number = number or error.errno
    reason = os.strerror(number) if number else " ".join(str(error).split())[:200]
    return WriteFailed(path, reason)


def file_being_written(error: BaseException) -> str | None:
    """The file open for writing in the innermost frame of `error`'s traceback that holds one, else
    None. A failed `write` names no file, but `path.write_text` and `with open(...) as f` keep it in a
    local (Rust's and torch's writers to a path do not: None)."""
    frames, traceback = [], error.__traceback__
    while traceback is not None:
        frames.append(traceback.tb_frame)
        traceback = traceback.tb_next
    for frame in reversed(frames):
        for value in frame.f_locals.values():
            if isinstance(value, io.IOBase) and isinstance(getattr(value, "name", None), str) \
                    and set(getattr(value, "mode", "")) & set("wax+"):
                return value.name
    return None


def free_space(path: Path) -> tuple[Path, int]:
    """The mount point of `path`'s filesystem (from its nearest existing parent) and the bytes free on
    it to an unprivileged user."""
    existing = Path(os.path.abspath(path))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    while not os.path.ismount(existing):
        existing = existing.parent
    return existing, free


def format_bytes(count: float) -> str:
    """`512` -> "512 B", `1536` -> "1.5 KiB", `3 * 2**30` -> "3.0 GiB"."""
    units, power = ("B", "KiB", "MiB", "GiB", "TiB"), 0
    while abs(count) >= 1024 and power < len(units) - 1:
        count, power = count / 1024, power + 1
    return f"{count:.0f} B" if power == 0 else f"{count:.1f} {units[power]}"
