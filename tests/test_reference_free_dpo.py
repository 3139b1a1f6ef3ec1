"""SimPO, CPO and ORPO in `posttrain dpo`: the recipe's loss (through `preference_losses`) gives the
issue's hand values, a run loads no reference model (no frozen copy, no reference forward, no
reference cache), its NLL term defaults to the objective's own, the displacement alarm is off and
says why, and a reference setting that cannot apply is one line."""

import json
import math

import pytest
import torch

from posttrain.errors import UserError
from posttrain.losses.preference import Loss, preference_losses
from posttrain.models import pair_forward
from posttrain.recipes import dpo
from tests.test_dpo import pairs_file, small_config  # noqa: F401  (pairs_file is a fixture)


def sums(chosen, rejected, chosen_lengths, rejected_lengths):
    return pair_forward.PairLogprobs(*(torch.tensor(v, dtype=torch.float64) for v in (chosen, rejected, chosen_lengths, rejected_lengths)))


def test_the_recipe_loss_of_each_reference_free_objective():
    zeros = torch.zeros(1, dtype=torch.float64)
    # SimPO: mean log-probs -0.5 (chosen, 4 tokens summing to -2) and -1.0 (rejected, 2 tokens), beta 2.5, gamma/beta 0.55 -> gamma 1.375.
    losses, _, _ = preference_losses(Loss(type="simpo", beta=2.5), sums([-2.0], [-2.0], [4], [2]), zeros, zeros)
    assert float(losses) == pytest.approx(0.757599, abs=1e-6)
    # ORPO: mean log-probs ln 0.5 and ln 0.25, lambda (loss.beta) 0.1 -> 0.1 x ln(4/3); with the chosen NLL ln 2, 0.721915.
    losses, _, _ = preference_losses(Loss(type="orpo", beta=0.1), sums([3 * math.log(0.5)], [2 * math.log(0.25)], [3], [2]), zeros, zeros)
    assert float(losses) == pytest.approx(0.0287682, abs=1e-6) and float(losses) - math.log(0.5) == pytest.approx(0.721915, abs=1e-6)
    # CPO: DPO's sigmoid on the policy's own summed log-probs, -log sigmoid(0.1 x (-2 - -4)).
    losses, _, _ = preference_losses(Loss(type="cpo", beta=0.1), sums([-2.0], [-4.0], [1], [1]), zeros, zeros)
    assert float(losses) == pytest.approx(-math.log(1 / (1 + math.exp(-0.2))), abs=1e-9)


def test_nll_term_defaults_to_the_objectives_own_and_settings_that_cannot_apply_are_one_line():
    for kind, weight in (("cpo", 1.0), ("orpo", 1.0), ("simpo", 0.0), ("sigmoid", 0.0)):
        loss = Loss(type=kind)
        loss.validate()
        assert loss.nll_weight == weight, kind
    explicit = Loss(type="orpo", nll_weight=0.5)
    explicit.validate()
    assert explicit.nll_weight == 0.5
    for loss, message in ((Loss(type="simpo", reference="precomputed"), "loss.type simpo uses no reference"),
                          (Loss(type="cpo", reference_refresh_every=2), "loss.type cpo uses no reference"),
                          (Loss(type="sigmoid", gamma_ratio=0.3), "loss.gamma_ratio applies to loss.type simpo only")):
        with pytest.raises(UserError, match=message):
            loss.validate()


@pytest.mark.parametrize("kind", ["simpo", "cpo", "orpo"])
def test_a_reference_free_run_loads_no_reference(tmp_path, pairs_file, monkeypatch, kind):  # noqa: F811
    made = []
    monkeypatch.setattr(dpo, "make_reference", lambda policy: made.append(policy))
    run_dir = dpo.run(small_config(tmp_path, pairs_file, "--loss.type", kind, "--loss.beta", "2.0" if kind == "simpo" else "0.1"))
    assert made == [], "no reference model may be built"
    assert not (run_dir / "reference_logprobs.pt").exists()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert all(math.isfinite(row["loss"]) for row in rows[1:])
    nll_weight = {"simpo": 0.0, "cpo": 1.0, "orpo": 1.0}[kind]
    for row in rows[1:]:  # the logged loss is the objective plus the NLL term at its resolved weight
        assert row["loss"] == pytest.approx(row["loss/preference"] + nll_weight * row["loss/nll"], abs=1e-6)
    card = json.loads((run_dir / "run_card.json").read_text())
    assert card["links"]["loss"]["reference"].startswith("none: the objective uses no reference")
    assert card["links"]["acceptance"]["displacement_alarm"].startswith(f"off: loss.type {kind} uses no reference")
    assert card["alarms"] == []
    if kind == "simpo":
        assert card["links"]["loss"]["gamma"] == pytest.approx(0.55 * 2.0)


@pytest.mark.parametrize("argv, expected", [
    (["simpo", "--chosen-mean", "-0.5", "--rejected-mean", "-1.0", "--beta", "2.5", "--gamma", "1.375"], 0.757599),
    (["orpo", "--chosen-mean", str(math.log(0.5)), "--rejected-mean", str(math.log(0.25)), "--lam", "0.1"], 0.721915),
    (["kto", "--log-ratio", "2", "--mismatched", "0.8", "0.2", "--beta", "0.1", "--label", "desirable"], 0.462570),
])
def test_explain_computes_the_offline_rows_with_the_library(capsys, argv, expected):
    from posttrain.cli import main

    assert main(["explain", *argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(expected, abs=1e-6)
