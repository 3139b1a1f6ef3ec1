"""The policy-gradient loss step, whole: `prepare` turns a sampled and scored batch into what the
update reads (the old / reference log-probs and the critic's values from no-grad forwards, the KL
in the reward when placed there, the advantages of `loss.advantage`'s entry in
`algorithms/estimators.py`), and `step` runs the update: the surrogate (`loss.surrogate`, an entry
of `algorithms/surrogates.py`: PPO's clipped ratio, GSPO, CISPO) against the proximal policy (the old
log-probs) or, under `loss.off_policy.objective behaviour`, the behaviour policy (the sampler's
log-probs), times the decoupled objective's importance weight pi_prox / pi_behav when a stale batch
asks for it (`loss.off_policy`, `algorithms/importance.py`) or truncated importance sampling, the KL
term in the loss, the entropy bonus (`loss.entropy`) and a critic's clipped value loss, and measures the exact KL to the reference
before it and the sampler-trainer mismatch.

`step` runs `update.epochs` passes over `update.mini_batches` mini-batches, one optimizer step each,
with the old log-probs fixed. Sampling and scoring the batch, and the run around the step (the
reference's refresh, the learning rates, logging) are the recipe's (`posttrain/recipes/online.py`);
the tensor math is `posttrain/algorithms/`.

    models = PolicyModels(Trainable(trainer, optimizer, scheduler, max_grad_norm), policy, reference, critic, placement)
    update_batch, metrics = prepare(models, scored_batch, settings, world)
    metrics |= step(models, update_batch, settings, world)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.algorithms import aggregate, clipped_value_loss, exact_kl, kl_estimate, masked_mean, sampler_mismatch
from posttrain.algorithms import effective_sample_size, importance_weights, truncated_importance_weights
from posttrain.algorithms.distill import reverse_kl_per_token, teacher_token_rewards
from posttrain.algorithms.estimators import ADVANTAGE_ESTIMATORS, StepRewards
from posttrain.algorithms.surrogates import SURROGATES
from posttrain.data.scored_batch import ScoredBatch
from posttrain.distributed import World, gradient_sync, rank_micro_batches
from posttrain.errors import UserError
from posttrain.hardware import Placement, cpu_placement
from posttrain.losses.policy_gradient_config import OffPolicy, OffPolicyObjective, off_policy_objective, precomputes_old
from posttrain.models.forward import CompletionScores, LogitTap, completion_values, rank_logprobs
from posttrain.optim import Trainable, clip_groups_and_step

SUMMED = ("loss", "value_loss", "clip/value", "ratio", "kl", "entropy", "tokens", "tis/weight", "tis/capped",
          "offpolicy/weight", "offpolicy/weight_sq", "offpolicy/units", "offpolicy/truncated", "offpolicy/masked")
"""The per-step sums `step` accumulates on the device (float64) and reduces over ranks once,
beside the surrogate's own fractions (`Surrogate.fractions`: clip/low, clip/high, clip/dual)."""


@dataclass
class PolicyModels:
    """What the step moves and reads: the policy's `Trainable` (its trainer a `TrainingForward`
    over `policy_scores`, or over `policy_and_critic` with the optimizer's groups [policy, critic]),
    the policy model itself (its no-grad forwards: old log-probs, the exact KL), the frozen reference
    (None: no KL), the critic (None: no values) and the placement (device, precision) of the no-grad
    forwards."""

    policy: Trainable
    policy_model: Any
    reference: Any = None
    critic: Any = None
    placement: Placement = field(default_factory=cpu_placement)

    @property
    def has_critic(self) -> bool:
        return self.critic is not None


@dataclass
class UpdateBatch:
    """One step's rollouts and what `prepare` computed from them before the update.

    Shapes: mask (N, T) bool (the tokens that reach the loss); advantages (N,) per sequence or (N, T)
    per token; owners (N,) the rank each row belongs to; old_logprobs, ref_logprobs, old_values,
    returns (N, T) or None (old None: the detached on-policy log-probs, ratio exactly 1)."""

    rollout: Any
    mask: torch.Tensor
    advantages: torch.Tensor
    owners: torch.Tensor
    seed: int
    """Seeds the mini-batches' row order (derive it from the run's seed and step)."""
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    exact_kl: ExactKL | None = None


@dataclass
class ExactKL:
    """Where the exact KL to the reference is measured (each rank: the first `exact_kl_tokens`
    counted tokens of its own rows, in row order) and both models' logits there, kept from forwards
    the step runs anyway: the reference's no-grad forward in `prepare`; the policy's no-grad forward
    of the old log-probs when there is one, else the update's own forward (then one optimizer step
    follows every forward: the policy before the update either way)."""

    reference: LogitTap
    policy: LogitTap

    @classmethod
    def at(cls, mask: torch.Tensor, owners: torch.Tensor, world: World, max_tokens: int) -> ExactKL:
        """The first `max_tokens` True positions of `mask` (N, T) in this rank's rows (`owners` (N,))."""
        mine = (owners == world.rank).nonzero().squeeze(1)
        positions = mask[mine].nonzero()[:max_tokens]  # (k, 2), row-major
        rows, columns = mine[positions[:, 0]], positions[:, 1]
        return cls(LogitTap(rows, columns), LogitTap(rows, columns))

    def value(self, temperature: float, world: World) -> float | None:
        """Exact KL(policy || reference) per token over every rank's positions (None: no positions)."""
        total = torch.zeros(2, dtype=torch.float64, device=self.reference.rows.device)
        if self.policy.logits is not None and self.reference.logits is not None:
            kl = exact_kl(self.policy.logits, self.reference.logits, temperature=temperature)
            total += torch.stack([kl.sum().double(), kl.new_tensor(kl.numel(), dtype=torch.float64)])
        kl_sum, count = world.reduce(total).tolist()
        return kl_sum / count if count else None


@dataclass(frozen=True)
class UpdateSettings:
    """The sections the step reads: the loss (estimator, surrogate, clip, aggregation, KL, sampler
    correction, off-policy objective), the update (epochs, mini-batches, micro-batches), the critic
    (value clip and weight), the sampling temperature of the log-probs, the completion budget (the
    Dr. GRPO normaliser), the group size G, the seed of this step's mini-batch order, the tokens the
    exact KL is measured on (0: none), whether this step trains the critic only (critic warm-up: the
    policy gets no gradient), and how many steps old the run's batches may be (`objective` resolves
    `loss.off_policy.objective` from it)."""

    loss: Any
    update: Any
    critic: Any
    temperature: float
    max_length: int
    group_size: int
    minibatch_seed: int
    """Seeds this step's mini-batch row order (the recipe derives it from the run's seed and step)."""
    exact_kl_tokens: int = 0
    critic_only: bool = False
    max_staleness: int = 0
    """k (`data.max_staleness`): the batch may have been sampled by weights up to k training steps old (0:
    on-policy); `objective` resolves `loss.off_policy.objective` from it."""

    @property
    def objective(self) -> OffPolicyObjective:
        """`loss.off_policy.objective` resolved (`off_policy_objective`): the proximal, decoupled or behaviour entry."""
        return off_policy_objective(self.loss, self.max_staleness)


def loss_rows(batch: ScoredBatch, mask_truncated: bool) -> torch.Tensor:
    """(N,) bool: the rows whose tokens reach the loss: scored, and not truncated under `loss.mask_truncated`."""
    return batch.valid & ~batch.rollout.truncated if mask_truncated else batch.valid


def prepare(models: PolicyModels, batch: ScoredBatch, settings: UpdateSettings, world: World) -> tuple[UpdateBatch, dict[str, Any]]:
    """What the update reads of a sampled and scored batch (on the models' device): the old and
    reference log-probs and the critic's values (no-grad forwards, each rank on its own rows), the
    KL in the reward when placed there, a dense reward's token rewards against the student's log-probs
    before the update (`dense_rewards`: a teacher's, `batch.scores.dense`; the old log-probs when the loss
    fixes them, else a no-grad forward of the reward's own, so the loss link is the same with or without a
    teacher), and the advantages of `loss.advantage`'s estimator.

    Returns (the `UpdateBatch`, the metrics measured before the update: the estimator's own, the
    rollout's kl/estimate for estimators that measure it there, advantages/abs_mean for
    per-sequence advantages)."""
    loss, rollout = settings.loss, batch.rollout
    if settings.objective.reads_behaviour and rollout.sampling.greedy:
        raise UserError(f"loss.off_policy.objective {settings.objective.name} needs sampled rollouts "
                        "(sampling.greedy is true: there is no behaviour distribution)")
    estimator = ADVANTAGE_ESTIMATORS[loss.advantage]
    mask = rollout.mask & loss_rows(batch, loss.mask_truncated)[:, None]  # (N, T): the tokens that reach the loss
    metrics: dict[str, Any] = {}
    probe = ExactKL.at(mask, batch.owners, world, settings.exact_kl_tokens) if models.reference and settings.exact_kl_tokens > 0 else None
    with models.placement.autocast():
        old_logprobs, ref_logprobs, old_values = rollout_forwards(models, batch, mask, settings, world, probe)
    token_rewards = None
    if batch.scores.dense:  # a teacher's log-probs against the student's before the update (the old ones when the loss fixes them)
        student = old_logprobs
        if student is None:
            with models.placement.autocast():
                student = rank_logprobs(models.policy_model, rollout, batch.owners, world, settings.temperature,
                                        settings.update.micro_batch_size)
        token_rewards = dense_rewards(batch.scores.dense, student, mask, metrics)
    in_reward = ref_logprobs is not None and loss.kl.placement == "reward"
    rollout_kl = ref_logprobs is not None and (in_reward or estimator.kl_metric == "rollout")
    kl = kl_estimate(old_logprobs, ref_logprobs, loss.kl.estimator) if rollout_kl else None
    if estimator.kl_metric == "rollout":
        metrics["kl/estimate"] = float(masked_mean(kl, mask)) if kl is not None else None
    estimate = estimator.estimate(
        StepRewards(batch.scores.rewards, mask, rollout.mask, settings.group_size, kl=kl,
                    kl_beta=loss.kl.beta if in_reward else 0.0, values=old_values, token_rewards=token_rewards),
        **loss.estimator_settings())
    metrics.update({name: None if math.isnan(value) else float(value) for name, value in estimate.metrics.items()})
    if not estimator.per_token:
        metrics["advantages/abs_mean"] = float(masked_mean(estimate.advantages.abs()[:, None].expand_as(mask), mask))
    return UpdateBatch(rollout, mask, estimate.advantages, batch.owners, seed=settings.minibatch_seed, old_logprobs=old_logprobs,
                       ref_logprobs=ref_logprobs, old_values=old_values, returns=estimate.returns, exact_kl=probe), metrics


def dense_rewards(terms: list, student_logprobs: torch.Tensor, mask: torch.Tensor, metrics: dict[str, Any]) -> torch.Tensor:
    """(N, T) the per-token rewards of a reward's dense terms (`Scores.dense`: each a teacher's
    log-probs of the sampled tokens and its weight) against the student's log-probs before the
    update (`algorithms.distill.teacher_token_rewards`), summed over the terms; adds to `metrics`
    each term's `distill/reverse_kl` (the mean per-token k1 estimate of KL(student || teacher)) and
    `distill/teacher_logprob` (the teacher's mean log-prob of the sampled tokens), suffixed by the
    term's name when there are several."""
    total = torch.zeros(mask.shape, device=mask.device)
    for term in terms:
        suffix = f"/{term.name}" if len(terms) > 1 else ""
        total = total + teacher_token_rewards(term.logprobs, student_logprobs, mask, term.weight)
        kl = reverse_kl_per_token(term.logprobs, student_logprobs, mask)
        metrics[f"distill/reverse_kl{suffix}"] = None if math.isnan(float(kl)) else float(kl)
        metrics[f"distill/teacher_logprob{suffix}"] = float(masked_mean(term.logprobs.float(), mask))
    return total


def rollout_forwards(models: PolicyModels, batch: ScoredBatch, mask: torch.Tensor, settings: UpdateSettings, world: World,
                     probe: ExactKL | None = None):
    """The no-grad forwards before the update, each rank on its own rows: the old log-probs (None
    when not precomputed: `precomputes_old`), the reference's (None without one) and, with a
    critic, its values; each (N, T). `probe` keeps the reference's logits at its positions (and the
    policy's, when the old log-probs are precomputed)."""
    rollout, temperature, micro = batch.rollout, settings.temperature, settings.update.micro_batch_size
    precomputed = precomputes_old(settings.loss, settings.update)
    old_logprobs = None
    if precomputed:
        old_logprobs = rank_logprobs(models.policy_model, rollout, batch.owners, world, temperature, micro,
                                     tap=probe.policy if probe else None)
    ref_logprobs = None
    if models.reference:
        ref_logprobs = rank_logprobs(models.reference, rollout, batch.owners, world, temperature, micro,
                                     tap=probe.reference if probe else None)
    old_values = None
    if models.critic is not None:
        inputs, P, T = rollout.forward_inputs(), rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
        mine = (batch.owners == world.rank).nonzero().squeeze(1)
        old_values = torch.zeros(mask.shape, device=mask.device)
        if len(mine):
            old_values[mine] = completion_values(models.critic, inputs, P, T, micro, rows=mine)
        old_values = world.reduce(old_values)
    return old_logprobs, ref_logprobs, old_values


def step(models: PolicyModels, batch: UpdateBatch, settings: UpdateSettings, world: World) -> dict[str, Any]:
    """The update on a prepared batch (the epochs of mini-batches, one optimizer step each), with
    two measures of the policy before it: the exact KL to the reference (`ExactKL`, on
    `settings.exact_kl_tokens` tokens, from the logits the forwards kept) and the sampler-trainer
    mismatch: the rollout engine's log-probs of the sampled tokens vs the training forward's (the
    precomputed old log-probs, else the first forward's). Returns the step's named metrics (floats)."""
    metrics: dict[str, Any] = {}
    update_metrics, first_logprobs = _update(models, batch, settings, world)
    if batch.exact_kl is not None:
        metrics["kl/exact"] = batch.exact_kl.value(settings.temperature, world)
    trainer_logprobs = batch.old_logprobs if batch.old_logprobs is not None else first_logprobs
    mismatch = sampler_mismatch(trainer_logprobs, batch.rollout.logprobs, batch.mask)
    metrics.update({f"mismatch/{name}": float(value) for name, value in mismatch.items()})
    metrics.update(update_metrics)
    return metrics


def _update(models: PolicyModels, batch: UpdateBatch, settings: UpdateSettings, world: World) -> tuple[dict[str, Any], torch.Tensor]:
    """`epochs` passes over `mini_batches` mini-batches, each accumulated over micro-batches with
    the mini-batch's global token and sequence counts, so the gradient does not depend on the
    micro-batch size or the world size; one clipped optimizer step per mini-batch (each parameter
    group clipped on its own). With a critic the loss is the policy loss + value_coef x the
    (clipped) value loss; during critic warm-up only the value loss. Mini-batches are drawn over
    the global batch; each rank forwards the rows it owns (`batch.owners`), all ranks running
    equally many micro-batches with the gradient synced on the last.

    Returns (the update's metrics summed over ranks, the (N, T) log-probs of each row's first
    forward, detached and summed over ranks: with no old log-probs these are the trainer's before
    the update, for the sampler-trainer mismatch)."""
    update, mask = settings.update, batch.mask
    N, T = batch.rollout.completion_ids.shape
    inputs = batch.rollout.forward_inputs()
    surrogate = SURROGATES[settings.loss.surrogate]
    sums = {name: torch.zeros((), dtype=torch.float64, device=mask.device) for name in SUMMED + tuple(m for m, _ in surrogate.fractions)}
    extremes = torch.full((3,), float("inf"), dtype=torch.float64, device=mask.device)  # (min ratio, -max ratio, -max weight)
    first_logprobs = torch.zeros(N, T, device=mask.device)
    grad_norms, scale = [], update.epochs * update.mini_batches
    generator = torch.Generator().manual_seed(batch.seed)
    for epoch in range(update.epochs):
        order = torch.randperm(N, generator=generator) if update.mini_batches > 1 else torch.arange(N)
        # Exactly `mini_batches` optimizer steps even when dynamic sampling left the batch short.
        for mini in torch.tensor_split(order, update.mini_batches):
            if len(mini) == 0:
                continue
            global_tokens = mask[mini].sum()
            for rows, weight, last in rank_micro_batches(mini, batch.owners, world, update.micro_batch_size):
                micro = _Micro(rows, mask[rows] & bool(weight), global_tokens, len(mini))
                with gradient_sync(models.policy.trainer, last):
                    result = _micro_loss(models.policy.trainer, batch, inputs, micro, settings)
                    # DDP and FSDP2 average gradients over ranks; the loss is a share of a global sum.
                    (result.loss * (weight * world.size) + result.anchor).backward()
                for name, value in result.sums.items():
                    sums[name] += weight * value / scale if name == "value_loss" else value
                sums["loss"] += weight * result.loss.detach().double() / scale
                sums["tokens"] += micro.mask.sum().double()
                extremes = _add_token_stats(sums, extremes, result, micro, settings)  # after backward: its activations are freed
                if epoch == 0 and weight:  # every row is in exactly one micro-batch of an epoch
                    first_logprobs[rows] = result.logprobs.detach()
                    if batch.exact_kl is not None and batch.old_logprobs is None:  # no old forward: this one is before the update
                        batch.exact_kl.policy.take(rows, result.scores.logits_at)
            grad_norms.append(_optimizer_step(models.policy, settings.critic_only))
    # An estimator that measures the KL on the rollout (`prepare`) reports that one, not the update's.
    kl_in_update = batch.ref_logprobs is not None and ADVANTAGE_ESTIMATORS[settings.loss.advantage].kl_metric == "update"
    present = {"kl"} if kl_in_update else set()
    present |= {"critic"} if models.has_critic else set()
    present |= {"tis"} if settings.loss.sampler_correction == "tis" else set()
    present |= {"offpolicy"} if settings.objective.weighted else set()
    metrics = _step_metrics(sums, extremes, grad_norms, world, present, [name for name, _ in surrogate.fractions])
    if settings.loss.entropy.coef > 0:
        metrics["entropy/bonus"] = settings.loss.entropy.coef * metrics["entropy"]
    if models.has_critic:
        metrics["critic_only"] = settings.critic_only
    return metrics, world.reduce(first_logprobs.masked_fill(~mask, 0.0))


@dataclass(frozen=True)
class _Micro:
    """One micro-batch of a mini-batch: its rows, their tokens that reach the loss (none for a
    zero-weight stand-in), and the mini-batch's global token and sequence counts."""

    rows: torch.Tensor
    mask: torch.Tensor
    global_tokens: torch.Tensor
    global_sequences: int


@dataclass
class _MicroLoss:
    """A micro-batch's forward: its loss, the zero term that keeps every parameter in the graph
    (with a critic DDP waits for all of them), its (n, T) log-probs, the forward's `CompletionScores`
    (entropies, logits at chosen positions), the surrogate's per-token statistics, its detached float64
    sums over the counted tokens and the largest importance weight of the decoupled objective (-inf: none)."""

    loss: torch.Tensor
    anchor: Any
    logprobs: torch.Tensor
    scores: CompletionScores
    stats: dict[str, torch.Tensor]
    sums: dict[str, torch.Tensor]
    weight_max: torch.Tensor | None = None


def _micro_loss(trainer, batch: UpdateBatch, inputs: dict[str, torch.Tensor], micro: _Micro, settings: UpdateSettings) -> _MicroLoss:
    """One micro-batch's forward and loss: the surrogate against the proximal policy (the old
    log-probs; the behaviour policy's under objective behaviour), with the decoupled objective's or
    TIS's weights, the KL in the loss and the entropy bonus when configured, aggregated with the
    mini-batch's normalisers, plus the critic's value loss."""
    loss_cfg, critic_cfg, rows, mask = settings.loss, settings.critic, micro.rows, micro.mask
    P, T = batch.rollout.prompt_ids.shape[1], batch.rollout.completion_ids.shape[1]
    scores = trainer(inputs, rows, P, T, batch.rollout.completion_ids[rows], settings.temperature,
                     entropy_grad=loss_cfg.entropy.coef > 0, score_mask=batch.rollout.mask[rows], detach_hidden=settings.critic_only)
    logprobs, values = scores.logprobs, scores.values
    old = batch.old_logprobs[rows] if batch.old_logprobs is not None else logprobs.detach()  # the proximal policy's
    behaviour = batch.rollout.sampler_logprobs[rows]
    objective, surrogate = settings.objective, SURROGATES[loss_cfg.surrogate]
    # A surrogate that draws at random gets a seed of the step's and the micro-batch's: a rerun draws alike.
    seed = {"seed": (batch.seed * 1_000_003 + int(rows[0])) % 2**63} if surrogate.seeded and len(rows) else {}
    per_token, stats = surrogate.function(logprobs, behaviour if objective.ratio_to_behaviour else old,
                                          batch.advantages[rows], mask, **loss_cfg.surrogate_settings(), **seed)
    sums: dict[str, torch.Tensor] = {}
    weight_max = None
    if objective.weighted:  # the batch was drawn by an older policy: weight by pi_prox / pi_behav
        per_token, weight_max = _staleness_weighted(per_token, old, behaviour, mask, loss_cfg.off_policy, sums)
    if loss_cfg.sampler_correction == "tis":  # truncated importance sampling: the sampler drew these tokens, not the trainer's policy
        weights = truncated_importance_weights(old, behaviour, loss_cfg.sampler_correction_cap)
        per_token = per_token * weights
        sums["tis/weight"] = (weights * mask).sum().double()
        sums["tis/capped"] = ((weights >= loss_cfg.sampler_correction_cap) & mask).sum().double()
    if batch.ref_logprobs is not None:
        kl = kl_estimate(logprobs, batch.ref_logprobs[rows], loss_cfg.kl.estimator)
        if loss_cfg.kl.placement == "loss":
            per_token = per_token + loss_cfg.kl.beta * kl
        sums["kl"] = (kl.detach() * mask).sum().double()
    if loss_cfg.entropy.coef > 0:  # the bonus: - coef x H_t on the policy's own tokens, with its gradient
        per_token = per_token - loss_cfg.entropy.coef * scores.entropy
    normalisers = (micro.global_tokens, micro.global_sequences)
    loss = aggregate(per_token, mask, loss_cfg.aggregation, *normalisers, max_length=settings.max_length)
    if values is not None:
        value_per_token, value_clipped = clipped_value_loss(values, batch.old_values[rows], batch.returns[rows], critic_cfg.value_clip)
        value_loss = aggregate(value_per_token, mask, loss_cfg.aggregation, *normalisers, max_length=settings.max_length)
        loss = critic_cfg.value_coef * value_loss if settings.critic_only else critic_cfg.value_coef * value_loss + loss
        sums["value_loss"] = value_loss.detach().double()
        sums["clip/value"] = (value_clipped.float() * mask).sum().double()
    anchor = 0.0 * logprobs.sum() if values is not None else 0.0
    return _MicroLoss(loss, anchor, logprobs, scores, stats, sums, weight_max)


def _staleness_weighted(per_token: torch.Tensor, proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
                        off_policy: OffPolicy, sums: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoupled objective's weight (Hilton et al., arXiv:2110.00641): each token's surrogate
    x sg(pi_prox / pi_behav) through the importance rule. Adds the weights' sums over the counted
    units (`ImportanceWeights.units`: tokens, or rows at the sequence levels) and the truncated and
    masked tokens to `sums`. Shapes (n, T). Returns (the weighted per-token loss, the largest raw weight)."""
    correction = importance_weights(proximal, behaviour, mask, **off_policy.rule())
    units = correction.units(mask).double()
    sums["offpolicy/weight"] = units.sum()
    sums["offpolicy/weight_sq"] = (units ** 2).sum()
    sums["offpolicy/units"] = units.new_tensor(float(units.numel()))
    sums["offpolicy/truncated"] = (correction.truncated & mask).sum().double()
    sums["offpolicy/masked"] = (correction.masked & mask).sum().double()
    weight_max = units.max() if units.numel() else units.new_tensor(float("-inf"))
    return per_token * correction.weights, weight_max


def _add_token_stats(sums: dict, extremes: torch.Tensor, result: _MicroLoss, micro: _Micro, settings: UpdateSettings) -> torch.Tensor:
    """Add a micro-batch's surrogate fractions (`Surrogate.fractions`), ratios and entropy to
    `sums`; returns the updated (min ratio, -max ratio, -max importance weight) over its counted tokens."""
    stats, mask = result.stats, micro.mask
    for name, key in (*SURROGATES[settings.loss.surrogate].fractions, ("ratio", "ratio")):
        sums[name] += (stats[key].float() * mask).sum().double()
    sums["entropy"] += (result.scores.entropy.detach() * mask).sum().double()
    ratios = stats["ratio"].double()
    low = ratios.masked_fill(~mask, float("inf")).min()
    high = ratios.masked_fill(~mask, float("-inf")).max()
    weight_max = result.weight_max if result.weight_max is not None else high.new_tensor(float("-inf"))
    return torch.minimum(extremes, torch.stack([low, -high, -weight_max]))


def _optimizer_step(policy: Trainable, critic_only: bool) -> float:
    """One clipped optimizer step (each group on its own); returns the policy group's norm. During
    critic warm-up the policy's gradients are dropped first (AdamW skips parameters without one)."""
    if critic_only:
        for parameter in policy.optimizer.param_groups[0]["params"]:
            parameter.grad = None
    return clip_groups_and_step(policy.optimizer, policy.scheduler, policy.max_grad_norm)[0]


def _step_metrics(sums: dict, extremes: torch.Tensor, grad_norms: list[float], world: World, present: set[str],
                  fractions: list[str]) -> dict[str, Any]:
    """The step's metrics from its device sums, reduced over ranks once (token means over the
    counted tokens; the loss summed over the step's mini-batches, each 1/(epochs x mini_batches));
    `present` names the optional groups that apply: kl (a reference), critic, tis, offpolicy (the
    decoupled objective's weights: their mean, max and effective sample size over the counted units,
    the fractions of counted tokens truncated and masked)."""
    totals = dict(zip(sums, world.reduce(torch.stack(list(sums.values()))).tolist()))
    world.reduce(extremes, "min")
    low, high, weight_high = extremes.tolist()
    tokens = max(1.0, totals["tokens"])
    metrics = {
        "loss": totals["loss"], **{name: totals[name] / tokens for name in fractions},
        "ratio/mean": totals["ratio"] / tokens, "ratio/min": float(low) if math.isfinite(low) else None,
        "ratio/max": -float(high) if math.isfinite(high) else None,
        "entropy": totals["entropy"] / tokens, "grad_norm": sum(grad_norms) / len(grad_norms),
    }
    if "kl" in present:
        metrics["kl/estimate"] = totals["kl"] / tokens
    if "critic" in present:
        metrics.update({"value_loss": totals["value_loss"], "clip/value": totals["clip/value"] / tokens})
    if "tis" in present:
        metrics.update({"tis/weight_mean": totals["tis/weight"] / tokens, "tis/capped_fraction": totals["tis/capped"] / tokens})
    if "offpolicy" in present:
        weights, squares, units = totals["offpolicy/weight"], totals["offpolicy/weight_sq"], totals["offpolicy/units"]
        metrics.update({"offpolicy/is_weight_mean": weights / max(1.0, units),
                        "offpolicy/is_weight_max": -weight_high if math.isfinite(weight_high) else None,
                        "offpolicy/is_ess": effective_sample_size(weights, squares, units),
                        "offpolicy/truncated_fraction": totals["offpolicy/truncated"] / tokens,
                        "offpolicy/masked_fraction": totals["offpolicy/masked"] / tokens})
    return metrics
