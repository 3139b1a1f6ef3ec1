"""The reward-model loss step (`posttrain rm`): Bradley-Terry on the scalar rewards of each pair's
chosen and rejected response, with the optional margin, centering and label smoothing
(`algorithms.bradley_terry_loss`). `loss_card` is the run card's loss link.

    metrics = step(Trainable(trainer, optimizer, scheduler, max_grad_norm), batch, RewardModelSettings(loss, micro_batch_size), world)

with each pair's margin (when `loss.margin`) in `batch.margins`.

The loss is the mean over the batch's pairs, each micro-batch's sum divided by the whole batch's
count, so the gradient does not depend on micro_batch_size or the world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posttrain.algorithms.reward_model import bradley_terry_loss, reward_pair_columns, reward_pair_metrics
from posttrain.data import PreferenceBatch
from posttrain.distributed import World, gradient_sync, rank_micro_batches
from posttrain.errors import UserError
from posttrain.optim import Optimization, Trainable


@dataclass
class Loss:
    """Link 3, loss: Bradley-Terry on r(chosen) - r(rejected)."""

    margin: bool = False
    """Subtract each pair's `margin` column (a number >= 0 in the pairs file; Llama 2 §3.2.2) from r_c - r_r; a pair without one is refused."""
    centering: float = 0.0
    """eta x mean((r_c + r_r)^2) added to the loss, keeping rewards centred on 0 (arXiv:2312.09244; TRL's center_rewards_coefficient, 0.01 there)."""
    label_smoothing: float = 0.0
    """Assumed label-flip rate e in [0, 0.5): -(1 - e) log sigmoid(d) - e log sigmoid(-d)."""

    def validate(self) -> None:
        if self.centering < 0:
            raise UserError(f"loss.centering must be >= 0, got {self.centering}")
        if not 0 <= self.label_smoothing < 0.5:
            raise UserError(f"loss.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")


@dataclass(frozen=True)
class RewardModelSettings:
    """What a reward-model step reads besides the model and the batch: the loss section and the
    micro-batch size (at most that many pairs per forward/backward)."""

    loss: Loss
    micro_batch_size: int


def pair_margins(pairs: list, loss: Loss, name: str) -> torch.Tensor | None:
    """(M,) float32 margins of `pairs` (their metadata's `margin`) when `loss.margin`, else None; a
    pair without a number >= 0 there is one UserError naming it and `name` (the file)."""
    if not loss.margin:
        return None
    values = []
    for pair in pairs:
        value = pair.metadata.get("margin")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise UserError(f"{name}: pair {pair.id}: loss.margin needs a `margin` number >= 0 in every pair, got {value!r}")
        values.append(float(value))
    return torch.tensor(values, dtype=torch.float32)


def step(models: Trainable, batch: PreferenceBatch, settings: RewardModelSettings, world: World | None = None) -> dict[str, float]:
    """One optimizer step on M pairs. `models.trainer` is a `TrainingForward` over
    `models.reward_model.batch_rewards` (possibly in DDP); `batch.margins` (M,) each pair's margin,
    or None. Returns the means over the whole batch: loss, accuracy (a tie is wrong), margin,
    rewards/chosen, rewards/rejected, and grad_norm (pre-clipping)."""
    world = world or World()
    margins, loss = batch.margins, settings.loss
    M = batch.chosen.input_ids.shape[0]
    device = batch.chosen.input_ids.device
    margins = margins.to(device) if margins is not None else None
    parts = [torch.zeros(3, 0, device=device)]
    for rows, weight, last in rank_micro_batches(torch.arange(M), world.block_owners(M), world, settings.micro_batch_size):
        with gradient_sync(models.trainer, last):
            chosen, rejected = models.trainer(batch, rows)
            losses = bradley_terry_loss(chosen, rejected, margin=None if margins is None else margins[rows],
                                        centering=loss.centering, label_smoothing=loss.label_smoothing)
            (losses.sum() / M * (weight * world.size)).backward()  # DDP averages gradients over ranks
        if weight:
            parts.append(reward_pair_columns(losses, chosen, rejected))
    columns = torch.cat(parts, dim=1)
    if world.active:  # through the CPU: a pickled CUDA tensor would unpickle onto the sender's GPU
        columns = torch.cat([part.to(device) for part in world.gather(columns.cpu())], dim=1)
    metrics = {"loss": float(columns[0].mean()), **{key: float(value) for key, value in reward_pair_metrics(columns[1], columns[2]).items()}}
    metrics["grad_norm"] = models.step()
    return metrics


def loss_card(loss: Loss, lora_rank: int, optim: Optimization, head_std: float) -> dict[str, Any]:
    """The run card's loss link of a reward-model run."""
    return {
        "objective": "Bradley-Terry: -log sigmoid(r_c - r_r" + (" - margin" if loss.margin else "") + ") (Ouyang et al. arXiv:2203.02155 eq. 1)",
        "margin": "each pair's `margin` column (Llama 2 §3.2.2)" if loss.margin else "none",
        "centering": loss.centering, "label_smoothing": loss.label_smoothing,
        "reduction": "mean over the batch's pairs (the centering term's batch mean, as TRL)",
        "head": f"Linear(H, 1) without bias, initialised N(0, {head_std:.4g}) = N(0, 1/sqrt(H + 1))",
        "pooling": "the decoder's final hidden state at each sequence's last attended token (the EOS appended), from the attention mask",
        "as_peers_spell_it": {"trl": f"RewardTrainer(center_rewards_coefficient={loss.centering or None}); a `margin` column",
                              "openrlhf": "train_rm --loss sigmoid" + (" --margin_loss" if loss.margin else "")},
        "lora_rank": lora_rank, "optimizer": {key: getattr(optim, key) for key in ("lr", "warmup_steps", "schedule", "weight_decay",
                                                                                  "betas", "max_grad_norm")},
    }
