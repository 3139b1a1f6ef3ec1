"""Users' data through Hugging Face `datasets`: Parquet, CSV, JSON, a save_to_disk directory, a
dataset name (cache only), column mapping and the named layouts (gsm8k, math, trl_prompt), the
GSM8K and MATH gold parsing, one-line errors; a GRPO run on a GSM8K-layout Parquet file whose
training reward and held-out checker both come from the declared format."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest

from posttrain.config import build_config
from posttrain.data import load_splits, load_task
from posttrain.data.files import FORMATS, map_row, resolve_columns
from posttrain.data.prompts import CONVENTIONS, validate_prompt_file
from posttrain.data.source import TaskSource
from posttrain.data.validation import last_boxed, parse_gsm8k_gold
from posttrain.errors import UserError
from posttrain.recipes import online, online_config, pairs, sft
from posttrain.rewards.answers import choice_letter

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("text, gold", [
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
    ("... #### 1,234", "1234"),
    ("#### $18.", "18"),
    ("#### -3.5", "-3.5"),
    ("the answer is 5", None),
    ("#### five", None),
    ("#### 7 #### 8", "8"),
])
def test_gsm8k_gold(text, gold):
    assert parse_gsm8k_gold(text) == gold


@pytest.mark.parametrize("text, gold", [
    (r"so $x = \boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
    (r"\boxed{3} first, finally \boxed{ 4 }", "4"),
    (r"\fbox{x^{2}}", "x^{2}"),
    (r"\boxed{}", None),
    (r"\boxed{unclosed", None),
    ("no box at all", None),
])
def test_math_boxed_gold(text, gold):
    assert last_boxed(text) == gold


def gsm8k_rows(count: int = 12) -> dict[str, list]:
    questions = [f"Tom has {i} apples and buys {i + 2} more. How many apples does he have?" for i in range(count)]
    answers = [f"{i} + {i + 2} = {2 * i + 2}\n#### {2 * i + 2:,}" for i in range(count)]
    return {"question": questions, "answer": answers}


@pytest.fixture
def gsm8k_parquet(tmp_path) -> Path:
    path = tmp_path / "gsm8k.parquet"
    datasets.Dataset.from_dict(gsm8k_rows()).to_parquet(str(path))
    return path


def test_gsm8k_parquet_with_the_format(gsm8k_parquet):
    task = load_task(str(gsm8k_parquet), options={"format": "gsm8k"})
    assert len(task.examples) == 12 and task.reward_kind == "math"
    assert task.examples[3].prompt.startswith("Tom has 3 apples") and task.examples[3].answer == "8"
    assert task.examples[3].id == "gsm8k.parquet:4"
    assert task.options == {"answer_format": "gsm8k", "format": "gsm8k", "answer_extraction": "marked",
                            "instruction": CONVENTIONS["gsm8k"].instruction}
    assert task.examples[3].prompt.endswith("\n\n" + CONVENTIONS["gsm8k"].instruction)
    assert task.examples[3].metadata["answer_extraction"] == "marked"


def test_the_same_mapping_by_columns_from_csv_and_json(tmp_path):
    rows = gsm8k_rows(4)
    datasets.Dataset.from_dict(rows).to_csv(str(tmp_path / "g.csv"))
    (tmp_path / "g.json").write_text(json.dumps([{"question": q, "answer": a} for q, a in zip(rows["question"], rows["answer"])]))
    for name in ("g.csv", "g.json"):
        task = load_task(str(tmp_path / name), options={"columns": {"prompt": "question"}, "answer_format": "gsm8k"})
        assert [e.answer for e in task.examples] == ["2", "4", "6", "8"], name


def test_csv_columns_are_text(tmp_path):
    """CSV has no types: a column of numbers stays text (a short numeric answer or completion must
    not become a number a text field rejects); an empty cell is a missing value, reported."""
    path = tmp_path / "n.csv"
    path.write_text('prompt,answer\n"1+1?",2\n"2+2?",4\n"x",\n')
    task = load_task(str(path), options={"answer_format": "number"}, strict=False)
    assert [(e.prompt, e.answer) for e in task.examples] == [("1+1?", "2"), ("2+2?", "4")] and task.rows_bad == 1
    _, report = validate_prompt_file(path, answer_format="number")
    assert report.lines() == [f"{path}:3: answer: wrong type: expected a string or number, got null"]


def test_a_saved_dataset_directory_and_its_splits(tmp_path):
    rows = gsm8k_rows(6)
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({k: v[:4] for k, v in rows.items()}),
        "test": datasets.Dataset.from_dict({k: v[4:] for k, v in rows.items()}),
    }).save_to_disk(str(tmp_path / "saved"))
    assert len(load_task(str(tmp_path / "saved"), options={"format": "gsm8k"}).examples) == 4
    test = load_task(str(tmp_path / "saved"), options={"format": "gsm8k", "split": "test"})
    assert [e.answer for e in test.examples] == ["10", "12"]
    with pytest.raises(UserError, match=r"no split 'dev' \(splits: train, test\)"):
        load_task(str(tmp_path / "saved"), options={"format": "gsm8k", "split": "dev"})


def test_math_layout_keeps_the_files_own_answer_column(tmp_path):
    path = tmp_path / "math.jsonl"
    rows = [{"problem": "What is 1/2 + 1/2?", "solution": r"It is $\boxed{1}$.", "answer": "1", "level": "Level 1"},
            {"problem": "Simplify x/x.", "solution": r"So \boxed{1} for x != 0", "answer": "1"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = load_task(str(path), options={"format": "math"})
    assert [e.answer for e in task.examples] == ["1", "1"]
    assert task.examples[0].metadata["source_answer"] == "1" and task.examples[0].metadata["level"] == "Level 1"


def test_bad_gold_rows_name_the_file_row_and_field(tmp_path):
    rows = gsm8k_rows(5)
    rows["answer"][2] = "forgot the marker"
    path = tmp_path / "bad.parquet"
    datasets.Dataset.from_dict(rows).to_parquet(str(path))
    with pytest.raises(UserError) as error:
        load_task(str(path), options={"format": "gsm8k"})
    assert f"{path}:3: answer: unparseable GSM8K gold: no number after '####'" in str(error.value)
    lenient = load_task(str(path), options={"format": "gsm8k"}, strict=False)
    assert len(lenient.examples) == 4 and lenient.rows_bad == 1


@pytest.mark.parametrize("options, message", [
    ({"format": "gsm8k", "columns": {"prompt": "text"}}, "no column 'text' (mapped to prompt; the file has: question, answer)"),
    ({"format": "alpaca"}, "data.format 'alpaca': unknown (known: " + ", ".join(FORMATS) + ")"),
    ({"answer_format": "letters"}, "answer_format: unknown 'letters' (choose from math, number, text, gsm8k, boxed, choice)"),
    ({"columns": {"query": "question"}}, "data.columns: unknown key 'query'"),
    ({"format": "gsm8k", "digits": 2}, "unknown option 'digits'"),
])
def test_mapping_errors_are_one_line(gsm8k_parquet, options, message):
    with pytest.raises(UserError) as error:
        load_task(str(gsm8k_parquet), options=options)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_dataset_name_not_in_the_cache_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    started = time.monotonic()
    with pytest.raises(UserError, match="dataset 'openai/gsm8k': not a local file or directory and not in the local Hugging Face cache"):
        load_task("openai/gsm8k", options={"format": "gsm8k"})
    assert time.monotonic() - started < 5  # offline for real: no retries of the hub (it took 23 s)


def test_an_unreadable_file_is_one_line(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(UserError, match=f"{path}: cannot be read as parquet"):
        load_task(str(path), options={"format": "gsm8k"})


RECIPE_DATA = {  # each command's settings, and what its validate needs besides the data section
    "grpo": (online_config.grpo_config, {}),
    "sft": (sft.Config, {}),
    "pairs": (pairs.PairSettings, {"model": "tiny", "out": "pairs.jsonl"}),
}


@pytest.mark.parametrize("command", RECIPE_DATA)
def test_every_data_section_is_one_task_source(command):
    """grpo / ppo, sft and pairs read a source alike: the same load options from the same fields, and
    the same one-line checks (sizes at least 1, a known format, known columns)."""
    settings, required = RECIPE_DATA[command]
    source = {"task": "arithmetic", "task_options": {"digits": 2}, "format": "gsm8k", "columns": {"prompt": "q"}, "split": "test"}
    config = build_config(settings, None, {**required, "data": source})
    assert isinstance(config.data, TaskSource)
    assert config.data.load_options() == TaskSource(**source).load_options() == {
        "digits": 2, "format": "gsm8k", "columns": {"prompt": "q"}, "split": "test"}
    size_flag = "--data.eval_size" if command == "pairs" else "data.eval_size"
    for data, message in (({"eval_size": 0}, f"{size_flag} must be at least 1, got 0"),
                          ({"format": "alpaca"}, "data.format 'alpaca': unknown"),
                          ({"columns": {"query": "q"}}, "data.columns: unknown key 'query'")):
        with pytest.raises(UserError) as error:
            build_config(settings, None, {**required, "data": {"task": "arithmetic", **data}})
        assert message in str(error.value) and "\n" not in str(error.value)


def test_map_row_renames_and_keeps_the_rest():
    mapping = resolve_columns("math", {"id": "unique_id"})
    row = map_row({"problem": "p", "solution": "s", "answer": "a", "unique_id": "u1", "level": 3}, mapping)
    assert row == {"prompt": "p", "answer": "s", "source_answer": "a", "id": "u1", "level": 3}


@pytest.mark.parametrize("text, letter", [
    ("B", "B"), ("(b)", "B"), ("B.", "B"), ("B)", "B"), ("B: Paris", "B"), ("Option B", "B"), ("answer: c", "C"),
    ("\\text{(D)}", "D"), (" E ", "E"), ("A cat", None), ("AB", None), ("42", None), ("", None), ("B Paris", None),
])
def test_choice_letter(text, letter):
    assert choice_letter(text) == letter


MMLU = {"question": ["Capital of France?", "2+2?", "Largest planet?", "Bad index?", "Letter past the options?", "No options"],
        "choices": [["Berlin", "Paris", "Rome"], ["3", "4"], ["Mars", "Jupiter", "Venus", "Earth"], ["x", "y"], ["x", "y"], []],
        "answer": ["1", "B", "(b)", "5", "C", "A"]}


def test_multiple_choice_golds_from_an_mmlu_layout(tmp_path):
    rows = {**MMLU, "answer": [1, 1, 1, 5, 0, 0]}  # MMLU: a 0-based index
    path = tmp_path / "mmlu.parquet"
    datasets.Dataset.from_dict(rows).to_parquet(str(path))
    with pytest.raises(UserError) as error:
        load_task(str(path), options={"format": "mmlu"})
    assert str(error.value).splitlines()[1:] == [
        f"{path}:4: answer: option index 5 out of range for 2 choices",
        f"{path}:6: choices: 0 options (need 2 to 26)",
    ]
    task = load_task(str(path), options={"format": "mmlu"}, strict=False)
    assert [e.answer for e in task.examples] == ["B", "B", "B", "A"] and task.rows_bad == 2
    assert task.reward_kind == "choice"
    assert task.examples[0].prompt == "Capital of France?\n\nA. Berlin\nB. Paris\nC. Rome"


def test_multiple_choice_letter_golds_from_jsonl(tmp_path):
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps({"prompt": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in zip(MMLU["question"][:5], MMLU["choices"], ["B", "b", "(B)", "C", "D"])))
    parsed, report = validate_prompt_file(path, answer_format="choice")
    assert [e.answer for _, e in parsed] == ["B", "B", "B"]
    assert report.lines() == [f"{path}:4: answer: option C but only 2 choices", f"{path}:5: answer: option D but only 2 choices"]
    _, report = validate_prompt_file(path)  # options without the choice gold format
    assert report.lines()[0] == (f"{path}:1: choices: options given but the gold format is 'math': "
                                 "set task_options {answer_format: choice} (or data.format mmlu)")


def test_splits_of_a_parquet_task_are_disjoint_and_seeded(gsm8k_parquet):
    train, held_out = load_splits(str(gsm8k_parquet), eval_size=4, seed=1, options={"format": "gsm8k"})
    assert len(train.examples) == 8 and len(held_out.examples) == 4
    assert not {e.id for e in train.examples} & {e.id for e in held_out.examples}


def digit_reward(completion: str, example) -> float:
    return float(any(ch.isdigit() for ch in completion))


def test_grpo_on_a_gsm8k_parquet_file_resolves_reward_and_checker_from_the_format(tmp_path, gsm8k_parquet):
    overrides = {
        "data": {"task": str(gsm8k_parquet), "format": "gsm8k", "eval_size": 4, "train_size": None, "prompts_per_step": 2,
                 "group_size": 2},
        "sampling": {"max_new_tokens": 6}, "max_steps": 2, "output_dir": str(tmp_path / "run"), "acceptance": {"eval_every": 0},
    }
    config = build_config(online_config.grpo_config, None, overrides)
    run_dir = online.run(config)
    card = json.loads((run_dir / "run_card.json").read_text())
    assert card["links"]["reward"]["verifier"] == "math"
    assert card["links"]["reward"]["resolved_from"] == "the task's gold format (math)"
    assert card["links"]["acceptance"]["checker_resolved"] == "math_equal"
    assert card["links"]["acceptance"]["independent"] is True  # math-verify trains, our own LaTeX reader accepts
    assert card["links"]["data"]["options"] == {"format": "gsm8k"}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and rows[-1]["heldout/pass@1"] is not None
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and "Tom has" in samples[0]["prompt"]  # rendered with the chat template


def test_eval_command_reads_the_same_file(tmp_path, gsm8k_parquet):
    out = tmp_path / "eval"
    result = subprocess.run([sys.executable, "-m", "posttrain", "eval", "--model", "tiny", "--task", str(gsm8k_parquet),
                             "--format", "gsm8k", "--eval-size", "4", "--max-new-tokens", "4", "--output-dir", str(out)],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n"] == 4 and summary["checker"]["verifier"] == "math_equal"


def test_data_check_reads_every_kind_and_format(tmp_path):
    rows = gsm8k_rows(3)
    rows["answer"][1] = "nope"
    parquet = tmp_path / "g.parquet"
    datasets.Dataset.from_dict(rows).to_parquet(str(parquet))
    sft = tmp_path / "sft.jsonl"
    sft.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{"prompt": "x"}\n')

    def check(*args):
        return subprocess.run([sys.executable, "-m", "posttrain", "data", "check", *args], capture_output=True, text=True, cwd=ROOT)

    result = check("--kind", "prompt", str(parquet), "--format", "gsm8k")
    assert result.returncode == 1
    assert result.stdout.splitlines()[:2] == [f"{parquet}:2: answer: unparseable GSM8K gold: no number after '####' in 'nope'",
                                              f"{parquet}: 3 rows read, 1 bad"]
    result = check("--kind", "sft", str(sft))
    assert result.returncode == 1 and result.stdout.splitlines() == [
        f"{sft}:2: completion: missing field (an SFT row has `messages`, or `prompt` and `completion`)", f"{sft}: 2 rows read, 1 bad",
        """hint: the rows' columns are prompt; map yours to ours with --data.columns '{"completion": "COLUMN"}', """
        "or pass the --data.format of their layout (docs/data.md)",
        "prompt lengths not checked (give --model SPEC and --max-prompt-tokens N)"]
    result = check("--kind", "preference", str(parquet), "--format", "gsm8k")
    assert result.returncode == 2 and "no column 'chosen'" in result.stderr


def test_file_tasks_are_row_views_equal_to_the_eager_parse(tmp_path, gsm8k_parquet):
    """A data file's examples are row handles (parsed again on reading), identical to the eager
    parse, split exactly as shuffling the parsed list would, and they pickle."""
    import pickle
    import random as stdlib_random

    from posttrain.data.examples import derived_seed
    from posttrain.data.files import RowView

    jsonl = tmp_path / "big.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + ("\n\n" if i % 7 == 0 else "\n")
                             for i in range(300)) + '{"prompt": "bad"\n')
    for source, options in ((jsonl, {"answer_format": "number"}), (gsm8k_parquet, {"format": "gsm8k"})):
        task = load_task(str(source), options=options, strict=False)
        assert isinstance(task.examples, RowView)
        eager, _ = validate_prompt_file(source, answer_format=options.get("answer_format"), data_format=options.get("format"))
        assert list(task.examples) == [example for _, example in eager]
        assert task.examples[5] == eager[5][1] and list(task.examples[2:4]) == [eager[2][1], eager[3][1]]
        train, held_out = load_splits(str(source), eval_size=4, seed=3, options=options, strict=False)
        shuffled = [example for _, example in eager]
        stdlib_random.Random(derived_seed(3, "split")).shuffle(shuffled)
        assert list(held_out.examples) == shuffled[:4] and list(train.examples) == shuffled[4:]
        assert list(pickle.loads(pickle.dumps(train.examples))) == list(train.examples)
    assert load_task(str(jsonl), options={"answer_format": "number"}, strict=False).rows_bad == 1


def test_trl_prompt_layout_with_chat_prompts(tmp_path):
    """TRL's prompt-only layout: `prompt` as chat messages (read as our `messages`) or a string."""
    path = tmp_path / "prompts.json"
    rows = [{"prompt": [{"role": "user", "content": "What is 2+3?"}], "answer": "5"},
            {"prompt": "What is 4+4?", "answer": "8"},
            {"prompt": [{"role": "user"}], "answer": "1"}]
    path.write_text(json.dumps(rows))
    parsed, report = validate_prompt_file(path, data_format="trl_prompt", answer_format="number")
    assert [(e.messages, e.prompt, e.answer) for _, e in parsed] == [
        ([{"role": "user", "content": "What is 2+3?"}], None, "5"), (None, "What is 4+4?", "8")]
    assert len(report.lines()) == 1 and report.lines()[0].startswith(f"{path}:3: prompt")
