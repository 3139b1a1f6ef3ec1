"""The one atomic file writer: every file a run or a command writes whole (config, run card, eval
results, plots, pairs and their provenance, the DPO reference cache, review sheets) goes through
`write_atomically`; only the append-only logs (metrics.jsonl, samples.jsonl: `runs/directory.py`)
and the checkpoint directories (staged in a temporary directory, then renamed: `runs/checkpoint.py`)
are written otherwise.

    write_text_atomically(run_dir / "summary.json", json.dumps(summary))
    write_atomically(path, lambda stream: torch.save(cache, stream))
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from posttrain.errors import WriteFailed, write_errno


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
