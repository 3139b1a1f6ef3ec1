"""The preference objectives as a table: each entry says what its rows are (pairs, or KTO's unpaired
rows), whether it needs a reference, which `loss.*` settings it reads, whether it takes label
smoothing and an NLL term (and its default weight), whether it is length-normalised, its run-card
text, the metrics its runs plot, its held-out evaluation and the metric the displacement alarm
watches. `losses.preference.step` dispatches through the entry; `recipes/dpo.py` asks the entry,
never "is it kto?", and `Loss.validate` checks `loss.type` and every setting against it
(the advantage-estimator table, `algorithms/estimators.py`, is the model).

Adding a pair objective is one function and one entry: a pure per-pair loss in `algorithms/` (or
anywhere) and `register_objective(PreferenceObjective(name=..., card=..., losses=...))`, which is
what a test-only objective does (tests/test_objective_table.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.algorithms import conservative_dpo_loss, cpo_loss, dpo_loss, hinge_loss, ipo_loss, orpo_loss, robust_dpo_loss, simpo_loss
from posttrain.algorithms.preference import PreferenceOutput, length_normalized_dpo_loss, length_normalized_ipo_loss
from posttrain.errors import UserError
from posttrain.losses import kto
from posttrain.models.pair_forward import PairLogprobs, pair_logprobs

PAIR_PLOTTED = ("loss", "rewards/accuracy", "rewards/margins", "logratio/chosen", "logratio/rejected",
                "heldout/preference_accuracy", "heldout/pass@1")
"""What a run on pairs plots."""
PAIR_FORWARD = ("chosen and rejected concatenated in one forward pass, each prompt computed once for both (a shared KV cache) "
                "where the model allows")
"""The run card's forward of a run on pairs."""
LABEL_SMOOTHING = ("refused", "optional", "required")
"""What an objective does with loss.label_smoothing: refuses a non-zero one, takes one, needs one > 0."""


@dataclass(frozen=True)
class PreferenceObjective:
    """One `loss.type`: what it computes, what it needs and what its run says of it."""

    name: str
    card: str
    """What the run card says the objective is (its paper and equation)."""
    losses: Callable[[Any, PairLogprobs, torch.Tensor, torch.Tensor], PreferenceOutput] | None
    """losses(loss section, the policy's `PairLogprobs` of M pairs, ref_chosen (M,), ref_rejected (M,))
    -> (losses, chosen_rewards, rejected_rewards), each (M,): what the pair step averages. None for
    an unpaired objective, whose own `step` computes its loss."""
    pair_loss: Callable[..., PreferenceOutput] | None = None
    """The pure function with `algorithms.preference`'s one signature, for a reference-based pair
    objective (`posttrain explain dpo --loss`); None otherwise."""
    paired: bool = True
    """Rows are (prompt, chosen, rejected) pairs; else unpaired labelled rows (`data.unpaired`)."""
    needs_reference: bool = True
    """False: no reference model is loaded or forwarded (its log-probs are zeros)."""
    settings: tuple[str, ...] = ()
    """The `loss.*` fields of its own (beyond beta and the reference's); every other objective's stay at their defaults."""
    label_smoothing: str = "refused"
    """One of `LABEL_SMOOTHING`."""
    nll_weight: float | None = 0.0
    """loss.nll_weight when unset: 0 (RPO off), the weight of the objective's own NLL term, or None: no NLL term at all."""
    length_normalized: bool = False
    """The objective reads per-token mean log-probs (the card's length handling)."""
    describe: Callable[[Any], dict] = lambda loss: {}
    """Extra run-card entries of its settings (the loss section -> dict)."""
    step: Callable[..., dict[str, float]] | None = None
    """step(models, batch, settings, world) -> metrics, for an objective whose step is not the pair step (None)."""
    forward: Callable = pair_logprobs
    """The trainer's function: (model, batch, rows, ...) -> the rows' summed log-probs."""
    forward_text: str = PAIR_FORWARD
    reduction: str = "mean over the batch's pairs"
    plotted: tuple[str, ...] = PAIR_PLOTTED
    heldout: str = "pairs"
    """The held-out evaluation (`evaluation.preference.HELDOUT_METRICS`): "pairs" or "unpaired"."""
    watched: str | None = "logratio/chosen"
    """The metric the displacement alarm watches; None: no alarm (no reference, so no log-ratio)."""
    class_balance: Callable[[int, int, Any], dict] | None = None
    """(desirable rows, undesirable rows, loss section) -> the card's class-balance entry, for unpaired objectives."""


def with_reference(loss_fn: Callable[..., PreferenceOutput]) -> Callable[[Any, PairLogprobs, torch.Tensor, torch.Tensor], PreferenceOutput]:
    """An entry's `losses` from a pure loss with `algorithms.preference`'s one signature."""
    def losses(loss, sums: PairLogprobs, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor) -> PreferenceOutput:
        return loss_fn(sums.chosen, sums.rejected, ref_chosen, ref_rejected, sums.chosen_lengths, sums.rejected_lengths,
                       beta=loss.beta, label_smoothing=loss.label_smoothing)
    return losses


def token_means(sums: PairLogprobs) -> tuple[torch.Tensor, torch.Tensor]:
    """(M,) per-token mean log-probs of the chosen and of the rejected responses."""
    return sums.chosen / sums.chosen_lengths.clamp(min=1), sums.rejected / sums.rejected_lengths.clamp(min=1)


def _referenced(name: str, loss_fn: Callable[..., PreferenceOutput], card: str, **fields: Any) -> PreferenceObjective:
    return PreferenceObjective(name=name, card=card, losses=with_reference(loss_fn), pair_loss=loss_fn, **fields)


_NO_REFERENCE = dict(needs_reference=False, watched=None)
_KTO_REFERENCE_POINT = ("z0 = max(0, mean over the whole batch of the mismatched rows' log-ratio), detached, all-reduced over ranks "
                        "(TRL: per micro-batch, each prompt with the previous row's completion); each row's mismatched completion is "
                        "another prompt's, fixed at load by a seeded cycle")

PREFERENCE_OBJECTIVES: dict[str, PreferenceObjective] = {entry.name: entry for entry in (
    _referenced("sigmoid", dpo_loss, "DPO sigmoid loss (arXiv:2305.18290 eq. 7)", label_smoothing="optional"),
    _referenced("conservative", conservative_dpo_loss, "conservative DPO, label smoothing (Mitchell 2023)", label_smoothing="required"),
    _referenced("robust", robust_dpo_loss, "robust DPO, unbiased under label noise (arXiv:2403.00409 eq. 8)", label_smoothing="optional"),
    _referenced("ipo", ipo_loss, "IPO squared loss (arXiv:2310.12036 eq. 17) on summed log-ratios"),
    _referenced("hinge", hinge_loss, "hinge / SLiC (arXiv:2305.10425 eq. 3)"),
    _referenced("length_normalized", length_normalized_dpo_loss,
                "length-normalised DPO: sigmoid loss on per-token MEAN log-probs (a different objective)", length_normalized=True),
    _referenced("length_normalized_ipo", length_normalized_ipo_loss,
                "length-normalised IPO (TRL's ipo): IPO squared loss on per-token MEAN log-ratios (a different objective)",
                length_normalized=True),
    PreferenceObjective(
        name="simpo", card=("SimPO (arXiv:2405.14734 eq. 6): -log sigmoid(beta x mean log pi(chosen) - beta x mean log pi(rejected) "
                            "- gamma), no reference"),
        losses=lambda loss, sums, _c, _r: simpo_loss(*token_means(sums), beta=loss.beta, gamma=loss.gamma_ratio * loss.beta),
        settings=("gamma_ratio",), length_normalized=True,
        describe=lambda loss: {"gamma_ratio": loss.gamma_ratio, "gamma": loss.gamma_ratio * loss.beta}, **_NO_REFERENCE),
    PreferenceObjective(
        name="cpo", card="CPO (arXiv:2401.08417 eq. 3): -log sigmoid(beta x (log pi(chosen) - log pi(rejected))) + the NLL term, no reference",
        losses=lambda loss, sums, _c, _r: cpo_loss(sums.chosen, sums.rejected, beta=loss.beta), nll_weight=1.0, **_NO_REFERENCE),
    PreferenceObjective(
        name="orpo", card=("ORPO (arXiv:2403.07691 eqs. 6-7): the NLL term + lambda x -log sigmoid(log odds(chosen) - log odds(rejected)) "
                           "on mean log-probs (lambda = loss.beta, TRL's beta), no reference"),
        losses=lambda loss, sums, _c, _r: orpo_loss(*token_means(sums), lam=loss.beta), nll_weight=1.0, length_normalized=True,
        **_NO_REFERENCE),
    PreferenceObjective(
        name="kto", card=("KTO (arXiv:2402.01306 eq. 7): unpaired completions, w_d x (1 - sigmoid(beta x (r - z0))) for a desirable one "
                          "and w_u x (1 - sigmoid(beta x (z0 - r))) for an undesirable one, r = log pi - log pi_ref summed, z0 = max(0, the "
                          "batch's mean r on mismatched prompt/completion pairs), detached"),
        losses=None, paired=False, settings=("desirable_weight", "undesirable_weight"), nll_weight=None,
        describe=lambda loss: {
            "desirable_weight": loss.desirable_weight, "undesirable_weight": loss.undesirable_weight,
            "reference_point": _KTO_REFERENCE_POINT,
            "as_peers_spell_it": {"trl": f"KTOTrainer(loss_type='kto', beta={loss.beta}, desirable_weight={loss.desirable_weight}, "
                                         f"undesirable_weight={loss.undesirable_weight})"}},
        step=kto.step, forward=kto.side_sums,
        forward_text="the mismatched completions without gradient (the reference point), then the rows' own completions",
        reduction="mean over the batch's rows", plotted=kto.PLOTTED, heldout="unpaired", watched="logratio/desirable",
        class_balance=kto.class_balance),
)}
"""Every preference objective by its `loss.type` name."""


def objective(name: str, where: str = "loss.type") -> PreferenceObjective:
    """The entry of `name`; a UserError naming every objective when there is none."""
    if name not in PREFERENCE_OBJECTIVES:
        raise UserError(f"{where}: must be one of {', '.join(map(repr, PREFERENCE_OBJECTIVES))}, got {name!r}")
    return PREFERENCE_OBJECTIVES[name]


def register_objective(entry: PreferenceObjective) -> PreferenceObjective:
    """Add `entry` to the table (a user's or a test's own objective); a name already taken is refused."""
    if entry.name in PREFERENCE_OBJECTIVES:
        raise ValueError(f"a preference objective named {entry.name!r} exists already")
    if entry.label_smoothing not in LABEL_SMOOTHING:
        raise ValueError(f"label_smoothing must be one of {LABEL_SMOOTHING}, got {entry.label_smoothing!r}")
    PREFERENCE_OBJECTIVES[entry.name] = entry
    return entry
