"""Preference pairs for DPO, in the formats TRL users already have: JSONL (one pair per line), or
any file `posttrain.data.files` reads (Parquet, CSV, JSON, Arrow, a `save_to_disk` directory, a
cached dataset name), with the user's columns mapped to ours (`columns`, `data_format`).

Standard:                {"prompt": "...", "chosen": "...", "rejected": "..."}
Conversational:          {"prompt": [messages], "chosen": [one assistant message], "rejected": [...]}
Conversational, implicit prompt (no "prompt" field): "chosen" and "rejected" are whole
conversations that share every message but the last, which is the assistant's answer.
Optional fields: `id`, `metadata`; any other field is kept in metadata. A shared system prompt is
given to the loader (or the tokeniser), not repeated in every row.

`load_pairs` gives a training run its pairs: the file validated, a held-out set (a second file, or
whole prompts split off the first, seeded), and the truncation policy applied once to all of them.
`PairSource` is a recipe's data section (`posttrain dpo`'s `data.*`: the file, the held-out pairs,
the rendering and truncation), `preference_data_card` the run card's data link.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from posttrain.data.examples import Example, derived_seed
from posttrain.data.files import check_columns, column_names, map_row, read_rows, resolve_columns
from posttrain.data.pair_batch import PreferenceBatch, tokenize_preference_pairs
from posttrain.data.tokenize import TruncationPolicy
from posttrain.data.validation import (
    ValidationReport,
    check_messages,
    check_prompt_length,
    check_text,
    type_name,
)
from posttrain.data.provenance import read_provenance
from posttrain.errors import UserError

logger = logging.getLogger(__name__)

KNOWN_FIELDS = {"prompt", "chosen", "rejected", "id", "metadata"}
REQUIRED_COLUMNS = {"chosen": "chosen", "rejected": "rejected"}
"""Every preference source has these (after the mapping): a file without one is one line, not a bad row each."""
UNPAIRED_COLUMNS = {"completion": "completion", "label": "label"}
"""An unpaired source (KTO's layout) has these (after the mapping) instead of `chosen` and `rejected`."""
PAIRS_NEEDED = "DPO's pairwise losses train on pairs: train KTO on these rows with --loss.type kto"
"""What a pair loader says of an unpaired source by default (`posttrain rm` says its own)."""


@dataclass
class PreferencePair:
    """One prompt (a string or chat messages) with a preferred and a dispreferred answer."""

    id: str
    prompt: str | list[dict]
    chosen: str
    rejected: str
    metadata: dict = field(default_factory=dict)


@dataclass
class PreferenceData:
    """The pairs of one file and how many rows validation dropped (strict: false), with their reasons."""

    source: str
    pairs: list[PreferencePair]
    rows_bad: int = 0
    system_prompt: str | None = None
    rows_bad_reasons: dict[str, int] = field(default_factory=dict)
    """The dropped rows per kind of problem (`ValidationReport.reasons`)."""

    def dropped(self, prefix: str = "") -> dict[str, Any]:
        """The run card's record of the dropped rows: `{prefix}rows_bad` and `{prefix}rows_bad_reasons`."""
        return {f"{prefix}rows_bad": self.rows_bad, f"{prefix}rows_bad_reasons": dict(self.rows_bad_reasons)}


def validate_preference_file(
    path: str | Path,
    *,
    data_format: str | None = None,
    columns: dict | None = None,
    source_split: str | None = None,
    tokenizer=None,
    max_prompt_tokens: int | None = None,
    system_prompt: str | None = None,
    use_chat_template: bool | None = None,
    unpaired_advice: str = PAIRS_NEEDED,
) -> tuple[list[tuple[int, PreferencePair]], ValidationReport]:
    """Read and check the whole file: the valid `(row number, pair)`s and the report of every problem.
    An unpaired source (`layout_of`: completion and label, no chosen or rejected) is one UserError
    line ending in `unpaired_advice` (what to run instead), not a missing field per row.

    data_format, columns: a named public layout (`trl_preference`) and/or an explicit mapping of our
    column names to the file's (`posttrain.data.files`); a mapped column the file lacks is a UserError.
    source_split: the split of a saved or cached dataset with several.
    tokenizer + max_prompt_tokens: also report prompts longer than the limit after the chat template.
    """
    mapping = resolve_columns(data_format, columns)
    present = source_columns(path, source_split)
    pair_columns = {**REQUIRED_COLUMNS, **mapping}
    if layout_of(present, mapping) == "unpaired":
        raise UserError(f"{path}: unpaired rows (KTO's layout: prompt, completion, label), not preference pairs "
                        f"(prompt, chosen, rejected); {unpaired_advice}")
    check_columns(str(path), column_names(path, source_split), pair_columns)
    report = ValidationReport(str(path))
    pairs = []
    for line, row in read_rows(path, report, source_split):
        pair = parse_preference_row(report, line, map_row(row, mapping), Path(path).name)
        if pair is not None and check_prompt_length(
            report, line, pair.prompt, tokenizer, max_prompt_tokens,
            system_prompt=system_prompt, use_chat_template=use_chat_template,
        ):
            pairs.append((line, pair))
    return pairs, report


def source_columns(path: str | Path, source_split: str | None = None) -> list[str]:
    """A source's column names: its schema's, or for JSONL the first row that parses."""
    present = column_names(path, source_split)
    if present is None:
        first = next(read_rows(path, ValidationReport(str(path)), source_split), None)
        present = list(first[1]) if first is not None else []
    return present


def layout_of(present: list[str], mapping: dict[str, str]) -> str:
    """"pairs" when the columns `present` hold the (mapped) chosen or rejected, else "unpaired" when
    they hold the completion and label of KTO's layout, else "unknown". `mapping`: our column name
    -> the source's (`resolve_columns`). layout_of(["prompt", "completion", "label"], {}) -> "unpaired"."""
    column = lambda ours: mapping.get(ours, ours)  # noqa: E731
    if column("chosen") in present or column("rejected") in present:
        return "pairs"
    return "unpaired" if all(column(ours) in present for ours in UNPAIRED_COLUMNS) else "unknown"


def load_preference_file(path: str | Path, *, strict: bool = True, system_prompt: str | None = None, **checks):
    """Validated preference pairs (see `validate_preference_file`); strict stops on any bad row,
    strict=False drops them and counts them in `rows_bad` (their reasons in `rows_bad_reasons`). No
    pairs left is a UserError."""
    parsed, report = validate_preference_file(path, system_prompt=system_prompt, **checks)
    report.enforce(strict)
    if not parsed:
        raise UserError(f"{path}: no usable preference pairs ({report.rows_read} rows read, {report.rows_bad} bad)")
    return PreferenceData(str(path), [pair for _, pair in parsed], report.rows_bad, system_prompt, report.reasons())


def parse_preference_row(report: ValidationReport, line: int, row: dict, file_name: str):
    """One row as a PreferencePair, or None after reporting each of its problems."""
    for name in ("chosen", "rejected"):
        if name not in row:
            report.add(line, name, "missing field")
    if "chosen" not in row or "rejected" not in row:
        return None
    conversational = isinstance(row["chosen"], list) or isinstance(row["rejected"], list)
    if conversational:
        parsed = _conversational(report, line, row)
    else:
        parsed = _standard(report, line, row)
    if parsed is None:
        return None
    prompt, chosen, rejected = parsed
    if chosen == rejected:
        report.add(line, "chosen", "identical to rejected")
        return None
    metadata = row.get("metadata", {})
    if not isinstance(metadata, dict):
        report.add(line, "metadata", f"wrong type: expected an object, got {type_name(metadata)}")
        return None
    extra = {key: value for key, value in row.items() if key not in KNOWN_FIELDS}
    return PreferencePair(
        id=str(row.get("id", f"{file_name}:{line}")), prompt=prompt, chosen=chosen, rejected=rejected,
        metadata={**metadata, **extra, "source": file_name, "line": line},
    )


def _standard(report, line, row):
    if "prompt" not in row:
        report.add(line, "prompt", "missing field (the standard format needs a prompt string)")
        return None
    ok = check_text(report, line, "prompt", row["prompt"])
    ok = check_text(report, line, "chosen", row["chosen"]) and ok
    ok = check_text(report, line, "rejected", row["rejected"]) and ok
    return (row["prompt"], row["chosen"], row["rejected"]) if ok else None


def _conversational(report, line, row):
    ok = check_messages(report, line, "chosen", row["chosen"])
    ok = check_messages(report, line, "rejected", row["rejected"]) and ok
    if "prompt" in row:
        ok = check_messages(report, line, "prompt", row["prompt"]) and ok
    if not ok:
        return None
    chosen, rejected = row["chosen"], row["rejected"]
    if "prompt" in row:
        prompt = row["prompt"]
        for name, answer in (("chosen", chosen), ("rejected", rejected)):
            if len(answer) != 1 or answer[0]["role"] != "assistant":
                report.add(line, name, "expected exactly one assistant message after an explicit prompt")
                ok = False
    else:  # implicit prompt: everything before the last message, identical in both
        prompt = chosen[:-1]
        if not prompt:
            report.add(line, "prompt", "missing field (no `prompt`, and `chosen` has no messages before its answer)")
            ok = False
        elif rejected[:-1] != prompt:
            report.add(line, "rejected", "implicit prompt differs from chosen's (all messages but the last must match)")
            ok = False
        for name, answer in (("chosen", chosen), ("rejected", rejected)):
            if answer[-1]["role"] != "assistant":
                report.add(line, name, "the last message must be the assistant's answer")
                ok = False
    return (prompt, chosen[-1]["content"], rejected[-1]["content"]) if ok else None


def prompt_key(prompt: str | list[dict]) -> str:
    """The key that identifies a pair's prompt (a string or a message list) across files and tasks."""
    return (Example("", messages=prompt) if isinstance(prompt, list) else Example("", prompt=prompt)).prompt_key()


def split_pairs(pairs: list[PreferencePair], count: int, seed: int) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held_out): whole prompts go to the held-out side (seeded order) until it has `count`
    pairs, so no prompt is on both sides. Leaving no training pair is a UserError."""
    keys = sorted({prompt_key(p.prompt) for p in pairs}, key=lambda k: derived_seed(seed, "heldout-pairs", k))
    held_keys, held = set(), 0
    sizes: dict[str, int] = {}
    for pair in pairs:
        sizes[prompt_key(pair.prompt)] = sizes.get(prompt_key(pair.prompt), 0) + 1
    for key in keys:
        if held >= count:
            break
        held_keys.add(key)
        held += sizes[key]
    train = [p for p in pairs if prompt_key(p.prompt) not in held_keys]
    if not train:
        raise UserError(f"data.heldout_pairs={count} leaves no training pairs out of {len(pairs)}; lower it or give data.heldout_file")
    return train, [p for p in pairs if prompt_key(p.prompt) in held_keys]


@dataclass
class PairSource:
    """Link 1, data: the pairs, the held-out pairs, and how over-long rows are handled."""

    pairs: str = ""
    """Preference pairs to train on (TRL standard or conversational format): a .jsonl, .parquet, .csv,
    .json or .arrow file, a `save_to_disk` directory, or a dataset name in the local Hugging Face cache."""
    heldout_file: str | None = None
    """Held-out pairs, read like `pairs` (the same format, columns and split); None: split
    `heldout_pairs` off `pairs` (by prompt, seeded)."""
    heldout_pairs: int = 32
    """Pairs split off `pairs` for held-out preference accuracy when no heldout_file (0: none)."""
    format: str | None = None
    """The pairs' public layout: trl_preference (prompt, chosen, rejected; docs/data.md)."""
    columns: dict = field(default_factory=dict)
    """Our column names -> the file's, e.g. {chosen: better, rejected: worse} (overrides the format's)."""
    split: str | None = None
    """The split of a saved or cached dataset with several (default train)."""
    strict: bool = True
    """A bad row stops the run (false: bad rows are dropped and counted)."""
    system_prompt: str | None = None
    """System prompt given to every pair (None: the one `posttrain pairs` sampled them with, from the
    pairs file's provenance; else none)."""
    use_chat_template: bool | None = None
    """Render prompts with the tokenizer's chat template (None: when it has one)."""
    max_prompt_tokens: int | None = None
    """Longest prompt in tokens (None: no limit)."""
    max_response_tokens: int | None = None
    """Longest chosen/rejected response in tokens, EOS included (None: no limit)."""
    prompt_truncation: Literal["error", "left", "drop"] = "error"
    """Over-long prompt: error (named by file line), keep its last tokens, or drop the pair."""
    response_truncation: Literal["right", "drop", "error"] = "right"
    """Over-long response: keep its first tokens, drop the pair, or error."""

    def validate(self, prefix: str = "data.") -> None:
        """The checks every pair recipe (dpo, rm) makes of its data section: pairs given, the format
        and column map known, heldout_pairs not negative (one UserError line each)."""
        if not self.pairs:
            raise UserError(f"{prefix}pairs: give the preference JSONL to train on (--{prefix}pairs FILE; posttrain pairs makes one)")
        if self.format is not None or self.columns:
            resolve_columns(self.format, self.columns)
        if self.heldout_pairs < 0:
            raise UserError(f"{prefix}heldout_pairs must be at least 0, got {self.heldout_pairs}")

    def truncation(self) -> TruncationPolicy:
        """The four truncation settings as the tokeniser's `TruncationPolicy`."""
        return TruncationPolicy(self.max_prompt_tokens, self.max_response_tokens, self.prompt_truncation, self.response_truncation)

    def load(self, tokenizer, device: torch.device | str, split_seed: int, loader: Callable[..., PairSplits] | None = None,
             **options: Any) -> LoadedPairs:
        """The pairs file read as every pair recipe (dpo, rm) reads it: its provenance (None without
        one), the system prompt from it when this section sets none (the prompts as the pairs were
        sampled), the training and held-out splits (`loader`: `load_pairs`, or
        `data.unpaired.load_unpaired` for unpaired rows; `options`, e.g. its `unpaired_advice`, passed
        on) and the `encode` that tokenises pairs as they were split, onto `device`."""
        provenance = read_provenance(self.pairs) if os.path.isfile(self.pairs) else None  # else the loader says so
        data = self
        if data.system_prompt is None and (provenance or {}).get("system_prompt"):
            data = dataclasses.replace(data, system_prompt=provenance["system_prompt"])
            logger.info("system prompt from the pairs' provenance: %r", data.system_prompt)
        rendering = dict(truncation=data.truncation(), system_prompt=data.system_prompt, use_chat_template=data.use_chat_template)

        def encode(pairs: list[PreferencePair]) -> PreferenceBatch:  # tokenised, on the run's device: the one boundary
            return tokenize_preference_pairs(tokenizer, pairs, **rendering).to(device)

        splits = (loader or load_pairs)(data.pairs, tokenizer, heldout_file=data.heldout_file, heldout_pairs=data.heldout_pairs,
                                        split_seed=split_seed, strict=data.strict, data_format=data.format, columns=data.columns,
                                        source_split=data.split, **rendering, **options)
        return LoadedPairs(data, provenance, encode, splits)


@dataclass
class PairSplits:
    """A run's training and held-out pairs (each kept by the truncation policy) and their counts."""

    train: list[PreferencePair]
    heldout: list[PreferencePair]
    stats: dict[str, Any]
    """rows_bad and rows_bad_reasons (what strict: false dropped from the training file; heldout_rows_bad
    and heldout_rows_bad_reasons from a held-out file), and per split (train, heldout): pairs,
    prompts_truncated, responses_truncated, dropped."""


@dataclass
class LoadedPairs:
    """What `PairSource.load` read: the section as the run resolved it, the pairs' provenance, the
    run's tokenising boundary and the splits."""

    data: PairSource
    """The section with the system prompt from the provenance when it set none."""
    provenance: dict[str, Any] | None
    """The pairs file's sidecar (`posttrain pairs`: model, verifier, task...); None: none."""
    encode: Callable[[list[PreferencePair]], PreferenceBatch]
    """Pairs -> a tokenised batch on the run's device."""
    splits: PairSplits


def load_pairs(
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
    unpaired_advice: str = PAIRS_NEEDED,
) -> PairSplits:
    """Validated training and held-out pairs, with the truncation policy applied once to all of them
    (so a training step never drops a pair) and the counts for the run card.

    Held out: the pairs of `heldout_file`, else `heldout_pairs` pairs split off `path` by prompt
    (`split_pairs` with `split_seed`), else none. Prompts are rendered as the run renders them
    (`system_prompt`, `use_chat_template`): a prompt over a limit whose policy is "error" is a bad
    row, named by file and line. `data_format`, `columns` and `source_split` say how to read both
    files (see `validate_preference_file`); an unpaired file is one line ending in `unpaired_advice`.
    """
    truncation = truncation or TruncationPolicy()
    checks = dict(system_prompt=system_prompt, tokenizer=tokenizer, use_chat_template=use_chat_template,
                  max_prompt_tokens=truncation.max_prompt_tokens if truncation.prompt == "error" else None,
                  data_format=data_format, columns=columns, source_split=source_split, unpaired_advice=unpaired_advice)
    loaded = load_preference_file(path, strict=strict, **checks)
    stats = loaded.dropped()
    if heldout_file:
        held_file = load_preference_file(heldout_file, strict=strict, **checks)
        train, held = loaded.pairs, held_file.pairs
        stats.update(held_file.dropped(prefix="heldout_"))
    elif heldout_pairs:
        train, held = split_pairs(loaded.pairs, heldout_pairs, split_seed)
    else:
        train, held = loaded.pairs, []
    return truncated_splits(tokenizer, train, held, stats, truncation=truncation,
                            system_prompt=system_prompt, use_chat_template=use_chat_template)


def truncated_splits(tokenizer, train: list[PreferencePair], held: list[PreferencePair], stats: dict[str, Any], *,
                     truncation: TruncationPolicy, system_prompt: str | None, use_chat_template: bool | None) -> PairSplits:
    """The training and held-out pairs that the truncation policy keeps (tokenised as a run does),
    with `stats` completed by each split's counts: pairs, prompts_truncated, responses_truncated, dropped."""
    splits = {}
    for name, pairs in (("train", train), ("heldout", held)):
        kept, counts = [], [0, 0, 0]
        for start in range(0, len(pairs), 256):
            batch = tokenize_preference_pairs(tokenizer, pairs[start : start + 256], truncation=truncation,
                                              system_prompt=system_prompt, use_chat_template=use_chat_template)
            kept += [pairs[start + i] for i in batch.kept]
            counts = [a + b for a, b in zip(counts, (batch.counts.prompts_truncated, batch.counts.responses_truncated, batch.counts.dropped))]
        splits[name] = kept
        stats[name] = {"pairs": len(kept), "prompts_truncated": counts[0], "responses_truncated": counts[1], "dropped": counts[2]}
    return PairSplits(splits["train"], splits["heldout"], stats)


def preference_data_card(data: PairSource, splits: PairSplits, provenance: dict[str, Any] | None, *, seed: int,
                         batch_size: int, micro_batch_size: int) -> dict[str, Any]:
    """The run card's data link of a run on preference pairs: the `data` section (where the pairs
    and the held-out pairs come from, how they are read, rendered and truncated), the pairs the run
    trains and evaluates on and what loading and splitting them counted (`splits`, after any other
    removal, e.g. of a held-out task's prompts), the split `seed`, the pairs per optimizer step and
    per forward/backward, and from `provenance` (the pairs file's sidecar; None: none) what sampled them."""
    unpaired = "desirable" in splits.stats.get("train", {})  # `data.unpaired.load_unpaired`'s rows (KTO)
    link = {
        "source": f"offline: {'unpaired rows (prompt, completion, label)' if unpaired else 'preference pairs'} from {data.pairs}",
        "train_pairs": len(splits.train),
        "heldout_pairs": len(splits.heldout),
        "heldout_pairs_from": data.heldout_file or f"split off the training file by prompt (seed {seed})",
        "format": data.format, "columns": data.columns, "split": data.split,
        **splits.stats, "truncation": {key: getattr(data, key) for key in ("max_prompt_tokens", "max_response_tokens", "prompt_truncation", "response_truncation")},
        "system_prompt": data.system_prompt, "batch_size": batch_size, "micro_batch_size": micro_batch_size,
    }
    if provenance:
        link.update({"sampled_from": provenance.get("model"), "task": provenance.get("task"),
                     "group_size": provenance.get("group_size"), "sampling": provenance.get("sampling")})
        if provenance.get("unpaired"):  # `posttrain pairs --unpaired`: where the rows came from, by their groups
            link["rows_from_groups"] = {key: provenance.get(f"rows_from_{key}_groups") for key in ("mixed", "all_correct", "all_incorrect")}
    return link
