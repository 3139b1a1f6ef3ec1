"""PPO with a critic: smoke over KL placements, critic kinds and aggregation modes, critic warm-up,
micro-batch invariance, resume, bad configs."""

import json
from pathlib import Path

import pytest
import torch

from posttrain.config import build_config, parse_overrides
from posttrain.models import load_model
from posttrain.recipes import online as ppo
from posttrain.recipes import online_config
from tests.rewards_for_tests import digits

ROOT = Path(__file__).resolve().parent.parent
SMALL = [
    "--data.eval_size", "8", "--data.train_size", "200", "--data.prompts_per_step", "4", "--data.group_size", "2",
    "--sampling.max_new_tokens", "6", "--update.micro_batch_size", "8", "--optim.lr", "1e-3", "--critic.lr", "1e-3",
]


def config_for(tmp_path, name, *extra):
    config = build_config(online_config.ppo_config, None, parse_overrides(SMALL + list(extra)))
    config.output_dir = str(tmp_path / name)
    return config


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_model(run_dir):
    return load_model(str(sorted((run_dir / "checkpoints").glob("step-*"))[-1] / "model"))[0]


@pytest.mark.parametrize(
    "placement, shared, aggregation",
    [("reward", "false", "token_mean"), ("loss", "true", "seq_mean_token_mean"), ("reward", "true", "seq_mean_token_sum_norm")],
)
def test_smoke(tmp_path, placement, shared, aggregation):
    config = config_for(tmp_path, "run", "--max-steps", "2", "--loss.kl.placement", placement,
                        "--critic.share_backbone", shared, "--loss.aggregation", aggregation)
    initial = {n: p.detach().clone() for n, p in load_model("tiny")[0].named_parameters()}
    run_dir = ppo.run(config, reward=digits)
    steps = [row for row in metrics(run_dir) if row["step"] > 0]
    assert len(steps) == 2
    for row in steps:
        assert all(torch.isfinite(torch.tensor(row[key])) for key in ("loss", "value_loss", "kl/estimate", "values/mean"))
    assert steps[0]["ratio/mean"] == pytest.approx(1.0, abs=1e-6)
    assert any(not torch.equal(initial[n], p) for n, p in final_model(run_dir).named_parameters())
    checkpoint = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    critic_state = torch.load(checkpoint / "critic.pt")
    assert any(key.startswith("value_head") for key in critic_state)
    assert (shared == "true") == (not any(key.startswith("backbone") for key in critic_state))
    card = json.loads((run_dir / "run_card.json").read_text())
    assert card["links"]["loss"]["kl"]["placement"] == placement and card["links"]["loss"]["critic_share_backbone"] == (shared == "true")


def test_critic_warmup_leaves_the_policy_unchanged(tmp_path):
    """Shared backbone, 2 warm-up steps: only the value head moves (hidden states detached)."""
    config = config_for(tmp_path, "run", "--max-steps", "2", "--critic.warmup_steps", "2", "--critic.share_backbone", "true")
    initial = {n: p.detach().clone() for n, p in load_model("tiny")[0].named_parameters()}
    run_dir = ppo.run(config, reward=digits)
    assert all(row["critic_only"] for row in metrics(run_dir) if row["step"] > 0)
    assert all(torch.equal(initial[n], p) for n, p in final_model(run_dir).named_parameters())
    head = torch.load(sorted((run_dir / "checkpoints").glob("step-*"))[-1] / "critic.pt")
    assert any(value.abs().sum() > 0 for value in head.values()), "the value head (zero-initialised) trained"


def test_resume_continues_exactly(tmp_path):
    straight = ppo.run(config_for(tmp_path, "straight", "--max-steps", "3", "--checkpoint-every", "1"), reward=digits)
    partial = config_for(tmp_path, "resumed", "--max-steps", "2", "--checkpoint-every", "1")
    ppo.run(partial, reward=digits)
    resumed = config_for(tmp_path, "resumed", "--max-steps", "3", "--checkpoint-every", "1")
    ppo.run(resumed, resume=True, reward=digits)
    # The partial run also evaluated at its last step (2): held-out keys differ by design.
    drop = lambda rows: [
        {k: v for k, v in r.items() if not k.startswith(("seconds/", "heldout/", "tokens_per_second"))} for r in rows
    ]
    assert drop(metrics(straight)) == drop(metrics(tmp_path / "resumed"))
    for (name, a), (_, b) in zip(final_model(straight).named_parameters(), final_model(tmp_path / "resumed").named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--loss.gae.gamma", "1.5"], "loss.gae.gamma and loss.gae.lam must be in [0, 1]"),
        (["--critic.lr", "0"], "critic.lr must be > 0"),
        (["--data.group_size", "0"], "data.group_size must be at least 1"),
        (["--critic.share", "true"], "unknown key 'critic.share'"),
    ],
)
def test_bad_config_one_line(tmp_path, capsys, overrides, message):
    from posttrain.cli import main

    assert main(["ppo", "--output-dir", str(tmp_path / "run"), *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
