"""Atomic, verified checkpoints: temp dir + fsync + rename; the newest complete one wins.

Layout of `checkpoints/step-000012/`: `model/` (a Hugging Face directory, loadable by
`AutoModelForCausalLM.from_pretrained`, or a LoRA adapter), any extra model directories
(`critic/`), `trainer_state.pt` (optimizer, scheduler, RNG states, data position, step) and
`MANIFEST.json` (size and SHA-256 of every file), written last. A directory whose manifest is
missing or does not match its files is incomplete or corrupted: `latest_checkpoint` skips it with a
warning and returns the previous one. Old checkpoints are removed only after the new one is complete.
A write that fails (disk full, file too large...) removes the temporary directory at once and raises a
one-line `WriteFailed`; the complete checkpoints are left as they were. Before each checkpoint a
warning says when the free space is under 1.5x the last one's size.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from posttrain.errors import WriteFailed, file_being_written, format_bytes, free_space, write_errno, write_failed

logger = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
PREFIX = "step-"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Every RNG a CPU run draws from: Python, NumPy and torch (CUDA too when present)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_step_checkpoint(
    checkpoints_dir: str | Path,
    step: int,
    write_models: Callable[[Path], None],
    trainer_state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write checkpoint `step` atomically and keep only the newest `keep` complete ones.

    Args:
        checkpoints_dir: the run's `checkpoints/`.
        step: the number of completed training steps.
        write_models: called with a temporary directory; writes `model/` (and e.g. `critic/`) into it,
            typically with `save_pretrained`.
        trainer_state: optimizer/scheduler state dicts, RNG states, data position... (torch.save-able).
        keep: complete checkpoints to keep (>= 1).

    Returns:
        the final checkpoint directory.
    """
    checkpoints_dir = Path(checkpoints_dir)
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoints_dir / f"{PREFIX}{step:06d}"
    temporary = checkpoints_dir / f".tmp-{PREFIX}{step:06d}-{os.getpid()}"
    _warn_if_short_of_space(checkpoints_dir)
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        _write_temporary(temporary, step, write_models, trainer_state)
    except BaseException as error:  # the partial checkpoint goes at once, whatever stopped it
        failure = _write_failure(error, temporary)  # before it goes: the free space the write found
        shutil.rmtree(temporary, ignore_errors=True)
        if failure is None:
            raise
        raise failure from error
    if final.exists():  # a stale copy of the same step (e.g. from before a crash): replace it
        shutil.rmtree(final)
    os.replace(temporary, final)
    _fsync(checkpoints_dir)
    for old in complete_checkpoints(checkpoints_dir, verify=False)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in checkpoints_dir.glob(f".tmp-{PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    logger.info("checkpoint saved: %s", final)
    return final


def _write_temporary(temporary: Path, step: int, write_models: Callable[[Path], None], trainer_state: dict[str, Any]) -> None:
    """The checkpoint's files in `temporary`, the manifest last, all fsynced."""
    temporary.mkdir()
    write_models(temporary)
    with (temporary / "trainer_state.pt").open("wb") as handle:  # a file object: a failed write's errno reaches us
        torch.save({**trainer_state, "step": step}, handle)
    files = sorted(p for p in temporary.rglob("*") if p.is_file())
    manifest = {
        "step": step,
        "files": {str(p.relative_to(temporary)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files},
    }
    for path in files:
        _fsync(path)
    (temporary / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync(temporary / MANIFEST)
    for directory in sorted({p.parent for p in files} | {temporary}):
        _fsync(directory)


def _warn_if_short_of_space(checkpoints_dir: Path) -> None:
    """Warn when the free space is under 1.5x the newest complete checkpoint's size (its manifest's
    bytes): the next one is written beside it, and the old one goes only once the new one is complete."""
    previous = complete_checkpoints(checkpoints_dir, verify=False)
    if not previous:
        return
    try:
        size = sum(entry["bytes"] for entry in json.loads((previous[-1] / MANIFEST).read_text())["files"].values())
    except (OSError, ValueError, KeyError, TypeError):
        return
    mount, free = free_space(checkpoints_dir)
    if free < 1.5 * size:
        logger.warning("%s: %s free on %s, and the last checkpoint (%s) took %s: the next one may not fit",
                       checkpoints_dir, format_bytes(free), mount, previous[-1].name, format_bytes(size))


def _write_failure(error: BaseException, temporary: Path) -> WriteFailed | None:
    """The one-line error for a checkpoint write that failed, naming the file being written where the
    error tells it, else the temporary directory; None if `error` is no write failure."""
    torch_writer = isinstance(error, RuntimeError) and re.search(r"inline_container|PytorchStreamWriter", str(error))
    if not (isinstance(error, OSError) or write_errno(error) or torch_writer):
        return None
    written = file_being_written(error)
    path = written if written and Path(written).is_relative_to(temporary) else temporary
    if torch_writer and not write_errno(error):  # torch.save to a path hides the errno: the free space tells
        return WriteFailed(path, f"torch's writer failed ({' '.join(str(error).split())[:200]})")
    return write_failed(error, path)


def verify_checkpoint(directory: Path) -> str | None:
    """None if `directory` is a complete checkpoint whose files match its manifest, else why not."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (incomplete write)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "unreadable manifest"
    for name, expected in manifest.get("files", {}).items():
        path = directory / name
        if not path.is_file():
            return f"missing {name}"
        if path.stat().st_size != expected["bytes"] or _sha256(path) != expected["sha256"]:
            return f"{name} does not match its checksum (truncated or corrupted)"
    return None


def complete_checkpoints(checkpoints_dir: str | Path, verify: bool = True) -> list[Path]:
    """Checkpoint directories in step order; with `verify`, only those that pass `verify_checkpoint`."""
    checkpoints_dir = Path(checkpoints_dir)
    if not checkpoints_dir.is_dir():
        return []
    candidates = sorted(p for p in checkpoints_dir.glob(f"{PREFIX}*") if p.is_dir())
    if not verify:
        return [p for p in candidates if (p / MANIFEST).is_file()]
    return [p for p in candidates if verify_checkpoint(p) is None]


def latest_checkpoint(checkpoints_dir: str | Path) -> Path | None:
    """The newest checkpoint that verifies; warns about each newer one that does not."""
    checkpoints_dir = Path(checkpoints_dir)
    if not checkpoints_dir.is_dir():
        return None
    for candidate in sorted((p for p in checkpoints_dir.glob(f"{PREFIX}*") if p.is_dir()), reverse=True):
        problem = verify_checkpoint(candidate)
        if problem is None:
            return candidate
        logger.warning("skipping checkpoint %s: %s; using the previous one", candidate, problem)
    return None


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """The trainer state saved with a checkpoint (contains Python/NumPy RNG states: trusted files only),
    its tensors on the CPU whatever device saved them (the optimizer's `load_state_dict` moves its
    state to the parameters' device)."""
    return torch.load(checkpoint / "trainer_state.pt", weights_only=False, map_location="cpu")  # any device resumes it
