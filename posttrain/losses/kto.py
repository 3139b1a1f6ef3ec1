"""The KTO loss step (Ethayarajh et al., arXiv:2402.01306): unpaired completions, each desirable or
undesirable, against a reference point z0 estimated from mismatched (prompt, completion) pairs. The
objective is `algorithms.kto_loss`; the rows are `data.unpaired` pairs (chosen = the row's
completion, rejected = its mismatched completion, the label beside).

One step: 1. z0 = max(0, mean over the WHOLE batch of the policy's minus the reference's summed
log-prob of the mismatched completions), without gradient (as the paper and TRL), all-reduced under
torchrun; 2. forward/backward of the rows' own completions in micro-batches, the loss the batch mean
of the per-row losses. The gradient therefore does not depend on micro_batch_size or the world size
(TRL's z0 is per micro-batch). The policy's mismatched forward takes no gradient, as TRL's.
The held-out rows are scored by `evaluation.preference.evaluate_unpaired` with the same metrics.

    metrics = step(models, batch, settings, world)   # batch.desirable: the (M,) labels
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.algorithms import KTO_CLASS_BALANCE_BAND, kto_class_balance, kto_loss
from posttrain.data import PreferenceBatch
from posttrain.distributed import World, gradient_sync, rank_micro_batches, unwrap
from posttrain.models.forward import batch_response_sums
from posttrain.models.pair_forward import reference_sums

PLOTTED = ("loss", "kl", "rewards/accuracy", "rewards/desirable", "rewards/undesirable", "logratio/desirable",
           "logratio/undesirable", "heldout/label_side_accuracy", "heldout/pass@1")
"""What a KTO run plots: its rows are unpaired, so desirable / undesirable instead of chosen / rejected."""
KTO_COLUMNS = ("loss", "reward", "logratio", "mismatched_logratio", "logps", "label")
"""The per-row values a step keeps (`kto_columns`), one row each of a (6, M) tensor."""


def side_sums(model, batch: PreferenceBatch, rows: torch.Tensor, side: str, full_forward: bool = False) -> torch.Tensor:
    """(n,) summed response log-probs of `rows` of one side of `batch` (`"chosen"`: the rows' own
    completions; `"rejected"`: their mismatched ones) through `model`: the trainer's function for KTO."""
    return batch_response_sums(model, getattr(batch, side), rows, full_forward)


def kto_columns(losses: torch.Tensor, rewards: torch.Tensor, logratios: torch.Tensor, mismatched: torch.Tensor,
                logps: torch.Tensor, desirable: torch.Tensor) -> torch.Tensor:
    """(6, n) detached per-row values in `KTO_COLUMNS` order, so micro-batches and ranks concatenate
    along dim 1 before `kto_metrics`. Args: each (n,)."""
    return torch.stack([losses.detach(), rewards.detach(), logratios.detach(), mismatched.detach(), logps.detach(),
                        desirable.to(losses.dtype)])


def kto_metrics(columns: torch.Tensor, reference_point: float) -> dict[str, float]:
    """The logged means of (6, M) `kto_columns`: loss, kl (z0), rewards/desirable and
    rewards/undesirable (beta x log-ratio, each over its class; absent when the batch has none),
    rewards/margins (their difference), logratio/* and logps/* per class, rewards/accuracy: the
    fraction of rows on their label's side of z0 (desirable r > z0, undesirable r < z0; a row at z0
    is wrong, so policy == reference gives 0), and rewards/ties: the fraction of rows at z0.
    Example: log-ratios [1.0, -0.2, 0.1], labels [desirable, undesirable, desirable], z0 0.1:
    accuracy 2/3, ties 1/3."""
    losses, rewards, logratios, _mismatched, logps, label = columns
    desirable = label > 0.5
    right = torch.where(desirable, logratios > reference_point, logratios < reference_point)
    metrics = {"loss": float(losses.mean()), "kl": reference_point, "rewards/accuracy": float(right.float().mean()),
               "rewards/ties": float((logratios == reference_point).float().mean()), "rows/desirable": float(desirable.float().mean())}
    for name, chosen in (("desirable", desirable), ("undesirable", ~desirable)):
        if chosen.any():
            metrics.update({f"rewards/{name}": float(rewards[chosen].mean()), f"logratio/{name}": float(logratios[chosen].mean()),
                            f"logps/{name}": float(logps[chosen].mean())})
    if desirable.any() and (~desirable).any():
        metrics["rewards/margins"] = metrics["rewards/desirable"] - metrics["rewards/undesirable"]
    return metrics


def step(models, batch: PreferenceBatch, settings, world: World | None = None) -> dict[str, float]:
    """One KTO optimizer step on M rows. `models`: a `PreferenceModels` whose trainer is a
    `TrainingForward` over `side_sums`; `batch`: M `data.unpaired` rows (chosen = completion,
    rejected = mismatched completion) with their (M,) `desirable` labels and, when precomputed, the
    reference's (M, 2) completion and mismatched sums in `reference` (else a forward of
    `models.reference`); `settings`: a `PreferenceSettings` (the loss section: beta,
    desirable_weight, undesirable_weight; the micro-batch size). Returns the step's metrics over
    the whole batch (`kto_metrics`), with "grad_norm" (pre-clipping)."""
    world = world or World()
    trainer = models.policy.trainer
    forward = unwrap(trainer)
    M = batch.chosen.input_ids.shape[0]
    device = batch.chosen.input_ids.device
    desirable, loss = batch.desirable.to(device), settings.loss
    micro = list(rank_micro_batches(torch.arange(M), world.block_owners(M), world, settings.micro_batch_size))
    # 1. The reference point over the whole batch, before any backward: no gradient, as in the paper and TRL.
    references, mismatched, total = [], [], torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for rows, weight, _ in micro:
            ref_own, ref_mismatched = reference_sums(models.reference, batch, rows, forward)
            ratio = trainer(batch, rows, "rejected").float() - ref_mismatched.float()
            references.append(ref_own)
            mismatched.append(ratio)
            if weight:
                total += torch.stack([ratio.double().sum(), torch.tensor(float(len(rows)), dtype=torch.float64, device=device)])
    total = world.reduce(total)
    mean_mismatched = (total[0] / total[1]).float().reshape(1)
    # 2. The rows' own completions, with gradient; the loss is the batch mean, however it is split.
    parts = [torch.zeros(len(KTO_COLUMNS), 0, device=device)]
    reference_point = 0.0
    for (rows, weight, last), ref_own, ratio_mismatched in zip(micro, references, mismatched):
        with gradient_sync(trainer, last):
            sums = trainer(batch, rows, "chosen")
            logratios = sums - ref_own
            losses, rewards, point = kto_loss(logratios, mean_mismatched, desirable[rows], beta=loss.beta,
                                              desirable_weight=loss.desirable_weight, undesirable_weight=loss.undesirable_weight)
            (losses.sum() / M * (weight * world.size)).backward()  # DDP / FSDP2 average gradients over ranks
        reference_point = float(point)
        if weight:
            parts.append(kto_columns(losses, rewards, logratios, ratio_mismatched, sums, desirable[rows]))
    columns = torch.cat(parts, dim=1)
    if world.active:  # through the CPU: a pickled CUDA tensor would unpickle onto the sender's GPU
        columns = torch.cat([part.to(device) for part in world.gather(columns.cpu())], dim=1)
    metrics = kto_metrics(columns, reference_point)
    metrics["grad_norm"] = models.policy.step()
    return metrics


def class_balance(desirable: int, undesirable: int, loss) -> dict[str, Any]:
    """The card's class-balance entry of a KTO run on `desirable` and `undesirable` training rows:
    the weighted ratio (`kto_class_balance`), TRL's recommended band, whether it is inside, and
    when not a `warning` naming the weights that would bring it in."""
    low, high = KTO_CLASS_BALANCE_BAND
    entry: dict[str, Any] = {"desirable": desirable, "undesirable": undesirable, "desirable_weight": loss.desirable_weight,
                             "undesirable_weight": loss.undesirable_weight, "band": [low, round(high, 6)]}
    if not desirable or not undesirable:
        missing, present = ("desirable", "undesirable") if not desirable else ("undesirable", "desirable")
        entry.update(ratio=None, in_band=False, warning=f"KTO: the training rows have no {missing} completion; only the {present} term trains")
        return entry
    ratio = kto_class_balance(desirable, undesirable, loss.desirable_weight, loss.undesirable_weight)
    entry.update(ratio=ratio, in_band=low <= ratio <= high)
    if not entry["in_band"]:
        lo_w = loss.desirable_weight * desirable / (high * undesirable)
        hi_w = loss.desirable_weight * desirable / (low * undesirable)
        entry["warning"] = (f"KTO class balance: desirable_weight x {desirable} desirable / (undesirable_weight x {undesirable} "
                            f"undesirable) = {ratio:.3f}, outside the recommended [{low:g}, {high:.3f}] (arXiv:2402.01306 eq. 8, "
                            f"TRL's KTO docs); loss.undesirable_weight in [{lo_w:.3f}, {hi_w:.3f}] brings it in")
    return entry
