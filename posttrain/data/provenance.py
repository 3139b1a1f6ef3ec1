"""A data file's provenance sidecar: `pairs.jsonl` -> `pairs.meta.json`, next to it, saying where the
rows came from (for `posttrain pairs` files: model, verifier, task, seed, sampling) and holding the
file's SHA-256, so a reader can tell whether the file is still the one it describes. `reward_card`
is the run card's reward link of a run on such a file: who labelled the pairs, as the sidecar says.
Both files are written by the one atomic writer, `posttrain/atomic.py`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from posttrain.atomic import write_text_atomically
from posttrain.errors import UserError

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


def rows_card(path: str, provenance: dict[str, Any] | None) -> dict[str, Any] | None:
    """The SFT run card's account of where a file's rows came from, as its sidecar records it (None:
    no sidecar). A `posttrain pairs --sft` file: "samples of model M (teacher), keep K, verifier V"
    with its row and completion-token counts, the budget a comparison run matches."""
    if not provenance:
        return None
    what = f"{provenance.get('kind', 'rows')}: samples of model {provenance.get('model')}"
    if provenance.get("sft"):
        what += f", --keep {provenance.get('keep')} ({provenance.get('keep_means')}), verifier {provenance.get('verifier')}"
    keys = ("model", "verifier", "task", "seed", "group_size", "keep", "distinct", "rows", "completion_tokens", "samples",
            "samples_correct", "max_rows", "max_tokens", "budget_reached", "sha256")
    return {"rows_from": what, **{key: provenance[key] for key in keys if key in provenance},
            "provenance_file": str(provenance_path(path)), "provenance_file_matches": provenance["file_matches"]}


def write_with_provenance(out: str | Path, rows: list[dict], provenance: dict[str, Any]) -> None:
    """The JSONL file, then its sidecar (`provenance` plus the file's SHA-256, added to the dict),
    each written atomically, so a crash leaves no half-written file under either name."""
    out = Path(out)
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    provenance["sha256"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    write_text_atomically(out, text)
    write_text_atomically(provenance_path(out), json.dumps(provenance, indent=1, default=str) + "\n")
