"""Preference pairs from users' files: Parquet / CSV / a saved dataset read to the same pairs as
JSONL, TRL's conversational layouts (explicit and implicit prompt), a column mapping, the one-line
errors (missing mapped column, unknown format), a bad row named by file:row: field, `posttrain data
check --kind preference` on Parquet, and a 2-step `posttrain dpo` on a Parquet pairs file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from posttrain.cli import main
from posttrain.config import build_config, parse_overrides
from posttrain.data import load_preference_file, validate_preference_file
from posttrain.data.preference import load_pairs
from posttrain.errors import UserError
from posttrain.models import build_tiny_tokenizer
from posttrain.recipes import dpo_config

ROOT = Path(__file__).resolve().parent.parent


def string_pairs(count: int = 6) -> list[dict]:
    """TRL's standard layout: prompt, chosen, rejected strings (plus an id)."""
    return [{"id": f"p{i}", "prompt": f"{10 + i}+{20 + i}=", "chosen": f"<answer>{30 + 2 * i}</answer>",
             "rejected": f"<answer>{31 + 2 * i}</answer>"}
            for i in range(count)]


def columns_of(rows: list[dict]) -> dict[str, list]:
    return {key: [row[key] for row in rows] for key in rows[0]}


def write_parquet(path: Path, rows: list[dict]) -> Path:
    datasets.Dataset.from_dict(columns_of(rows)).to_parquet(str(path))
    return path


def triples(data) -> list[tuple]:
    return [(pair.id, pair.prompt, pair.chosen, pair.rejected) for pair in data.pairs]


def test_parquet_csv_and_a_saved_split_load_the_same_pairs_as_jsonl(tmp_path):
    rows = string_pairs()
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    expected = triples(load_preference_file(jsonl))
    parquet = write_parquet(tmp_path / "pairs.parquet", rows)
    assert triples(load_preference_file(parquet)) == expected
    assert triples(load_preference_file(parquet, data_format="trl_preference")) == expected
    datasets.Dataset.from_dict(columns_of(rows)).to_csv(str(tmp_path / "pairs.csv"))
    assert triples(load_preference_file(tmp_path / "pairs.csv", data_format="trl_preference")) == expected
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(columns_of(rows[:4])),
                          "test": datasets.Dataset.from_dict(columns_of(rows[4:]))}).save_to_disk(str(tmp_path / "saved"))
    assert triples(load_preference_file(tmp_path / "saved", source_split="test")) == expected[4:]
    assert load_preference_file(parquet).pairs[0].metadata == {"source": "pairs.parquet", "line": 1}


def test_conversational_pairs_explicit_and_implicit_prompt(tmp_path):
    user = [{"role": "user", "content": "Sky?"}]
    explicit = write_parquet(tmp_path / "explicit.parquet", [
        {"prompt": user, "chosen": [{"role": "assistant", "content": "Blue."}], "rejected": [{"role": "assistant", "content": "Green."}]},
    ])
    implicit = write_parquet(tmp_path / "implicit.parquet", [  # no prompt column: the shared prefix is the prompt
        {"chosen": user + [{"role": "assistant", "content": "Blue."}], "rejected": user + [{"role": "assistant", "content": "Green."}]},
        {"chosen": user + [{"role": "assistant", "content": "Blue."}], "rejected": [{"role": "user", "content": "Sea?"},
                                                                                    {"role": "assistant", "content": "Green."}]},
    ])
    (pair,) = load_preference_file(explicit, data_format="trl_preference").pairs
    assert (pair.prompt, pair.chosen, pair.rejected) == (user, "Blue.", "Green.")
    parsed, report = validate_preference_file(implicit, data_format="trl_preference")
    assert [(p.prompt, p.chosen, p.rejected) for _, p in parsed] == [(user, "Blue.", "Green.")]
    assert report.lines() == [f"{implicit}:2: rejected: implicit prompt differs from chosen's (all messages but the last must match)"]


def test_a_column_mapping_over_the_format(tmp_path):
    rows = [{"question": row["prompt"], "better": row["chosen"], "worse": row["rejected"], "chosen": "stale", "source": "web"}
            for row in string_pairs(3)]
    path = write_parquet(tmp_path / "mine.parquet", rows)
    data = load_preference_file(path, data_format="trl_preference",
                                columns={"prompt": "question", "chosen": "better", "rejected": "worse"})
    assert [(p.prompt, p.chosen, p.rejected) for p in data.pairs] == [(r["question"], r["better"], r["worse"]) for r in rows]
    # The file's own `chosen` column is not read as ours; the rest is kept in metadata.
    assert data.pairs[0].metadata == {"source_chosen": "stale", "source": "mine.parquet", "line": 1}


@pytest.mark.parametrize("options, message", [
    ({"data_format": "trl_preference", "columns": {"chosen": "better"}},
     "pairs.parquet: no column 'better' (mapped to chosen; the file has: id, prompt, chosen, rejected)"),
    ({"columns": {"rejected": "worse"}}, "pairs.parquet: no column 'worse' (mapped to rejected;"),
    ({"data_format": "ultrafeedback"}, "data.format 'ultrafeedback': unknown (known: "),
    ({"columns": {"better": "chosen"}}, "data.columns: unknown key 'better'"),
])
def test_mapping_errors_are_one_line(tmp_path, options, message):
    path = write_parquet(tmp_path / "pairs.parquet", string_pairs(2))
    with pytest.raises(UserError) as error:
        load_preference_file(path, **options)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_a_file_without_chosen_is_one_line_even_without_a_format(tmp_path):
    path = write_parquet(tmp_path / "prompts.parquet", [{"prompt": "1+1=", "answer": "2"}])
    with pytest.raises(UserError, match=r"prompts.parquet: no column 'chosen' \(mapped to chosen; the file has: prompt, answer\)$"):
        load_preference_file(path)


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_an_unpaired_file_is_one_line_naming_its_layout(tmp_path, suffix):
    """KTO's rows (prompt, completion, label) given to a pair loader: one line saying the file is
    unpaired and what to run instead (DPO: --loss.type kto), not a missing `chosen` per row and a hint
    to map a `chosen` column. JSONL is read from its first row, Parquet from its schema."""
    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1) if i % 2 else "no", "label": bool(i % 2)} for i in range(6)]
    path = tmp_path / f"rows.{suffix}"
    if suffix == "parquet":
        write_parquet(path, rows)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(UserError) as error:
        load_pairs(path, build_tiny_tokenizer(), heldout_pairs=2)
    message = str(error.value)
    assert message.startswith(f"{path}: unpaired rows (KTO's layout: prompt, completion, label), not preference pairs"), message
    assert message.endswith("train KTO on these rows with --loss.type kto") and "\n" not in message, message
    with pytest.raises(UserError, match="a reward model needs pairs$"):
        load_preference_file(path, unpaired_advice="a reward model needs pairs")


def test_bad_rows_name_file_row_and_field(tmp_path):
    rows = string_pairs(4)
    rows[1]["chosen"] = None  # a null cell
    rows[2]["rejected"] = rows[2]["chosen"]
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(UserError) as error:
        load_preference_file(path, data_format="trl_preference")
    assert str(error.value).splitlines() == [
        f"{path}: 4 rows read, 2 bad (fix them, or set data.strict false to drop bad rows):",
        f"{path}:2: chosen: wrong type: expected a string, got null",
        f"{path}:3: chosen: identical to rejected",
    ]
    lenient = load_preference_file(path, data_format="trl_preference", strict=False)
    assert [p.id for p in lenient.pairs] == ["p0", "p3"] and lenient.rows_bad == 2


def test_load_pairs_reads_the_pairs_and_the_heldout_file_alike(tmp_path):
    rows = [{"q": row["prompt"], "better": row["chosen"], "rejected": row["rejected"]} for row in string_pairs(5)]
    train = write_parquet(tmp_path / "train.parquet", rows[:3])
    held = write_parquet(tmp_path / "held.parquet", rows[3:])
    splits = load_pairs(train, build_tiny_tokenizer(), heldout_file=held, data_format="trl_preference",
                        columns={"prompt": "q", "chosen": "better"})
    assert [p.chosen for p in splits.train] == [r["better"] for r in rows[:3]]
    assert [p.chosen for p in splits.heldout] == [r["better"] for r in rows[3:]]


def test_data_check_preference_on_parquet(tmp_path, capsys):
    rows = string_pairs(3)
    rows[1]["prompt"] = "  "
    path = write_parquet(tmp_path / "prefs.parquet", rows)
    assert main(["data", "check", "--kind", "preference", str(path), "--format", "trl_preference",
                 "--columns", '{"id": "id"}']) == 1
    assert capsys.readouterr().out.splitlines()[:2] == [f"{path}:2: prompt: empty or whitespace-only", f"{path}: 3 rows read, 1 bad"]
    clean = write_parquet(tmp_path / "clean.parquet", string_pairs(2))
    assert main(["data", "check", "--kind", "preference", str(clean), "--format", "trl_preference"]) == 0
    assert main(["data", "check", "--kind", "preference", str(clean), "--columns", '{"chosen": "nope"}']) == 2
    assert "no column 'nope' (mapped to chosen" in capsys.readouterr().err


def test_dpo_config_checks_the_format_once():
    with pytest.raises(UserError, match=r"^data.format 'trl': unknown \(known: .*trl_preference"):
        build_config(dpo_config.Config, None, parse_overrides(["--data.pairs", "x.parquet", "--data.format", "trl"]))
    with pytest.raises(UserError, match="data.columns: unknown key 'better'"):
        build_config(dpo_config.Config, None, parse_overrides(["--data.pairs", "x.parquet", "--data.columns", '{"better": "b"}']))


def test_dpo_cli_on_a_parquet_pairs_file(tmp_path):
    """2 steps on the tiny model from a Parquet file (no provenance sidecar) whose chosen column is
    `better`; the held-out pairs are a second Parquet file read with the same mapping."""
    rows = [{"prompt": row["prompt"], "better": row["chosen"], "rejected": row["rejected"]} for row in string_pairs(10)]
    train = write_parquet(tmp_path / "prefs.parquet", rows[:8])
    held = write_parquet(tmp_path / "held.parquet", rows[8:])
    result = subprocess.run(
        [sys.executable, "-m", "posttrain", "dpo", "--model", "tiny", "--data.pairs", str(train), "--data.heldout_file", str(held),
         "--data.format", "trl_preference", "--data.columns", '{"chosen": "better"}', "--batch_size", "4",
         "--micro_batch_size", "2", "--optim.lr", "1e-3", "--max-steps", "2", "--output-dir", str(tmp_path / "run")],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    card = json.loads((tmp_path / "run" / "run_card.json").read_text())
    data = card["links"]["data"]
    assert (data["format"], data["columns"], data["split"]) == ("trl_preference", {"chosen": "better"}, None)
    assert data["train_pairs"] == 8 and data["heldout_pairs"] == 2 and data["heldout_pairs_from"] == str(held)
    assert "not recorded" in card["links"]["reward"]["labels"]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in metrics] == [0, 1, 2] and "heldout/preference_accuracy" in metrics[-1]
