"""DAPO's soft overlong punishment (arXiv:2503.14476 eq. 13, `reward_options.overlong`): the values by
hand, errors left alone, the order with `reward_options.truncated`, the config's one-line errors, a
tiny GRPO run's metric, samples.jsonl field and card, and `posttrain explain overlong`."""

import doctest
import json
import re

import pytest
import torch

import posttrain.algorithms.overlong
from posttrain.algorithms.overlong import overlong_shaping
from posttrain.cli import main
from posttrain.config import build_config, parse_overrides
from posttrain.errors import UserError
from posttrain.recipes import online_config
from posttrain.rewards import Verdict
from posttrain.rewards.overlong import Overlong, overlong_metrics
from posttrain.rewards.scores import truncation_policy
from tests.test_grpo import SMALL


def test_values_by_hand():
    """max_tokens 20, buffer 4, penalty 1: the ramp starts after max - buffer = 16 tokens.
    15 = max - buffer - 1 -> 0; 16 (the zone's start) -> 0; 18 = max - buffer/2 -> (16 - 18) / 4 = -0.5
    = -penalty/2; 20 = max -> (16 - 20) / 4 = -1 = -penalty; 21 and 100 > max -> -penalty.
    With penalty 3 every value is 3x."""
    lengths = torch.tensor([15, 16, 18, 20, 21, 100])
    assert overlong_shaping(lengths, 20, 4).tolist() == [0.0, 0.0, -0.5, -1.0, -1.0, -1.0]
    assert overlong_shaping(lengths, 20, 4, penalty=3.0).tolist() == [0.0, 0.0, -1.5, -3.0, -3.0, -3.0]
    # buffer = max_tokens: the ramp covers every length, 1 token -> -1/4 of the penalty per token
    assert overlong_shaping(torch.tensor([0, 1, 4, 5]), 4, 4).tolist() == [0.0, -0.25, -1.0, -1.0]


def test_dtype_device_and_docstring_example():
    """float32 out of integer lengths, float64 kept, on the lengths' device; the docstring's example holds."""
    out = overlong_shaping(torch.tensor([18], dtype=torch.long), 20, 4)
    assert out.dtype == torch.float32 and out.device == torch.device("cpu")
    assert overlong_shaping(torch.tensor([18.0], dtype=torch.float64), 20, 4).dtype == torch.float64
    assert doctest.testmod(posttrain.algorithms.overlong, extraglobs={"torch": torch}).failed == 0
    with pytest.raises(ValueError, match="0 < buffer <= max_tokens"):
        overlong_shaping(torch.tensor([1]), 20, 0)


def test_only_ok_verdicts_are_shaped_and_kept_apart():
    """An ok 1.0 of 18 tokens -> 1.0 - 0.5 = 0.5, with details overlong -0.5 and task_reward 1.0; an
    infra or data error stays as it was (not scored, not shaped). Metrics over the scored rows only:
    mean shaping (-0.5 + 0) / 2, fraction with shaping < 0 = 1/2."""
    verdicts = [Verdict.ok(1.0, "right"), Verdict.infra_error("sandbox died"), Verdict.data_error("no gold"), Verdict.ok(0.0, "wrong")]
    shaped = Overlong(max_tokens=20, buffer=4).shape(verdicts, torch.tensor([18, 30, 30, 10]))
    assert shaped[0].reward == 0.5 and shaped[0].details == {"overlong": -0.5, "task_reward": 1.0}
    assert "overlong: -0.5" in shaped[0].reason
    assert shaped[1] is verdicts[1] and shaped[2] is verdicts[2]
    assert shaped[3].reward == 0.0 and shaped[3].details["overlong"] == 0.0
    assert overlong_metrics(shaped) == {"reward/overlong": -0.25, "overlong_fraction": 0.5}
    assert overlong_metrics(verdicts) == {}  # off: no keys


def test_composes_with_the_truncated_penalty():
    """reward_options.truncated applies first (in score_rows), then the shaping: a truncated ok 1.0 at
    L = max_tokens = 20 under penalty:0.5 -> 1.0 - 0.5 (truncated) - 1.0 (overlong) = -0.5; details keep
    both steps (unpenalised 1.0, task_reward 0.5 = the reward before the shaping). Under `exclude` the
    row is a data error and the shaping leaves it alone."""
    overlong = Overlong(max_tokens=20, buffer=4)
    lengths = torch.tensor([20, 12])
    verdicts = [Verdict.ok(1.0, "right"), Verdict.ok(1.0, "right")]
    penalised = overlong.shape(truncation_policy(verdicts, [True, False], "penalty:0.5"), lengths)
    assert [v.reward for v in penalised] == [-0.5, 1.0]
    assert penalised[0].details == {"unpenalised": 1.0, "overlong": -1.0, "task_reward": 0.5}
    excluded = overlong.shape(truncation_policy(verdicts, [True, False], "exclude"), lengths)
    assert excluded[0].status == "data_error" and "overlong" not in excluded[0].details
    assert excluded[1].reward == 1.0 and excluded[1].details["overlong"] == 0.0


def config(*flags, yaml_path=None):
    return build_config(online_config.grpo_config, yaml_path, parse_overrides(list(flags)))


@pytest.mark.parametrize("flags, message", [
    (["--reward_options.overlong.max_tokens", "6", "--reward_options.overlong.buffer", "0"], "reward_options.overlong.buffer must be in (0, max_tokens = 6], got 0"),
    (["--reward_options.overlong.max_tokens", "6", "--reward_options.overlong.buffer", "7"], "reward_options.overlong.buffer must be in (0, max_tokens = 6], got 7"),
    (["--reward_options.overlong.max_tokens", "6"], "reward_options.overlong.buffer must be in (0, max_tokens = 6], got None"),
    (["--reward_options.overlong.max_tokens", "0", "--reward_options.overlong.buffer", "1"], "reward_options.overlong.max_tokens must be at least 1, got 0"),
    (["--reward_options.overlong.max_tokens", "6", "--reward_options.overlong.buffer", "2", "--reward_options.overlong.penalty", "-1"],
     "reward_options.overlong.penalty must be >= 0, got -1.0"),
    (["--reward_options.overlong.buffer", "2"], "reward_options.overlong.max_tokens: set it to turn the shaping on"),
    (["--reward_options.overlong.max_tokens", "7", "--reward_options.overlong.buffer", "2"], "reward_options.overlong.max_tokens 7 exceeds the 6 tokens"),
    (["--reward.overlong.max_tokens", "6"], "command line: reward.overlong moved to reward_options.overlong"),
    (["--reward_options.overlong", "6"], "'reward_options.overlong' is a section"),
])
def test_config_errors_are_one_line(flags, message):
    with pytest.raises(UserError, match=re.escape(message)) as error:
        config(*SMALL, *flags)
    assert len(str(error.value).splitlines()) == 1


def test_config_from_yaml_and_flags(tmp_path):
    """A preset sets max_tokens, a flag the buffer: validated once, on the whole section. `reward:
    {overlong: ...}` in YAML says where it lives. With tools the budget is max_turns x max_new_tokens."""
    preset = tmp_path / "preset.yaml"
    preset.write_text("sampling: {max_new_tokens: 6}\nreward_options: {overlong: {max_tokens: 6}}\n")
    assert config("--reward_options.overlong.buffer", "2", yaml_path=preset).reward_options.overlong == Overlong(6, 2, 1.0)
    assert not online_config.Config().reward_options.overlong.enabled
    moved = tmp_path / "moved.yaml"
    moved.write_text("reward:\n  overlong: {max_tokens: 6, buffer: 2}\n")
    with pytest.raises(UserError, match=re.escape(f"{moved}: reward.overlong moved to reward_options.overlong")):
        config(yaml_path=moved)
    tools = [*SMALL, "--tools.names", "add", "--tools.max_turns", "2", "--reward_options.overlong.buffer", "2"]
    assert config(*tools, "--reward_options.overlong.max_tokens", "12").reward_options.overlong.max_tokens == 12
    with pytest.raises(UserError, match="max_tokens 13 exceeds the 12 tokens"):
        config(*tools, "--reward_options.overlong.max_tokens", "13")


def test_tiny_grpo_run_logs_and_records_the_shaping(tmp_path):
    """2 steps of the tiny model, B*G = 8 rows per step written to samples.jsonl, max_new_tokens 6 and
    overlong max_tokens 6, buffer 3 (the ramp over 4..6 tokens). Each row's `overlong` is the shaping
    of its length, apart from its reward; the step's `reward/overlong` is their mean (every row is
    scored: the digits reward never fails) and `overlong_fraction` the share below 0."""
    run_dir = tmp_path / "run"
    assert main(["grpo", *SMALL, "--reward", "callable:tests.rewards_for_tests.digits", "--max-steps", "2", "--samples_per_step", "8",
                 "--acceptance.sets", "[]", "--output-dir", str(run_dir), "--reward_options.overlong.max_tokens", "6",
                 "--reward_options.overlong.buffer", "3", "--reward_options.overlong.penalty", "0.5"]) == 0
    steps = [row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if row["step"] > 0 and "loss" in row]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and len(samples) == 16
    allowed = {0.0, -0.5 / 3, -1.0 / 3, -0.5}  # L <= 3, L = 4, 5, 6 (truncated) tokens
    for step, rows in zip(steps, (samples[:8], samples[8:])):
        shaping = [row["overlong"] for row in rows]
        assert all(min(abs(value - a) for a in allowed) < 1e-6 for value in shaping)
        assert all(row["overlong"] == pytest.approx(-0.5) for row in rows if row["truncated"])
        assert step["reward/overlong"] == pytest.approx(sum(shaping) / 8)
        assert step["overlong_fraction"] == pytest.approx(sum(value < 0 for value in shaping) / 8)
        assert all(row["reward"] - row["overlong"] in (pytest.approx(0.0), pytest.approx(1.0)) for row in rows)
    link = json.loads((run_dir / "run_card.json").read_text())["links"]["reward"]
    assert link["overlong"]["max_tokens"] == 6 and link["overlong"]["buffer"] == 3 and link["overlong"]["penalty"] == 0.5
    assert "-penalty if L > max_tokens" in link["overlong"]["formula"]


def test_explain(capsys):
    """The defaults (max 20, buffer 4, penalty 1) show a length before, inside and past the ramp."""
    assert main(["explain", "overlong", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"lengths": [15, 18, 25], "shaping": [0.0, -0.5, -1.0]}
    assert main(["explain", "overlong", "--max-tokens", "10", "--buffer", "4", "--penalty", "2", "--lengths", "5", "6", "8", "10", "11", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shaping"] == [0.0, 0.0, -1.0, -2.0, -2.0]
    assert main(["explain", "overlong"]) == 0
    assert "L = 18: shaping -0.5000" in capsys.readouterr().out
    assert main(["explain", "overlong", "--buffer", "0"]) == 2
    err = capsys.readouterr().err
    assert "0 < buffer <= max_tokens" in err and len(err.strip().splitlines()) == 1


def test_length_is_the_policys_own_tokens_not_the_observations():
    """`sample_and_score` measures L with the loss mask: a rollout whose first 2 completion positions are
    attended but not the policy's (as a tool's observation tokens are: attention True, mask False)
    has L = mask tokens. With max_new_tokens 6, max_tokens 6 and buffer 2, a row of 6 attended
    positions and 4 policy tokens gets 0 (by the attention it would get -1)."""
    import dataclasses

    from posttrain.data.examples import Example, Task
    from posttrain.data.scored_batch import sample_and_score
    from posttrain.data.stream import PromptStream
    from posttrain.models import load_model
    from posttrain.rewards import get_verifier
    from posttrain.rollout import SamplingConfig
    from posttrain.rollout.sampler import single_turn
    from posttrain.runs.timer import Timer

    def with_observations(*args, **kwargs):
        rollout = single_turn(*args, **kwargs)
        mask = rollout.mask.clone()
        mask[:, :2] = False  # pretend the first two positions were a tool's
        return dataclasses.replace(rollout, attention=rollout.completion_attention_mask, mask=mask)

    policy, tokenizer = load_model("tiny")
    task = Task(name="t", split="train", examples=[Example(id=str(i), prompt=f"{i}+1=", answer=str(i + 1)) for i in range(4)],
                reward_kind="number")
    batch = sample_and_score(policy, tokenizer, PromptStream(task, 0), get_verifier("exact"), prompts=2, group_size=4,
                             sampling=SamplingConfig(max_new_tokens=6), seed=0, step=0, timer=Timer(), sampler=with_observations,
                             overlong=Overlong(max_tokens=6, buffer=2))
    own = batch.rollout.mask.sum(-1)
    assert batch.rollout.lengths.max() == 6 and own.max() == 4
    shaping = [verdict.details["overlong"] for verdict in batch.scores.verdicts]
    assert shaping == overlong_shaping(own, 6, 2).tolist() == [0.0] * 8
