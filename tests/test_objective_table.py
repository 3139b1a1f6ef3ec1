"""The preference-objective table (`losses/objectives.py`): a new pair loss is one function and one
entry, registered from outside `posttrain/` and trained by `posttrain dpo`; and a contract every
entry keeps (its declared fields agree with each other and with what the recipe does with them)."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from posttrain.errors import UserError
from posttrain.evaluation.preference import HELDOUT_METRICS
from posttrain.losses.objectives import LABEL_SMOOTHING, PREFERENCE_OBJECTIVES, PreferenceObjective, register_objective, with_reference
from posttrain.losses.preference import Loss, loss_card, preference_losses
from posttrain.models.pair_forward import PairLogprobs, pair_logprobs
from posttrain.optim import Optimization
from posttrain.recipes import dpo
from tests.test_dpo import arithmetic_pairs, small_config, write_pairs

MARGIN = 1.0


def margin_logistic_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, chosen_lengths=None,
                         rejected_lengths=None, *, beta, label_smoothing=0.0):
    """A test-only pair loss with `algorithms.preference`'s one signature: softplus(1 - 2 beta h),
    h = (chosen - ref_chosen) - (rejected - ref_rejected); rewards 2 beta x each log-ratio."""
    chosen_rewards = 2 * beta * (chosen_logps - ref_chosen_logps)
    rejected_rewards = 2 * beta * (rejected_logps - ref_rejected_logps)
    return F.softplus(MARGIN - (chosen_rewards - rejected_rewards)), chosen_rewards.detach(), rejected_rewards.detach()


MARGIN_LOGISTIC = PreferenceObjective(name="margin_logistic", card="test-only: softplus(1 - 2 beta h)",
                                      losses=with_reference(margin_logistic_loss), pair_loss=margin_logistic_loss)


@pytest.fixture
def registered():
    """The test-only objective in the table for one test, as a user's module would register it."""
    register_objective(MARGIN_LOGISTIC)
    yield MARGIN_LOGISTIC
    PREFERENCE_OBJECTIVES.pop(MARGIN_LOGISTIC.name)


def test_a_registered_pair_loss_by_hand(registered):
    """Two pairs, beta 0.1: h = (-2 + 3) - (-4 + 3) = 2 and (-1 + 1) - (-3 + 2) = 1, so 2 beta h =
    0.4 and 0.2; losses softplus(0.6) = 1.037488 and softplus(0.8) = 1.171101."""
    sums = PairLogprobs(torch.tensor([-2.0, -1.0]), torch.tensor([-4.0, -3.0]), torch.ones(2), torch.ones(2))
    losses, chosen_rewards, rejected_rewards = preference_losses(Loss(type="margin_logistic"), sums, torch.tensor([-3.0, -1.0]),
                                                                 torch.tensor([-3.0, -2.0]))
    assert losses.tolist() == pytest.approx([1.0374879504858856, 1.1711006659477778], abs=1e-6)
    assert (chosen_rewards - rejected_rewards).tolist() == pytest.approx([0.4, 0.2], abs=1e-6)


def test_a_registered_pair_loss_trains_through_the_recipe(tmp_path, registered):
    """`posttrain dpo --loss.type margin_logistic` with nothing changed under posttrain/: 2 steps on
    the tiny model. At step 1 the policy is the reference, every h is 0, so the loss is
    softplus(1 - 0) = log(1 + e) = 1.313262 (DPO's would be ln 2); the card names the objective."""
    pairs_file = write_pairs(tmp_path / "pairs.jsonl", arithmetic_pairs())
    run_dir = dpo.run(small_config(tmp_path, pairs_file, "--loss.type", "margin_logistic"))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if row.get("step", 0) >= 1 and "loss" in row]
    assert [row["step"] for row in trained] == [1, 2]
    assert trained[0]["loss"] == pytest.approx(math.log1p(math.e), abs=1e-6) == 1.3132616875182228
    assert math.isfinite(trained[1]["loss"]) and trained[1]["loss"] != trained[0]["loss"]
    card = json.loads((run_dir / "run_card.json").read_text())
    assert card["links"]["loss"]["objective"] == MARGIN_LOGISTIC.card and card["links"]["loss"]["type"] == "margin_logistic"


def test_an_unknown_type_names_the_table_and_a_taken_name_is_refused(registered):
    with pytest.raises(UserError, match="loss.type: must be one of 'sigmoid', .*'margin_logistic', got 'slic'"):
        Loss(type="slic").validate()
    with pytest.raises(ValueError, match="exists already"):
        register_objective(dataclasses.replace(MARGIN_LOGISTIC))


def _sums(policy: bool) -> tuple[PairLogprobs, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1 if policy else 2)
    chosen, rejected = -torch.rand(4, generator=generator) * 10, -torch.rand(4, generator=generator) * 10
    return PairLogprobs(chosen, rejected, torch.tensor([3, 5, 1, 4]), torch.tensor([2, 6, 1, 3])), chosen, rejected


@pytest.mark.parametrize("name", list(PREFERENCE_OBJECTIVES))
def test_each_entry_keeps_the_contract(name):
    """Each entry's declared fields agree: paired entries compute per-pair losses through the pair
    step, unpaired ones read unpaired rows through their own step, forward and held-out
    evaluation; an entry without a reference has no alarm and losses that do not read the
    reference's sums (so the recipe loads none), an entry with one gives rewards 0 at policy ==
    reference; its own settings are loss fields; its default section validates and makes a card."""
    entry = PREFERENCE_OBJECTIVES[name]
    assert entry.name == name and entry.card and entry.plotted and entry.label_smoothing in LABEL_SMOOTHING
    assert entry.heldout in HELDOUT_METRICS
    fields = {field.name for field in dataclasses.fields(Loss)}
    assert set(entry.settings) <= fields - {"type", "beta", "reference", "reference_refresh_every", "label_smoothing", "nll_weight"}
    if entry.paired:
        assert entry.losses is not None and entry.step is None and entry.forward is pair_logprobs and entry.heldout == "pairs"
        assert entry.class_balance is None and entry.nll_weight is not None
    else:  # unpaired rows: their own step, forward (one side at a time), held-out metrics and class balance; no NLL on a chosen side
        assert entry.losses is None and entry.step is not None and entry.forward is not pair_logprobs
        assert entry.heldout == "unpaired" and entry.class_balance is not None and entry.nll_weight is None
    assert (entry.watched is None) == (not entry.needs_reference)
    if entry.watched is not None:
        assert entry.watched in entry.plotted and entry.watched.startswith("logratio/")
    loss = Loss(type=name, label_smoothing=0.1 if entry.label_smoothing == "required" else 0.0)
    loss.validate()
    card = loss_card(loss, None, 0, Optimization())
    assert card["objective"] == entry.card and card["reduction"] == entry.reduction
    assert card["reference"].startswith("none") == (not entry.needs_reference)
    if entry.losses is None:
        return
    sums, chosen, rejected = _sums(policy=True)
    losses, chosen_rewards, rejected_rewards = entry.losses(loss, sums, chosen, rejected)
    assert losses.shape == chosen_rewards.shape == rejected_rewards.shape == (4,) and torch.isfinite(losses).all()
    if entry.needs_reference:
        assert torch.equal(chosen_rewards, torch.zeros(4)) and torch.equal(rejected_rewards, torch.zeros(4))
    else:
        _, other_chosen, other_rejected = _sums(policy=False)
        assert torch.equal(entry.losses(loss, sums, other_chosen, other_rejected)[0], losses)
        with pytest.raises(UserError, match="uses no reference"):
            Loss(type=name, reference="precomputed").validate()
    if entry.pair_loss is not None:
        assert torch.equal(with_reference(entry.pair_loss)(loss, sums, chosen, rejected)[0], losses)
