"""The preference loss step: the DPO family on summed response log-probs of chosen and rejected
responses against a reference (live, or precomputed once), plus an optional NLL term on the chosen
responses (RPO), and KTO on unpaired rows. What each `loss.type` is, needs and reads is its entry in
`losses/objectives.PREFERENCE_OBJECTIVES`; `step` dispatches through it. The objectives themselves
are pure functions in `posttrain/algorithms/`. `loss_card` is the run card's loss link: the
objective and every setting of it, the reference, the optimizer.

    metrics = step(PreferenceModels(Trainable(trainer, optimizer, scheduler, max_grad_norm), reference),
                   batch, PreferenceSettings(loss, micro_batch_size), world)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from posttrain.algorithms import pair_columns, pair_metrics
from posttrain.data import PreferenceBatch
from posttrain.distributed import World, gradient_sync, rank_micro_batches, unwrap
from posttrain.errors import UserError
from posttrain.losses.objectives import PREFERENCE_OBJECTIVES, PreferenceObjective, objective
from posttrain.models.pair_forward import PairLogprobs, reference_sums
from posttrain.optim import Optimization, Trainable

REFERENCE_CACHE = "reference_logprobs.pt"
"""The precomputed reference's file in the run directory (`loss.reference: precomputed`)."""


@dataclass
class Loss:
    """Link 3, loss: the objective, beta, length handling, reference handling."""

    PRIMARY: ClassVar[dict[str, Any]] = {"type": PREFERENCE_OBJECTIVES}
    """What a value given to the section itself meant (`config._primary_hint`): `--loss kto` is --loss.type kto."""

    type: str = "sigmoid"
    """A name in `losses.objectives.PREFERENCE_OBJECTIVES`: sigmoid (DPO; cDPO with label_smoothing, unlike TRL's sigmoid) | conservative (cDPO) | robust | ipo (summed
    log-ratios) | hinge | length_normalized (token-mean objective, TRL's sigmoid_norm) | length_normalized_ipo
    (token-mean IPO, TRL's ipo) | simpo | cpo | orpo (reference-free: no reference model is loaded) | kto (unpaired
    rows: prompt, completion, label; a pairs file is read as one desirable and one undesirable row per pair)."""
    beta: float = 0.1
    """Inverse temperature of the implicit reward beta * (log pi - log pi_ref); simpo: of beta x mean log pi (the paper: 2.5); orpo: its lambda (TRL's beta)."""
    gamma_ratio: float = 0.55
    """simpo: the target margin as gamma / beta (the paper's ratio; the card states the absolute gamma, TRL's simpo_gamma)."""
    desirable_weight: float = 1.0
    """kto: w_d, the weight of a desirable row's loss (TRL's desirable_weight)."""
    undesirable_weight: float = 1.0
    """kto: w_u, the weight of an undesirable row's loss; choose both so w_d x n_d / (w_u x n_u) is in [1, 4/3] (the run warns otherwise)."""
    label_smoothing: float = 0.0
    """Assumed label-flip rate (sigmoid, conservative: > 0, robust)."""
    nll_weight: float | None = None
    """Weight of the token-mean NLL of the chosen responses: RPO (arXiv:2404.19733) on a DPO loss; CPO's and ORPO's own term. None: 1.0 for cpo and orpo, else 0 (off)."""
    reference: Literal["live", "precomputed"] = "live"
    """live: a frozen copy (or, with LoRA, the base with adapters off); precomputed: one pass at start, cached."""
    reference_refresh_every: int = 0
    """TR-DPO hard update (arXiv:2404.09656): copy the policy into the reference every N steps (0: never)."""

    def validate(self, lora_rank: int = 0) -> None:
        """One UserError line naming the `loss.*` field that is out of range or does not apply (what
        applies is the objective's entry in `PREFERENCE_OBJECTIVES`)."""
        entry = objective(self.type)
        if self.beta <= 0:
            raise UserError(f"loss.beta must be > 0, got {self.beta}")
        if self.nll_weight is None:  # resolved, so config.yaml holds the number
            self.nll_weight = entry.nll_weight or 0.0
        self._own_settings(entry)
        if min(self.desirable_weight, self.undesirable_weight) <= 0:
            raise UserError(f"loss.desirable_weight and loss.undesirable_weight must be > 0, got {self.desirable_weight}, {self.undesirable_weight}")
        if entry.nll_weight is None and self.nll_weight:
            reason = "" if entry.paired else " (its rows are not pairs with a chosen side)"
            raise UserError(f"loss.nll_weight does not apply to loss.type {self.type}{reason}; leave it unset")
        if self.gamma_ratio < 0:
            raise UserError(f"loss.gamma_ratio must be >= 0, got {self.gamma_ratio}")
        if not entry.needs_reference and (self.reference != "live" or self.reference_refresh_every):
            raise UserError(f"loss.type {self.type} uses no reference: leave loss.reference and loss.reference_refresh_every unset")
        if entry.label_smoothing == "refused" and self.label_smoothing:
            smoothed = [name for name, other in PREFERENCE_OBJECTIVES.items() if other.label_smoothing != "refused"]
            raise UserError(f"loss.label_smoothing applies to {', '.join(smoothed)}, not {self.type}")
        low = 1e-12 if entry.label_smoothing == "required" else 0.0
        if not low <= self.label_smoothing < 0.5:
            raise UserError(f"loss.label_smoothing must be in {'(0' if low else '[0'}, 0.5) for {self.type}, got {self.label_smoothing}")
        if self.nll_weight < 0 or self.reference_refresh_every < 0:
            raise UserError("loss.nll_weight and loss.reference_refresh_every must be >= 0")
        if self.reference_refresh_every and self.reference == "precomputed":
            raise UserError("loss.reference_refresh_every needs a live reference (loss.reference: live)")
        if self.reference_refresh_every and lora_rank:
            raise UserError("loss.reference_refresh_every: a LoRA reference is the base model and cannot be refreshed")

    def _own_settings(self, entry: PreferenceObjective) -> None:
        """Refuse another objective's own setting changed from its default (`PreferenceObjective.settings`)."""
        for other in PREFERENCE_OBJECTIVES.values():
            changed = [name for name in other.settings if name not in entry.settings and getattr(self, name) != getattr(Loss, name)]
            if changed:
                fields = " and ".join(f"loss.{name}" for name in other.settings)
                verb = "apply" if len(other.settings) > 1 else "applies"
                raise UserError(f"{fields} {verb} to loss.type {other.name} only (this run: {self.type})")

    @property
    def objective(self) -> PreferenceObjective:
        """This section's entry in `PREFERENCE_OBJECTIVES`."""
        return objective(self.type)


@dataclass
class PreferenceModels:
    """What a preference step moves and reads: the policy (its `Trainable`, whose trainer is a
    `TrainingForward` over `pair_logprobs`, possibly in DDP / FSDP2) and the live reference (a
    `ReferenceModel`; None when the reference log-probs are precomputed)."""

    policy: Trainable
    reference: Any = None


@dataclass(frozen=True)
class PreferenceSettings:
    """What a preference step reads besides the models and the batch: the loss section and the
    micro-batch size (at most that many rows per forward/backward)."""

    loss: Loss
    micro_batch_size: int


def preference_losses(loss: Loss, policy: PairLogprobs, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor):
    """Per-pair losses and implicit rewards of the configured objective (its entry's `losses`); each
    (M,). A reference-free objective reads the policy's sums alone (the reference's are zeros)."""
    return loss.objective.losses(loss, policy, ref_chosen, ref_rejected)


def step_metrics(columns: torch.Tensor, nll: float, nll_weight: float) -> dict[str, float]:
    """The logged means of (7, M) `pair_columns`, with loss = preference loss + nll_weight * nll."""
    means = {key: float(value) for key, value in pair_metrics(columns).items()}
    return {"loss": means["loss/preference"] + (nll_weight or 0.0) * nll, "loss/preference": means["loss/preference"], "loss/nll": nll, **means}


def step(models: PreferenceModels, batch: PreferenceBatch, settings: PreferenceSettings, world: World | None = None) -> dict[str, float]:
    """One optimizer step of the objective `settings.loss.type` names: its entry's own step (KTO's on
    unpaired rows), else `pair_step`. Returns the step's metrics, with "grad_norm" (pre-clipping)."""
    return (settings.loss.objective.step or pair_step)(models, batch, settings, world)


def pair_step(models: PreferenceModels, batch: PreferenceBatch, settings: PreferenceSettings, world: World | None = None) -> dict[str, float]:
    """One optimizer step on a batch of M pairs: forward/backward over micro-batches of at most
    `settings.micro_batch_size` pairs, then clip and step. The loss is the batch mean of the per-pair
    losses (the objective's `losses`) plus nll_weight * the batch's chosen-token-mean NLL,
    normalised by the whole batch's counts, so the gradient does not depend on the micro-batch size
    or the world size. The reference log-probs are `batch.reference` ((M, 2) chosen / rejected sums,
    precomputed) or, when it is None, a forward of `models.reference`. Under torchrun each rank takes
    its block of the pairs, all ranks running as many micro-batches (a short rank a zero-weight one).
    Returns the step's metrics over the whole batch, with "grad_norm" (pre-clipping)."""
    world = world or World()
    loss = settings.loss
    trainer = models.policy.trainer
    forward = unwrap(trainer)
    M = batch.chosen.input_ids.shape[0]  # pairs (P is the prompt width everywhere else)
    chosen_tokens = batch.chosen.mask[:, 1:].sum().clamp(min=1)
    device = batch.chosen.input_ids.device
    parts, nll_total = [torch.zeros(7, 0, device=device)], torch.zeros(1, dtype=torch.float64, device=device)
    for rows, weight, last in rank_micro_batches(torch.arange(M), world.block_owners(M), world, settings.micro_batch_size):
        ref_chosen, ref_rejected = reference_sums(models.reference, batch, rows, forward)
        with gradient_sync(trainer, last):
            sums = trainer(batch, rows)
            losses, chosen_rewards, rejected_rewards = preference_losses(loss, sums, ref_chosen, ref_rejected)
            nll = -sums.chosen.sum() / chosen_tokens  # RPO term: this micro-batch's share of the batch token mean
            total = losses.sum() / M + (loss.nll_weight * nll if loss.nll_weight else 0.0)
            (total * (weight * world.size)).backward()  # DDP / FSDP2 average gradients over ranks
        if weight:
            nll_total += nll.detach().double()
            parts.append(pair_columns(losses, chosen_rewards, rejected_rewards, sums.chosen, sums.rejected, ref_chosen, ref_rejected))
    columns = torch.cat(parts, dim=1)
    if world.active:  # through the CPU: a pickled CUDA tensor would unpickle onto the sender's GPU
        columns = torch.cat([part.to(device) for part in world.gather(columns.cpu())], dim=1)
    metrics = step_metrics(columns, float(world.reduce(nll_total)), loss.nll_weight)
    metrics["grad_norm"] = models.policy.step()
    return metrics


def loss_card(loss: Loss, reference: Any, lora_rank: int, optim: Optimization) -> dict[str, Any]:
    """The run card's loss link: the objective (its entry's card text and settings) and every
    setting of `loss`, the reference (`reference`: a live `ReferenceModel`, whose `adapter_disabled`
    says it is the LoRA base, or None when precomputed into `REFERENCE_CACHE`; `lora_rank` > 0: from
    the LoRA base) and the optimizer section `optim`, in full."""
    entry = loss.objective
    if not entry.needs_reference:
        reference_text = "none: the objective uses no reference (no reference model loaded, no reference forward)"
    elif reference is None:
        reference_text = "precomputed once at the start from the initial policy" + (" (LoRA base)" if lora_rank else "") + f", cached in {REFERENCE_CACHE}; no reference model in memory"
    elif reference.adapter_disabled:
        reference_text = "LoRA base (the policy with adapters disabled; no copy)"
    else:
        reference_text = "frozen copy of the initial policy"
    return {
        "objective": entry.card, "type": loss.type, "beta": loss.beta, "label_smoothing": loss.label_smoothing,
        **entry.describe(loss),
        "sequence_logprob": "sum over response tokens (prompt and padding masked, the ending EOS counted)",
        "length_handling": "per-token mean log-probs (length-normalised objective)" if entry.length_normalized else "none: summed log-probs",
        "nll_weight": loss.nll_weight,
        "nll_term": ("off" if not loss.nll_weight else f"{loss.type.upper()}'s own term: weight * token-mean NLL of the chosen responses"
                     if entry.nll_weight else "RPO: weight * token-mean NLL of the chosen responses (arXiv:2404.19733)"),
        "reference": reference_text, "reference_refresh_every": loss.reference_refresh_every,
        "reference_refresh": "TR-DPO hard update: the reference becomes the current policy (arXiv:2404.09656)" if loss.reference_refresh_every else "never",
        "forward": entry.forward_text, "reduction": entry.reduction,
        "optimizer": dataclasses.asdict(optim),
    }
