"""The training-signal check (evaluation/signal.py): a run whose reward scores nothing warns, then
stops in one line with a `posttrain verify` command that replays the failing rows; a run whose
groups never differ rings the alarm once; the card's "training_signal" section counts both; the
counters survive a checkpoint."""

import json
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.evaluation.run_record import read_run
from posttrain.evaluation.signal import FAILURES_FILE, SignalLost, StepSignal, TrainingSignal
from tests.flags import with_flags

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--data.eval_size", "4", "--data.train_size", "50", "--data.prompts_per_step", "2", "--data.group_size", "4",
         "--sampling.max_new_tokens", "6", "--acceptance.eval_every", "0", "--seed", "3"]


def failed(rows: int = 8, reason: str = "infra_error: RuntimeError: down") -> StepSignal:
    return StepSignal(rows=rows, infra_errors=rows, reasons=[reason], zero_variance_fraction=None, grad_norm=0.0)


def test_counts_warns_rings_once_and_stops(tmp_path, caplog):
    signal = TrainingSignal(stop_after=3, window=2, verify="callable:m.f")
    with caplog.at_level(logging.WARNING, logger="posttrain.evaluation.signal"):
        signal.observe(1, StepSignal(rows=8, infra_errors=3, data_errors=2, reasons=["data_error: nan"], zero_variance_fraction=0.5,
                                     grad_norm=0.3))
    assert "could not score 5 of 8 rows (3 infra_error, 2 data_error); first: data_error: nan" in caplog.text
    signal.stop(1, [])  # 5 of 8 failed: a warning, no stop
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="posttrain.evaluation.signal"):
        signal.observe(2, StepSignal(rows=8, zero_variance_fraction=1.0, grad_norm=0.0))  # all groups equal: silent
        signal.observe(3, failed())
    assert caplog.text.count("training signal gone: for 2 steps in a row (to step 3)") == 1
    signal.stop(3, [])
    signal.observe(4, failed())
    signal.stop(4, [])  # two steps in a row all failed: not yet
    signal.observe(5, failed())
    assert len(signal.rings) == 1, "the alarm rings once"
    rows = [{"completion": "x", "answer": "1", "status": "infra_error", "reason": "RuntimeError: down"}]
    with pytest.raises(SignalLost) as stopped:
        signal.stop(5, rows, tmp_path)
    assert str(stopped.value) == (
        "step 5: the reward could not score any row for 3 steps in a row (infra_error: RuntimeError: down); the run stops; "
        f"try the reward on those rows: posttrain verify --verifier 'callable:m.f' --input {tmp_path / FAILURES_FILE}")
    assert [json.loads(line) for line in (tmp_path / FAILURES_FILE).read_text().splitlines()] == rows
    card = signal.card()
    assert card == {"steps": 5, "rows": 40, "infra_error_rate": 27 / 40, "data_error_rate": 2 / 40,
                    "zero_variance_group_fraction": 0.75, "steps_without_reward_signal": 4, "steps_without_gradient": 4,
                    "alarm": signal.rings[0]}
    resumed = TrainingSignal(stop_after=3, window=2, verify="callable:m.f", **json.loads(json.dumps(signal.state())))
    assert resumed.card() == card and resumed.failed_in_a_row == 3


def test_off_switches_and_a_python_reward(tmp_path):
    never = TrainingSignal(stop_after=0, window=0)
    for step in range(1, 8):
        never.observe(step, failed())
        never.stop(step, [{"completion": "x"}], tmp_path)
    assert never.rings == [] and not (tmp_path / FAILURES_FILE).exists()
    python = TrainingSignal(stop_after=1, verify=None)
    python.observe(1, failed())
    with pytest.raises(SignalLost, match=f"the failing rows are in {tmp_path / FAILURES_FILE}$"):
        python.stop(1, [{"completion": "x"}], tmp_path)
    with pytest.raises(SignalLost, match=r"\(infra_error: RuntimeError: down\); the run stops$"):
        python.stop(1, [])


def grpo(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    args = with_flags(SMALL, *extra)
    return subprocess.run([sys.executable, "-m", "posttrain", "grpo", *args, "--output-dir", str(tmp_path / "run")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_reward_that_always_raises_stops_the_run_with_a_command_that_replays_it(tmp_path):
    result = grpo(tmp_path, "--reward", "callable:rewards_for_tests.broken", "--max-steps", "10")
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    run = tmp_path / "run"
    assert last == ("posttrain: error: step 3: the reward could not score any row for 3 steps in a row (infra_error: "
                    "RuntimeError: the reward service is down); the run stops; try the reward on those rows: posttrain verify "
                    f"--verifier 'callable:rewards_for_tests.broken' --input {run / FAILURES_FILE}"), last
    assert "step 1: the reward could not score 8 of 8 rows (8 infra_error, 0 data_error)" in result.stderr
    assert "reward=n/a" in result.stderr, "the progress bar says nothing was scored, not reward=0.000"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in steps] == [0, 1, 2, 3] and all(row["errors/infra"] == 8 for row in steps[1:])
    card = json.loads((run / "run_card.json").read_text())
    assert card["training_signal"]["infra_error_rate"] == 1.0 and card["training_signal"]["steps_without_reward_signal"] == 3
    assert card["training_signal"]["steps_without_gradient"] == 3 and any("could not score any row" in n for n in card["notes"])
    # The printed command runs as written and shows the reward's own error on the kept rows.
    command = shlex.split(last.split("try the reward on those rows: ")[1])
    assert command[:2] == ["posttrain", "verify"]
    replay = subprocess.run([sys.executable, "-m", "posttrain", *command[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])})
    verdicts = [json.loads(line) for line in replay.stdout.splitlines()]
    assert len(verdicts) == 3 and all(v["status"] == "infra_error" and "the reward service is down" in v["reason"] for v in verdicts)


def test_a_reward_that_never_differs_rings_the_alarm_once_and_trains_on(tmp_path):
    result = grpo(tmp_path, "--reward", "callable:rewards_for_tests.constant", "--max-steps", "4", "--acceptance.signal_window", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr.count("training signal gone: for 2 steps in a row (to step 2)") == 1
    assert "(every group's rewards were equal)" in result.stderr and "reward=1.000" in result.stderr
    card = json.loads((tmp_path / "run" / "run_card.json").read_text())
    signal = card["training_signal"]
    assert signal["zero_variance_group_fraction"] == 1.0 and signal["steps_without_reward_signal"] == 4
    assert signal["infra_error_rate"] == 0.0 and signal["alarm"].startswith("training signal gone") and signal["alarm"] in card["alarms"]


def test_a_run_without_groups_whose_reward_never_differs_rings_the_alarm_and_the_checklist_says_no(tmp_path, capsys):
    """Issue 40 item 1: REINFORCE++ with one sample per prompt and a reward of 0 on every row. No
    group exists, so the zero-variance group fraction says nothing; the estimator's own fact (every
    reward of the batch equal: whitened returns 0) is what the check counts: every step without
    reward signal, the alarm, the summary line and the checklist all say so."""
    from posttrain.cli import main
    from posttrain.evaluation import checklist as cl

    result = grpo(tmp_path, "--reward", "callable:rewards_for_tests.zero", "--loss.advantage", "reinforce_pp", "--data.group_size", "1",
                  "--max-steps", "3", "--acceptance.signal_window", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr.count("training signal gone: for 2 steps in a row (to step 2)") == 1
    assert "(every reward in the batch was equal)" in result.stderr
    run = tmp_path / "run"
    card = json.loads((run / "run_card.json").read_text())
    signal = card["training_signal"]
    assert signal["steps"] == 3 and signal["steps_without_reward_signal"] == 3 and signal["zero_variance_group_fraction"] is None
    assert signal["alarm"] in card["alarms"]
    assert "3 of 3 steps without reward signal" in result.stdout
    answer = cl.checklist(read_run(run)).answers["signal"]
    assert answer.answer == "no" and "3 steps without reward signal" in answer.detail
    assert [a["answer"] for a in card["checklist"]["answers"] if a["name"] == "signal"] == ["no"]
    capsys.readouterr()
    assert main(["checklist", str(run), "--require", "signal"]) == 1


def test_groups_equal_inside_but_not_across_the_batch_are_signal_for_a_batch_level_estimator():
    """REINFORCE++ (whitened over the batch) learns from rewards [0, 0 | 1, 1]; GRPO does not. The
    step's signal is the estimator's: the old group check called both silent."""
    signal = TrainingSignal(window=1)
    signal.observe(1, StepSignal(rows=4, zero_variance_fraction=1.0, grad_norm=0.5, silent_fraction=0.0, scope="batch"))
    assert signal.card()["steps_without_reward_signal"] == 0 and signal.rings == []
    signal.observe(2, StepSignal(rows=4, zero_variance_fraction=1.0, grad_norm=0.0, silent_fraction=1.0, scope="group"))
    assert signal.card()["steps_without_reward_signal"] == 1 and "(every group's rewards were equal)" in signal.rings[0]


def test_a_run_ends_with_three_lines_and_a_results_section(tmp_path):
    """The run's last words: each held-out set from its first evaluation to its last (the change's
    interval paired over the same problems), the training signal, where the results are; the
    card holds the same as its results section."""
    result = grpo(tmp_path, "--reward", "callable:rewards_for_tests.digits", "--max-steps", "2", "--acceptance.eval_every", "2",
                  "--acceptance.sets", '[{"name": "digits_3", "task_options": {"digits": 3}, "size": 4}]')
    assert result.returncode == 0, result.stderr[-2000:]
    run = tmp_path / "run"
    held, training, where = result.stdout.strip().splitlines()
    assert where == f"results: {run} (the run card: {run / 'run_card.md'})"
    card = json.loads((run / "run_card.json").read_text())
    found = card["results"]
    assert list(found["sets"]) == ["in_distribution", "digits_3"]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for name, entry in found["sets"].items():
        key = f"heldout/{name}/pass@1"
        assert (entry["start"]["step"], entry["end"]["step"]) == (0, 2)
        assert (entry["start"]["pass@1"], entry["end"]["pass@1"]) == (steps[0][key], steps[2][key])
        assert entry["start"]["ci95"] == [steps[0][f"{key}_low"], steps[0][f"{key}_high"]]
        before, after = (json.loads(path.read_text())["summary"]["correct"] for path in (
            run / "eval" / (f"step-{s:06d}.json" if name == "in_distribution" else f"{name}-step-{s:06d}.json") for s in (0, 2)))
        change = entry["change"]
        assert change["paired"] and change["value"] == pytest.approx(sum(after) / len(after) - sum(before) / len(before))
        assert change["ci95"][0] <= change["value"] <= change["ci95"][1]
    assert held.startswith("held-out: in_distribution ") and "; digits_3 " in held and held.count(" paired") == 2
    reward = [row["reward/mean"] for row in steps[1:]]
    assert training.startswith(f"training: reward {reward[0]:.3f} (step 1) -> {reward[-1]:.3f} (step 2); loss ")
    assert "unscorable rows 0.0% infra, 0.0% data" in training and "steps without reward signal" in training
    markdown = (run / "run_card.md").read_text()
    assert "## Results" in markdown and "| digits_3 | " in markdown and "## Training signal" in markdown
    assert "held-out in_distribution at step 2 (arithmetic): pass@1 " in result.stderr, "each set is named in the log"
    assert "held-out digits_3 at step 2 (arithmetic): pass@1 " in result.stderr
