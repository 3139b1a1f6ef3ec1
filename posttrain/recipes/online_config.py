"""The settings of the online recipe (`posttrain grpo`, `posttrain ppo`): one section per link
(the loss link's sections, with the critic and the update, live with their step in
`posttrain/losses/policy_gradient_config.py`), checked in `validate` (called once, by
`build_config`), and the two commands' default configs. What the recipe does with them is
`online.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from posttrain.algorithms.estimators import ADVANTAGE_ESTIMATORS
from posttrain.config import PolicyFields
from posttrain.data.scored_batch import PromptSource
from posttrain.distributed import Parallel
from posttrain.errors import UserError
from posttrain.evaluation import settings as evaluation_settings
from posttrain.losses.policy_gradient_config import KL, MOVED, Critic, Loss, Update, off_policy_objective  # the loss link's sections
from posttrain.optim import Optimization
from posttrain.rollout import SamplingConfig
from posttrain.rollout.engines import RolloutSettings
from posttrain.rollout.episodes import ToolSettings


Data = PromptSource
"""Link 1, data: the prompts and groups (`data.*`); the section lives with the sampler that reads it, in `posttrain/data/scored_batch.py`."""


@dataclass
class Acceptance(evaluation_settings.Acceptance):
    """Link 4, acceptance (`evaluation/settings.Acceptance`: checker, eval_every, max_new_tokens,
    sets), with pass@k and the divergence alarm."""

    eval_every: int = 10
    """Evaluate every N steps (0: only at the start and the end)."""
    max_new_tokens: int | None = None
    """Generation budget of each held-out answer; None: sampling.max_new_tokens, the rollouts' budget."""
    k: int = 1
    """Also report pass@k from k samples per problem at sampling.temperature (1: greedy pass@1 only)."""
    alarm_window: int = 3
    """Divergence alarm: evaluations to look back over."""
    alarm_reward_rise: float = 0.1
    """Divergence alarm: training-reward rise over the window that, without held-out gain, rings it."""
    signal_stop_after: int = 3
    """Training signal: stop the run when the reward could not score any row for this many steps in a row (0: never stop)."""
    signal_window: int = 5
    """Training signal: ring the alarm once when this many steps in a row had no reward signal (every row unscorable, or every group's rewards equal; 0: never)."""

    def validate(self, prefix: str = "acceptance.") -> None:
        super().validate(prefix)
        if self.k < 1 or self.alarm_window < 1:
            raise UserError(f"{prefix}k and {prefix}alarm_window must be at least 1, got {self.k} and {self.alarm_window}")
        if self.signal_stop_after < 0 or self.signal_window < 0:
            raise UserError(f"{prefix}signal_stop_after and {prefix}signal_window must be 0 (off) or more, "
                            f"got {self.signal_stop_after} and {self.signal_window}")


@dataclass
class Config(PolicyFields):
    MOVED: ClassVar[dict[str, str]] = {**MOVED, "reward.overlong": "reward_options.overlong"}
    """The keys the loss split renamed (`losses/policy_gradient_config.MOVED`): `loss.kl_beta moved to loss.kl.beta`; and
    issue 43's `reward.overlong`, which lives with the reward's other settings (`reward` is the verifier's name)."""

    data: Data = field(default_factory=Data)
    """Link 1: prompts and groups."""
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(max_new_tokens=32))
    """Rollout sampling settings (the training log-probs use the same temperature)."""
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    """The engine that samples rollouts and held-out answers (`rollout/engines.py`): builtin, or vllm (in this process, or a `posttrain vllm-serve` server at rollout.vllm.url), its weights synced after every update."""
    tools: ToolSettings = field(default_factory=ToolSettings)
    """Tool-calling episodes (`rollout/episodes.py`): the tools the model may call between turns, max_turns, the observation cap; no tools: one turn per row."""
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
    """Tokens per step on which the exact full-vocabulary KL is logged (needs loss.kl.beta > 0)."""

    def validate(self) -> None:
        super().validate()
        self.optim.validate()
        self.parallel.validate()
        data, loss, update, critic = self.data, self.loss, self.update, self.critic
        loss.validate()
        critic.validate()
        update.validate()
        estimator = ADVANTAGE_ESTIMATORS[loss.advantage]
        if data.group_size < estimator.min_group_size:
            raise UserError(f"data.group_size must be at least {estimator.min_group_size}"
                            + (" (a group of one has no relative signal)" if estimator.min_group_size > 1 else "") + f", got {data.group_size}")
        data.validate()  # sizes, format and columns (`data/source.TaskSource`)
        self.tools.validate()
        self.rollout.validate(self.sampling)
        self.reward_options.overlong.validate(self.policy_token_budget())
        if loss.sampler_correction == "tis" and self.sampling.greedy:
            raise UserError("loss.sampler_correction tis needs sampled rollouts (sampling.greedy is true: there is no sampler distribution)")
        off_policy = off_policy_objective(loss, data.max_staleness)
        if off_policy.reads_behaviour and self.sampling.greedy:
            raise UserError(f"loss.off_policy.objective {off_policy.name} needs sampled rollouts "
                            "(sampling.greedy is true: there is no behaviour distribution)")
        if data.dynamic_sampling and data.group_size < 2:
            raise UserError("data.dynamic_sampling needs groups: data.group_size >= 2")
        if not estimator.needs_critic and critic != Critic():
            with_critic = [entry for entry in ADVANTAGE_ESTIMATORS.values() if entry.needs_critic]
            raise UserError(f"the critic section applies to loss.advantage {' or '.join(e.name for e in with_critic)} "
                            f"({', '.join(f'posttrain {e.command}' for e in with_critic)}) only")
        self.acceptance.validate()
        rows = data.prompts_per_step * data.group_size
        if rows % update.mini_batches:
            raise UserError(f"{rows} rows per step (prompts_per_step x group_size) do not split into {update.mini_batches} mini-batches")

    def policy_token_budget(self) -> int:
        """The most tokens of its own the policy can write in one row: sampling.max_new_tokens; in a
        tool episode max_turns x that, or tools.max_episode_tokens if less (which counts the observations too)."""
        if not self.tools.enabled:
            return self.sampling.max_new_tokens
        turns = self.tools.max_turns * self.sampling.max_new_tokens
        return turns if self.tools.max_episode_tokens is None else min(turns, self.tools.max_episode_tokens)


def grpo_config() -> Config:
    """`posttrain grpo`'s defaults: group-relative advantages, no critic, no KL."""
    return Config()


def ppo_config() -> Config:
    """`posttrain ppo`'s defaults: GAE from a critic, one sample per prompt, a k1 KL penalty in the reward."""
    return Config(data=Data(group_size=1), loss=Loss(advantage="gae", kl=KL(beta=0.05, estimator="k1", placement="reward")),
                  exact_kl_tokens=0)


def sampling_engine(config: Config) -> RolloutSettings:
    """The engine that samples: `config.rollout`'s, except that asynchronous generation
    (`data.async_generation`) runs the built-in engine in a worker process of its own (`worker`),
    so that generation and the trainer's forwards run at once; on a CPU the worker then takes half
    the trainer's threads unless `rollout.worker_threads` says (on 2 cores, 2 + 1 threads stepped
    1.03 s against 1.53 s for 2 + 2: docs/off_policy.md)."""
    rollout = config.rollout
    if not config.data.async_generation or rollout.engine not in ("builtin", "worker"):
        return rollout
    threads = rollout.worker_threads
    if threads is None and config.hardware.device in ("cpu", "auto") and not torch.cuda.is_available():
        threads = max(1, torch.get_num_threads() // 2)
    return dataclasses.replace(rollout, engine="worker", worker_threads=threads)
