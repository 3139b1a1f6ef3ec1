"""GRPO recipe: smoke runs over every KL placement and aggregation mode, accumulation invariance,
on-policy ratio of 1, errors and zero-signal groups, bad configs, and resume after SIGKILL."""

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from posttrain.config import build_config, parse_overrides
from posttrain.data.scored_batch import ScoredBatch
from posttrain.errors import UserError
from posttrain.recipes import online as grpo
from posttrain.recipes import online_config
from posttrain.rewards import Verdict
from posttrain.rewards.scores import Scores
from posttrain.rollout import generate
from posttrain.models import load_model
from tests.rewards_for_tests import broken, digits

ROOT = Path(__file__).resolve().parent.parent
SMALL = [
    "--data.eval_size", "8", "--data.train_size", "200", "--data.prompts_per_step", "2", "--data.group_size", "4",
    "--sampling.max_new_tokens", "6", "--update.micro_batch_size", "8", "--optim.lr", "1e-3",
]


def small_config(tmp_path, *extra) -> online_config.Config:
    config = build_config(online_config.grpo_config, None, parse_overrides(SMALL + list(extra)))
    config.output_dir = str(tmp_path / "run")
    return config


def weights(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "aggregation, placement, beta",
    [
        ("token_mean", "loss", 0.05),
        ("seq_mean_token_mean", "reward", 0.05),
        ("seq_mean_token_sum", "loss", 0.0),
        ("seq_mean_token_sum_norm", "reward", 0.1),
    ],
)
def test_smoke_every_aggregation_and_kl_placement(tmp_path, aggregation, placement, beta):
    config = small_config(
        tmp_path, "--max-steps", "2", "--loss.aggregation", aggregation, "--loss.kl.placement", placement,
        "--loss.kl.beta", str(beta),
    )
    initial = weights(load_model("tiny")[0])
    run_dir = grpo.run(config, reward=digits)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row["step"] > 0 and "loss" in row]
    assert len(steps) == 2
    assert all(torch.isfinite(torch.tensor(row["loss"])) for row in steps)
    # mu = 1 with one mini-batch: the first pass is on-policy, the ratio is exactly 1.
    assert steps[0]["ratio/min"] == steps[0]["ratio/max"] == 1.0
    if beta:
        assert steps[0]["kl/exact"] is not None and "kl/estimate" in steps[0]
    final = load_model(str(sorted((run_dir / "checkpoints").iterdir())[-1] / "model"))[0]
    assert any(not torch.equal(initial[n], p) for n, p in final.named_parameters()), "parameters did not change"
    card = json.loads((run_dir / "run_card.json").read_text())
    assert set(card["links"]) == {"data", "reward", "loss", "acceptance"}
    loss = card["links"]["loss"]
    assert loss["aggregation"] == aggregation and loss["kl"]["placement"] == placement and loss["std"] == "population (n)"
    assert card["links"]["reward"]["verifier"].startswith("python:")
    assert (run_dir / "plots" / "reward_mean.png").is_file() and (run_dir / "samples.jsonl").is_file()
    assert list((run_dir / "eval").glob("step-*.json"))


def test_micro_batch_split_gives_the_same_update(tmp_path):
    """4 micro-batches of 2 vs 1 of 8 (and 8 of 1): with SGD at lr 1 the parameter change is
    the gradient itself, which the global normaliser makes identical. Through the public step."""
    config = small_config(tmp_path, "--loss.kl.beta", "0.1", "--loss.aggregation", "token_mean", "--optim.max_grad_norm", "null")
    policy, tokenizer = load_model("tiny")
    rollout = generate(policy, tokenizer, ["12+34=", "5+6="], group_size=4, sampling=config.sampling, seed=3)
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    batch = ScoredBatch(rollout=rollout, examples=[], rendered=[], scores=Scores.of([Verdict.ok(r, "") for r in rewards]),
                        owners=torch.zeros(8, dtype=torch.long), stats={})
    results = []
    for micro in (8, 2, 1):
        config.update.micro_batch_size = micro
        state = grpo.setup(config, reward=digits)
        state.optimizer = torch.optim.SGD(state.trainer.parameters(), lr=1.0)
        state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda step: 1.0)
        metrics = grpo.step(state, batch)
        results.append((weights(state.policy), metrics["loss"]))
    for other, loss in results[1:]:
        assert loss == pytest.approx(results[0][1], abs=1e-6)
        for name, value in results[0][0].items():
            assert torch.allclose(other[name], value, atol=1e-5), name


def test_infra_errors_everywhere_give_zero_advantage_and_no_nan(tmp_path):
    config = small_config(tmp_path, "--max-steps", "1", "--loss.kl.beta", "0.0")
    initial = weights(load_model("tiny")[0])
    run_dir = grpo.run(config, reward=broken)
    step = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1]
    assert step["errors/infra"] == 8 and step["reward/mean"] is None
    assert step["loss"] == 0.0 and step["grad_norm"] == 0.0
    final = load_model(str(next((run_dir / "checkpoints").iterdir()) / "model"))[0]
    assert all(torch.equal(initial[n], p) for n, p in final.named_parameters())
    sample = json.loads((run_dir / "samples.jsonl").read_text().splitlines()[0])
    assert sample["status"] == "infra_error" and "the reward service is down" in sample["reason"]


def test_dynamic_sampling_refills_and_counts(tmp_path):
    """Groups whose rewards are all equal are dropped and refilled with fresh prompts: every trained
    group has signal, and the counts add up (kept in the first round + refilled = trained)."""
    config = small_config(tmp_path, "--max-steps", "1", "--data.dynamic_sampling", "true", "--data.max_refill_rounds", "3")
    run_dir = grpo.run(config, reward=digits)
    step = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1]
    # Either the batch was refilled to B = 2 groups, or the 1 + 3 rounds ran out first.
    assert step["groups/trained"] == 2 or step["sampling_rounds"] == 4
    assert step["groups/zero_variance_fraction"] == 0.0
    assert step["groups/refilled"] <= step["groups/trained"]
    # Every drawn prompt was either kept or dropped; a second round happens only after a drop.
    assert step["groups/dropped"] + step["groups/trained"] >= 2
    assert step["sampling_rounds"] == 1 or step["groups/dropped"] > 0
    card = json.loads((run_dir / "run_card.json").read_text())
    assert card["links"]["data"]["dynamic_sampling"] is True


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--data.group_size", "1"], "group_size must be at least 2"),
        (["--update.mini_batches", "3"], "do not split into 3 mini-batches"),
        (["--loss.aggregation", "mean"], "loss.aggregation must be one of"),
        (["--loss.kl.placement", "both"], "placement: must be one of"),
        (["--loss.kl.reference_refresh_every", "5"], "needs a reference"),
        (["--sampling.temperature", "0"], "temperature must be > 0"),
        (["--data.prompts_per_step", "two"], "expected an integer"),
        (["--lossy.kl_beta", "1"], "unknown key 'lossy'"),
    ],
)
def test_bad_config_one_line(tmp_path, capsys, overrides, message):
    """In-process through the CLI entry point (a subprocess per case would re-import torch each time)."""
    from posttrain.cli import main

    assert main(["grpo", "--output-dir", str(tmp_path / "run"), *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists(), "nothing may be written for a bad config"


def cli(tmp_path, run_dir, *extra):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return [sys.executable, "-m", "posttrain", "grpo", *SMALL, "--reward", "callable:rewards_for_tests.digits",
            "--checkpoint-every", "1", "--seed", "5", *extra], env


def test_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path):
    """Kill -9 after the second checkpoint, tear the newest checkpoint as a crash mid-write would,
    resume: per-step metrics (except timings) and final weights equal an uninterrupted run."""
    straight, env = cli(tmp_path, None, "--output-dir", str(tmp_path / "straight"), "--max-steps", "4")
    subprocess.run(straight, env=env, check=True, capture_output=True, cwd=ROOT)

    interrupted = tmp_path / "interrupted"
    command, env = cli(tmp_path, None, "--output-dir", str(interrupted), "--max-steps", "4")
    process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and not (interrupted / "checkpoints" / "step-000003").exists():
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    newest = sorted((interrupted / "checkpoints").glob("step-*"))[-1]
    torn = newest / "model" / "model.safetensors"
    if torn.exists():
        torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    resume, env = [sys.executable, "-m", "posttrain", "grpo", "--resume", str(interrupted)], cli(tmp_path, None)[1]
    result = subprocess.run(resume, env=env, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "skipping checkpoint" in result.stderr or not torn.exists()

    def comparable(path):
        rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in row.items() if not k.startswith(("seconds/", "tokens_per_second"))} for row in rows]

    assert comparable(interrupted) == comparable(tmp_path / "straight")
    final_a = load_model(str(tmp_path / "straight" / "checkpoints" / "step-000004" / "model"))[0]
    final_b = load_model(str(interrupted / "checkpoints" / "step-000004" / "model"))[0]
    for (name, a), (_, b) in zip(final_a.named_parameters(), final_b.named_parameters()):
        assert torch.equal(a, b), name


def test_resume_with_reference_refresh_restores_the_reference(tmp_path):
    """With the reference refreshed every 2 steps and a checkpoint after step 3 (not a refresh
    step), the resumed run's KL (against the step-2 reference) equals the uninterrupted run's."""
    extra = ["--loss.kl.beta", "0.1", "--loss.kl.reference_refresh_every", "2", "--checkpoint-every", "1"]
    straight = small_config(tmp_path / "a", "--max-steps", "4", *extra)
    grpo.run(straight, reward=digits)
    partial = small_config(tmp_path / "b", "--max-steps", "3", "--acceptance.eval_every", "0", *extra)
    grpo.run(partial, reward=digits)
    resumed = small_config(tmp_path / "b", "--max-steps", "4", *extra)
    grpo.run(resumed, resume=True, reward=digits)
    rows = lambda path: {r["step"]: r for r in (json.loads(l) for l in (path / "run" / "metrics.jsonl").read_text().splitlines())}
    a, b = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert a[4]["kl/estimate"] == b[4]["kl/estimate"] and a[4]["loss"] == b[4]["loss"]
    card = json.loads((tmp_path / "b" / "run" / "run_card.json").read_text())
    assert card["run"]["reference_refreshed_at"] == [2, 4]


def test_tensorboard_event_files_hold_the_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = small_config(tmp_path, "--max-steps", "2", "--tensorboard", "true")
    run_dir = grpo.run(config, reward=digits)
    board = EventAccumulator(str(run_dir / "tensorboard"))
    board.Reload()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [(event.step, event.value) for event in board.Scalars("reward/mean")]
    assert logged == [(row["step"], pytest.approx(row["reward/mean"])) for row in rows if row.get("reward/mean") is not None]
    assert "heldout/pass@1" in board.Tags()["scalars"]


def test_tensorboard_off_by_default_writes_no_events(tmp_path):
    run_dir = grpo.run(small_config(tmp_path, "--max-steps", "1"), reward=digits)
    assert not (run_dir / "tensorboard").exists()


def test_divergence_alarm_rings_once_in_a_gamed_run_and_not_in_an_honest_one(tmp_path):
    """A reward keyed on a training-only marker (any digit in the completion) rises to 1 within a
    few steps while held-out accuracy (the exact checker) stays 0: the alarm rings, once, though the
    condition holds at two evaluations. With the checker's own rule as the reward nothing rises and
    it stays quiet."""
    fast = ["--data.prompts_per_step", "4", "--update.micro_batch_size", "16", "--optim.lr", "3e-3", "--max-steps", "12",
            "--acceptance.eval_every", "3", "--acceptance.alarm_window", "3", "--seed", "1"]
    gamed = grpo.run(small_config(tmp_path / "gamed", *fast), reward=digits)
    rows = [json.loads(line) for line in (gamed / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["reward/mean"] == 1.0 and all(row["heldout/pass@1"] == 0.0 for row in rows if "heldout/pass@1" in row)
    alarms = json.loads((gamed / "run_card.json").read_text())["alarms"]
    divergence = [alarm for alarm in alarms if alarm.startswith("divergence")]
    assert len(divergence) == 1 and divergence[0].startswith("divergence: from step ") and "changed by +0.000" in divergence[0]
    # Once every completion has a digit, every group's rewards are equal: the training-signal alarm rings too.
    assert [alarm for alarm in alarms if alarm not in divergence] == [json.loads((gamed / "run_card.json").read_text())[
        "training_signal"]["alarm"]]
    honest = grpo.run(small_config(tmp_path / "honest", *fast, "--reward", "exact"))
    honest_card = json.loads((honest / "run_card.json").read_text())
    # The untrained model never answers exactly: no reward rose, so no divergence; but no group ever differed.
    assert honest_card["alarms"] == [honest_card["training_signal"]["alarm"]]
    assert honest_card["training_signal"]["zero_variance_group_fraction"] == 1.0


def test_shifted_heldout_sets_are_evaluated_plotted_and_carded(tmp_path):
    """Default sets of arithmetic (one more digit, the sums in words) beside the in-distribution
    split: one metric key per set (in-distribution also under heldout/pass@1), an eval file per set,
    one figure, the card's sets; a named set that overlaps training loses those prompts (counted)."""
    run_dir = grpo.run(small_config(tmp_path, "--max-steps", "1"), reward=digits)
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    for name in ("in_distribution", "digits_3", "words"):
        assert f"heldout/{name}/pass@1" in last and f"heldout/{name}/pass@1_high" in last
    assert last["heldout/pass@1"] == last["heldout/in_distribution/pass@1"]
    words = json.loads((run_dir / "eval" / "words-step-000001.json").read_text())
    assert re.search(r"\d+ plus \d+ =", words["rows"][0]["prompt"])
    assert (run_dir / "plots" / "heldout_sets.png").is_file()
    sets = json.loads((run_dir / "run_card.json").read_text())["links"]["acceptance"]["sets"]
    assert sets["digits_3"]["options"] == {"digits": 3} and sets["words"]["checker"] == "integer" and sets["words"]["independent"]

    config = small_config(tmp_path / "named", "--data.task_options", "{digits: 1}", "--acceptance.sets",
                          "[{name: again, task_options: {digits: 1}, size: 60}]")
    state = grpo.setup(config, reward=digits)
    (again,) = state.shifted
    training = {e.prompt for e in state.train.examples}
    assert again.spec["training_prompts_removed"] > 0 and not {e.prompt for e in again.task.examples} & training
    assert again.spec["size"] == 60 - again.spec["training_prompts_removed"]
    assert grpo.setup(small_config(tmp_path / "none", "--acceptance.sets", "[]"), reward=digits).shifted == []


@pytest.mark.parametrize("sets, message", [
    ("[{task: arithmetic}]", "acceptance.sets[1]: name must be a word"),
    ("[{name: in_distribution}]", "name 'in_distribution' is reserved"),
    ("[{name: a}, {name: a}]", "name 'a' is used twice"),
    ("[{name: a, size: 0}]", "size must be a positive integer"),
    ("[{name: a, digits: 3}]", "unknown key 'digits'"),
])
def test_bad_heldout_sets_are_one_line(tmp_path, sets, message):
    with pytest.raises(UserError, match=re.escape(message)):
        small_config(tmp_path, "--acceptance.sets", sets)


def test_acceptance_budget_is_its_own_setting(tmp_path):
    """acceptance.max_new_tokens (the shared evaluation/settings.Acceptance field) bounds the held-out
    answers apart from the rollouts' sampling.max_new_tokens; unset, the rollouts' budget applies."""
    config = small_config(tmp_path, "--max-steps", "1", "--acceptance.max_new_tokens", "2", "--acceptance.sets", "[]")
    run_dir = grpo.run(config, reward=digits)
    held = json.loads((run_dir / "eval" / "step-000000.json").read_text())
    assert held["summary"]["mean_length"] <= 2 < 6
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert max(len(row["completion"]) for row in samples) > 2  # the rollouts kept their 6 tokens
    assert online_config.Config().acceptance.max_new_tokens is None
    for flag, message in ((["--acceptance.k", "0"], "acceptance.k and acceptance.alarm_window must be at least 1"),
                          (["--acceptance.eval_every", "-1"], "acceptance.eval_every must be at least 0"),
                          (["--acceptance.max_new_tokens", "0"], "acceptance.max_new_tokens must be at least 1")):
        with pytest.raises(UserError, match=message):
            small_config(tmp_path, *flag)
