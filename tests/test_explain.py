"""`posttrain explain`: the seed's numbers through the CLI, exact JSON keys, one-line errors."""

import json
import math
import subprocess
import sys

import pytest

from posttrain.cli import main


def run_json(capsys, *argv):
    assert main(["explain", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_advantages(capsys):
    result = run_json(capsys, "advantages", "--rewards", "0", "1", "0", "0")
    assert set(result) == {"mean", "std", "advantages"}
    assert result["mean"] == 0.25
    assert round(result["std"], 4) == 0.4330
    assert [round(a, 4) for a in result["advantages"]] == [-0.5774, 1.7321, -0.5774, -0.5774]


def test_advantages_options(capsys):
    result = run_json(capsys, "advantages", "--rewards", "0", "1", "0", "0", "--scale", "none")
    assert result["advantages"] == [-0.25, 0.75, -0.25, -0.25]
    result = run_json(capsys, "advantages", "--rewards", "0", "1", "nan", "1", "--group-size", "2")
    assert result["mean"] == [0.5, 1.0]
    assert result["advantages"] == pytest.approx([-1.0, 1.0, 0.0, 0.0])


def test_clip(capsys):
    result = run_json(
        capsys, "clip", "--old-prob", "0.20", "--new-prob", "0.26", "--advantage", "1.7320508",
        "--clip-low", "0.2", "--clip-high", "0.2",
    )
    assert set(result) == {"ratio", "objective", "loss", "clipped"}
    assert round(result["ratio"], 4) == 1.3
    assert round(result["objective"], 3) == 2.078
    assert round(result["loss"], 3) == -2.078
    assert result["clipped"] is True


def test_dpo(capsys):
    result = run_json(
        capsys, "dpo", "--chosen", "-2", "--rejected", "-4", "--ref-chosen", "-3", "--ref-rejected", "-3", "--beta", "0.2"
    )
    assert set(result) == {"logit", "loss", "chosen_reward", "rejected_reward"}
    assert result["logit"] == pytest.approx(0.4)
    assert round(result["loss"], 4) == 0.5130
    assert result["chosen_reward"] == pytest.approx(0.2) and result["rejected_reward"] == pytest.approx(-0.2)


def test_kl(capsys):
    result = run_json(capsys, "kl", "--policy", "0.8", "0.2", "--reference", "0.5", "0.5")
    assert set(result) == {"exact", "per_token", "expected"}
    assert set(result["per_token"]) == set(result["expected"]) == {"k1", "k2", "k3"}
    assert round(result["exact"], 4) == 0.1927
    assert result["per_token"]["k1"] == pytest.approx([math.log(1.6), math.log(0.4)])
    assert result["expected"]["k1"] == pytest.approx(result["exact"])
    assert result["expected"]["k3"] == pytest.approx(result["exact"])
    assert result["expected"]["k2"] != pytest.approx(result["exact"])


def test_distill_three_tokens(capsys):
    # log p_teacher - log p_student = [0.2, -0.6, 0]: the first token rewarded, the second punished, the third agreed
    result = run_json(capsys, "distill")
    assert result["token_rewards"] == pytest.approx([0.2, -0.6, 0.0])
    assert result["reverse_kl_per_token"] == pytest.approx(0.4 / 3)
    assert result["advantages"] == pytest.approx([0.2, -0.6, 0.0])  # discount 0: each token's own
    assert result["sequence_sum"] == pytest.approx(-0.4)
    to_go = run_json(capsys, "distill", "--discount", "1", "--weight", "0.5")
    assert to_go["advantages"] == pytest.approx([-0.2, -0.3, 0.0])


def test_text_output_is_readable(capsys):
    assert main(["explain", "advantages", "--rewards", "0", "1", "0", "0"]) == 0
    out = capsys.readouterr().out
    assert "1.7321" in out and "population std" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["advantages", "--rewards", "1"], "group of one"),
        (["advantages", "--rewards", "1", "0", "1", "--group-size", "2"], "not a whole number of groups"),
        (["advantages", "--rewards", "1", "0", "--eps", "-1"], "--eps"),
        (["kl", "--policy", "0.8", "0.2", "--reference", "0.5"], "--reference has 1"),
        (["kl", "--policy", "0.8", "0.3", "--reference", "0.5", "0.5"], "sum to 1"),
        (["kl", "--policy", "1.5", "-0.5", "--reference", "0.5", "0.5"], "(0, 1]"),
        (["clip", "--old-prob", "0", "--new-prob", "0.3", "--advantage", "1"], "--old-prob"),
        (["clip", "--old-prob", "0.2", "--new-prob", "1.3", "--advantage", "1"], "--new-prob"),
        (["clip", "--old-prob", "0.2", "--new-prob", "0.3", "--advantage", "1", "--dual-clip", "0.5"], "dual_clip"),
        (["dpo", "--chosen", "-2", "--rejected", "-4", "--ref-chosen", "-3", "--ref-rejected", "-3", "--beta", "0"], "--beta"),
        (["decoupled", "--logprob", "-1", "--proximal", "-1", "-2", "--behaviour", "-1", "--advantage", "1"], "one value per token"),
        (["decoupled", "--logprob", "-1", "--proximal", "-1", "--behaviour", "-1", "--advantage", "1", "--cap", "0"], "--cap > 0"),
        (["distill", "--teacher", "-1", "-2", "--student", "-1"], "one log-prob per token"),
        (["distill", "--teacher", "0.5", "--student", "-1"], "<= 0"),
        (["distill", "--discount", "2"], "--discount"),
    ],
)
def test_bad_arguments_one_line_exit_2(capsys, argv, message):
    assert main(["explain", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_console_script_exit_codes():
    """Through a real process: argparse errors (not a number) are also one line and exit 2."""
    ok = subprocess.run(
        [sys.executable, "-m", "posttrain", "explain", "dpo", "--chosen", "-2", "--rejected", "-4",
         "--ref-chosen", "-3", "--ref-rejected", "-3", "--beta", "0.2", "--json"],
        capture_output=True, text=True,
    )
    assert ok.returncode == 0 and json.loads(ok.stdout)["loss"] == pytest.approx(0.5130152523999526)
    bad = subprocess.run(
        [sys.executable, "-m", "posttrain", "explain", "advantages", "--rewards", "a", "b"],
        capture_output=True, text=True,
    )
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1 and "not a number" in bad.stderr
