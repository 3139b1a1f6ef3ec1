"""The advantage estimators as a table: each entry says what it needs (a critic, groups), which
`loss.<section>` of settings it reads, how a KL placed in the reward enters it, its run-card text and the
metrics it plots, and computes the step's advantages from the step's rewards. The loss link
(`losses/policy_gradient.prepare`) and the online recipe ask the entry, never "is it group?".

Adding an estimator is one function and one entry in `ADVANTAGE_ESTIMATORS`, from any module
(tests/test_estimator_table.py adds one and runs it through `posttrain grpo`), plus, if it has
settings of its own, their section in `losses/policy_gradient_config.Loss`.
Pure tensor math like the rest of `algorithms/`: no models, configs or `.item()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from posttrain.algorithms.advantages import discounted_returns, explained_variance, gae, grpo_advantages, masked_mean, reinforce_returns
from posttrain.algorithms.advantages import rloo_advantages
from posttrain.algorithms.advantages import whiten as whiten_tokens
from posttrain.algorithms.kl import kl_in_reward


@dataclass(frozen=True)
class StepRewards:
    """What an advantage estimator reads of one step's batch: N = B * G rows, group-contiguous
    (row b * G + g), T response tokens."""

    rewards: torch.Tensor
    """(N,) verifier rewards; NaN = unscored (infra or data error), left out of every baseline."""
    mask: torch.Tensor
    """(N, T) bool: the tokens that reach the loss (valid rows only)."""
    sampled: torch.Tensor
    """(N, T) bool: every sampled token (a KL in the reward charges each of them)."""
    group_size: int
    """G."""
    kl: torch.Tensor | None = None
    """(N, T) per-token KL estimate of the rollout against the reference, when one exists."""
    kl_beta: float = 0.0
    """The KL's weight in the reward (0 when the KL is a loss term or there is none)."""
    values: torch.Tensor | None = None
    """(N, T) the critic's values of the rollout, for estimators that need a critic."""
    token_rewards: torch.Tensor | None = None
    """(N, T) per-token rewards of a dense reward (a teacher's, `algorithms/distill.py`), 0 off the
    mask; None: the reward is the sequence's alone. Per-sequence estimators add each row's sum to its
    reward, per-token ones add each token's to its token reward (`sequence_rewards`, `with_token_rewards`)."""


def sequence_rewards(inputs: StepRewards) -> torch.Tensor:
    """(N,) each row's reward plus the sum of its per-token rewards (a dense reward summed over the
    sequence, for the estimators with one advantage per sequence); NaN rows stay NaN."""
    if inputs.token_rewards is None:
        return inputs.rewards
    return inputs.rewards + inputs.token_rewards.sum(-1).to(inputs.rewards.dtype)


def with_token_rewards(inputs: StepRewards, token_rewards: torch.Tensor) -> torch.Tensor:
    """(N, T) `token_rewards` plus the dense reward's own on the counted tokens (unchanged without one)."""
    if inputs.token_rewards is None:
        return token_rewards
    return token_rewards + torch.where(inputs.mask, inputs.token_rewards, torch.zeros_like(inputs.token_rewards)).to(token_rewards.dtype)


@dataclass(frozen=True)
class Estimate:
    advantages: torch.Tensor
    """(N,) one advantage per sequence, or (N, T) one per token (`per_token` estimators)."""
    returns: torch.Tensor | None = None
    """(N, T) the critic's regression targets, for estimators that need a critic."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """0-dim tensors (NaN where undefined) to log, named."""


@dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    command: str
    """The `posttrain` command whose default it is (its runs' directories and resume hints)."""
    algorithm: str
    """The run card's name for the algorithm it makes."""
    estimate: Callable[..., Estimate]
    """estimate(StepRewards, **settings) -> Estimate, settings being the fields of `loss.<section>`."""
    section: str | None
    """The `loss.<section>` of settings it reads (None: none; other estimators' sections must stay at their defaults)."""
    needs_critic: bool
    per_token: bool
    """Advantages (N, T) per token; else (N,) per sequence."""
    min_group_size: int
    """Samples per prompt it needs: 2 for a group baseline, 1 otherwise."""
    kl_in_reward: str
    """What a KL placed in the reward does, for the run card ({estimator}: the KL estimator's name)."""
    kl_metric: str
    """Where kl/estimate is measured: "update" (each forward of the update) or "rollout" (before it)."""
    plotted: tuple[str, ...]
    """The metrics its runs plot in plots/metrics.png."""
    reward_placement: str | None = None
    """Where the sequence reward enters, when it is not the whole sequence's (for the run card)."""
    describe: Callable[[dict], dict] = lambda settings: {}
    """Extra run-card entries of its settings."""
    peers: str = ""
    """The same estimator as the peers spell it (TRL, verl, OpenRLHF), for the run card."""
    signal_scope: str = "group"
    """The rows whose rewards must differ for a step's advantages to carry the reward's signal:
    "group" (each prompt's G samples: a group baseline cancels a reward the group shares) or "batch"
    (the whole step: a batch-wide normalisation, or a critic, is the only baseline)."""

    def silent_fraction(self, rewards: torch.Tensor, counted: torch.Tensor, group_size: int) -> torch.Tensor:
        """The fraction of this estimator's `signal_scope` units without reward signal (`silent_fraction`)."""
        return silent_fraction(rewards, counted, group_size, self.signal_scope)


def silent_fraction(rewards: torch.Tensor, counted: torch.Tensor, group_size: int, scope: str) -> torch.Tensor:
    """The fraction of a step's units (groups of G rows, `scope` "group"; the whole batch, "batch")
    whose counted rows' rewards are all equal, fewer than two counted rows included: in such a unit
    the reward moves no advantage apart from the others (group estimators: advantage 0 or the KL's
    alone; reinforce_pp: whitened returns 0, or one equal push on every token unwhitened; gae: what
    the critic expected, not what the reward said).

    Args:
        rewards: (N,) group-contiguous sequence rewards, NaN = unscored.
        counted: (N,) bool, the rows that reach the loss (scored, with a token in the loss mask).
        group_size: G.
        scope: "group" | "batch".
    Returns:
        0-dim float tensor in [0, 1].

    Example: rewards [1, 1, 0, 1], G = 2, every row counted: "group" -> 0.5 (the first group's
    rewards are equal), "batch" -> 0.0; with rows 2-3 not counted, "batch" -> 1.0.
    """
    if scope not in ("group", "batch"):
        raise ValueError(f"scope must be 'group' or 'batch', got {scope!r}")
    size = group_size if scope == "group" else rewards.numel()
    counted = (counted & ~torch.isnan(rewards)).view(-1, size)
    values = rewards.view(-1, size)
    highest = torch.where(counted, values, torch.full_like(values, -torch.inf)).amax(dim=1)
    lowest = torch.where(counted, values, torch.full_like(values, torch.inf)).amin(dim=1)
    differs = (counted.sum(dim=1) >= 2) & (highest > lowest)
    return 1.0 - differs.float().mean()


def group_estimate(inputs: StepRewards, scale: str, eps: float, unbiased_std: bool) -> Estimate:
    """GRPO's group-relative advantages (`grpo_advantages`), each sequence's reward first charged
    beta x the sum of its per-token KL estimates when the KL is placed in the reward (a dense
    reward's tokens summed into it first, `sequence_rewards`)."""
    rewards = sequence_rewards(inputs)
    if inputs.kl is not None and inputs.kl_beta:  # every sampled token of a row pays: the row counts in its group's baseline
        rewards = kl_in_reward(rewards, inputs.kl, inputs.sampled, inputs.kl_beta, per_token=False)
    return Estimate(grpo_advantages(rewards, inputs.group_size, scale=scale, eps=eps, unbiased_std=unbiased_std))


def standardized_rewards(rewards: torch.Tensor) -> torch.Tensor:
    """(N,) sequence rewards standardised over the scored rows (NaN rows stay NaN): mean 0,
    population std 1 (a constant batch: 0). Example: [1, 3, NaN] -> [-1, 1, NaN]."""
    scored = rewards[~torch.isnan(rewards)]
    if scored.numel() < 2:
        return rewards - scored.mean() if scored.numel() else rewards
    return (rewards - scored.mean()) / scored.std(correction=0).clamp(min=1e-6)


def gae_estimate(inputs: StepRewards, gamma: float, lam: float, whiten: bool, normalize_rewards: bool = False) -> Estimate:
    """PPO's per-token advantages: GAE (Schulman et al. arXiv:1506.02438 eq. 16) over per-token
    rewards (the sequence reward on its last token, standardised over the batch first when asked,
    -beta x KL on every token when placed in the reward: Ouyang et al. arXiv:2203.02155 eq. 2) and
    the critic's values; whitened over the batch's counted tokens when asked. Unscored rows (NaN)
    get reward 0 and no loss (mask)."""
    values, mask = inputs.values, inputs.mask
    kl = inputs.kl if inputs.kl is not None else torch.zeros_like(values)
    rewards = standardized_rewards(inputs.rewards) if normalize_rewards else inputs.rewards
    token_rewards = with_token_rewards(inputs, kl_in_reward(torch.nan_to_num(rewards, nan=0.0), kl, mask, inputs.kl_beta, per_token=True))
    advantages, returns = gae(token_rewards, values, mask, gamma, lam)
    if whiten:
        advantages = whiten_tokens(advantages, mask)
    return Estimate(advantages, returns, {"values/mean": masked_mean(values, mask), "returns/mean": masked_mean(returns, mask),
                                          "explained_variance": explained_variance(values, returns, mask)})


def rloo_estimate(inputs: StepRewards) -> Estimate:
    """REINFORCE leave-one-out (Ahmadian et al. arXiv:2402.14740 eq. 6): each sequence's reward
    minus the mean of the others in its group (`rloo_advantages`), each first charged beta x the
    sum of its per-token KL estimates when the KL is placed in the reward (as the paper and TRL do;
    a dense reward's tokens summed into it first, `sequence_rewards`)."""
    rewards = sequence_rewards(inputs)
    if inputs.kl is not None and inputs.kl_beta:
        rewards = kl_in_reward(rewards, inputs.kl, inputs.sampled, inputs.kl_beta, per_token=False)
    return Estimate(rloo_advantages(rewards, inputs.group_size))


def _reinforce_pp(inputs: StepRewards, rewards: torch.Tensor, whiten: bool) -> Estimate:
    """Per-token returns of `rewards` (on each row's last counted token, -beta x KL on every token
    when the KL is in the reward), whitened over the batch's counted tokens when asked."""
    mask = inputs.mask
    kl = inputs.kl if inputs.kl is not None else torch.zeros(mask.shape, dtype=rewards.dtype, device=mask.device)
    token_rewards = with_token_rewards(inputs, kl_in_reward(torch.nan_to_num(rewards, nan=0.0), kl, mask, inputs.kl_beta, per_token=True))
    returns = reinforce_returns(token_rewards, mask)
    advantages = whiten_tokens(returns, mask) if whiten else returns
    return Estimate(advantages, metrics={"returns/mean": masked_mean(returns, mask)})


def reinforce_pp_estimate(inputs: StepRewards, whiten: bool) -> Estimate:
    """REINFORCE++ (Hu et al. arXiv:2501.03262 eqs. 4-6): per-token returns R - beta x the sum of
    the KL estimates from each token on (gamma = 1, no critic, no group), whitened over every
    counted token of the batch (the global normalisation that replaces a baseline)."""
    return _reinforce_pp(inputs, inputs.rewards, whiten)


def reinforce_pp_baseline_estimate(inputs: StepRewards, whiten: bool) -> Estimate:
    """REINFORCE++-baseline (arXiv:2501.03262 v3 section 3.2, verl `reinforce_plus_plus_baseline`):
    each reward minus its group's mean first (`grpo_advantages` with scale none), then as
    REINFORCE++: per-token returns with the KL when in the reward, whitened over the batch."""
    return _reinforce_pp(inputs, grpo_advantages(inputs.rewards, inputs.group_size, scale="none"), whiten)


def distill_estimate(inputs: StepRewards, discount: float, baseline: str) -> Estimate:
    """On-policy distillation's per-token advantages (Thinking Machines 2025, Tinker's
    `kl_discount_factor`; Qwen3 arXiv:2505.09388 section 4.5):

        A_t = sum_{t' >= t} discount^(t' - t) r_t'  +  (R - b)

    r_t the dense reward of each counted token (the teacher's, minus beta x the KL estimate when the
    KL is placed in the reward), discounted over the row's later counted tokens (`discounted_returns`:
    0, the default, leaves each token its own reward), plus the sequence reward R of a weighted sum
    with a task reward (`teacher:DIR+0.5*exact`) on every token, minus the group's mean with
    `baseline` group (none: b = 0). Not whitened: the teacher's log-ratio has a scale of its own.
    Unscored rows (NaN R) get 0 and no loss."""
    mask = inputs.mask
    dense = inputs.token_rewards if inputs.token_rewards is not None else torch.zeros(mask.shape, device=mask.device)
    if inputs.kl is not None and inputs.kl_beta:
        dense = dense - inputs.kl_beta * torch.where(mask, inputs.kl.detach(), torch.zeros_like(inputs.kl))
    sequence = grpo_advantages(inputs.rewards, inputs.group_size, scale="none") if baseline == "group" else inputs.rewards
    dtype = torch.promote_types(dense.dtype, torch.float32)
    advantages = discounted_returns(dense.to(dtype), mask, discount) + torch.nan_to_num(sequence.to(dtype), nan=0.0)[:, None]
    return Estimate(torch.where(mask, advantages, torch.zeros_like(advantages)),
                    metrics={"distill/token_reward": masked_mean(dense.to(dtype), mask)})


_REINFORCE_KL = "per-token penalty: -beta x the {estimator} estimate in each token's reward, summed into every earlier token's return"
_REINFORCE_WHITEN = lambda settings: {"whitening": "population variance (n) over the batch's counted tokens, mean shifted to 0"  # noqa: E731
                                      if settings["whiten"] else "none"}

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "group": AdvantageEstimator(
        name="group", command="grpo", algorithm="GRPO (group-relative advantages, clipped surrogate, no critic)",
        estimate=group_estimate, section="group", needs_critic=False,
        per_token=False, min_group_size=2,
        kl_in_reward=("per-sequence sum: each sequence's reward minus beta x the sum of its per-token {estimator} "
                      "estimates, before the group advantages"),
        kl_metric="update",
        plotted=("reward/mean", "heldout/pass@1", "kl/exact", "kl/estimate", "length/mean", "loss", "entropy"),
        describe=lambda settings: {"std": "sample (n-1)" if settings["unbiased_std"] else "population (n)"},
        peers="TRL GRPOTrainer; verl adv_estimator=grpo; OpenRLHF advantage_estimator=group_norm", signal_scope="group",
    ),
    "gae": AdvantageEstimator(
        name="gae", command="ppo", algorithm="PPO with a learned critic (GAE advantages, clipped surrogate, clipped value loss)",
        estimate=gae_estimate, section="gae", needs_critic=True, per_token=True, min_group_size=1,
        kl_in_reward="per-token penalty: -beta x the {estimator} estimate in each token's reward before GAE (Ouyang et al. eq. 2)",
        kl_metric="rollout",
        plotted=("reward/mean", "heldout/pass@1", "kl/estimate", "value_loss", "length/mean", "loss"),
        reward_placement="verifier score on the last response token",
        peers="TRL PPOTrainer; verl adv_estimator=gae; OpenRLHF advantage_estimator=gae", signal_scope="batch",
    ),
    "rloo": AdvantageEstimator(
        name="rloo", command="grpo", algorithm="RLOO (REINFORCE with a leave-one-out group baseline, no critic)",
        estimate=rloo_estimate, section=None, needs_critic=False, per_token=False, min_group_size=2,
        kl_in_reward=("per-sequence sum: each sequence's reward minus beta x the sum of its per-token {estimator} "
                      "estimates, before the leave-one-out baseline (arXiv:2402.14740, TRL RLOOTrainer)"),
        kl_metric="update",
        plotted=("reward/mean", "heldout/pass@1", "kl/exact", "kl/estimate", "length/mean", "loss", "entropy"),
        peers="TRL RLOOTrainer; verl adv_estimator=rloo; OpenRLHF advantage_estimator=rloo", signal_scope="group",
    ),
    "reinforce_pp": AdvantageEstimator(
        name="reinforce_pp", command="grpo", algorithm="REINFORCE++ (per-token KL-penalised returns, batch-whitened, no critic, no group)",
        estimate=reinforce_pp_estimate, section="reinforce", needs_critic=False, per_token=True, min_group_size=1,
        kl_in_reward=_REINFORCE_KL, kl_metric="update",
        plotted=("reward/mean", "heldout/pass@1", "kl/exact", "kl/estimate", "returns/mean", "length/mean", "loss"),
        reward_placement="verifier score on the last response token", describe=_REINFORCE_WHITEN,
        peers="verl adv_estimator=reinforce_plus_plus; OpenRLHF advantage_estimator=reinforce", signal_scope="batch",
    ),
    "reinforce_pp_baseline": AdvantageEstimator(
        name="reinforce_pp_baseline", command="grpo",
        algorithm="REINFORCE++-baseline (group-mean baseline, then per-token returns, batch-whitened, no critic)",
        estimate=reinforce_pp_baseline_estimate, section="reinforce", needs_critic=False, per_token=True, min_group_size=2,
        kl_in_reward=_REINFORCE_KL, kl_metric="update",
        plotted=("reward/mean", "heldout/pass@1", "kl/exact", "kl/estimate", "returns/mean", "length/mean", "loss"),
        reward_placement="verifier score minus its group's mean, on the last response token", describe=_REINFORCE_WHITEN,
        peers="verl adv_estimator=reinforce_plus_plus_baseline; OpenRLHF advantage_estimator=reinforce_baseline",
        signal_scope="group",
    ),
    "distill": AdvantageEstimator(
        name="distill", command="grpo",
        algorithm="On-policy distillation (per-token teacher reward, discounted over the row's tokens, no critic)",
        estimate=distill_estimate, section="distill", needs_critic=False, per_token=True, min_group_size=1,
        kl_in_reward="per-token penalty: -beta x the {estimator} estimate added to each token's reward before the discount",
        kl_metric="update",
        plotted=("reward/mean", "heldout/pass@1", "distill/reverse_kl", "distill/teacher_logprob", "length/mean", "loss", "entropy"),
        reward_placement="each token's teacher reward on that token; a task reward of the sum (minus its group mean with baseline group) on every token",
        describe=lambda settings: {"discount": settings["discount"], "sequence_baseline": settings["baseline"]},
        peers="Thinking Machines / Tinker on-policy distillation (kl_discount_factor); verl, NeMo-RL, prime-rl, SkyRL; "
              "TRL GKDTrainer (lmbda=1, beta=1: the reverse KL on student samples, full-vocabulary)",
        signal_scope="batch",
    ),
}
"""Every advantage estimator by its `loss.advantage` name."""
