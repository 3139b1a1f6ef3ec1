"""The off-policy corrections of the loss link (issue 42), by hand: the importance rule (TIS and
masked IS at the token and sequence levels on a 2 x 3 example), the effective sample size, the
decoupled objective and the behaviour baseline against the proximal step (exactly equal when the
policies coincide), an end-to-end step through `policy_gradient.prepare` + `step` on a batch whose
sampler log-probs were moved (weights != 1, one checked by hand, the offpolicy/* metrics), `auto`'s
resolution, the refused combinations, and `posttrain explain decoupled`'s numbers."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch

from posttrain.algorithms import effective_sample_size, importance_weights, truncated_importance_weights
from posttrain.cli import main
from posttrain.config import build_config
from posttrain.errors import UserError
from posttrain.losses import policy_gradient
from posttrain.losses.policy_gradient_config import Critic, Loss, OffPolicy, Update, loss_card, off_policy_objective
from posttrain.recipes import online, online_config
from posttrain.rollout import SamplingConfig
from tests.rewards_for_tests import digits
from tests.test_online_step import SMALL, fixed_batch

# log w = target - behaviour = [[0.5, 1.3, -1.0], [0.2, -0.9, (0.3, not counted)]]
TARGET = torch.tensor([[-1.0, -0.2, -3.0], [-0.5, -1.2, -0.7]], dtype=torch.float64)
BEHAVIOUR = torch.tensor([[-1.5, -1.5, -2.0], [-0.7, -0.3, -1.0]], dtype=torch.float64)
MASK = torch.tensor([[True, True, True], [True, True, False]])
e = math.exp


def weights(level: str, mode: str, **bounds) -> torch.Tensor:
    return importance_weights(TARGET, BEHAVIOUR, MASK, level, mode, **bounds).weights


def test_token_level_truncated_and_masked_by_hand():
    """Token level: w = exp(log w) per token. truncate at 2: 3.669 -> 2, the rest as is; mask [0.5, 2]:
    3.669 and 0.368 and 0.407 leave the band -> 0. The uncounted token is weighted too (the loss masks it)."""
    expected = torch.tensor([[e(0.5), 2.0, e(-1.0)], [e(0.2), e(-0.9), e(0.3)]], dtype=torch.float64)
    assert torch.allclose(weights("token", "truncate", cap=2.0), expected, rtol=1e-12)
    masked = torch.tensor([[e(0.5), 0.0, 0.0], [e(0.2), 0.0, e(0.3)]], dtype=torch.float64)
    assert torch.allclose(weights("token", "mask", lower=0.5, upper=2.0), masked, rtol=1e-12)
    result = importance_weights(TARGET, BEHAVIOUR, MASK, "token", "truncate", cap=2.0)
    assert result.truncated.tolist() == [[False, True, False], [False, False, False]]
    assert not result.masked.any()
    assert result.raw[0, 1].item() == pytest.approx(e(1.3), rel=1e-12)
    assert result.units(MASK).tolist() == pytest.approx([e(0.5), e(1.3), e(-1.0), e(0.2), e(-0.9)], rel=1e-12)
    masked_result = importance_weights(TARGET, BEHAVIOUR, MASK, "token", "mask", lower=0.5, upper=2.0)
    assert masked_result.masked.tolist() == [[False, True, True], [False, True, False]]


def test_sequence_levels_truncated_and_masked_by_hand():
    """Sequence level: the counted log-ratios summed, row 0: 0.5 + 1.3 - 1.0 = 0.8 -> w = 2.2255; row 1:
    0.2 - 0.9 = -0.7 (the uncounted 0.3 left out) -> w = 0.4966, on every token of the row. truncate at
    2: [2, 0.4966]; mask [0.5, 2]: both leave the band -> 0. Geometric: exp(0.8 / 3) = 1.3056 and
    exp(-0.7 / 2) = 0.7047, both inside [0.5, 2]."""
    ones = torch.ones(3, dtype=torch.float64)
    truncated = weights("sequence", "truncate", cap=2.0)
    assert torch.allclose(truncated, torch.stack([2.0 * ones, e(-0.7) * ones]), rtol=1e-12)
    assert weights("sequence", "mask", lower=0.5, upper=2.0).eq(0).all()
    result = importance_weights(TARGET, BEHAVIOUR, MASK, "sequence", "truncate", cap=2.0)
    assert result.units(MASK).tolist() == pytest.approx([e(0.8), e(-0.7)], rel=1e-12)
    assert result.truncated.tolist() == [[True] * 3, [False] * 3]
    geometric = weights("geometric", "mask", lower=0.5, upper=2.0)
    assert torch.allclose(geometric, torch.stack([e(0.8 / 3) * ones, e(-0.35) * ones]), rtol=1e-12)


def test_tis_is_the_rules_token_truncate_case():
    """`truncated_importance_weights` (loss.sampler_correction tis) is `importance_weights` at the token
    level, truncated, bit for bit, in float32 as the step computes it."""
    target, behaviour = TARGET.float(), BEHAVIOUR.float()
    rule = importance_weights(target, behaviour, MASK, "token", "truncate", cap=2.0).weights
    assert torch.equal(truncated_importance_weights(target, behaviour, cap=2.0), rule)
    assert torch.equal(rule, torch.exp(target - behaviour).clamp(max=2.0))  # the formula TIS always had


def test_effective_sample_size_by_hand():
    """(sum w)^2 / (n sum w^2): [2, 0.5, 1, 1] -> 4.5^2 / (4 x 6.25) = 0.81; equal weights -> 1; none -> 1."""
    w = torch.tensor([2.0, 0.5, 1.0, 1.0], dtype=torch.float64)
    assert effective_sample_size(float(w.sum()), float((w ** 2).sum()), 4) == pytest.approx(0.81)
    assert effective_sample_size(3.0 * 0.7, 3.0 * 0.49, 3) == pytest.approx(1.0)
    assert effective_sample_size(0.0, 0.0, 0) == 1.0


# -- through the step -----------------------------------------------------------------------------

def state_with(off_policy: dict | None = None, epochs: int = 2, **extra) -> online.State:
    """The tiny GRPO state of tests/test_online_step.py; 2 epochs, so the proximal log-probs are
    precomputed before the update (and the second epoch's ratios move off 1)."""
    overrides = copy.deepcopy(SMALL)
    overrides["update"] = {"epochs": epochs, "micro_batch_size": 8}
    if off_policy:
        overrides["loss"] = {**overrides["loss"], "off_policy": off_policy}
    overrides.update(extra)
    return online.setup(build_config(online_config.grpo_config, None, overrides), reward=digits)


def run_step(state: online.State, batch, max_staleness: int = 0, behaviour_shift=None):
    """`prepare` + `step` as the recipe runs them, at `max_staleness`; `behaviour_shift(old)` sets the
    sampler's log-probs from the proximal ones before the update. Returns (metrics, update batch)."""
    models, settings = online.loss_inputs(state)
    settings = dataclasses.replace(settings, max_staleness=max_staleness)
    update_batch, metrics = policy_gradient.prepare(models, batch, settings, state.world)
    if behaviour_shift is not None:
        update_batch.rollout = dataclasses.replace(update_batch.rollout, sampler_logprobs=behaviour_shift(update_batch.old_logprobs))
    metrics |= policy_gradient.step(models, update_batch, settings, state.world)
    return metrics, update_batch


def parameters(state: online.State) -> list[torch.Tensor]:
    return [parameter.detach().clone() for parameter in state.policy.parameters()]


@pytest.mark.parametrize("objective", ["decoupled", "behaviour"])
def test_proximal_equals_behaviour_gives_the_on_policy_step_exactly(objective):
    """With the sampler's log-probs equal to the proximal policy's: decoupled's weights are exp(0) = 1
    and behaviour's ratio is the proximal one, so the loss, every metric of the proximal step and the
    weights after two epochs (the gradients) are bit-identical to the proximal objective's."""
    plain, other = state_with({"objective": "proximal"}), state_with({"objective": objective})
    batch = fixed_batch(plain)
    same = lambda old: old.clone()  # noqa: E731
    a, _ = run_step(plain, copy.deepcopy(batch), behaviour_shift=same)
    b, _ = run_step(other, copy.deepcopy(batch), behaviour_shift=same)
    for key in ("loss", "ratio/mean", "ratio/min", "ratio/max", "clip/low", "clip/high", "grad_norm"):
        assert a[key] == b[key], key
    assert all(torch.equal(x, y) for x, y in zip(parameters(plain), parameters(other)))
    if objective == "decoupled":
        assert b["offpolicy/is_weight_mean"] == 1.0 and b["offpolicy/is_weight_max"] == 1.0 and b["offpolicy/is_ess"] == 1.0
        assert b["offpolicy/truncated_fraction"] == 0.0 and b["offpolicy/masked_fraction"] == 0.0
    else:
        assert not any(key.startswith("offpolicy/") for key in b)


def shifted(old: torch.Tensor) -> torch.Tensor:
    """The behaviour policy's log-probs: the proximal ones minus 0.3 (w = e^0.3 = 1.35), row 0 minus 1.0
    (w = e = 2.72: above the cap and the band)."""
    shift = torch.full_like(old, 0.3)
    shift[0] = 1.0
    return old - shift


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_decoupled_step_on_a_stale_batch_by_hand(monkeypatch, mode):
    """auto at max_staleness 2 resolves to decoupled. Each counted token of row 0 has w = e (truncated to
    2, or masked to 0), every other e^0.3 (inside both); the recorded weight of token (0, 0) is checked
    against the proximal and behaviour log-probs by hand, and the metrics against the n counted tokens
    (two epochs count each twice: the mean, ESS and fractions do not change)."""
    recorded = []

    def recording(*args, **kwargs):
        result = importance_weights(*args, **kwargs)
        recorded.append(result)
        return result

    monkeypatch.setattr(policy_gradient, "importance_weights", recording)
    state = state_with({"mode": mode} if mode == "mask" else None)
    batch = fixed_batch(state)
    metrics, update_batch = run_step(state, batch, max_staleness=2, behaviour_shift=shifted)
    assert len(recorded) == 2  # one micro-batch per epoch
    mask = update_batch.mask
    proximal, behaviour = update_batch.old_logprobs, update_batch.rollout.sampler_logprobs
    by_hand = math.exp(float(proximal[0, 0]) - float(behaviour[0, 0]))
    assert by_hand == pytest.approx(math.e, rel=1e-5)
    assert float(recorded[0].weights[0, 0]) == pytest.approx(2.0 if mode == "truncate" else 0.0)
    assert float(recorded[0].weights[1, 0]) == pytest.approx(math.exp(0.3), rel=1e-5)
    first_row, counted = int(mask[0].sum()), int(mask.sum())
    raw = [math.e] * first_row + [math.exp(0.3)] * (counted - first_row)
    assert metrics["offpolicy/is_weight_mean"] == pytest.approx(sum(raw) / counted, rel=1e-5)
    assert metrics["offpolicy/is_weight_max"] == pytest.approx(math.e, rel=1e-5)
    ess = sum(raw) ** 2 / (counted * sum(w * w for w in raw))
    assert metrics["offpolicy/is_ess"] == pytest.approx(ess, rel=1e-5) and metrics["offpolicy/is_ess"] < 1
    changed = first_row / counted
    assert metrics["offpolicy/truncated_fraction"] == pytest.approx(changed if mode == "truncate" else 0.0)
    assert metrics["offpolicy/masked_fraction"] == pytest.approx(changed if mode == "mask" else 0.0)


def test_auto_at_max_staleness_0_is_the_proximal_step():
    """The default (auto) at max_staleness 0 is today's step: no weights, no offpolicy/* metrics, even
    with the sampler's log-probs moved."""
    state = state_with()
    metrics, _ = run_step(state, fixed_batch(state), max_staleness=0, behaviour_shift=shifted)
    assert not any(key.startswith("offpolicy/") for key in metrics)


def test_auto_resolution():
    """auto: proximal at max_staleness 0 and with TIS on (its weight is the truncated pi_prox / pi_behav);
    decoupled otherwise; an explicit objective is itself."""
    assert off_policy_objective(Loss(), 0).name == "proximal"
    assert off_policy_objective(Loss(), 1).name == "decoupled"
    assert off_policy_objective(Loss(sampler_correction="tis"), 4).name == "proximal"
    assert off_policy_objective(Loss(off_policy=OffPolicy(objective="behaviour")), 0).name == "behaviour"
    card = loss_card(Loss(), Critic(), Update(), SamplingConfig(), None, max_staleness=2)
    assert card["off_policy_meaning"].startswith("decoupled: decoupled PPO") and "truncate at 2.0" in card["off_policy_meaning"]


@pytest.mark.parametrize("loss, message", [
    (Loss(sampler_correction="tis", off_policy=OffPolicy(objective="decoupled")),
     "loss.sampler_correction tis and loss.off_policy.objective decoupled both weight each token by pi_old / pi_sampler"),
    (Loss(sampler_correction="tis", off_policy=OffPolicy(objective="behaviour")), "has nothing to correct"),
    (Loss(off_policy=OffPolicy(mode="mask", cap=3.0)), "loss.off_policy.cap does not apply to objective auto, mode mask"),
    (Loss(off_policy=OffPolicy(objective="proximal", level="sequence")), "loss.off_policy.level does not apply"),
    (Loss(off_policy=OffPolicy(mode="mask", lower=2.0, upper=1.0)), "0 <= lower < upper"),
])
def test_refused_settings_one_line(loss, message):
    with pytest.raises(UserError, match=message) as error:
        loss.validate()
    assert len(str(error.value).splitlines()) == 1


def test_refused_through_the_config():
    with pytest.raises(UserError, match="use one"):
        build_config(online_config.grpo_config, None, {"loss": {"sampler_correction": "tis", "off_policy": {"objective": "decoupled"}}})


def test_greedy_rollouts_have_no_behaviour_distribution():
    """Refused when the config is built (the recipe's check), and by `prepare` itself for a library
    caller whose batch was drawn greedily."""
    with pytest.raises(UserError, match="loss.off_policy.objective decoupled needs sampled rollouts"):
        state_with({"objective": "decoupled"}, sampling={"max_new_tokens": 6, "greedy": True})
    state = state_with({"objective": "decoupled"}, sampling={"max_new_tokens": 6})
    batch = fixed_batch(state)
    batch.rollout.sampling = dataclasses.replace(batch.rollout.sampling, greedy=True)
    with pytest.raises(UserError, match="loss.off_policy.objective decoupled needs sampled rollouts"):
        run_step(state, batch)


# -- posttrain explain decoupled --------------------------------------------------------------------

def test_explain_decoupled_numbers(capsys):
    """log pi -0.9, pi_prox -1.0, pi_behav -1.5, A 1, eps 0.2: r = e^0.1 = 1.105171 (inside [0.8, 1.2]),
    w = e^0.5 = 1.648721, loss = -w r A = -1.822119 = d loss / d log pi. Against the behaviour policy
    rho = e^0.6 = 1.822119 is clipped at 1.2: loss -1.2, gradient 0."""
    assert main(["explain", "decoupled", "--logprob", "-0.9", "--proximal", "-1.0", "--behaviour", "-1.5",
                 "--advantage", "1", "--clip", "0.2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ratio"] == pytest.approx([e(0.1)], rel=1e-12)
    assert result["clipped_term"] == pytest.approx([e(0.1)], rel=1e-12)
    assert result["weight"] == pytest.approx([e(0.5)], rel=1e-12)
    assert result["loss"] == pytest.approx(-e(0.6), rel=1e-12)
    assert result["grad"] == pytest.approx([-e(0.6)], rel=1e-12)
    assert result["behaviour_ratio"] == pytest.approx([e(0.6)], rel=1e-12)
    assert result["behaviour_loss"] == pytest.approx(-1.2) and result["behaviour_grad"] == [0.0]


def test_explain_decoupled_sequence_mask(capsys):
    """Two tokens, level sequence: w = exp(0.5 + 1.3) = 6.05 leaves [0.5, 2] -> weight 0, loss 0, no gradient."""
    assert main(["explain", "decoupled", "--logprob", "-1", "-0.2", "--proximal", "-1", "-0.2", "--behaviour", "-1.5", "-1.5",
                 "--advantage", "1", "--level", "sequence", "--mode", "mask", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["raw_weight"] == pytest.approx([e(1.8)] * 2, rel=1e-12)
    assert result["weight"] == [0.0, 0.0] and result["loss"] == 0.0 and result["grad"] == [0.0, 0.0]


def test_explain_decoupled_text(capsys):
    assert main(["explain", "decoupled", "--logprob", "-0.9", "--proximal", "-1.0", "--behaviour", "-1.5", "--advantage", "1"]) == 0
    out = capsys.readouterr().out
    assert "weight w             = [1.648721]" in out and "loss = -1.822119" in out and "loss -1.200000" in out


def test_decoupled_step_at_the_sequence_level():
    """Level sequence, through the step: each row's weight is exp(sum of its counted log-ratios): row 0
    e^(1.0 n_0) (truncated at 2), row i e^(0.3 n_i); the metrics count rows, not tokens (n = 8 rows),
    and the truncated fraction counts the tokens of the truncated rows."""
    state = state_with({"objective": "decoupled", "level": "sequence"})
    metrics, update_batch = run_step(state, fixed_batch(state), behaviour_shift=shifted)
    lengths = update_batch.mask.sum(-1).tolist()
    raw = [math.exp(n * (1.0 if row == 0 else 0.3)) for row, n in enumerate(lengths) if n]
    assert metrics["offpolicy/is_weight_mean"] == pytest.approx(sum(raw) / len(raw), rel=1e-4)
    assert metrics["offpolicy/is_weight_max"] == pytest.approx(max(raw), rel=1e-4)
    assert metrics["offpolicy/is_ess"] == pytest.approx(sum(raw) ** 2 / (len(raw) * sum(w * w for w in raw)), rel=1e-4)
    truncated_tokens = sum(n for n, w in zip([n for n in lengths if n], raw) if w > 2.0)
    assert metrics["offpolicy/truncated_fraction"] == pytest.approx(truncated_tokens / sum(lengths))
