"""The settings of the policy-gradient loss link, one section per axis: `loss.advantage` names the
estimator (`algorithms/estimators.py`), whose own settings are `loss.<its section>` (group, gae,
reinforce); `loss.surrogate` names the surrogate (`algorithms/surrogates.py`), whose own settings
are `loss.<its section>` (clip, gspo, cispo, clip_cov, kl_cov); `loss.aggregation` how per-token losses become one; `loss.kl` the KL
to the reference and where it goes; `loss.entropy` the entropy bonus; `loss.off_policy` what the step does with a batch an older policy sampled
(`off_policy_objective` resolves its `auto`). `Critic` and `Update` are the value model's and the update's
sections. Each checks what it can alone in `validate`; what spans sections is the recipe config's.
`precomputes_old` says whether these sections need the old log-probs fixed before the update, and
`loss_card` is the run card's loss link: every setting that applies, and what each means.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from posttrain.algorithms.estimators import ADVANTAGE_ESTIMATORS
from posttrain.algorithms.policy import AGGREGATIONS
from posttrain.algorithms.surrogates import SURROGATES
from posttrain.errors import UserError

if TYPE_CHECKING:
    from posttrain.rollout import SamplingConfig


@dataclass
class GroupAdvantage:
    """`loss.advantage: group` (GRPO): rewards minus the group mean, scaled."""

    scale: Literal["group", "batch", "none"] = "group"
    """Divide by the group std (GRPO), the batch std, or nothing (Dr. GRPO)."""
    eps: float = 1e-6
    """Added to the std before dividing."""
    unbiased_std: bool = False
    """False: population std (denominator G, as in the seed); True: G - 1."""


@dataclass
class GaeAdvantage:
    """`loss.advantage: gae` (PPO): per-token GAE from the critic's values."""

    gamma: float = 1.0
    """Discount over tokens."""
    lam: float = 0.95
    """GAE's lambda."""
    whiten: bool = True
    """Normalise advantages to zero mean, unit std over the batch's response tokens."""
    normalize_rewards: bool = False
    """Standardise the sequence rewards over the batch's scored rows (mean 0, population std 1) before the KL and GAE: a learned
    reward model's scale is arbitrary, and it would set the critic's targets and the reward-to-KL trade-off (OpenRLHF's
    normalize_reward, per batch here; TRL's whiten_rewards whitens per-token rewards)."""


@dataclass
class Clip:
    """`loss.surrogate: clip`: the PPO clipped ratio."""

    low: float = 0.2
    """Ratio clipped below at 1 - low."""
    high: float = 0.2
    """Ratio clipped above at 1 + high (DAPO clip-higher: 0.28)."""
    dual: float | None = None
    """Cap negative-advantage losses at dual * |A| (c > 1; None: off)."""


@dataclass
class ReinforceAdvantage:
    """`loss.advantage: reinforce_pp | reinforce_pp_baseline` (REINFORCE++): per-token returns, no critic."""

    whiten: bool = True
    """Normalise the returns to zero mean, unit (population) std over the batch's response tokens (REINFORCE++'s global normalisation)."""


@dataclass
class DistillAdvantage:
    """`loss.advantage: distill` (on-policy distillation): each token's teacher reward, discounted over the row's later tokens."""

    discount: float = 0.0
    """gamma over the row's later tokens: 0 (Thinking Machines' and Tinker's default) gives each token its own reward only; 1 the whole reward to go."""
    baseline: Literal["none", "group"] = "none"
    """The sequence part of a mixed reward (`teacher:DIR+0.5*exact`): none: R on every token; group: R minus its group's mean (needs data.group_size >= 2)."""


@dataclass
class Gspo:
    """`loss.surrogate: gspo`: the sequence ratio exp(mean log r), clipped (its range is narrow: it bounds a geometric mean)."""

    low: float = 3e-4
    """Sequence ratio clipped below at 1 - low (arXiv:2507.18071: 3e-4)."""
    high: float = 4e-4
    """Sequence ratio clipped above at 1 + high (arXiv:2507.18071: 4e-4)."""


@dataclass
class Cispo:
    """`loss.surrogate: cispo`: the importance weight clipped to absolute bounds and stopped; every token keeps its gradient."""

    low: float = 0.0
    """Absolute lower bound of the weight (0: none)."""
    high: float = 5.0
    """Absolute upper bound of the weight (TRL's recommended epsilon_high; MiniMax-M1 tunes it)."""


@dataclass
class ClipCov:
    """`loss.surrogate: clip_cov` (Clip-Cov, arXiv:2505.22617): the PPO clip, and a random share of the
    high-covariance tokens left out of the gradient. Defaults: verl's."""

    low: float = 0.2
    """Ratio clipped below at 1 - low (as loss.clip.low)."""
    high: float = 0.2
    """Ratio clipped above at 1 + high (as loss.clip.high)."""
    fraction: float = 2e-4
    """The share of a micro-batch's counted tokens whose gradient is removed (verl clip_cov_ratio; at least one token)."""
    lower: float = 1.0
    """The covariance band's lower end (verl clip_cov_lb)."""
    upper: float = 5.0
    """The covariance band's upper end (verl clip_cov_ub)."""


@dataclass
class KlCov:
    """`loss.surrogate: kl_cov` (KL-Cov, arXiv:2505.22617): the unclipped ratio, and coef x |log r| on the
    top share of tokens by covariance. Defaults: verl's."""

    fraction: float = 2e-4
    """The share of a micro-batch's counted tokens penalised, the highest covariance first (verl kl_cov_ratio; at least one token)."""
    coef: float = 1.0
    """The penalty's weight (verl ppo_kl_coef)."""


@dataclass
class Entropy:
    """`loss.entropy`: a bonus on the policy's entropy at each of its own counted tokens."""

    coef: float = 0.0
    """Each token's loss gets - coef x H_t, H_t the entropy of softmax(logits / temperature) there, aggregated like the
    surrogate (0: off, and nothing is computed; > 0 holds entropy up; negative is refused: lower the temperature instead)."""


@dataclass
class KL:
    """The KL to a frozen reference: its weight, its sampled estimator and where it enters."""

    beta: float = 0.0
    """KL coefficient; 0 loads no reference model at all."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Sampled KL estimator."""
    placement: Literal["loss", "reward"] = "loss"
    """A loss term, or in the reward: for group advantages each sequence's summed estimate is
    subtracted from its reward; for gae each token's estimate is a per-token penalty."""
    reference_refresh_every: int = 0
    """Copy the policy into the reference every N steps (0: never; recorded in the run card)."""


@dataclass(frozen=True)
class OffPolicyObjective:
    """One value of `loss.off_policy.objective` (auto resolves to one: `off_policy_objective`): what the
    surrogate's ratio is taken against, and whether each token's loss is weighted by the importance
    rule's pi_prox / pi_behav. The loss step asks the entry, never the name."""

    name: str
    ratio_to_behaviour: bool
    """True: the surrogate's old log-probs are the behaviour policy's (the sampler's); False: the proximal policy's."""
    weighted: bool
    """Each token's surrogate x sg(pi_prox / pi_behav) through the importance rule (`importance_weights`)."""
    meaning: str
    """What the run card says it is."""

    @property
    def reads_behaviour(self) -> bool:
        """Whether the step reads the sampler's log-probs (a greedy rollout has none)."""
        return self.ratio_to_behaviour or self.weighted


OFF_POLICY_OBJECTIVES: dict[str, OffPolicyObjective] = {
    "proximal": OffPolicyObjective(
        "proximal", ratio_to_behaviour=False, weighted=False,
        meaning="the clip against the proximal policy (the weights at the start of this step), no staleness weight: "
                "today's on-policy step"),
    "decoupled": OffPolicyObjective(
        "decoupled", ratio_to_behaviour=False, weighted=True,
        meaning="decoupled PPO (Hilton, Cobbe & Schulman, arXiv:2110.00641; AReaL, arXiv:2505.24298): "
                "-w min(r A, clip(r) A), r = pi / pi_prox clipped, w = sg(pi_prox / pi_behav) through the importance rule"),
    "behaviour": OffPolicyObjective(
        "behaviour", ratio_to_behaviour=True, weighted=False,
        meaning="PPO on stale data as is: the ratio and its clip against the behaviour policy (old = the sampler's "
                "log-probs), no weight: the baseline the corrections are measured against"),
}
"""Every resolved `loss.off_policy.objective` by name."""


@dataclass
class OffPolicy:
    """`loss.off_policy`: what the step does with a batch sampled by a policy up to `data.max_staleness`
    steps old. Three policies meet in a stale step: the behaviour policy that sampled the batch (its
    log-probs are the sampler's own, `Rollout.sampler_logprobs`), the proximal policy (the weights at
    the start of this step: the old log-probs) and the policy being trained. The importance rule
    (level, mode, cap, lower, upper) weights each token by pi_prox / pi_behav under `decoupled`
    (`algorithms/importance.py: importance_weights`).

    Peers: AReaL `actor.use_decoupled_loss: true` with `actor.behav_imp_weight_cap` (tokens whose weight
    exceeds it are dropped: mode mask, lower 0, upper = the cap) and `rollout.max_head_offpolicyness`
    (our data.max_staleness); verl `algorithm.rollout_is_level` / `rollout_is_mode` /
    `rollout_is_threshold` (our cap or upper) / `rollout_is_threshold_lower` (our lower; theirs
    defaults to 1 / upper); TRL GRPOConfig `vllm_importance_sampling_mode` (token_truncate,
    token_mask, sequence_truncate, sequence_mask: our level + mode) and `vllm_importance_sampling_cap`."""

    objective: Literal["auto", "proximal", "decoupled", "behaviour"] = "auto"
    """auto: proximal when the run's data.max_staleness is 0, decoupled otherwise (proximal too when
    loss.sampler_correction tis is on: its weight is already the truncated pi_prox / pi_behav);
    proximal: the clip against the proximal policy, no staleness weight (today's step); decoupled: the
    clip against the proximal policy times the importance weight pi_prox / pi_behav (Hilton et al.,
    arXiv:2110.00641; AReaL, arXiv:2505.24298); behaviour: the ratio and clip against the behaviour
    policy (standard PPO on stale data, the baseline)."""
    level: Literal["token", "sequence", "geometric"] = "token"
    """decoupled's weight per token (w_t), per sequence (prod_t w_t = exp(sum_t log w_t): the likelihood
    ratio, unbiased, high variance), or geometric (exp(mean_t log w_t), verl's geometric: a narrow quantity)."""
    mode: Literal["truncate", "mask"] = "truncate"
    """truncate: min(w, cap) (TIS, Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"); mask: weight 0 where w leaves [lower, upper] (MIS / IcePop-style masking,
    Liu, Li et al. 2025, "When speed kills stability"); a masked token stays in the normaliser."""
    cap: float = 2.0
    """mode truncate: the truncation C (verl rollout_is_threshold 2.0; TIS's cap, loss.sampler_correction_cap)."""
    lower: float = 0.5
    """mode mask: the band's lower end (verl rollout_is_threshold_lower, by default 1 / upper)."""
    upper: float = 2.0
    """mode mask: the band's upper end (verl rollout_is_threshold; AReaL behav_imp_weight_cap, e.g. 5, with lower 0).
    At level sequence the weights spread far wider (verl suggests 2-10); at level geometric far narrower (1.0002-1.001)."""

    def rule(self) -> dict[str, Any]:
        """The importance rule's keyword settings (`importance_weights(..., **rule)`)."""
        return {"level": self.level, "mode": self.mode, "cap": self.cap, "lower": self.lower, "upper": self.upper}

    def validate(self, sampler_correction: str) -> None:
        """One UserError line: a bound out of range, a setting for the other mode or for an objective
        without weights, or decoupled / behaviour with TIS on (the same tokens weighted twice, or a
        weight of exactly 1)."""
        if self.cap <= 0 or not 0 <= self.lower < self.upper:
            raise UserError(f"loss.off_policy needs cap > 0 and 0 <= lower < upper, got cap {self.cap}, lower {self.lower}, upper {self.upper}")
        default = OffPolicy()
        entry = OFF_POLICY_OBJECTIVES.get(self.objective)  # None: auto, which may resolve to decoupled
        unused = {"truncate": ("lower", "upper"), "mask": ("cap",)}[self.mode]
        if entry is not None and not entry.weighted:
            unused = ("level", "mode", "cap", "lower", "upper")
        for name in unused:
            if getattr(self, name) != getattr(default, name):
                raise UserError(f"loss.off_policy.{name} does not apply to objective {self.objective}, mode {self.mode} (level and "
                                "mode apply to objective decoupled or auto; cap to mode truncate; lower and upper to mode mask)")
        if sampler_correction == "tis" and entry is not None and entry.weighted:
            raise UserError(f"loss.sampler_correction tis and loss.off_policy.objective {self.objective} both weight each token by "
                            "pi_old / pi_sampler: use one (decoupled with level token, mode truncate is TIS)")
        if sampler_correction == "tis" and entry is not None and entry.ratio_to_behaviour:
            raise UserError(f"loss.sampler_correction tis has nothing to correct under loss.off_policy.objective {self.objective} "
                            "(the ratio is already against the sampler's log-probs): use one")


@dataclass
class Loss:
    """Link 3, loss: every setting that makes two "GRPO"s (or "PPO"s) differ, each named, one
    section per axis."""

    PRIMARY: ClassVar[dict[str, Any]] = {"advantage": ADVANTAGE_ESTIMATORS, "surrogate": SURROGATES}
    """What a value given to the section itself meant (`config._primary_hint`): `--loss rloo` is --loss.advantage rloo."""

    advantage: str = "group"
    """The advantage estimator (`algorithms/estimators.py`): group: group-relative advantages, no critic (GRPO); gae: per-token GAE from a learned critic (PPO); rloo: leave-one-out group baseline (RLOO); reinforce_pp: per-token KL-penalised returns, batch-whitened (REINFORCE++); reinforce_pp_baseline: the group mean subtracted first; distill: each token's own dense reward (a teacher's: on-policy distillation)."""
    group: GroupAdvantage = field(default_factory=GroupAdvantage)
    """loss.advantage group's settings."""
    gae: GaeAdvantage = field(default_factory=GaeAdvantage)
    """loss.advantage gae's settings."""
    reinforce: ReinforceAdvantage = field(default_factory=ReinforceAdvantage)
    """loss.advantage reinforce_pp's and reinforce_pp_baseline's settings."""
    distill: DistillAdvantage = field(default_factory=DistillAdvantage)
    """loss.advantage distill's settings."""
    surrogate: str = "clip"
    """The surrogate (`algorithms/surrogates.py`): clip: the PPO clipped ratio per token; gspo: the clipped sequence ratio (needs aggregation seq_mean_token_mean); cispo: the clipped, stopped importance weight times log pi; clip_cov / kl_cov: the clip with high-covariance tokens detached, or the unclipped ratio with them penalised (arXiv:2505.22617)."""
    clip: Clip = field(default_factory=Clip)
    """loss.surrogate clip's settings."""
    gspo: Gspo = field(default_factory=Gspo)
    """loss.surrogate gspo's settings."""
    cispo: Cispo = field(default_factory=Cispo)
    """loss.surrogate cispo's settings."""
    clip_cov: ClipCov = field(default_factory=ClipCov)
    """loss.surrogate clip_cov's settings."""
    kl_cov: KlCov = field(default_factory=KlCov)
    """loss.surrogate kl_cov's settings."""
    entropy: Entropy = field(default_factory=Entropy)
    """The entropy bonus (coef 0: none)."""
    aggregation: str = "token_mean"
    """token_mean | seq_mean_token_mean (GRPO paper) | seq_mean_token_sum | seq_mean_token_sum_norm (Dr. GRPO)."""
    kl: KL = field(default_factory=KL)
    """The KL to the reference (beta 0: none, no reference loaded)."""
    mask_truncated: bool = False
    """Leave completions that hit max_new_tokens out of the loss (DAPO overlong filtering)."""
    sampler_correction: Literal["none", "tis"] = "none"
    """none, or tis: weight each token's surrogate by min(exp(old - sampler log-prob), cap), correcting for the rollout engine's numerics (bf16) and top-p/top-k truncation."""
    sampler_correction_cap: float = 2.0
    """tis: the truncation C of the importance weight."""
    off_policy: OffPolicy = field(default_factory=OffPolicy)
    """What the step does with a batch an older policy sampled (data.max_staleness > 0): the objective and its importance rule."""

    def validate(self) -> None:
        """One UserError line naming the `loss.*` field that is out of range, unknown, or set for
        an estimator or surrogate this run does not use."""
        for setting, table in (("advantage", ADVANTAGE_ESTIMATORS), ("surrogate", SURROGATES)):
            if getattr(self, setting) not in table:
                raise UserError(f"loss.{setting} must be one of {', '.join(table)}, got {getattr(self, setting)!r}")
        if self.aggregation not in AGGREGATIONS:  # a str, not a Literal: this message names the field the way users read it
            raise UserError(f"loss.aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}")
        for setting, table in (("advantage", ADVANTAGE_ESTIMATORS), ("surrogate", SURROGATES)):
            mine = table[getattr(self, setting)].section
            for section in {entry.section for entry in table.values()} - {None, mine}:
                if getattr(self, section) != getattr(Loss(), section):
                    users = " or ".join(name for name, entry in table.items() if entry.section == section)
                    raise UserError(f"loss.{section} applies to loss.{setting} {users} only (this run: {getattr(self, setting)})")
        allowed = SURROGATES[self.surrogate].aggregations
        if allowed is not None and self.aggregation not in allowed:
            raise UserError(f"loss.aggregation must be {' or '.join(allowed)} with loss.surrogate {self.surrogate} "
                            f"(its ratio is a per-sequence mean), got {self.aggregation}")
        clip, kl, group, gae = self.clip, self.kl, self.group, self.gae
        if self.gspo.low < 0 or self.gspo.low >= 1 or self.gspo.high < 0:
            raise UserError(f"loss.gspo.low must be in [0, 1) and loss.gspo.high >= 0, got {self.gspo.low}, {self.gspo.high}")
        if not 0 <= self.cispo.low < self.cispo.high:
            raise UserError(f"loss.cispo needs 0 <= low < high (absolute bounds on the ratio), got {self.cispo.low}, {self.cispo.high}")
        if not 0 <= self.clip_cov.low < 1 or self.clip_cov.high < 0 or not 0 < self.clip_cov.fraction <= 1 \
                or self.clip_cov.lower >= self.clip_cov.upper:
            raise UserError(f"loss.clip_cov needs 0 <= low < 1, high >= 0, 0 < fraction <= 1 and lower < upper, got {self.clip_cov}")
        if not 0 < self.kl_cov.fraction <= 1 or self.kl_cov.coef < 0:
            raise UserError(f"loss.kl_cov needs 0 < fraction <= 1 and coef >= 0, got fraction {self.kl_cov.fraction}, coef {self.kl_cov.coef}")
        if not self.entropy.coef >= 0:
            raise UserError(f"loss.entropy.coef must be >= 0 (a bonus; a negative one would drive the entropy down), got {self.entropy.coef}")
        if clip.low < 0 or clip.low >= 1 or clip.high < 0:
            raise UserError(f"loss.clip.low must be in [0, 1) and loss.clip.high >= 0, got {clip.low}, {clip.high}")
        if clip.dual is not None and clip.dual <= 1:
            raise UserError(f"loss.clip.dual must be > 1, got {clip.dual}")
        if kl.beta < 0 or group.eps < 0:
            raise UserError("loss.kl.beta and loss.group.eps must be >= 0")
        if not 0 <= self.distill.discount <= 1:
            raise UserError(f"loss.distill.discount must be in [0, 1], got {self.distill.discount}")
        if not 0 <= gae.gamma <= 1 or not 0 <= gae.lam <= 1:
            raise UserError(f"loss.gae.gamma and loss.gae.lam must be in [0, 1], got {gae.gamma}, {gae.lam}")
        if kl.reference_refresh_every and kl.beta == 0:
            raise UserError("loss.kl.reference_refresh_every needs a reference: set loss.kl.beta > 0")
        if kl.reference_refresh_every < 0:
            raise UserError(f"loss.kl.reference_refresh_every must be >= 0, got {kl.reference_refresh_every}")
        if self.sampler_correction_cap <= 0:
            raise UserError(f"loss.sampler_correction_cap must be > 0, got {self.sampler_correction_cap}")
        self.off_policy.validate(self.sampler_correction)

    def estimator_settings(self) -> dict[str, Any]:
        """The keyword settings of this run's advantage estimator (its section's fields)."""
        section = ADVANTAGE_ESTIMATORS[self.advantage].section
        return dataclasses.asdict(getattr(self, section)) if section else {}

    def surrogate_settings(self) -> dict[str, Any]:
        """The keyword settings of this run's surrogate (its section's fields)."""
        return dataclasses.asdict(getattr(self, SURROGATES[self.surrogate].section))

    def settings(self) -> dict[str, Any]:
        """The sections that apply to this run (for the run card): the shared ones, this
        estimator's and this surrogate's own."""
        owned = {entry.section for table in (ADVANTAGE_ESTIMATORS, SURROGATES) for entry in table.values()}
        mine = {ADVANTAGE_ESTIMATORS[self.advantage].section, SURROGATES[self.surrogate].section}
        return {key: value for key, value in dataclasses.asdict(self).items() if key in mine or key not in owned}

    def entropy_meaning(self) -> str:
        """What `loss.entropy` does, in words (for the run card, when coef > 0)."""
        return (f"- {self.entropy.coef:g} x H_t added to each token's loss, H_t the entropy of the policy's softmax(logits / temperature) "
                "at that token, with its gradient, aggregated like the policy loss")

    def kl_meaning(self) -> str:
        """What `kl.placement` does for this advantage estimator, in words (for the run card)."""
        if self.kl.beta == 0:
            return "no KL term (kl.beta = 0)"
        if self.kl.placement == "loss":
            return f"beta x the per-token {self.kl.estimator} estimate added to each token's loss, aggregated like the policy loss"
        return ADVANTAGE_ESTIMATORS[self.advantage].kl_in_reward.format(estimator=self.kl.estimator)


MOVED = {
    **{f"loss.{old}": f"loss.{new}" for old, new in {
        "clip_low": "clip.low", "clip_high": "clip.high", "dual_clip": "clip.dual",
        "advantage_scale": "group.scale", "advantage_eps": "group.eps", "unbiased_std": "group.unbiased_std",
        "gamma": "gae.gamma", "lam": "gae.lam", "whiten_advantages": "gae.whiten",
        "kl_beta": "kl.beta", "kl_estimator": "kl.estimator", "kl_placement": "kl.placement",
        "reference_refresh_every": "kl.reference_refresh_every",
    }.items()},
    "loss.dynamic_sampling": "data.dynamic_sampling", "loss.max_refill_rounds": "data.max_refill_rounds",
}
"""The policy-gradient keys that moved when `loss` was split into sections: old -> new."""


@dataclass
class Critic:
    """The value model (used only by estimators that need a critic: `loss.advantage: gae`)."""

    share_backbone: bool = False
    """True: a value head on the policy's own backbone; False: a separate copy of it."""
    lr: float = 1e-5
    """Critic learning rate (value head, and the separate backbone)."""
    value_clip: float | None = 0.2
    """Clip new values to old +- value_clip in the value loss (None: off)."""
    value_coef: float = 0.5
    """Weight of the value loss in the total loss."""
    warmup_steps: int = 0
    """Steps at the start that train only the critic (the policy is left unchanged)."""

    def validate(self) -> None:
        if self.lr <= 0 or self.value_coef < 0 or self.warmup_steps < 0:
            raise UserError("critic.lr must be > 0, critic.value_coef and critic.warmup_steps >= 0")


@dataclass
class Update:
    """How one batch of rollouts is turned into optimizer steps."""

    epochs: int = 1
    """mu: passes over the batch with the old log-probs fixed (1: on-policy, ratio exactly 1 at first)."""
    mini_batches: int = 1
    """Optimizer steps per epoch (the batch's rows split evenly)."""
    micro_batch_size: int = 16
    """Rows per forward/backward; accumulation does not change the gradient (global normalisers)."""

    def validate(self) -> None:
        if self.epochs < 1 or self.mini_batches < 1 or self.micro_batch_size < 1:
            raise UserError("update.epochs, update.mini_batches and update.micro_batch_size must be >= 1")


def precomputes_old(loss: Loss, update: Update) -> bool:
    """Whether a no-grad forward computes the old log-probs before the update (else the first
    forward's, detached: ratio exactly 1). A critic's value targets are the rollout's, and several
    epochs or mini-batches, or a KL in the reward, need the old policy's log-probs fixed."""
    return (ADVANTAGE_ESTIMATORS[loss.advantage].needs_critic or update.epochs > 1 or update.mini_batches > 1
            or loss.kl.placement == "reward")


def off_policy_objective(loss: Loss, max_staleness: int) -> OffPolicyObjective:
    """`loss.off_policy.objective` resolved for a run whose batches are up to `max_staleness` steps
    old: auto is proximal at max_staleness 0, and when `loss.sampler_correction tis` already weights
    each token by min(pi_prox / pi_behav, cap) (the decoupled objective at level token, mode
    truncate); decoupled otherwise. Any other value is its own entry."""
    objective = loss.off_policy.objective
    if objective == "auto":
        objective = "proximal" if max_staleness == 0 or loss.sampler_correction == "tis" else "decoupled"
    return OFF_POLICY_OBJECTIVES[objective]


def off_policy_meaning(loss: Loss, max_staleness: int | None) -> str:
    """What `loss.off_policy` does in this run, in words (for the run card); `max_staleness` None:
    not known here, so `auto`'s rule is said."""
    if max_staleness is None and loss.off_policy.objective == "auto":
        return ("auto: proximal at data.max_staleness 0 (or with loss.sampler_correction tis), decoupled otherwise; "
                "decoupled is " + OFF_POLICY_OBJECTIVES["decoupled"].meaning)
    objective, rule = off_policy_objective(loss, max_staleness or 0), loss.off_policy
    weight = (f"; importance rule: level {rule.level}, " + (f"truncate at {rule.cap}" if rule.mode == "truncate" else
                                                              f"mask outside [{rule.lower}, {rule.upper}]")
              if objective.weighted else "")
    return f"{objective.name}: {objective.meaning}{weight}"


def loss_card(loss: Loss, critic: Critic, update: Update, sampling: SamplingConfig, reference: Any,
              max_staleness: int | None = None) -> dict[str, Any]:
    """The run card's loss link: the algorithm, every section that applies (the critic's only with
    an estimator that needs one), the estimator's and surrogate's card text, where the KL goes, the
    reference (`reference`: None, or a reference model with `adapter_disabled`), how the old
    log-probs are had (`precomputes_old`), the distribution the log-probs are taken under
    (`sampling`'s temperature and truncation), the sampler correction and the off-policy objective
    (resolved for `max_staleness`, the run's data.max_staleness; None: its rule)."""
    estimator = ADVANTAGE_ESTIMATORS[loss.advantage]
    return {
        "algorithm": estimator.algorithm,
        **loss.settings(),
        **({f"critic_{k}": v for k, v in dataclasses.asdict(critic).items()} if estimator.needs_critic else {}),
        **dataclasses.asdict(update),
        **estimator.describe(loss.estimator_settings()),
        "advantage_as_peers_spell_it": estimator.peers,
        "surrogate_meaning": SURROGATES[loss.surrogate].describe(loss.surrogate_settings()),
        "surrogate_as_peers_spell_it": SURROGATES[loss.surrogate].peers,
        "kl_placement_meaning": loss.kl_meaning(),
        **({"entropy_bonus_meaning": loss.entropy_meaning()} if loss.entropy.coef > 0 else {}),
        "reference": "none (kl.beta = 0)" if reference is None else ("LoRA base (adapters disabled)" if reference.adapter_disabled else "frozen copy of the initial policy"),
        "old_logprobs": "recomputed by a no-grad forward before the update" if precomputes_old(loss, update) else "the on-policy forward, detached (ratio exactly 1)",
        "logprob_distribution": f"softmax(logits / {sampling.temperature}) over the full vocabulary"
        + (" (sampling truncated by top-p/top-k: the sampler's distribution differs)" if sampling.truncates else ""),
        "sampler_correction_meaning": (f"truncated importance sampling: each token's surrogate x min(exp(old - sampler log-prob), {loss.sampler_correction_cap})"
                                       if loss.sampler_correction == "tis" else "none: the tokens are treated as drawn from the trainer's old policy (mismatch/* measures how far they are not)"),
        "off_policy_meaning": off_policy_meaning(loss, max_staleness),
    }
