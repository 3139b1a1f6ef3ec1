"""Step 0 of `posttrain compare` (compare.py): every input checked before any work. --output-dir may
hold only an earlier comparison and none of the inputs; --start and --teacher are resolved to a model
directory and loaded once; --pairs is read and validated whole, as each offline row reads it. A
mistake is one UserError line naming its flag, and nothing is written (an earlier comparison in
--output-dir stays until `fresh_directory` replaces it).
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.data.preference import load_preference_file
from posttrain.data.provenance import read_provenance
from posttrain.errors import UserError
from posttrain.models import load_model
from posttrain.recipes import stages
from posttrain.rewards.teacher import teacher_directory


@dataclass(frozen=True)
class Inputs:
    """The comparison's inputs, checked (`check_inputs`)."""

    output_dir: Path
    """--output-dir, resolved: empty, absent, or an earlier comparison that `fresh_directory` replaces."""
    start: str | None
    """--start's model directory (`start_model`); None: the demo's SFT stage trains one."""
    pairs: dict[str, Any] | None
    """--pairs' provenance sidecar ({} without one); None: the pairs are sampled from the start."""
    teacher: str | None
    """--teacher's model directory; None: the teacher's rows are left out or refused."""


def check_inputs(output_dir: str, start: str | None, pairs: str | None, teacher: str | None) -> Inputs:
    """Every flag naming a path checked, the output directory first; the first mistake is one UserError line."""
    out = Path(output_dir).resolve()
    check_output_dir(out, start, pairs, teacher)
    return Inputs(out, check_start(start) if start else None, check_pairs(pairs) if pairs else None,
                  check_teacher(teacher) if teacher else None)


def check_teacher(teacher: str) -> str:
    """`--teacher`'s model directory (a run directory's `final/` export, else its newest checkpoint, or a
    model directory), loaded once to prove it loads; a UserError line naming the flag otherwise."""
    path = Path(teacher).expanduser()
    if not path.is_dir():
        raise UserError(f"--teacher {teacher}: no such directory (give a model directory, or a run directory with final/)")
    final = teacher_directory(str(path))
    model = str(Path(final).resolve()) if final != str(path) else start_model(path, "--teacher")
    try:
        load_model(model)
    except UserError as error:
        raise UserError(f"--teacher {teacher}: {error}") from None
    return model


def check_start(start: str) -> str:
    """`--start`'s model directory (`start_model`), loaded once to prove it loads; a UserError line naming the flag otherwise."""
    path = Path(start).expanduser()
    if not path.is_dir():
        raise UserError(f"--start {start}: no such directory (give an SFT run directory or a model directory)")
    model = start_model(path)
    try:
        load_model(model)
    except UserError as error:
        raise UserError(f"--start {start}: {error}") from None
    return model


def check_pairs(pairs_file: str) -> dict[str, Any]:
    """`--pairs`: a file of preference pairs every offline row can read (read and validated whole, as each row's
    `posttrain dpo` reads it); returns its provenance sidecar ({} without one). A UserError line naming the flag otherwise."""
    path = Path(pairs_file).expanduser()
    if not path.is_file():
        raise UserError(f"--pairs {pairs_file}: no such file")
    try:
        load_preference_file(path, unpaired_advice="--pairs takes preference pairs (every offline row trains on them; KTO reads "
                                                   "each pair as a desirable and an undesirable row): make them with posttrain pairs")
        return read_provenance(path) or {}
    except UserError as error:  # the reader's bad-row report in one line: its first bad row and the count (compare has no data.* flags)
        lines = str(error).splitlines()
        counts = re.search(r"\d+ rows read, \d+ bad", lines[0])
        detail = f"{lines[1]} ({counts.group(0)}; each offline row reads the file as posttrain dpo does)" if counts and len(lines) > 1 else lines[0]
        raise UserError(f"--pairs {pairs_file}: {detail}") from None


def start_model(path: Path, flag: str = "--start") -> str:
    """The start's (or `flag`'s) model directory: `path` itself, or a run directory's newest checkpoint."""
    if (path / "checkpoints").is_dir():
        return stages.last_checkpoint(path, stages.newest_step(path))
    if not (path / "config.json").is_file():
        raise UserError(f"{flag} {path}: neither a model directory (config.json) nor a run directory (checkpoints/step-N/model)")
    return str(path.resolve())


def check_output_dir(out: Path, start: str | None, pairs: str | None, teacher: str | None = None) -> None:
    """`out` may hold only an earlier comparison (comparison.json), which a new one replaces, and so may not hold
    --start, --pairs or --teacher (the replacement would delete them): else one UserError line."""
    for flag, given in (("--start", start), ("--pairs", pairs), ("--teacher", teacher)):
        if given is not None and out in Path(given).resolve().parents:
            raise UserError(f"{flag} {given} lies inside --output-dir {out}, which a new comparison replaces; choose another --output-dir")
    if out.exists() and (not out.is_dir() or (not (out / "comparison.json").exists() and any(out.iterdir()))):
        raise UserError(f"--output-dir {out}: holds something other than a finished comparison; choose another")


def fresh_directory(out: Path) -> Path:
    """`out` (`check_output_dir` passed), created empty: an earlier comparison there is replaced."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    return out
