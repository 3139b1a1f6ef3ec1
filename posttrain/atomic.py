"""The one atomic file writer: every file a run or a command writes whole (config, run card, eval
results, plots, pairs and their provenance, the DPO reference cache, review sheets) goes through
`write_atomically`; only the append-only logs (metrics.jsonl, samples.jsonl: `runs/directory.py`)
and the checkpoint directories (staged in a temporary directory, then renamed: `runs/checkpoint.py`)
are written otherwise.

    write_text_atomically(run_dir / "summary.json", json.dumps(summary))
    write_atomically(path, lambda stream: torch.save(cache, stream))

An output a user names (`--out`, `--output`, `--output-dir`) is checked before any work, so that a
mistake in it never costs the run: `check_output_file` / `output_path_problem`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from posttrain.errors import UserError, WriteFailed, write_errno


def write_atomically(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """Write `path` by calling `write` with a binary file open on a temporary file in the same
    directory (created if missing), then fsync and rename: a crash leaves the old file or the new
    one, never half of it. An OSError with an errno, or any error behind which is a full disk (`errors.DISK_ERRNOS`,
    also behind torch's and safetensors' writers), is a one-line `WriteFailed` naming `path`; the
    temporary file is removed whatever stopped the write."""
    path = Path(path)
    handle, temporary = None, None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(handle, "wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
        number = write_errno(error) or (error.errno if isinstance(error, OSError) else None)
        if number:  # named by `path`, not by the temporary file an OSError may name
            raise WriteFailed(path, os.strerror(number)) from error
        raise


def write_text_atomically(path: str | Path, text: str) -> None:
    """`write_atomically` of `text`, UTF-8."""
    write_atomically(path, lambda stream: stream.write(text.encode("utf-8")))


def output_path_problem(path: str | Path, directory: bool = False) -> str | None:
    """Why `path` cannot be made an output file (or, with `directory`, an output directory): it
    exists as the other kind, a parent of it is a file, or its nearest existing parent is not
    writable; None if it can. Whether it already exists is the caller's question."""
    path = Path(path)
    if path.exists() and path.is_dir() != directory:
        return "is a directory, not a file" if path.is_dir() else "is a file, not a directory"
    parent = path if path.is_dir() else path.parent  # where the new file (or the run's files) will be made
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable"
    return None


def check_output_file(path: str | Path, flag: str, overwrite: bool = False) -> Path:
    """`path` as a new output file of the command-line flag `flag`, checked before any work: a one-line
    UserError if it cannot be written (`output_path_problem`) or, unless `overwrite`, already exists."""
    path = Path(path)
    problem = output_path_problem(path)
    if problem is not None:
        raise UserError(f"{flag} {path}: {problem}")
    if path.exists() and not overwrite:
        raise UserError(f"{flag} {path}: already exists; pass --overwrite to replace it, or choose another {flag}")
    return path
