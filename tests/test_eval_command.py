"""`posttrain eval`: the held-out split of a training run, scored by a checker, written to a dir."""

import json
import re

import pytest

from posttrain.cli import main


def test_eval_writes_summary_and_rows(tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["eval", "--model", "tiny", "--task", "arithmetic", "--eval-size", "6", "--k", "2",
                 "--max-new-tokens", "4", "--output-dir", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n"] == 6 and summary["pass@1"] == 0.0  # an untrained model writes no <answer> tags
    assert summary["pass@1_ci95"][0] < 1e-12 and 0 < summary["pass@1_ci95"][1] < 1
    assert "pass@2" in summary and summary["checker"]["verifier"] == "integer"  # the independent checker of number tasks
    rows = json.loads((out / "eval.json").read_text())["rows"]
    assert len(rows) == 6 and {"id", "prompt", "completion", "reward", "status", "reason"} <= set(rows[0])
    assert "pass@1" in capsys.readouterr().out


def test_eval_bad_input_writes_nothing(tmp_path, capsys):
    for argv, message in (
        (["--checker", "nope"], "acceptance.checker: unknown verifier"),
        (["--task-options", "{digits: 2"], "data.task_options: expected a mapping, got '{digits: 2'"),
        (["--k", "0"], "acceptance.k must be at least 1"),
        (["--eval-size", "0"], "data.eval_size must be at least 1"),
        (["--task", "arithmetic", "--data.task", "rg:leg_counting"], "--task and --data.task set the same key"),
        (["--bogus", "1"], "unknown key 'bogus'"),
        (["--timeout", "0"], "reward_options: timeout_s must be > 0"),
        (["--checker", "mbpp", "--extraction", "boxed"], "reward_options.extraction 'boxed': a code verifier takes one of"),
    ):
        out = tmp_path / "eval"
        # the base flags the case does not give itself (a key given twice is refused before anything else)
        base = [part for flag, value in (("--task", "arithmetic"), ("--eval-size", "4")) if flag not in argv for part in (flag, value)]
        code = main(["eval", "--model", "tiny", *base, "--output-dir", str(out), *argv])
        assert code == 2 and message in capsys.readouterr().err
        assert not out.exists()


def test_eval_takes_the_code_checkers_settings(tmp_path, capsys):
    """--timeout / --memory-mb / --extraction reach the checker (recorded in summary.json), and
    --unsafe-no-sandbox is said in the output and the summary."""
    from pathlib import Path

    mbpp = Path(__file__).parent / "data" / "mbpp_small.jsonl"
    out = tmp_path / "eval"
    assert main(["eval", "--model", "tiny", "--task", str(mbpp), "--format", "mbpp", "--eval-size", "2", "--max-new-tokens", "4",
                 "--timeout", "3", "--memory-mb", "512", "--extraction", "raw", "--unsafe-no-sandbox", "--output-dir", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["checker"]["verifier"] == "mbpp" and summary["checker"]["unsafe_no_sandbox"] is True
    assert summary["checker"]["timeout_s"] == 3 and summary["checker"]["memory_mb"] == 512
    assert summary["checker"]["code_policy"] == "raw" and summary["unsafe_no_sandbox"] is True
    assert "UNSAFE" in capsys.readouterr().out


def test_eval_takes_the_recipes_keys_and_a_config_file(tmp_path, capsys):
    """The settings are the recipes' sections: dotted keys and a YAML file set what the short flags
    set (`evaluation/settings.EvalConfig`), and --help lists both spellings."""
    config = tmp_path / "eval.yaml"
    config.write_text("model: tiny\ndata: {task: arithmetic, task_options: {digits: 1}, eval_size: 3}\n")
    out = tmp_path / "eval"
    assert main(["eval", "--config", str(config), "--acceptance.max_new_tokens", "2", "--output-dir", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n"] == 3 and summary["mean_length"] <= 2
    rows = json.loads((out / "eval.json").read_text())["rows"]
    operands = [re.findall(r"(\d+)\+(\d+)=", row["prompt"])[0] for row in rows]
    assert len(operands) == 3 and all(len(a) == 1 and len(b) == 1 for a, b in operands)  # task_options reached the task
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = capsys.readouterr().out
    assert "data.task_options" in text and "--task-options" in text and "--data.task_options" in text
