"""DPO's step and held-out metrics from per-pair results, and the likelihood-displacement alarm."""

from __future__ import annotations

import torch

from posttrain.recipes.preference_data import PairLogprobs


class DisplacementAlarm:
    """Likelihood displacement (the seed: DPO can win by pushing both answers down): rings when the
    chosen log-ratio log pi(chosen) - log pi_ref(chosen), averaged over the last `window` steps, is
    below -threshold while the preference accuracy over those steps is above that of the run's first
    `window` steps. Rings once; `history` is saved in checkpoints so a resumed run rings the same."""

    def __init__(self, threshold: float, window: int, history: list | None = None, rings: list | None = None):
        self.threshold, self.window = threshold, window
        self.history: list[tuple[int, float, float]] = [tuple(h) for h in history or []]
        self.rings: list[str] = list(rings or [])

    def observe(self, step: int, chosen_logratio: float, accuracy: float) -> str | None:
        self.history.append((step, chosen_logratio, accuracy))
        if self.rings or len(self.history) < 2:
            return None
        recent, first = self.history[-self.window :], self.history[: self.window]
        drop = sum(h[1] for h in recent) / len(recent)
        accuracy_now, accuracy_start = sum(h[2] for h in recent) / len(recent), sum(h[2] for h in first) / len(first)
        if drop < -self.threshold and accuracy_now > accuracy_start:
            self.rings.append(
                f"likelihood displacement at step {step}: the chosen responses' log-prob is {drop:.3f} nats below the "
                f"reference's (threshold {self.threshold}) while preference accuracy rose {accuracy_start:.3f} -> "
                f"{accuracy_now:.3f}: DPO is winning by pushing both answers down"
            )
            return self.rings[-1]
        return None


def pair_columns(losses, chosen_rewards, rejected_rewards, sums: PairLogprobs, ref_chosen, ref_rejected) -> torch.Tensor:
    """(7, P) detached [losses, chosen rewards, rejected rewards, chosen logps, rejected logps,
    chosen log-ratio, rejected log-ratio], for `pair_metrics`."""
    chosen, rejected = sums.chosen.detach(), sums.rejected.detach()
    return torch.stack([losses.detach(), chosen_rewards, rejected_rewards, chosen, rejected, chosen - ref_chosen, rejected - ref_rejected])


def pair_metrics(columns: torch.Tensor, nll: float, nll_weight: float) -> dict[str, float]:
    """Means over pairs of the (7, P) `pair_columns`; loss = preference loss + nll_weight * nll."""
    losses, chosen_r, rejected_r, chosen, rejected, chosen_ratio, rejected_ratio = columns
    preference = float(losses.mean())
    return {
        "loss": preference + nll_weight * nll, "loss/preference": preference, "loss/nll": nll,
        "rewards/chosen": float(chosen_r.mean()), "rewards/rejected": float(rejected_r.mean()),
        "rewards/margins": float((chosen_r - rejected_r).mean()),
        "rewards/accuracy": float((chosen_r > rejected_r).float().mean()),
        "logps/chosen": float(chosen.mean()), "logps/rejected": float(rejected.mean()),
        "logratio/chosen": float(chosen_ratio.mean()), "logratio/rejected": float(rejected_ratio.mean()),
    }
