"""Atomic, verified checkpoints: temp dir + fsync + rename; the newest complete one wins.

Layout of `checkpoints/step-000012/`: `model/` (a Hugging Face directory, loadable by
`AutoModelForCausalLM.from_pretrained`, or a LoRA adapter), any extra model directories
(`critic/`), `trainer_state.pt` (optimizer, scheduler, RNG states, data position, step) and
`MANIFEST.json` (size and SHA-256 of every file), written last. A directory whose manifest is
missing or does not match its files is incomplete or corrupted: `latest_checkpoint` skips it with a
warning and returns the previous one. Old checkpoints are removed only after the new one is complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

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


def save_checkpoint(
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
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    write_models(temporary)
    torch.save({**trainer_state, "step": step}, temporary / "trainer_state.pt")
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
