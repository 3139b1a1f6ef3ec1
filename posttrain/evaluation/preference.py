"""Held-out preference acceptance (DPO's first acceptance number): the configured objective's
pair metrics on pairs the policy never trained on, against the same reference as training.

    heldout/preference_accuracy   fraction of pairs whose chosen reward is strictly higher (TRL's
                                  convention: a tie is wrong), with _low / _high (Wilson 95%)
    heldout/preference_accuracy_ties  pairs whose two rewards are equal (all of them while the
                                  policy is the reference), counted apart
    heldout/loss                  the pairwise loss (no NLL term)
    heldout/margins               mean chosen - rejected implicit reward
    heldout/logratio/chosen       mean log pi - log pi_ref of the chosen responses
    heldout/nll                   token-mean NLL of the chosen responses

KTO's unpaired rows (`evaluate_unpaired`) are not pairs: their accuracy is
heldout/label_side_accuracy (rows on their label's side of the reference point z0, with _low,
_high and _ties), beside the step's other KTO metrics under heldout/.

The pairs go through `models.pair_forward.pair_logprobs` in micro-batches and their
`algorithms.pair_columns` are concatenated before `losses.preference.step_metrics` averages them,
so the numbers do not depend on the micro-batch size. Held-out task accuracy, the second number,
is `evaluation.acceptance.evaluate_sets` on the task split `heldout_task` builds (each setting from
the acceptance section, else from the pairs' provenance), with a checker whose independence from
whoever labelled the pairs `labeller_independence` states. `preference_acceptance_card` is the run
card's acceptance link.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from posttrain.algorithms import kto_loss, pair_columns
from posttrain.data import PreferenceBatch, PreferencePair
from posttrain.data.examples import Task
from posttrain.data.unpaired import labels
from posttrain.evaluation.acceptance import HeldOutSet, default_checker, heldout_split, independence
from posttrain.evaluation.stats import wilson_interval
from posttrain.losses.kto import kto_columns, kto_metrics
from posttrain.losses.preference import Loss, preference_losses, step_metrics
from posttrain.models.pair_forward import pair_logprobs
from posttrain.rewards import Verifier, get_verifier


@dataclass
class HeldoutPairs:
    """Held-out pairs and what scores them: the objective, and the reference live or cached."""

    pairs: list[PreferencePair]
    encode: Callable[[list[PreferencePair]], PreferenceBatch]
    """Pairs -> a tokenised batch on the policy's device (the recipe's one boundary)."""
    loss: Loss
    micro_batch_size: int
    reference: Any = None
    """The live reference (a `ReferenceModel`); None when `cached` holds its sums."""
    cached: torch.Tensor | None = None
    """(M, 2) the precomputed reference's chosen / rejected sums of `pairs`, in order."""


@torch.no_grad()
def evaluate_pairs(policy, held: HeldoutPairs) -> dict[str, float]:
    """The held-out pair metrics of `policy` (named in the module docstring); {} without pairs.
    The caller puts the policy in eval mode and its precision around the call."""
    if not held.pairs:
        return {}
    parts, nll_sum, nll_tokens = [], 0.0, 0
    for start in range(0, len(held.pairs), held.micro_batch_size):
        batch = held.encode(held.pairs[start : start + held.micro_batch_size])
        if held.cached is not None:
            ref_chosen, ref_rejected = held.cached[start : start + held.micro_batch_size].to(batch.chosen.input_ids.device).unbind(1)
        else:
            ref_sums = pair_logprobs(held.reference, batch)
            ref_chosen, ref_rejected = ref_sums.chosen, ref_sums.rejected
        sums = pair_logprobs(policy, batch)
        losses, chosen_rewards, rejected_rewards = preference_losses(held.loss, sums, ref_chosen, ref_rejected)
        parts.append(pair_columns(losses, chosen_rewards, rejected_rewards, sums.chosen, sums.rejected, ref_chosen, ref_rejected))
        nll_sum, nll_tokens = nll_sum - float(sums.chosen.sum()), nll_tokens + int(sums.chosen_lengths.sum())
    means = step_metrics(torch.cat(parts, dim=1), nll_sum / max(1, nll_tokens), held.loss.nll_weight)
    pairs = len(held.pairs)
    low, high = wilson_interval(round(means["rewards/accuracy"] * pairs), pairs)
    return {
        "heldout/preference_accuracy": means["rewards/accuracy"], "heldout/preference_accuracy_low": low,
        "heldout/preference_accuracy_high": high, "heldout/preference_accuracy_ties": round(means["rewards/ties"] * pairs),
        "heldout/loss": means["loss/preference"],
        "heldout/margins": means["rewards/margins"], "heldout/logratio/chosen": means["logratio/chosen"],
        "heldout/nll": means["loss/nll"],
    }


@torch.no_grad()
def evaluate_unpaired(policy, held: HeldoutPairs) -> dict[str, float]:
    """The held-out metrics of `policy` on KTO's unpaired rows (`held.pairs`: `data.unpaired`
    rows, chosen = the row's completion, rejected = its mismatched one), {} without rows: the step's
    `losses.kto.kto_metrics` with z0 from the held-out rows' own mismatched completions, prefixed
    heldout/. Its accuracy compares no pair, so it is not called a preference accuracy:
    heldout/label_side_accuracy is the fraction of rows on their label's side of z0, with _low /
    _high (Wilson 95%) and _ties (the number of rows at z0, counted wrong: all of them while the
    policy is the reference). The caller puts the policy in eval mode and its precision around the call."""
    if not held.pairs:
        return {}
    sides: dict[str, list[torch.Tensor]] = {"own": [], "mismatched": [], "ref_own": [], "ref_mismatched": []}
    for start in range(0, len(held.pairs), held.micro_batch_size):
        batch = held.encode(held.pairs[start : start + held.micro_batch_size])
        sums = pair_logprobs(policy, batch)
        if held.cached is not None:
            ref_own, ref_mismatched = held.cached[start : start + held.micro_batch_size].to(sums.chosen.device).unbind(1)
        else:
            ref = pair_logprobs(held.reference, batch)
            ref_own, ref_mismatched = ref.chosen, ref.rejected
        for name, value in (("own", sums.chosen), ("mismatched", sums.rejected), ("ref_own", ref_own), ("ref_mismatched", ref_mismatched)):
            sides[name].append(value)
    own, mismatched, ref_own, ref_mismatched = (torch.cat(sides[name]).float() for name in ("own", "mismatched", "ref_own", "ref_mismatched"))
    desirable = labels(held.pairs).to(own.device)  # (M,)
    logratios, mismatched_ratios = own - ref_own, mismatched - ref_mismatched
    losses, rewards, point = kto_loss(logratios, mismatched_ratios, desirable, beta=held.loss.beta,
                                      desirable_weight=held.loss.desirable_weight, undesirable_weight=held.loss.undesirable_weight)
    metrics = kto_metrics(kto_columns(losses, rewards, logratios, mismatched_ratios, own, desirable), float(point))
    rows = len(held.pairs)
    correct, ties = round(metrics.pop("rewards/accuracy") * rows), round(metrics.pop("rewards/ties") * rows)
    low, high = wilson_interval(correct, rows)
    return {"heldout/label_side_accuracy": correct / rows, "heldout/label_side_accuracy_low": low, "heldout/label_side_accuracy_high": high,
            "heldout/label_side_accuracy_ties": ties, **{f"heldout/{key}": value for key, value in metrics.items()}}


HELDOUT_METRICS: dict[str, Callable[[Any, HeldoutPairs], dict[str, float]]] = {"pairs": evaluate_pairs, "unpaired": evaluate_unpaired}
"""The held-out evaluations by the name an objective's entry gives (`PreferenceObjective.heldout`)."""


def labeller_independence(labeller: str | None, checker: Verifier) -> tuple[bool, str]:
    """`independence` of the held-out checker from the verifier that labelled the pairs (named in
    their provenance); pairs labelled by no recorded verifier are checked independently of it."""
    if labeller is None:
        return True, f"the pairs name no labelling verifier; the checker {checker.name} is the only verifier of this run"
    try:
        return independence(get_verifier(labeller), checker)
    except ValueError:  # a python:<function> labeller cannot be rebuilt by name
        same = labeller == checker.name
        return not same, (f"the checker {checker.name} is the labeller itself" if same
                          else f"the labeller {labeller} cannot be rebuilt to compare; the checker {checker.name} is another verifier")


def heldout_task(acceptance: Any, provenance: dict | None, seed: int) -> tuple[Task | None, dict | None]:
    """The held-out task split for acceptance (None when the pairs come from no known task), and
    the spec it was built from ({task, options, eval_size, split_seed, checker}; None without a
    task): each setting from `acceptance` (a recipe's acceptance section with task, task_options,
    eval_size, split_seed and checker), else from the pairs' `provenance`, else the defaults (200
    problems, split seed `seed`, the task's strict default checker)."""
    origin = provenance or {}
    task = acceptance.task or origin.get("task")
    if task is None:
        return None, None
    spec = {
        "task": task,
        "options": acceptance.task_options if acceptance.task_options is not None else origin.get("task_options", {}),
        "eval_size": acceptance.eval_size or origin.get("eval_size") or 200,
        "split_seed": acceptance.split_seed if acceptance.split_seed is not None else origin.get("seed", seed),
    }
    held_out = heldout_split(task, spec["eval_size"], spec["split_seed"], spec["options"])
    spec["checker"] = acceptance.checker or default_checker(held_out)
    return held_out, spec


HELDOUT_PAIRS_TEXT = ("{count} pairs: preference accuracy (chosen reward > rejected reward; TRL's convention, a tie counts as "
                      "wrong, so it reads 0 while the policy is the reference), its Wilson 95% interval, the ties counted apart")
HELDOUT_ROWS_TEXT = ("{count} unpaired rows: label-side accuracy (a desirable row's log-ratio above the reference point z0, an "
                     "undesirable row's below; a row at z0 counts as wrong, so it reads 0 while the policy is the reference), "
                     "its Wilson 95% interval, the rows at z0 counted apart")


def preference_acceptance_card(acceptance: Any, heldout_pairs: int, task_spec: dict | None, checker: Verifier | None,
                               provenance: dict | None, shifted: Sequence[HeldOutSet] = (), unpaired: bool = False) -> dict[str, Any]:
    """The run card's acceptance link of a run on preference pairs: the `heldout_pairs` held-out
    pairs (`unpaired`: KTO's rows, scored by their side of the reference point), the held-out task
    (`task_spec`, from `heldout_task`; None: none) and its `checker` (whether it is the pairs'
    labeller, named in their `provenance`, and whether it is independent of it), the displacement
    alarm's settings (`acceptance`: displacement_threshold, alarm_window) and the `shifted` held-out sets."""
    link = {
        "heldout_pairs": (HELDOUT_ROWS_TEXT if unpaired else HELDOUT_PAIRS_TEXT).format(count=heldout_pairs),
        "heldout_task": (f"{task_spec['task']} held-out split ({task_spec['eval_size']} problems, split seed {task_spec['split_seed']}, "
                         "disjoint from the pairs' prompts)") if task_spec else "none (the pairs come from no known task)",
        "checker": task_spec["checker"] if task_spec else None, "displacement_threshold": acceptance.displacement_threshold,
        "alarm_window": acceptance.alarm_window,
    }
    labeller = (provenance or {}).get("verifier")
    if task_spec and labeller is not None:
        link["checker_is_labeller"] = task_spec["checker"] == labeller
    if checker is not None:
        independent, why = labeller_independence(labeller, checker)
        link.update({"independent": independent, "independence_reason": why, "checker_settings": checker.describe()})
    if shifted:
        link["sets"] = {held.name: held.spec for held in shifted}
    return link
