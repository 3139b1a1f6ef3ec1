"""The common mistakes of issue 27, each as the user typed it: the exit code, the one line on
stderr, and nothing written or overwritten."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.cli import main

POSTTRAIN = str(Path(sys.executable).parent / "posttrain")
"""The installed `posttrain` script: unlike `python -m posttrain`, it does not put the current
directory on the import path by itself."""
SMALL_ONLINE = ["--max-steps", "1", "--data.eval_size", "8", "--data.train_size", "50", "--data.prompts_per_step", "2",
                "--data.group_size", "2", "--sampling.max_new_tokens", "4"]
MY_REWARD = "def score(completion, example):\n    return float(any(c.isdigit() for c in completion))\n"


def one_error_line(capsys) -> str:
    """The one line a refused command printed on stderr (log lines of its start aside)."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("posttrain: ")]
    assert len(lines) == 1, lines
    return lines[0]


# --- item 4: --reward callable: -------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["grpo", "--reward", "callable:my_rewards.nope", *SMALL_ONLINE],
    ["ppo", "--reward", "callable:my_rewards.nope", *SMALL_ONLINE],
    ["pairs", "--model", "tiny", "--data.task", "arithmetic", "--verifier", "callable:my_rewards.nope"],
], ids=lambda argv: argv[0])
def test_a_callable_path_that_does_not_import_is_one_line(argv, tmp_path, monkeypatch, capsys):
    """grpo, ppo and pairs as verify does: one line naming the path, the reason and where modules
    are looked for; no run directory, no pairs file."""
    monkeypatch.chdir(tmp_path)
    output = ["--out", str(tmp_path / "pairs.jsonl")] if argv[0] == "pairs" else ["--output-dir", str(tmp_path / "run")]
    assert main(argv + output) == 2
    setting = "--verifier" if argv[0] == "pairs" else "reward"
    assert one_error_line(capsys) == (
        f"posttrain: error: {setting}: cannot load callable:my_rewards.nope: ModuleNotFoundError: No module named "
        f"'my_rewards' (modules are imported from the current directory, {tmp_path}, then PYTHONPATH)")
    assert sorted(path.name for path in tmp_path.iterdir()) == []


def test_a_missing_function_of_a_module_in_the_current_directory_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_rewards.py").write_text(MY_REWARD)
    monkeypatch.chdir(tmp_path)
    assert main(["grpo", "--reward", "callable:my_rewards.scor", *SMALL_ONLINE, "--output-dir", "run"]) == 2
    assert one_error_line(capsys) == (
        "posttrain: error: reward: cannot load callable:my_rewards.scor: AttributeError: module 'my_rewards' has no "
        f"attribute 'scor' (modules are imported from the current directory, {tmp_path}, then PYTHONPATH)")
    assert not (tmp_path / "run").exists()


def test_the_posttrain_script_imports_a_reward_module_from_the_current_directory(tmp_path):
    """`posttrain grpo --reward callable:my_rewards.score` run where my_rewards.py is, without
    PYTHONPATH: the run trains and scores with it (the trainer checks the path, its workers score)."""
    (tmp_path / "my_rewards.py").write_text(MY_REWARD)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([POSTTRAIN, "grpo", "--reward", "callable:my_rewards.score", *SMALL_ONLINE, "--output-dir", "run"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "results: run"
    assert "training reward callable:my_rewards.score" in result.stderr
    assert (tmp_path / "run" / "checkpoints" / "step-000001").is_dir()
