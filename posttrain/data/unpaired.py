"""Unpaired preference rows for KTO, in TRL's unpaired layout, and the reference point's mismatched
completions.

Standard:        {"prompt": "...", "completion": "...", "label": true}
Conversational:  {"prompt": [messages], "completion": [one assistant message], "label": false}
`label` true is a desirable completion, false an undesirable one (a 0 / 1 integer is read the same);
optional `id`, `metadata`, every other field kept in metadata. A paired file (prompt, chosen,
rejected) is read as two rows per pair, chosen desirable and rejected undesirable (TRL's
`unpair_preference_dataset`). Files, formats (`trl_unpaired`), column maps and splits as for pairs.

KTO's reference point z0 is the policy's log-ratio on (prompt, completion) pairs that do not belong
together. Each row is given, once at load, the completion of another row with a different prompt
(a seeded cycle), so the mismatched completion is fixed per row: a precomputed reference covers it,
and a batch's z0 does not depend on how the batch is split. (TRL pairs each prompt with the
previous row's completion inside each batch; both estimate the same expectation.) A row then
travels as a `PreferencePair` whose `chosen` is its completion and `rejected` its mismatched
completion, the label in `metadata["label"]`, so the pair tokeniser, the shared-prompt forward and
the reference cache serve KTO unchanged.

    splits = load_unpaired("rows.jsonl", tokenizer, heldout_pairs=32, split_seed=0)
    desirable = labels(splits.train)   # (M,) bool
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.data.examples import derived_seed
from posttrain.data.files import check_columns, column_names, map_row, read_rows, resolve_columns
from posttrain.data.preference import (
    KNOWN_FIELDS,
    UNPAIRED_COLUMNS,
    PairSplits,
    PreferencePair,
    load_preference_file,
    prompt_key,
    source_columns,
    split_pairs,
    truncated_splits,
)
from posttrain.data.tokenize import TruncationPolicy
from posttrain.data.validation import ValidationReport, check_messages, check_prompt_length, check_text, type_name
from posttrain.errors import UserError

@dataclass
class UnpairedRow:
    """One prompt (a string or chat messages), one completion, and whether it is desirable."""

    id: str
    prompt: str | list[dict]
    completion: str
    label: bool
    metadata: dict = field(default_factory=dict)


def parse_unpaired_row(report: ValidationReport, line: int, row: dict, file_name: str) -> UnpairedRow | None:
    """One row as an `UnpairedRow`, or None after reporting each of its problems."""
    ok = True
    for name in ("prompt", "completion", "label"):
        if name not in row:
            report.add(line, name, "missing field")
            ok = False
    if not ok:
        return None
    label = row["label"]
    if isinstance(label, bool) or (isinstance(label, int) and label in (0, 1)):
        label = bool(label)
    else:
        report.add(line, "label", f"expected true / false (or 1 / 0), got {label!r}")
        ok = False
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(completion, list) or isinstance(prompt, list):
        ok = check_messages(report, line, "prompt", prompt) and ok
        if check_messages(report, line, "completion", completion):
            if len(completion) != 1 or completion[0]["role"] != "assistant":
                report.add(line, "completion", "expected exactly one assistant message after a conversational prompt")
                ok = False
            else:
                completion = completion[0]["content"]
        else:
            ok = False
    else:
        ok = check_text(report, line, "prompt", prompt) and ok
        ok = check_text(report, line, "completion", completion) and ok
    metadata = row.get("metadata", {})
    if not isinstance(metadata, dict):
        report.add(line, "metadata", f"wrong type: expected an object, got {type_name(metadata)}")
        ok = False
    if not ok:
        return None
    extra = {key: value for key, value in row.items() if key not in KNOWN_FIELDS | set(UNPAIRED_COLUMNS)}
    return UnpairedRow(id=str(row.get("id", f"{file_name}:{line}")), prompt=prompt, completion=completion, label=label,
                       metadata={**metadata, **extra, "source": file_name, "line": line})


def is_unpaired(path: str | Path, *, data_format: str | None = None, columns: dict | None = None, source_split: str | None = None) -> bool:
    """Whether a source holds unpaired rows (a `completion` and a `label`) rather than pairs: from
    its columns, or for JSONL from its first row."""
    mapping = {**UNPAIRED_COLUMNS, **resolve_columns(data_format, columns)}
    present = source_columns(path, source_split)
    return mapping["completion"] in present and mapping["label"] in present


def unpair(pairs: list[PreferencePair]) -> list[UnpairedRow]:
    """Each pair as two rows: its chosen answer desirable, its rejected answer undesirable (ids
    `<pair id>/chosen`, `<pair id>/rejected`)."""
    rows = []
    for pair in pairs:
        for side, completion, label in (("chosen", pair.chosen, True), ("rejected", pair.rejected, False)):
            rows.append(UnpairedRow(f"{pair.id}/{side}", pair.prompt, completion, label, {**pair.metadata, "pair": pair.id}))
    return rows


def with_mismatched(rows: list[UnpairedRow], seed: int, name: str, pool: list[UnpairedRow] | None = None) -> list[PreferencePair]:
    """Each row as a `PreferencePair` (chosen = its completion, rejected = a mismatched completion:
    the next row of `pool` (default `rows`) with a different prompt, in a cycle seeded by `seed`;
    metadata label and mismatched_from). A pool of fewer than two distinct prompts is a UserError
    naming `name`. (The held-out rows of one prompt take their mismatched completions from every row:
    they only estimate the reference point, and carry no label into it.)"""
    if not rows:
        return []
    pool = rows if pool is None else pool
    if len({prompt_key(row.prompt) for row in pool}) < 2:
        raise UserError(f"{name}: KTO needs rows of at least two different prompts (its reference point pairs each prompt with "
                        f"another prompt's completion); these {len(pool)} rows share one")
    cycle = sorted(range(len(pool)), key=lambda i: derived_seed(seed, "kto-mismatch", pool[i].id, str(i)))
    position = {index: k for k, index in enumerate(cycle)}
    pairs = []
    for index, row in enumerate(rows):
        key = prompt_key(row.prompt)
        start = position[index] if pool is rows else derived_seed(seed, "kto-start", row.id, str(index)) % len(cycle)
        other = next(pool[cycle[(start + step) % len(cycle)]] for step in range(1, len(cycle) + 1)
                     if prompt_key(pool[cycle[(start + step) % len(cycle)]].prompt) != key)
        pairs.append(PreferencePair(id=row.id, prompt=row.prompt, chosen=row.completion, rejected=other.completion,
                                    metadata={**row.metadata, "label": row.label, "mismatched_from": other.id}))
    return pairs


def labels(pairs: list[PreferencePair]) -> torch.Tensor:
    """(M,) bool: each `with_mismatched` row's label (True: desirable)."""
    return torch.tensor([bool(pair.metadata["label"]) for pair in pairs], dtype=torch.bool)


def read_unpaired(path: str | Path, *, strict: bool = True, data_format: str | None = None, columns: dict | None = None,
                  source_split: str | None = None, tokenizer=None, max_prompt_tokens: int | None = None,
                  system_prompt: str | None = None, use_chat_template: bool | None = None) -> tuple[list[UnpairedRow], dict[str, Any], str]:
    """The rows of one source, validated: (rows, the bad rows' record, "unpaired" | "pairs"); a
    paired source is read with the pair loader and unpaired. The record is the run card's
    {rows_bad, rows_bad_reasons} (`ValidationReport.dropped`): what strict: false dropped. strict
    stops on any bad row; no row left is a UserError."""
    checks = dict(data_format=data_format, columns=columns, source_split=source_split, tokenizer=tokenizer,
                  max_prompt_tokens=max_prompt_tokens, use_chat_template=use_chat_template)
    if not is_unpaired(path, data_format=data_format, columns=columns, source_split=source_split):
        loaded = load_preference_file(path, strict=strict, system_prompt=system_prompt, **checks)
        return unpair(loaded.pairs), loaded.dropped(), "pairs"
    mapping = {**UNPAIRED_COLUMNS, **resolve_columns(data_format, columns)}
    check_columns(str(path), column_names(path, source_split), mapping)
    report = ValidationReport(str(path))
    rows = []
    for line, raw in read_rows(path, report, source_split):
        row = parse_unpaired_row(report, line, map_row(raw, mapping), Path(path).name)
        if row is not None and check_prompt_length(report, line, row.prompt, tokenizer, max_prompt_tokens,
                                                   system_prompt=system_prompt, use_chat_template=use_chat_template):
            rows.append(row)
    report.enforce(strict)
    if not rows:
        raise UserError(f"{path}: no usable unpaired rows ({report.rows_read} rows read, {report.rows_bad} bad)")
    return rows, report.dropped(), "unpaired"


def load_unpaired(
    path: str | Path,
    tokenizer,
    *,
    heldout_file: str | Path | None = None,
    heldout_pairs: int = 0,
    split_seed: int = 0,
    strict: bool = True,
    truncation: TruncationPolicy | None = None,
    system_prompt: str | None = None,
    use_chat_template: bool | None = None,
    data_format: str | None = None,
    columns: dict | None = None,
    source_split: str | None = None,
) -> PairSplits:
    """A KTO run's training and held-out rows (`with_mismatched` pairs), as `load_pairs` gives a DPO
    run its pairs: validated, held out by whole prompts (`heldout_file`, else `heldout_pairs` rows
    split off `path` with `split_seed`), the truncation policy applied once. The stats add the
    source's layout and each split's desirable and undesirable counts."""
    truncation = truncation or TruncationPolicy()
    checks = dict(strict=strict, data_format=data_format, columns=columns, source_split=source_split, tokenizer=tokenizer,
                  max_prompt_tokens=truncation.max_prompt_tokens if truncation.prompt == "error" else None,
                  system_prompt=system_prompt, use_chat_template=use_chat_template)
    rows, dropped, layout = read_unpaired(path, **checks)
    stats: dict[str, Any] = {**dropped, "layout": layout if layout == "unpaired" else
                             "pairs, unpaired: each chosen answer desirable, each rejected undesirable"}
    if heldout_file:
        held, held_dropped, _ = read_unpaired(heldout_file, **checks)
        train = rows
        stats.update({f"heldout_{key}": value for key, value in held_dropped.items()})
    elif heldout_pairs:
        train, held = split_pairs(rows, heldout_pairs, split_seed)  # whole prompts: reads only .prompt
    else:
        train, held = rows, []
    splits = truncated_splits(tokenizer, with_mismatched(train, split_seed, f"{path}: the training rows"),
                              with_mismatched(held, split_seed, "the held-out rows (data.heldout_pairs / data.heldout_file)",
                                              pool=held if len({prompt_key(row.prompt) for row in held}) > 1 else held + train),
                              stats, truncation=truncation, system_prompt=system_prompt, use_chat_template=use_chat_template)
    for name, kept in (("train", splits.train), ("heldout", splits.heldout)):
        desirable = int(labels(kept).sum()) if kept else 0
        stats[name].update({"rows": len(kept), "desirable": desirable, "undesirable": len(kept) - desirable})
    return splits
