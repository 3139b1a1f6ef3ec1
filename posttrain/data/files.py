"""Users' data files as rows: JSONL (our own reader, which numbers every bad line), and through
Hugging Face `datasets` Parquet, CSV, JSON, Arrow files, a directory saved with `save_to_disk`, or a
dataset name already in the local Hugging Face cache; plus the column mapping and the named public
layouts (`data.format`) that turn a user's columns into ours.

    rows = read_rows("gsm8k-train.parquet", report, split=None)          # (row number, dict) pairs
    mapping = resolve_columns("gsm8k", {"prompt": "question"})            # ours -> theirs
    row = map_row(row, mapping)                                            # keys renamed to ours

Row numbers count from 1 in file order (for JSONL, the line number), so a bad row is reported as
`<file>:<row>: <field>: <problem>`, whatever the file type.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from posttrain.data.validation import ValidationReport, type_name
from posttrain.errors import UserError

CANONICAL_COLUMNS = ("prompt", "messages", "answer", "tests", "entry_point", "id", "chosen", "rejected", "completion",
                     "label", "inputs", "outputs", "choices")
"""The names our loaders read; `data.columns` maps each to a column of the user's file."""

FORMATS: dict[str, dict[str, Any]] = {
    "gsm8k": {"columns": {"prompt": "question", "answer": "answer"}, "answer_format": "gsm8k",
              "about": "GSM8K: `question`, `answer` whose gold follows `####` (commas, $, a trailing . dropped)"},
    "math": {"columns": {"prompt": "problem", "answer": "solution"}, "answer_format": "boxed",
             "about": "MATH (Hendrycks): `problem`, `solution` whose gold is its last \\boxed{...}"},
    "mmlu": {"columns": {"prompt": "question", "choices": "choices", "answer": "answer"}, "answer_format": "choice",
             "about": "MMLU-style multiple choice: `question`, `choices` (option texts, shown as A. B. ...), `answer` (0-based index or letter)"},
    "mbpp": {"columns": {"prompt": "text", "tests": "test_list", "id": "task_id"}, "answer_format": None, "show_tests": "first",
             "about": "MBPP: `text` (the task in words, then the first of `test_list` shown: it names the function), `test_list` "
                      "(assert lines; the function name is read from them), `task_id`"},
    "humaneval": {"columns": {"prompt": "prompt", "tests": "test", "entry_point": "entry_point", "id": "task_id"},
                  "answer_format": None, "about": "HumanEval: `prompt` (signature + docstring), `test` (check(candidate)), `entry_point`, `task_id`"},
    "code_contests": {"columns": {"prompt": "description"}, "answer_format": None,
                      "about": "CodeContests: `description`, stdin/stdout cases from `public_tests` + `private_tests` ({input: [...], output: [...]}), or `inputs` / `outputs` lists"},
    "trl_sft": {"columns": {}, "answer_format": None,
                "about": "TRL's SFT layouts: `messages` (a conversation), or `prompt` + `completion` (strings or messages)"},
    "trl_prompt": {"columns": {"prompt": "prompt"}, "answer_format": None,
                   "about": "TRL's prompt-only layout: `prompt` (a string or chat messages), plus `answer` or `tests`"},
    "trl_preference": {"columns": {"chosen": "chosen", "rejected": "rejected"}, "answer_format": None,
                       "about": "TRL's preference layouts: `prompt`, `chosen`, `rejected` (strings, or chat messages), or no `prompt` "
                                "and whole conversations sharing every message but the last"},
    "trl_unpaired": {"columns": {"completion": "completion", "label": "label"}, "answer_format": None,
                     "about": "TRL's unpaired preference layout (KTO): `prompt`, `completion` (strings, or chat messages: the prompt's "
                              "list and one assistant message), `label` (true: desirable, false: undesirable)"},
}
"""Named public layouts: the column mapping, how the gold answer is written, and which tests an
assert-list problem's prompt shows (`show_tests`, `data.prompts.SHOW_TESTS`; none when not named)."""

FILE_TYPES = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".arrow": "arrow"}
"""Extensions read through `datasets` (.jsonl has its own line-numbering reader)."""


def is_data_source(spec: str) -> bool:
    """True for something `read_rows` can try: an existing path, a data file name, or a dataset
    name of the hub's `owner/name` form."""
    return Path(spec).expanduser().exists() or spec.endswith((".jsonl", *FILE_TYPES)) or spec.count("/") == 1


def read_rows(source: str | Path, report: ValidationReport, split: str | None = None) -> Iterator[tuple[int, dict]]:
    """`(row number, row)` for every row of `source`: a .jsonl file (bad lines go to `report`), a
    .parquet / .csv / .json / .arrow file, a `save_to_disk` directory, or a cached dataset name
    (`split`, default `train`, picks the split of a dataset with several). A missing file, an
    unreadable file or a name not in the local cache is one UserError line."""
    for _, number, row in RowTable(source, split).scan(report):
        yield number, row


class RowTable:
    """The rows of one source, read again on demand instead of held as Python objects: a `datasets`
    Dataset (memory-mapped Arrow) by position, a JSONL file by the byte offset of each line. `scan`
    reads every row once (for validation) and gives each a `handle`; `row(handle)` reads that row
    again. Pickles without its open file."""

    def __init__(self, source: str | Path, split: str | None = None):
        self.source = str(source)
        path = Path(source).expanduser()
        self.jsonl = path.suffix == ".jsonl"  # any other file is read by its type, or refused by name (`_open_dataset`)
        self._path, self._file, self._dataset = path, None, None
        if self.jsonl:
            if split not in (None, "train"):
                raise UserError(f"{source}: a JSONL file has one split; drop --data.split {split}")
            if not path.is_file():
                raise UserError(f"{path}: no such file")
        else:
            self._dataset = _open_dataset(self.source, path, split)

    @property
    def columns(self) -> list[str] | None:
        """The columns of a `datasets`-read source (None for JSONL, whose rows may differ)."""
        return None if self.jsonl else list(self._dataset.column_names)

    def scan(self, report: ValidationReport) -> Iterator[tuple[int, int, dict]]:
        """`(handle, row number, row)` for every row; JSONL lines that are blank are skipped, lines
        that are not one JSON object go to `report` (a file is read a line at a time). A source
        without a row is one UserError line. Once every row is read, `report.hint` says which
        `data.format` (or `data.columns`) the first row that lacked one of our fields needed
        (`layout_hint`), as the caller's parse of each row reported it."""
        lacking = None  # (columns, field) of the first row a parse found without one of our fields
        for handle, number, row in self._rows(report):
            before = len(report.problems)
            yield handle, number, row
            if lacking is None:
                missing = [p.field for p in report.problems[before:] if p.reason.startswith("missing field")]
                lacking = (list(row), missing[0]) if missing else None
        if not report.rows_read:
            raise UserError(f"{self.source}: no rows (an empty file)")
        if lacking is not None:
            report.hint = layout_hint(*lacking)

    def _rows(self, report: ValidationReport) -> Iterator[tuple[int, int, dict]]:
        if not self.jsonl:
            report.rows_read += len(self._dataset)
            for index, row in enumerate(self._dataset):
                yield index, index + 1, dict(row)
            return
        with open(self._path, "rb") as handle:
            offset = 0
            for number, raw in enumerate(handle, start=1):
                start, offset = offset, offset + len(raw)
                if not raw.strip():
                    continue
                report.rows_read += 1
                row = _json_object(raw[:-1] if raw.endswith(b"\n") else raw, number, report)
                if row is not None:
                    yield start, number, row

    def row(self, handle: int) -> dict:
        """The row `scan` gave `handle` (a JSONL line is parsed again; it parsed before)."""
        if not self.jsonl:
            return dict(self._dataset[handle])
        if self._file is None:
            self._file = open(self._path, "rb")
        self._file.seek(handle)
        return json.loads(self._file.readline().decode("utf-8-sig" if handle == 0 else "utf-8"))

    def __getstate__(self):
        return {**self.__dict__, "_file": None}


def _json_object(raw: bytes, number: int, report: ValidationReport) -> dict | None:
    try:
        text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as error:
        report.add(number, "row", f"non-UTF-8 bytes (byte 0x{raw[error.start]:02x} at column {error.start + 1})")
        return None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as error:
        report.add(number, "row", f"invalid JSON: {error.msg} (column {error.colno})")
        return None
    if not isinstance(row, dict):
        report.add(number, "row", f"expected a JSON object, got {type_name(row)}")
        return None
    return row


class RowView(Sequence):
    """A sequence of parsed items (Examples, SFT rows) kept as row handles of a `RowTable`: each
    item is parsed again when it is read, so a file of a million rows costs two integer arrays, not
    a million Python objects. `parse(number, row)` must give the item the validation pass kept.
    Slicing and `take(positions)` give views; anything else that reads items reads them one at a time."""

    def __init__(self, table: RowTable, handles, numbers, parse: Callable[[int, dict], Any]):
        self.table, self.parse = table, parse
        self.handles, self.numbers = array("q", handles), array("q", numbers)

    def __len__(self) -> int:
        return len(self.handles)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return RowView(self.table, self.handles[index], self.numbers[index], self.parse)
        return self.parse(self.numbers[index], self.table.row(self.handles[index]))

    def take(self, positions) -> RowView:
        """The items at `positions`, in that order, as a view."""
        positions = list(positions)
        return RowView(self.table, [self.handles[i] for i in positions], [self.numbers[i] for i in positions], self.parse)

    def __repr__(self) -> str:
        return f"RowView({self.table.source!r}, {len(self)} rows)"


def pick(items: Sequence, positions) -> Sequence:
    """`items` at `positions`, in order: a view of a `RowView`, a list of anything else."""
    return items.take(positions) if isinstance(items, RowView) else [items[i] for i in positions]


def column_names(source: str | Path, split: str | None = None) -> list[str] | None:
    """The columns of a `datasets`-read source (None for JSONL, whose rows may differ)."""
    return RowTable(source, split).columns


def _open_dataset(source: str, path: Path, split: str | None):
    import datasets

    datasets.disable_progress_bars()
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
        elif path.suffix in FILE_TYPES:
            if not path.is_file():
                raise UserError(f"{source}: no such file")
            options = {"features": _csv_text_columns(path)} if path.suffix == ".csv" else {}
            loaded = datasets.load_dataset(FILE_TYPES[path.suffix], data_files=str(path), split="train", **options)
        elif path.exists():
            kind = f"a {path.suffix} file" if path.suffix else "a file without an extension"
            raise UserError(f"{source}: {kind}, not a data file posttrain reads (.jsonl, .parquet, .csv, .json, .arrow, "
                            "or a save_to_disk directory); convert it to one of them")
        else:
            loaded = _cached_dataset(source, split)
    except UserError:
        raise
    except FileNotFoundError as error:
        raise UserError(f"{source}: {_first_line(error)}") from None
    except Exception as error:  # pyarrow / datasets parse errors: name the file, one line
        raise UserError(f"{source}: cannot be read as {FILE_TYPES.get(path.suffix, 'a dataset')} ({type(error).__name__}: {_first_line(error)})") from None
    if isinstance(loaded, datasets.DatasetDict):
        chosen = split or ("train" if "train" in loaded else None)
        if chosen not in loaded:
            raise UserError(f"{source}: no split {chosen!r} (splits: {', '.join(loaded)}); choose one with --data.split")
        return loaded[chosen]
    if split not in (None, "train") and split != getattr(loaded, "split", None):
        raise UserError(f"{source}: a single-split dataset; drop --data.split {split}")
    return loaded


def _csv_text_columns(path: Path):
    """Every column of a CSV file as text: CSV has no types, and a column of short numeric answers
    (`"30"`) must not turn into numbers that a text field then rejects. The file is read once here
    first, so that a record with more fields than the header (an unquoted comma) is one line naming
    it, not the CSV parser's traceback; a record with fewer is left to the row checks (null cells)."""
    import csv

    import datasets

    try:
        with open(path, newline="", encoding="utf-8") as handle:
            reader = csv.reader(handle)
            header = next(reader, [])
            records = (record for record in reader if record)  # blank lines are no rows (as the parser skips them)
            for number, record in enumerate(records, start=1):
                if len(record) > len(header):
                    raise UserError(f"{path}: line {reader.line_num} (row {number}): {len(record)} fields, the header has "
                                    f"{len(header)} (quote a field that holds a comma)")
    except UnicodeDecodeError as error:
        raise UserError(f"{path}: non-UTF-8 bytes (byte 0x{error.object[error.start]:02x}); save it as UTF-8") from None
    except csv.Error as error:
        raise UserError(f"{path}: line {reader.line_num}: not CSV ({error})") from None
    return datasets.Features({name: datasets.Value("string") for name in header})


def _cached_dataset(name: str, split: str | None):
    """A hub dataset from the local Hugging Face cache only (offline: never a network wait).
    `datasets` reads HF_DATASETS_OFFLINE / HF_HUB_OFFLINE when it is imported, so setting the
    variables here would be too late (it retried the hub for 23 s): its own switch is turned on
    for the call instead."""
    import datasets

    previous = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        return datasets.load_dataset(name, split=split or "train")
    except Exception as error:
        raise UserError(f"dataset {name!r}: not a local file or directory and not in the local Hugging Face cache "
                        f"({_first_line(error)})") from None
    finally:
        datasets.config.HF_HUB_OFFLINE = previous


def task_load_options(task_options: dict | None, data_format: str | None = None, columns: dict | None = None,
                      split: str | None = None) -> dict[str, Any]:
    """The options `load_splits` / `load_task` take: a task's own options plus, when set, a data
    file's `format`, `columns` and `split` (how every recipe and `posttrain eval` spell them)."""
    extra = {"format": data_format, "columns": columns or None, "split": split}
    return {**(task_options or {}), **{key: value for key, value in extra.items() if value}}


def resolve_columns(data_format: str | None, columns: dict | None) -> dict[str, str]:
    """Our column name -> the user's, from a named format overridden by explicit `columns`
    (identity for every name neither mentions). Unknown names are one UserError line."""
    if data_format is not None and data_format not in FORMATS:
        raise UserError(f"data.format {data_format!r}: unknown (known: {', '.join(FORMATS)})")
    mapping = dict(FORMATS[data_format]["columns"]) if data_format else {}
    for ours, theirs in (columns or {}).items():
        if ours not in CANONICAL_COLUMNS:
            raise UserError(f"data.columns: unknown key {ours!r} (known: {', '.join(CANONICAL_COLUMNS)})")
        if not isinstance(theirs, str) or not theirs:
            raise UserError(f"data.columns.{ours}: expected a column name, got {theirs!r}")
        mapping[ours] = theirs
    return mapping


def check_columns(source: str, present: list[str] | None, mapping: dict[str, str]) -> None:
    """Every mapped column must be in the file: else one line naming the file and the column."""
    if present is None:  # JSONL: checked row by row (a missing field is reported with its line)
        return
    for ours, theirs in mapping.items():
        if theirs not in present:
            raise UserError(f"{source}: no column {theirs!r} (mapped to {ours}; the file has: {', '.join(present)})")


CONTEST_TESTS = ("public_tests", "private_tests")
"""CodeContests' case columns, each {"input": [...], "output": [...]} (generated_tests are left out)."""


def contest_cases(row: dict) -> dict:
    """A CodeContests-style row with its case columns flattened into `inputs` / `outputs` lists
    (rows that already have `inputs` are returned as they are)."""
    if "inputs" in row or not any(isinstance(row.get(key), dict) for key in CONTEST_TESTS):
        return row
    inputs, outputs = [], []
    for key in CONTEST_TESTS:
        tests = row.get(key) or {}
        inputs += list(tests.get("input") or [])
        outputs += list(tests.get("output") or [])
    # The public cases stay (in metadata, never shown as such): they are the examples the
    # description shows, which `posttrain audit --data` tries as a lookup table.
    return {**{k: v for k, v in row.items() if k != "private_tests"}, "inputs": inputs, "outputs": outputs}


def map_row(row: dict, mapping: dict[str, str]) -> dict:
    """The row with the user's mapped columns renamed to ours (unmapped columns kept as they are;
    a column of ours that the mapping sends elsewhere is not read as ours)."""
    if not mapping:
        return row
    renamed = {theirs: ours for ours, theirs in mapping.items()}
    mapped: dict[str, Any] = {}
    for key, value in row.items():
        if key in renamed:
            mapped[renamed[key]] = value
        elif key in mapping and mapping[key] != key:
            mapped[f"source_{key}"] = value  # e.g. a file's own `answer` column when answer maps elsewhere
        else:
            mapped.setdefault(key, value)
    return mapped


def layout_hint(columns: list[str], missing: str) -> str:
    """What a row with `columns` that lacks our field `missing` needs: the `data.format` whose
    columns it has and which maps `missing` from one of them (the one naming most columns), else
    `data.columns` (or a format that needs columns the row lacks). `layout_hint(["question", "answer"], "prompt")` ->
    "hint: the rows' columns (question, answer) are the gsm8k layout: pass --data.format gsm8k"."""
    shown = ", ".join(columns[:8]) + (", ..." if len(columns) > 8 else "")
    fits = [name for name, layout in FORMATS.items()
            if set(layout["columns"].values()) <= set(columns) and layout["columns"].get(missing, missing) != missing]
    if fits:
        best = max(fits, key=lambda name: len(FORMATS[name]["columns"]))
        return f"hint: the rows' columns ({shown}) are the {best} layout: pass --data.format {best}"
    return (f"hint: the rows' columns are {shown}; map yours to ours with --data.columns '{{\"{missing}\": \"COLUMN\"}}', "
            "or pass the --data.format of their layout (docs/data.md)")


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
