"""Issue 27, items 5 and 6 (and item 11's data sizes), each as the user typed it: a small file
trains by default, a bad file is a few lines that say what to change, and nothing is written."""

import json

import pytest

from posttrain.cli import main
from posttrain.data.files import layout_hint
from posttrain.data.sft_data import load_data
from posttrain.data.tasks import default_eval_size, load_splits
from posttrain.errors import UserError
from posttrain.models import load_model

SFT_FAST = ["--max-steps", "1", "--batch_size", "4", "--micro_batch_size", "4", "--acceptance.max_new_tokens", "2"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def prompt_rows(count):
    return [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(count)]


def chat_rows(count):
    return [{"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": str(i)}]} for i in range(count)]


def gsm8k_rows(count):
    return [{"question": f"What is {i}+1?", "answer": f"{i}+1={i + 1}\n#### {i + 1}"} for i in range(count)]


def error_lines(capsys) -> list[str]:
    """stderr of a refused command from its `posttrain: error:` line on (log lines of its start aside)."""
    lines = capsys.readouterr().err.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("posttrain: ")]
    assert len(starts) == 1, lines
    return lines[starts[0]:]


def card_data(run_dir):
    return json.loads((run_dir / "run_card.json").read_text())["links"]["data"]


# --- item 5: SFT and pairs train on every row not held out ----------------------------------------

def test_sft_on_a_40_row_prompt_file_with_eval_size_4_trains_on_the_other_36(tmp_path, monkeypatch):
    """Was `task ok.jsonl: train_size=20000 + eval_size=4 is more than its 40 examples`."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "ok.jsonl", prompt_rows(40))
    assert main(["sft", "--data.task", "ok.jsonl", "--data.eval_size", "4", *SFT_FAST, "--output-dir", "run"]) == 0
    data = card_data(tmp_path / "run")
    assert (data["train_examples"], data["heldout_examples"], data["heldout_size_from"]) == (36, 4, "data.eval_size")


def test_sft_on_a_120_row_chat_file_holds_out_a_tenth_and_says_so(tmp_path, monkeypatch, caplog):
    """Was `eval_size=200 leaves no training rows out of 120`: 120 // 10 = 12 held out, 108 trained."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(120))
    with caplog.at_level("INFO", logger="posttrain.data.tasks"):
        assert main(["sft", "--data.task", "chat.jsonl", *SFT_FAST, "--output-dir", "run"]) == 0
    assert "chat.jsonl: holding out 12 of its 120 rows (data.eval_size not set: one in 10 of a file under 2000 rows)" in caplog.messages
    data = card_data(tmp_path / "run")
    assert (data["train_rows"], data["heldout_rows"]) == (108, 12)
    assert data["heldout_size_from"] == "data.eval_size not set: 200, or one in 10 rows of a file under 2000"


def test_grpo_pairs_and_eval_on_a_120_row_gsm8k_file_hold_out_the_same_tenth(tmp_path, monkeypatch, caplog, capsys):
    """Was `eval_size=200 leaves no training examples out of 120` for every recipe but SFT: GRPO,
    pairs and eval now resolve the same default (12 of 120), pairs record the resolved size in
    their provenance (a DPO run re-derives the held-out split from it), eval scores those 12."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows(120))
    online = ["--data.task", "gsm8k.jsonl", "--data.format", "gsm8k", "--sampling.max_new_tokens", "2",
              "--acceptance.max_new_tokens", "2", "--acceptance.sets", "[]"]
    with caplog.at_level("INFO", logger="posttrain.data.tasks"):
        assert main(["grpo", *online, "--data.prompts_per_step", "2", "--data.group_size", "2", "--max-steps", "1",
                     "--output-dir", "run"]) == 0
    assert "gsm8k.jsonl: holding out 12 of its 120 rows (data.eval_size not set: one in 10 of a file under 2000 rows)" in caplog.messages
    data = card_data(tmp_path / "run")
    assert (data["train_prompts"], data["heldout_prompts"]) == (108, 12)
    assert data["heldout_size_from"] == "data.eval_size not set: 200, or one in 10 rows of a file under 2000"
    assert main(["pairs", "--model", "tiny", "--data.task", "gsm8k.jsonl", "--data.format", "gsm8k", "--data.max_prompts", "4", "--group_size", "4",
                 "--verifier", "callable:tests.rewards_for_tests.digits", "--sampling.max_new_tokens", "6", "--out", "pairs.jsonl"]) == 0
    assert json.loads((tmp_path / "pairs.meta.json").read_text())["eval_size"] == 12
    assert main(["eval", "--model", "tiny", "--task", "gsm8k.jsonl", "--format", "gsm8k", "--max-new-tokens", "2",
                 "--output-dir", "eval"]) == 0
    assert "tiny on gsm8k.jsonl held-out (12 problems, checker math_equal)" in capsys.readouterr().out


def test_default_eval_size_is_200_or_a_tenth_of_a_small_file():
    assert [default_eval_size(rows, "f") for rows in (1, 9, 40, 120, 1999, 2000, 50_000)] == [1, 1, 4, 12, 199, 200, 200]


def test_sft_train_size_larger_than_the_file_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(40))
    assert main(["sft", "--data.task", "chat.jsonl", "--data.train_size", "100", *SFT_FAST, "--output-dir", "run"]) == 2
    assert error_lines(capsys) == ["posttrain: error: data.task chat.jsonl: train_size=100 + eval_size=4 is more than its 40 rows"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl"]


def test_sft_with_fewer_training_rows_than_one_batch_is_refused(tmp_path, monkeypatch, capsys):
    """docs/data.md: a run whose data is smaller than one batch stops before its first step (the
    stream would repeat rows within a step): 40 rows - 38 held out = 2, batch_size 32."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(40))
    assert main(["sft", "--data.task", "chat.jsonl", "--data.eval_size", "38", "--output-dir", "run"]) == 2
    assert error_lines(capsys) == ["posttrain: error: data.task chat.jsonl: 2 training rows, fewer than one batch of batch_size=32"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl"]


def test_grpo_with_fewer_training_prompts_than_one_step_is_refused(tmp_path, monkeypatch, capsys):
    """`--data.prompts_per_step 8` on a file that leaves 2 training prompts would repeat each 4x in a
    step: one line before the run directory exists."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "sums.jsonl", prompt_rows(10))
    assert main(["grpo", "--data.task", "sums.jsonl", "--data.eval_size", "8", "--data.prompts_per_step", "8",
                 "--output-dir", "run"]) == 2
    line = error_lines(capsys)[0]
    assert "2 usable examples, fewer than one batch of data.prompts_per_step=8" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sums.jsonl"]


def test_pairs_on_a_40_row_file_samples_its_36_training_prompts(tmp_path, monkeypatch, capsys):
    """Was `train_size=256 (max_prompts) + eval_size=4 is more than its 40 examples`. The tiny
    model never writes a 9-digit gold, so no pair comes out: the line counts the prompts sampled."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "ok.jsonl", [{"prompt": f"{i}+1=", "answer": str(123456789 + i)} for i in range(40)])
    assert main(["pairs", "--model", "tiny", "--data.task", "ok.jsonl", "--data.eval_size", "4", "--group-size", "2",
                 "--sampling.max_new_tokens", "2", "--out", "pairs.jsonl"]) == 2
    assert error_lines(capsys) == ["posttrain: error: no pairs: of 36 prompts, 0 had only correct answers, 36 only incorrect, "
                                   "0 could not be scored (G=2); nothing written"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.jsonl"]


# --- item 6: data.strict, a few bad rows, the layout hint ------------------------------------------

def mixed_file(path):
    return write_jsonl(path, prompt_rows(40) + [{"prompt": "", "answer": "1"}])


def test_grpo_advice_names_data_strict_and_it_drops_the_bad_row(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    mixed_file(tmp_path / "mixed.jsonl")
    assert main(["grpo", "--data.task", "mixed.jsonl", "--data.eval_size", "4", "--output-dir", "run"]) == 2
    assert error_lines(capsys) == [
        "posttrain: error: mixed.jsonl: 41 rows read, 1 bad (fix them, or set data.strict false to drop bad rows):",
        "mixed.jsonl:41: prompt: empty or whitespace-only"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixed.jsonl"]
    # What `posttrain grpo --data.strict false` loads (recipes/online.setup's call).
    from posttrain.config import build_config, parse_overrides
    from posttrain.recipes.online_config import Config

    config = build_config(Config, None, parse_overrides(["--data.task", "mixed.jsonl", "--data.eval_size", "4", "--data.strict", "false"]))
    train, held_out = load_splits(config.data.task, train_size=config.data.train_size, eval_size=config.data.eval_size,
                                  seed=config.seed, options=config.data.load_options())
    assert (len(train.examples), len(held_out.examples), train.rows_bad) == (36, 4, 1)
    # ... and says so in the run card's data link, not only in the log: the count and the reasons, counted.
    from posttrain.data.scored_batch import online_data_card

    card = online_data_card(config.data, train, held_out, config.sampling, grouped=True)
    assert (card["rows_bad"], card["rows_bad_reasons"]) == (1, {"prompt: empty or whitespace-only": 1})


def test_sft_data_strict_false_drops_bad_rows_of_rows_and_tasks(tmp_path):
    from posttrain.config import build_config
    from posttrain.recipes import sft

    _, tokenizer = load_model("tiny")
    bad_chat = write_jsonl(tmp_path / "chat.jsonl", chat_rows(40) + [{"messages": [{"role": "user", "content": "hi"}]}])
    for path, key in ((bad_chat, "train_rows"), (mixed_file(tmp_path / "mixed.jsonl"), "train_examples")):
        config = build_config(sft.Config, None, {"data": {"task": str(path), "strict": False}})
        data = load_data(config.data, config.seed, tokenizer)
        assert (data.card[key], len(data.held_out), data.card["rows_bad"], data.card["options"]) == (36, 4, 1, {"strict": False})
        reason = "messages: no assistant message to train on" if path == bad_chat else "prompt: empty or whitespace-only"
        assert data.card["rows_bad_reasons"] == {reason: 1}, data.card


def test_dpo_and_kto_cards_count_the_dropped_rows_and_their_reasons(tmp_path):
    """`--data.strict false` on a pairs file with 3 bad rows (2 missing `rejected`, 1 chosen identical
    to rejected) and a held-out file with 1 (an empty prompt): the data link of the run card names
    both counts and the reasons by kind, for DPO's pairs and for KTO reading the same pairs unpaired."""
    from posttrain.data.preference import PairSource, load_pairs, preference_data_card
    from posttrain.data.unpaired import load_unpaired

    _, tokenizer = load_model("tiny")
    good = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(8)]
    pairs = write_jsonl(tmp_path / "pairs.jsonl", good + [{"prompt": "a", "chosen": "b"}, {"prompt": "c", "chosen": "d"},
                                                          {"prompt": "e", "chosen": "f", "rejected": "f"}])
    held = write_jsonl(tmp_path / "held.jsonl", good[:3] + [{"prompt": " ", "chosen": "x", "rejected": "y"}])
    expected = {"rows_bad": 3, "rows_bad_reasons": {"rejected: missing field": 2, "chosen: identical to rejected": 1},
                "heldout_rows_bad": 1, "heldout_rows_bad_reasons": {"prompt: empty or whitespace-only": 1}}
    for load in (load_pairs, load_unpaired):
        splits = load(pairs, tokenizer, heldout_file=held, strict=False)
        assert {key: splits.stats[key] for key in expected} == expected
    splits = load_pairs(pairs, tokenizer, heldout_file=held, strict=False)
    card = preference_data_card(PairSource(pairs=str(pairs), heldout_file=str(held), strict=False), splits, None, seed=0,
                                batch_size=4, micro_batch_size=2)
    assert {key: card[key] for key in expected} == expected


def test_a_gsm8k_layout_file_is_five_rows_a_count_and_the_format_to_pass(tmp_path, monkeypatch, capsys):
    """Was one line per row (40) and no word of --data.format gsm8k."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "gsm.jsonl", gsm8k_rows(40))
    assert main(["grpo", "--data.task", "gsm.jsonl", "--output-dir", "run"]) == 2
    assert error_lines(capsys) == [
        "posttrain: error: gsm.jsonl: 40 rows read, 40 bad (fix them, or set data.strict false to drop bad rows):",
        *[f"gsm.jsonl:{row}: prompt: missing field (need `prompt` or `messages`)" for row in range(1, 6)],
        "... and 35 more (posttrain data check lists them all)",
        "hint: the rows' columns (question, answer) are the gsm8k layout: pass --data.format gsm8k"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gsm.jsonl"]
    # The advice can be followed, in `data check` as in training.
    assert main(["data", "check", "gsm.jsonl", "--data.format", "gsm8k"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "gsm.jsonl: 40 rows read, 0 bad"


def test_an_alpaca_file_given_to_sft_is_told_to_map_its_columns(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": f"say {i}", "output": str(i)} for i in range(10)])
    assert main(["data", "check", "--kind", "sft", "alpaca.jsonl"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-3:] == ["alpaca.jsonl: 10 rows read, 10 bad",
                        """hint: the rows' columns are instruction, output; map yours to ours with --data.columns '{"prompt": "COLUMN"}', """
                        "or pass the --data.format of their layout (docs/data.md)",
                        "prompt lengths not checked (give --model SPEC and --max-prompt-tokens N)"]


@pytest.mark.parametrize("columns, missing, expected", [
    (["question", "answer"], "prompt", "are the gsm8k layout: pass --data.format gsm8k"),
    (["question", "choices", "answer"], "prompt", "are the mmlu layout: pass --data.format mmlu"),  # the layout naming most
    (["problem", "solution", "level"], "prompt", "are the math layout: pass --data.format math"),
    (["text", "test_list", "task_id", "code"], "prompt", "are the mbpp layout: pass --data.format mbpp"),
    (["description", "public_tests"], "prompt", "are the code_contests layout: pass --data.format code_contests"),
    (["prompt", "better", "worse"], "chosen", """--data.columns '{"chosen": "COLUMN"}', or pass the --data.format of their layout (docs/data.md)"""),
])
def test_layout_hint(columns, missing, expected):
    assert layout_hint(columns, missing).endswith(expected)


@pytest.mark.parametrize("name", ["ok.tsv", "ok.txt", "ok"])
def test_an_unknown_extension_is_refused_by_name(name, tmp_path, monkeypatch, capsys):
    """Was parsed as JSONL (a .tsv: one invalid-JSON line per row; this one even trained)."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / name, prompt_rows(40))
    kind = f"a {name[2:]} file" if "." in name else "a file without an extension"
    line = (f"posttrain: error: {name}: {kind}, not a data file posttrain reads (.jsonl, .parquet, .csv, .json, .arrow, "
            "or a save_to_disk directory); convert it to one of them")
    assert main(["grpo", "--data.task", name, "--data.eval_size", "4", "--output-dir", "run"]) == 2
    assert error_lines(capsys) == [line]
    assert main(["data", "check", name]) == 2
    assert error_lines(capsys) == [line]
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_data_check_on_an_empty_file_fails_as_training_does(tmp_path, monkeypatch, capsys):
    """Was `0 rows read, 0 bad`, exit 0, where training stops."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n")
    for argv in (["data", "check", "empty.jsonl"], ["data", "check", "--kind", "sft", "empty.jsonl"],
                 ["sft", "--data.task", "empty.jsonl", "--output-dir", "run"], ["grpo", "--data.task", "empty.jsonl", "--output-dir", "run"]):
        assert main(argv) == 2, argv
        assert error_lines(capsys) == ["posttrain: error: empty.jsonl: no rows (an empty file)"], argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl"]


def test_data_check_sft_checks_prompt_lengths(tmp_path, monkeypatch, capsys):
    """Was silently skipped for --kind sft. "12+34=" is 25 tokens in the tiny chat template, as a
    string prompt and as the one user message before a conversation's assistant turn."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "sft.jsonl", [
        {"prompt": "12+34=", "completion": "46"},
        {"messages": [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "46"}]},
        {"prompt": "1=", "completion": "1"}])
    assert main(["data", "check", "--kind", "sft", "sft.jsonl", "--model", "tiny", "--max-prompt-tokens", "24"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "sft.jsonl:1: prompt: 25 tokens, longer than max_prompt_tokens=24",
        "sft.jsonl:2: prompt: 25 tokens, longer than max_prompt_tokens=24",
        "sft.jsonl: 3 rows read, 2 bad"]
    assert main(["data", "check", "--kind", "sft", "sft.jsonl", "--model", "tiny", "--max-prompt-tokens", "25"]) == 0


def test_a_ragged_csv_is_one_line_with_its_line_number(tmp_path, monkeypatch, capsys):
    """Was the CSV parser's ERROR log and `cannot be read as csv (DatasetGenerationError: ...)`."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ragged.csv").write_text("prompt,answer\n1+1=,2\n\n2+2=,4,extra\n3+3=,6\n")
    line = "posttrain: error: ragged.csv: line 4 (row 2): 3 fields, the header has 2 (quote a field that holds a comma)"
    assert main(["data", "check", "ragged.csv"]) == 2
    assert error_lines(capsys) == [line]
    assert main(["grpo", "--data.task", "ragged.csv", "--data.eval_size", "1", "--output-dir", "run"]) == 2
    assert error_lines(capsys) == [line]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ragged.csv"]


def test_two_training_prompts_are_fewer_than_one_batch_of_prompts_per_step(tmp_path):
    """The check `--data.prompts_per_step 8` needs in the online recipe (recipes/online.setup, after
    the screening): 40 rows - 38 held out = 2 prompts, each of which a step of 8 would repeat 4x."""
    from posttrain.data.examples import require_examples

    path = write_jsonl(tmp_path / "ok.jsonl", prompt_rows(40))
    train, _ = load_splits(str(path), eval_size=38, seed=0)
    with pytest.raises(UserError) as error:
        require_examples(train, 8, setting="data.prompts_per_step")
    assert str(error.value) == f"{path} (train): 2 usable examples, fewer than one batch of data.prompts_per_step=8 (a step would repeat them)"
    require_examples(train, 2, setting="data.prompts_per_step")
