"""A reward model's held-out acceptance: its pair accuracy on held-out preference pairs (a tie is
wrong) with a Wilson interval, margins, the rewards' scale (stored with the export for `rm:`'s
`stored` normalisation), and the length-bias probes (`algorithms.reward_model.length_bias`).

    metrics, scale = evaluate_reward_pairs(model, pairs, encode, micro_batch_size, loss)
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from posttrain.algorithms.reward_model import bradley_terry_loss, length_bias, reward_pair_metrics, reward_scale
from posttrain.evaluation.stats import wilson_interval
from posttrain.models.reward_model import batch_rewards


@torch.no_grad()
def pair_rewards(model, pairs: list, encode: Callable, micro_batch_size: int) -> dict[str, torch.Tensor]:
    """(M,) chosen and rejected rewards of `pairs` and their response lengths in tokens (the EOS
    counted), in micro-batches of `micro_batch_size` pairs. The caller sets eval mode and precision."""
    parts: dict[str, list[torch.Tensor]] = {"chosen": [], "rejected": [], "chosen_lengths": [], "rejected_lengths": []}
    for start in range(0, len(pairs), micro_batch_size):
        batch = encode(pairs[start : start + micro_batch_size])
        chosen, rejected = batch_rewards(model, batch)
        for name, value in (("chosen", chosen), ("rejected", rejected), ("chosen_lengths", batch.chosen.mask.sum(-1)),
                            ("rejected_lengths", batch.rejected.mask.sum(-1))):
            parts[name].append(value.float().cpu())
    return {name: torch.cat(values) for name, values in parts.items()}


def evaluate_reward_pairs(model, pairs: list, encode: Callable, micro_batch_size: int, loss,
                          margins: torch.Tensor | None = None) -> tuple[dict[str, Any], dict[str, float]]:
    """The held-out metrics of a reward model on `pairs` ({} without pairs), each under `heldout/`:
    preference_accuracy (+ _low, _high: Wilson 95%), loss, margin, rewards/chosen, rewards/rejected,
    reward_length_correlation, accuracy_shorter_chosen and shorter_chosen_pairs; and the rewards'
    scale over all 2M responses (mean, std_population, std_sample)."""
    if not pairs:
        return {}, {}
    rewards = pair_rewards(model, pairs, encode, micro_batch_size)
    chosen, rejected = rewards["chosen"], rewards["rejected"]
    losses = bradley_terry_loss(chosen, rejected, margin=margins, centering=loss.centering, label_smoothing=loss.label_smoothing)
    means = {key: float(value) for key, value in reward_pair_metrics(chosen, rejected).items()}
    low, high = wilson_interval(means["accuracy"] * len(pairs), len(pairs))
    probes = length_bias(chosen, rejected, rewards["chosen_lengths"], rewards["rejected_lengths"])
    metrics = {
        "heldout/preference_accuracy": means["accuracy"], "heldout/preference_accuracy_low": low, "heldout/preference_accuracy_high": high,
        "heldout/loss": float(losses.mean()), "heldout/margin": means["margin"], "heldout/rewards/chosen": means["rewards/chosen"],
        "heldout/rewards/rejected": means["rewards/rejected"],
        "heldout/reward_length_correlation": float(probes["reward_length_correlation"]),
        "heldout/shorter_chosen_pairs": int(probes["shorter_chosen_pairs"]),
        "heldout/accuracy_shorter_chosen": None if probes["accuracy_shorter_chosen"].isnan() else float(probes["accuracy_shorter_chosen"]),
    }
    scale = {key: float(value) for key, value in reward_scale(torch.cat([chosen, rejected])).items()}
    return metrics, scale
