"""The settings of the online recipe (`posttrain grpo`, `posttrain ppo`): one section per link,
the critic and the update, checked in `validate` (called once, by `build_config`), and the two
commands' default configs. What the recipe does with them is `online.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from posttrain.algorithms.estimators import ADVANTAGE_ESTIMATORS
from posttrain.algorithms.policy import AGGREGATIONS
from posttrain.config import PolicyFields
from posttrain.data.files import resolve_columns
from posttrain.data.source import TaskSource
from posttrain.distributed import Parallel
from posttrain.errors import UserError
from posttrain.evaluation.acceptance import check_set_specs
from posttrain.optim import Optimization
from posttrain.rollout import SamplingConfig


@dataclass
class Data(TaskSource):
    """Link 1, data: which prompts (task, format, columns, split, system_prompt, eval_size: the
    shared `TaskSource`), how many per step, and the held-out split kept apart."""

    sizes: ClassVar[tuple[str, ...]] = ("train_size", "eval_size", "prompts_per_step")

    train_size: int | None = None
    """Training prompts; None: 20000 for a generated task (arithmetic, rg:), every row not held out for a file."""
    prompts_per_step: int = 8
    """B: prompts sampled per step."""
    group_size: int = 8
    """G: completions per prompt (>= 2 for group advantages; 1 is fine with a critic)."""
    preflight: bool = True
    """Code tasks: run each problem's reference solution (MBPP `code`, HumanEval `canonical_solution`, a `solution` column) in the sandbox first; a problem failing its own tests is removed and counted."""
    exclude_weak_tests: bool = False
    """Code tasks: drop training problems whose tests accept a trivial program (a lookup of the prompt's examples, a constant, an echo, a catch-all; `posttrain audit --data`), counted in the card."""


def estimator_owned(field_name: str) -> list[str]:
    """The advantage estimators that read the `loss.<field_name>` setting (none: a shared field)."""
    return [name for name, entry in ADVANTAGE_ESTIMATORS.items() if field_name in entry.settings]


@dataclass
class Loss:
    """Link 3, loss: every setting that makes two "GRPO"s (or "PPO"s) differ, each named."""

    advantage: str = "group"
    """The advantage estimator (`algorithms/estimators.py`): group: group-relative advantages, no critic (GRPO); gae: per-token GAE from a learned critic (PPO)."""
    clip_low: float = 0.2
    """Ratio clipped below at 1 - clip_low."""
    clip_high: float = 0.2
    """Ratio clipped above at 1 + clip_high (DAPO clip-higher: 0.28)."""
    dual_clip: float | None = None
    """Cap negative-advantage losses at dual_clip * |A| (c > 1; None: off)."""
    advantage_scale: Literal["group", "batch", "none"] = "group"
    """group advantages: divide by the group std (GRPO), the batch std, or nothing (Dr. GRPO)."""
    advantage_eps: float = 1e-6
    """group advantages: added to the std before dividing."""
    unbiased_std: bool = False
    """group advantages: False: population std (denominator G, as in the seed); True: G - 1."""
    gamma: float = 1.0
    """gae: discount over tokens."""
    lam: float = 0.95
    """gae: lambda."""
    whiten_advantages: bool = True
    """gae: normalise advantages to zero mean, unit std over the batch's response tokens."""
    aggregation: str = "token_mean"
    """token_mean | seq_mean_token_mean (GRPO paper) | seq_mean_token_sum | seq_mean_token_sum_norm (Dr. GRPO)."""
    kl_beta: float = 0.0
    """KL coefficient; 0 loads no reference model at all."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Sampled KL estimator."""
    kl_placement: Literal["loss", "reward"] = "loss"
    """KL as a loss term, or in the reward: for group advantages each sequence's summed estimate
    is subtracted from its reward; for gae each token's estimate is a per-token penalty."""
    reference_refresh_every: int = 0
    """Copy the policy into the reference every N steps (0: never; recorded in the run card)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more prompts to refill the batch."""
    max_refill_rounds: int = 3
    """Dynamic sampling: at most this many extra sampling rounds per step."""
    mask_truncated: bool = False
    """Leave completions that hit max_new_tokens out of the loss (DAPO overlong filtering)."""
    sampler_correction: Literal["none", "tis"] = "none"
    """none, or tis: weight each token's surrogate by min(exp(old - sampler log-prob), cap), correcting for the rollout engine's numerics (bf16) and top-p/top-k truncation."""
    sampler_correction_cap: float = 2.0
    """tis: the truncation C of the importance weight."""

    def settings(self) -> dict[str, Any]:
        """The fields that apply to this advantage estimator (for the run card): the shared ones and its own."""
        own = ADVANTAGE_ESTIMATORS[self.advantage].settings
        return {key: value for key, value in dataclasses.asdict(self).items() if key in own or not estimator_owned(key)}

    def kl_meaning(self) -> str:
        """What `kl_placement` does for this advantage estimator, in words (for the run card)."""
        if self.kl_beta == 0:
            return "no KL term (kl_beta = 0)"
        if self.kl_placement == "loss":
            return f"beta x the per-token {self.kl_estimator} estimate added to each token's loss, aggregated like the policy loss"
        return ADVANTAGE_ESTIMATORS[self.advantage].kl_in_reward.format(estimator=self.kl_estimator)


@dataclass
class Critic:
    """The value model (used only with `loss.advantage: gae`)."""

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


@dataclass
class Update:
    """How one batch of rollouts is turned into optimizer steps."""

    epochs: int = 1
    """mu: passes over the batch with the old log-probs fixed (1: on-policy, ratio exactly 1 at first)."""
    mini_batches: int = 1
    """Optimizer steps per epoch (the batch's rows split evenly)."""
    micro_batch_size: int = 16
    """Rows per forward/backward; accumulation does not change the gradient (global normalisers)."""


@dataclass
class Acceptance:
    """Link 4, acceptance: held-out problems scored by a checker chosen apart from the reward."""

    checker: str | None = None
    """Held-out checker (a verifier name); None: the task's strict default."""
    eval_every: int = 10
    """Evaluate every N steps (0: only at the start and the end)."""
    k: int = 1
    """Also report pass@k from k samples per problem (1: greedy pass@1 only)."""
    alarm_window: int = 3
    """Divergence alarm: evaluations to look back over."""
    alarm_reward_rise: float = 0.1
    """Divergence alarm: training-reward rise over the window that, without held-out gain, rings it."""
    sets: list[dict] | None = None
    """Shifted held-out sets evaluated beside the in-distribution split, each {name, task, task_options, size, checker} (task defaults to data.task, size to min(eval_size, 200)); None: the task's defaults (arithmetic: one more digit, and the sums in words); []: none."""


@dataclass
class Config(PolicyFields):
    data: Data = field(default_factory=Data)
    """Link 1: prompts and groups."""
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(max_new_tokens=32))
    """Rollout sampling settings (the training log-probs use the same temperature)."""
    reward: str = "auto"
    """Link 2: the training verifier (posttrain.rewards name, weighted sum, or callable:<path>); auto: the task's gold format decides (exact for arithmetic, math for math/GSM8K/MATH golds, humaneval for code), the same one the held-out checker defaults to."""
    loss: Loss = field(default_factory=Loss)
    """Link 3: the loss settings."""
    critic: Critic = field(default_factory=Critic)
    """The value model (loss.advantage gae only)."""
    update: Update = field(default_factory=Update)
    """Epochs, mini-batches and micro-batches."""
    optim: Optimization = field(default_factory=lambda: Optimization(lr=1e-5))
    """Optimizer and schedule (a critic uses critic.lr with the same schedule)."""
    acceptance: Acceptance = field(default_factory=Acceptance)
    """Link 4: held-out evaluation."""
    parallel: Parallel = field(default_factory=Parallel)
    """Under torchrun: DDP or FSDP2 (FSDP2: group advantages only); ignored in one process."""
    samples_per_step: int = 4
    """Rows per step written to samples.jsonl."""
    exact_kl_tokens: int = 64
    """Tokens per step on which the exact full-vocabulary KL is logged (needs kl_beta > 0)."""

    def validate(self) -> None:
        super().validate()
        self.optim.validate()
        self.parallel.validate()
        data, loss, update, critic = self.data, self.loss, self.update, self.critic
        if loss.advantage not in ADVANTAGE_ESTIMATORS:
            raise UserError(f"loss.advantage must be one of {', '.join(ADVANTAGE_ESTIMATORS)}, got {loss.advantage!r}")
        estimator = ADVANTAGE_ESTIMATORS[loss.advantage]
        if data.group_size < estimator.min_group_size:
            raise UserError(f"data.group_size must be at least {estimator.min_group_size}"
                            + (" (a group of one has no relative signal)" if estimator.min_group_size > 1 else "") + f", got {data.group_size}")
        if data.format is not None or data.columns:
            resolve_columns(data.format, data.columns)
        for name in ("train_size", "eval_size", "prompts_per_step"):
            if getattr(data, name) is not None and getattr(data, name) < 1:
                raise UserError(f"data.{name} must be at least 1, got {getattr(data, name)}")
        if loss.aggregation not in AGGREGATIONS:  # a str, not a Literal: this message names the field the way users read it
            raise UserError(f"loss.aggregation must be one of {', '.join(AGGREGATIONS)}, got {loss.aggregation!r}")
        if loss.clip_low < 0 or loss.clip_low >= 1 or loss.clip_high < 0:
            raise UserError(f"loss.clip_low must be in [0, 1) and clip_high >= 0, got {loss.clip_low}, {loss.clip_high}")
        if loss.dual_clip is not None and loss.dual_clip <= 1:
            raise UserError(f"loss.dual_clip must be > 1, got {loss.dual_clip}")
        if loss.kl_beta < 0 or loss.advantage_eps < 0:
            raise UserError("loss.kl_beta and loss.advantage_eps must be >= 0")
        if not 0 <= loss.gamma <= 1 or not 0 <= loss.lam <= 1:
            raise UserError(f"loss.gamma and loss.lam must be in [0, 1], got {loss.gamma}, {loss.lam}")
        if loss.reference_refresh_every and loss.kl_beta == 0:
            raise UserError("loss.reference_refresh_every needs a reference: set loss.kl_beta > 0")
        if loss.sampler_correction_cap <= 0:
            raise UserError(f"loss.sampler_correction_cap must be > 0, got {loss.sampler_correction_cap}")
        if loss.sampler_correction == "tis" and self.sampling.greedy:
            raise UserError("loss.sampler_correction tis needs sampled rollouts (sampling.greedy is true: there is no sampler distribution)")
        if loss.dynamic_sampling and data.group_size < 2:
            raise UserError("loss.dynamic_sampling needs groups: data.group_size >= 2")
        if critic.lr <= 0 or critic.value_coef < 0 or critic.warmup_steps < 0:
            raise UserError("critic.lr must be > 0, critic.value_coef and critic.warmup_steps >= 0")
        if not estimator.needs_critic and critic != Critic():
            with_critic = [entry for entry in ADVANTAGE_ESTIMATORS.values() if entry.needs_critic]
            raise UserError(f"the critic section applies to loss.advantage {' or '.join(e.name for e in with_critic)} "
                            f"({', '.join(f'posttrain {e.command}' for e in with_critic)}) only")
        defaults = Loss()
        for item in dataclasses.fields(Loss):
            owners = estimator_owned(item.name)
            if owners and loss.advantage not in owners and getattr(loss, item.name) != getattr(defaults, item.name):
                raise UserError(f"loss.{item.name} applies to loss.advantage {' or '.join(owners)} only (this run: {loss.advantage})")
        if self.acceptance.sets is not None:
            check_set_specs(self.acceptance.sets)
        rows = data.prompts_per_step * data.group_size
        if update.epochs < 1 or update.mini_batches < 1 or update.micro_batch_size < 1:
            raise UserError("update.epochs, update.mini_batches and update.micro_batch_size must be >= 1")
        if rows % update.mini_batches:
            raise UserError(f"{rows} rows per step (prompts_per_step x group_size) do not split into {update.mini_batches} mini-batches")


def grpo_config() -> Config:
    """`posttrain grpo`'s defaults: group-relative advantages, no critic, no KL."""
    return Config()


def ppo_config() -> Config:
    """`posttrain ppo`'s defaults: GAE from a critic, one sample per prompt, a k1 KL penalty in the reward."""
    return Config(data=Data(group_size=1), loss=Loss(advantage="gae", kl_beta=0.05, kl_estimator="k1", kl_placement="reward"),
                  exact_kl_tokens=0)
