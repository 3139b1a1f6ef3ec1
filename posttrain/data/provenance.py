"""A data file's provenance sidecar: `pairs.jsonl` -> `pairs.meta.json`, next to it, saying where the
rows came from (for `posttrain pairs` files: model, verifier, task, seed, sampling) and holding the
file's SHA-256, so a reader can tell whether the file is still the one it describes. `reward_card`
is the run card's reward link of a run on such a file: who labelled the pairs, as the sidecar says.
Also the atomic file writer (`write_atomically`; `write_text_atomically` for text) that these files,
the run card, eval results and the DPO reference cache go through.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable

from posttrain.errors import UserError, WriteFailed, write_errno

logger = logging.getLogger(__name__)


def provenance_path(data_path: str | Path) -> Path:
    """`pairs.jsonl` -> `pairs.meta.json`, next to it."""
    path = Path(data_path)
    return path.with_name(path.name.removesuffix(".jsonl") + ".meta.json")


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def read_provenance(data_path: str | Path) -> dict[str, Any] | None:
    """The sidecar next to a data file (None if there is none), with `file_matches` telling whether
    the file is still the one it describes (a mismatch is logged, not an error)."""
    sidecar = provenance_path(data_path)
    if not sidecar.is_file():
        return None
    try:
        meta = json.loads(sidecar.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{sidecar}: not valid JSON (the provenance of {data_path}); fix or delete it") from None
    meta["file_matches"] = meta.get("sha256") == file_sha256(data_path)
    if not meta["file_matches"]:
        logger.warning("%s: the file changed after %s was written; its provenance may not apply", data_path, sidecar)
    return meta


def reward_card(pairs: str, provenance: dict[str, Any] | None) -> dict[str, Any]:
    """The run card's reward link of a run on the preference pairs file `pairs`: who labelled them,
    as their `provenance` (`read_provenance`; None: no sidecar) records it."""
    if not provenance:
        return {"labels": f"as given in {pairs} (who labelled them is not recorded)"}
    return {
        "labels": f"labels came from verifier {provenance.get('verifier')} on samples of model {provenance.get('model')}",
        "verifier": provenance.get("verifier"), "verifier_settings": provenance.get("verifier_settings"),
        "correct_threshold": provenance.get("correct_threshold"), "pairs_seed": provenance.get("seed"),
        "provenance_file_matches": provenance["file_matches"],
    }


def write_atomically(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """Write `path` by calling `write` with a binary file open on a temporary file in the same
    directory, then fsync and rename: a crash leaves the old file or the new one, never half of it. A
    full disk (or another write failure of `errors.DISK_ERRNOS`, also behind torch's writer) is a
    one-line `WriteFailed` naming `path`; the temporary file is removed whatever stopped the write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        number = write_errno(error)
        failure = WriteFailed(path, os.strerror(number)) if number else None
        Path(temporary).unlink(missing_ok=True)
        if failure is not None:
            raise failure from error
        raise


def write_text_atomically(path: str | Path, text: str) -> None:
    """`write_atomically` of `text`, UTF-8."""
    write_atomically(path, lambda stream: stream.write(text.encode("utf-8")))


def write_with_provenance(out: str | Path, rows: list[dict], provenance: dict[str, Any]) -> None:
    """The JSONL file, then its sidecar (`provenance` plus the file's SHA-256, added to the dict),
    each written atomically, so a crash leaves no half-written file under either name."""
    out = Path(out)
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    provenance["sha256"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    write_text_atomically(out, text)
    write_text_atomically(provenance_path(out), json.dumps(provenance, indent=1, default=str) + "\n")
