"""`posttrain ppo`: PPO with a learned critic, and any verifier as the reward.

The four links: data = the model's own completions (online; G per prompt, G = 1 allowed);
reward = the configured verifier (a program works: TRL's PPO accepts only a reward model);
loss = clipped surrogate on per-token GAE advantages from a value head, clipped value loss, the KL
to the frozen reference folded into per-token rewards (Ouyang et al., arXiv:2203.02155 eq. 2) or
added to the loss; acceptance = held-out prompts with a separately configured checker.

Each step: 1. sample, 2. score, 3. values, per-token rewards, GAE, 4. update policy and critic
(mu epochs over mini-batches; the first `critic.warmup_steps` steps train only the critic),
5. log, evaluate, checkpoint.

    posttrain ppo --config presets/tiny-ppo.yaml --max-steps 20
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm

from posttrain.algorithms import (
    AGGREGATIONS, aggregate, clipped_surrogate, clipped_value_loss, gae, kl_estimate, kl_penalized_rewards,
    masked_mean, token_logprobs, whiten,
)
from posttrain.config import save_yaml, to_dict
from posttrain.data.examples import derived_seed
from posttrain.data.tasks import load_splits
from posttrain.distributed import Parallel, gradient_sync, init_world, wrap
from posttrain.errors import UserError
from posttrain.evaluation.alarms import DivergenceAlarm
from posttrain.models import make_critic, make_reference
from posttrain.recipes.common import (
    Optimization, Timer, default_output_dir, fused_adamw_supported, load_policy, lr_multiplier, restore_training, save_training, seed_everything,
)
from posttrain.recipes.online import (
    Acceptance, Data, Sampling, evaluate_held_out, make_verifier, rank_logprobs, rollout_metrics, sample_rows, section_dict, token_entropy,
)
from posttrain.recipes.online_data import PromptStream, rank_micro_batches, sample_and_score
from posttrain.runs import RunDirectory, new_card, plot_metrics, write_run_card

logger = logging.getLogger(__name__)

PLOTTED = ["reward/mean", "heldout/pass@1", "kl/estimate", "value_loss", "length/mean", "loss"]


@dataclass
class Loss:
    """Link 3, loss: PPO-clip with GAE and a critic."""

    clip_low: float = 0.2
    """Ratio clipped below at 1 - clip_low."""
    clip_high: float = 0.2
    """Ratio clipped above at 1 + clip_high."""
    dual_clip: float | None = None
    """Cap negative-advantage losses at dual_clip * |A| (c > 1; None: off)."""
    gamma: float = 1.0
    """GAE discount over tokens."""
    lam: float = 0.95
    """GAE lambda."""
    whiten_advantages: bool = True
    """Normalise advantages to zero mean, unit std over the batch's response tokens."""
    aggregation: str = "token_mean"
    """token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm."""
    kl_beta: float = 0.05
    """KL coefficient; 0 loads no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """Sampled KL estimator (k1 is the classic per-token penalty in the reward)."""
    kl_placement: Literal["reward", "loss"] = "reward"
    """KL as a per-token penalty in the rewards (PPO-RLHF) or as a loss term."""


@dataclass
class CriticSettings:
    """The value model."""

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
    """mu: passes over the batch with the old log-probs and values fixed."""
    mini_batches: int = 1
    """Optimizer steps per epoch."""
    micro_batch_size: int = 16
    """Rows per forward/backward (global normalisers: the gradient does not depend on it)."""


@dataclass
class Config:
    model: str = "tiny"
    """Model spec: tiny | smollm2-135m | a local Hugging Face directory | a hub id."""
    lora_rank: int = 0
    """LoRA rank (0: train all weights)."""
    lora_alpha: float = 16.0
    """LoRA alpha."""
    data: Data = field(default_factory=lambda: Data(group_size=1))
    """Link 1: prompts and samples per prompt (G = 1 is fine: the critic is the baseline)."""
    sampling: Sampling = field(default_factory=Sampling)
    """Rollout sampling settings."""
    reward: str = "exact"
    """Link 2: the training verifier."""
    loss: Loss = field(default_factory=Loss)
    """Link 3: the loss settings."""
    critic: CriticSettings = field(default_factory=CriticSettings)
    """The value model."""
    update: Update = field(default_factory=Update)
    """Epochs, mini-batches and micro-batches."""
    optim: Optimization = field(default_factory=lambda: Optimization(lr=1e-5))
    """Policy optimizer and schedule (the critic uses critic.lr with the same schedule)."""
    acceptance: Acceptance = field(default_factory=Acceptance)
    """Link 4: held-out evaluation."""
    parallel: Parallel = field(default_factory=Parallel)
    """Under torchrun: DDP (FSDP2 is not supported for PPO yet); ignored in one process."""
    max_steps: int = 50
    """Training steps."""
    checkpoint_every: int = 50
    """Save a checkpoint every N steps (and at the end)."""
    samples_per_step: int = 4
    """Rows per step written to samples.jsonl."""
    seed: int = 0
    """Seeds data order, sampling and initialisation."""
    output_dir: str | None = None
    """Run directory (default runs/ppo-<time>)."""
    tensorboard: bool = False
    """Also write the metrics as TensorBoard event files in <run>/tensorboard (needs `pip install tensorboard`)."""

    def validate(self) -> None:
        self.data.validate(min_group_size=1)
        self.optim.validate()
        self.parallel.validate()
        if self.loss.aggregation not in AGGREGATIONS:
            raise UserError(f"loss.aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.loss.aggregation!r}")
        if not 0 <= self.loss.gamma <= 1 or not 0 <= self.loss.lam <= 1:
            raise UserError(f"loss.gamma and loss.lam must be in [0, 1], got {self.loss.gamma}, {self.loss.lam}")
        if self.loss.dual_clip is not None and self.loss.dual_clip <= 1:
            raise UserError(f"loss.dual_clip must be > 1, got {self.loss.dual_clip}")
        if self.critic.lr <= 0 or self.critic.value_coef < 0 or self.critic.warmup_steps < 0:
            raise UserError("critic.lr must be > 0, critic.value_coef and critic.warmup_steps >= 0")
        rows = self.data.prompts_per_step * self.data.group_size
        if min(self.update.epochs, self.update.mini_batches, self.update.micro_batch_size) < 1:
            raise UserError("update.epochs, update.mini_batches and update.micro_batch_size must be >= 1")
        if rows % self.update.mini_batches:
            raise UserError(f"{rows} rows per step do not split into {self.update.mini_batches} mini-batches")
        if min(self.max_steps, self.checkpoint_every) < 1:
            raise UserError("max_steps and checkpoint_every must be at least 1")
        self.sampling.engine_config()


def run(config: Config, resume: bool = False, reward: Any = None) -> Path:
    """Train with PPO and a critic; returns the run directory. `reward` may be a Verifier or any
    callable `fn(completion, example) -> float | Verdict`, used instead of `config.reward`."""
    # 0. Set-up: everything that can fail on bad input fails before the run directory exists.
    config.validate()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and config.parallel.strategy != "ddp":
        raise UserError("ppo under torchrun supports parallel.strategy ddp only (its critic is not sharded with FSDP2)")
    world = init_world(config.parallel)
    seed_everything(config.seed)
    policy, tokenizer = load_policy(config.model, config.lora_rank, config.lora_alpha)
    critic = make_critic(policy, share_backbone=config.critic.share_backbone)
    train, held_out = load_splits(
        config.data.task, train_size=config.data.train_size, eval_size=config.data.eval_size, seed=config.seed,
        options=config.data.task_options,
    )
    verifier = make_verifier(reward, config.reward)
    verifier.prepare()
    reference = make_reference(policy) if config.loss.kl_beta > 0 else None
    run_dir = RunDirectory(config.output_dir or default_output_dir("ppo", world), resume=resume, writer=world.main, tensorboard=config.tensorboard)
    config.output_dir = str(run_dir.path)
    if world.main:
        save_yaml(config, run_dir.path / "config.yaml")
    # What forward/backward goes through: one call = the logits and values of some rows (DDP or not).
    trainer = wrap(PolicyAndCritic(policy, critic, config.critic.share_backbone), world)
    optimizer, scheduler = make_optimizers(policy, critic, config)
    state = restore_training(run_dir, policy, optimizer, scheduler, extra_models={"critic": critic}, world=world) if resume else {"step": 0}
    stream = PromptStream(train, config.seed, state.get("stream_position", 0))
    alarm = DivergenceAlarm(config.acceptance.alarm_window, config.acceptance.alarm_reward_rise, history=state.get("alarm_history", []))
    card = make_card(config, train, held_out, verifier, reference, reward)
    card["run"]["world_size"] = world.size
    if world.main:
        write_run_card(run_dir.path, card)
    sampling = config.sampling.engine_config()

    if state["step"] == 0:
        run_dir.log_metrics(0, evaluate(policy, tokenizer, held_out, config, run_dir, 0, alarm, None, world))
    policy.train()
    critic.train()
    progress = tqdm(range(state["step"], config.max_steps), desc="ppo", initial=state["step"], total=config.max_steps, disable=not world.main)
    for step in progress:
        done, timer, metrics = step + 1, Timer(), {}
        # 1-2. Sample B prompts x G completions and score them.
        rollout, examples, scores, rendered, group_stats, owners = sample_and_score(
            policy, tokenizer, stream, verifier, config.data, config.seed, sampling, step, timer, world=world
        )
        metrics.update(group_stats)
        inputs = rollout.forward_inputs()
        P, T = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
        scored = ~torch.isnan(scores.rewards)  # infra/data errors never reach the loss
        mask = rollout.mask & scored[:, None]
        # 3. Old log-probs and values, per-token rewards (KL penalty), GAE advantages and returns.
        with timer("training"):
            old_logprobs = rank_logprobs(policy, rollout, owners, world, sampling.temperature, config.update.micro_batch_size)
            ref_logprobs = rank_logprobs(reference, rollout, owners, world, sampling.temperature, config.update.micro_batch_size) if reference else None
            mine = (owners == world.rank).nonzero().squeeze(1)
            old_values = torch.zeros(mask.shape)
            if len(mine):
                old_values[mine] = critic_values(critic, inputs, P, T, config.update.micro_batch_size, rows=mine)
            old_values = world.reduce(old_values)
        sequence_rewards = torch.nan_to_num(scores.rewards, nan=0.0)
        kl = kl_estimate(old_logprobs, ref_logprobs, config.loss.kl_estimator) if ref_logprobs is not None else torch.zeros_like(old_logprobs)
        beta_in_reward = config.loss.kl_beta if config.loss.kl_placement == "reward" else 0.0
        token_rewards = kl_penalized_rewards(sequence_rewards, kl, mask, beta_in_reward)
        advantages, returns = gae(token_rewards, old_values, mask, config.loss.gamma, config.loss.lam)
        if config.loss.whiten_advantages:
            advantages = whiten(advantages, mask)
        # 4. Update policy and critic.
        with timer("training"):
            metrics.update(update_policy_and_critic(
                trainer, optimizer, scheduler, rollout, inputs, mask, advantages, returns, old_logprobs,
                old_values, ref_logprobs, owners, world, config, step, critic_only=step < config.critic.warmup_steps,
            ))
        # 5. Log, evaluate, checkpoint.
        metrics.update(rollout_metrics(rollout, scores, timer))
        metrics.update({
            "kl/estimate": float(masked_mean(kl, mask)) if ref_logprobs is not None else None,
            "values/mean": float(masked_mean(old_values, mask)), "returns/mean": float(masked_mean(returns, mask)),
            "explained_variance": explained_variance(old_values, returns, mask),
            "lr": scheduler.get_last_lr()[0], "critic_lr": scheduler.get_last_lr()[1],
        })
        run_dir.log_samples(done, sample_rows(rollout, examples, scores, rendered, config.samples_per_step))
        if (config.acceptance.eval_every and done % config.acceptance.eval_every == 0) or done == config.max_steps:
            metrics.update(evaluate(policy, tokenizer, held_out, config, run_dir, done, alarm, metrics["reward/mean"], world))
            card["alarms"] = list(alarm.rings)
            if world.main:
                write_run_card(run_dir.path, card)
        run_dir.log_metrics(done, metrics)
        if "heldout/pass@1" in metrics and world.main:
            plot_metrics(run_dir.read_metrics(), PLOTTED, run_dir.plots)
        progress.set_postfix(reward=f"{metrics['reward/mean'] or 0:.3f}")
        if done % config.checkpoint_every == 0 or done == config.max_steps:
            save_training(run_dir, done, policy, tokenizer, optimizer, scheduler, extra_models={"critic": critic}, world=world,
                          extra_state={"stream_position": stream.position, "alarm_history": alarm.history})
    if world.main:
        write_run_card(run_dir.path, card)
    del trainer
    world.close()
    return run_dir.path


class PolicyAndCritic(torch.nn.Module):
    """Policy and critic as DDP sees them in training: one forward returns the (n, T, V) logits and
    (n, T) values of some rows (from the policy's last hidden states through the value head when the
    critic shares its backbone, else from the critic's own forward)."""

    def __init__(self, policy, critic, share_backbone: bool):
        super().__init__()
        self.policy, self.critic, self.share_backbone = policy, critic, share_backbone

    def forward(self, inputs, rows, P: int, T: int, detach_hidden: bool = False):
        output = self.policy(input_ids=inputs["input_ids"][rows], attention_mask=inputs["attention_mask"][rows],
                             position_ids=inputs["position_ids"][rows], output_hidden_states=self.share_backbone)
        logits = output.logits[:, P - 1 : P - 1 + T]
        if self.share_backbone:
            hidden = output.hidden_states[-1][:, P - 1 : P - 1 + T]
            return logits, self.critic.values_from_hidden(hidden.detach() if detach_hidden else hidden)
        return logits, critic_values(self.critic, inputs, P, T, len(rows), rows=rows, grad=True)


def evaluate(policy, tokenizer, held_out, config: Config, run_dir, step: int, alarm, train_reward, world) -> dict[str, Any]:
    """Held-out acceptance on rank 0 (the others wait)."""
    metrics = evaluate_held_out(policy, tokenizer, held_out, config, run_dir, step, alarm, train_reward) if world.main else {}
    world.barrier()
    return metrics


def make_optimizers(policy, critic, config: Config):
    """One AdamW with two parameter groups (policy at optim.lr, critic at critic.lr) and one
    schedule; a shared-backbone critic contributes only its value head."""
    policy_params = [p for p in policy.parameters() if p.requires_grad]
    critic_params = [p for p in critic.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": policy_params, "lr": config.optim.lr}, {"params": critic_params, "lr": config.critic.lr}],
        betas=tuple(config.optim.betas), weight_decay=config.optim.weight_decay,
        fused=fused_adamw_supported(policy_params + critic_params) or None,  # as make_optimizer
    )
    total = config.max_steps * config.update.epochs * config.update.mini_batches
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, config.optim.warmup_steps, total, config.optim.schedule)
    )
    return optimizer, scheduler


def critic_values(critic, inputs, P: int, T: int, micro_batch_size: int, rows=None, grad: bool = False) -> torch.Tensor:
    """(n, T) values V(s_t) of the state before each completion token (the hidden state of the
    token preceding it, like the logits that score it)."""
    rows = torch.arange(inputs["input_ids"].shape[0]) if rows is None else rows
    pieces = []
    with torch.set_grad_enabled(grad):
        for start in range(0, len(rows), micro_batch_size):
            chunk = rows[start : start + micro_batch_size]
            values = critic(input_ids=inputs["input_ids"][chunk], attention_mask=inputs["attention_mask"][chunk],
                            position_ids=inputs["position_ids"][chunk])
            pieces.append(values[:, P - 1 : P - 1 + T])
    return torch.cat(pieces)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float | None:
    """1 - Var(returns - values) / Var(returns) over response tokens: how much the critic explains."""
    if not mask.any():
        return None
    variance = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    residual = returns - values
    residual_variance = masked_mean((residual - masked_mean(residual, mask)) ** 2, mask)
    return float(1 - residual_variance / variance) if variance > 0 else None


def update_policy_and_critic(trainer, optimizer, scheduler, rollout, inputs, mask, advantages, returns, old_logprobs,
                             old_values, ref_logprobs, owners, world, config: Config, step: int, critic_only: bool) -> dict[str, Any]:
    """Step 4: total loss = policy loss + value_coef * value loss (+ beta * KL when placed in the
    loss), each aggregated with the mini-batch's global normalisers; during critic warm-up only the
    value loss, and a shared backbone then gets no gradient (its hidden states are detached).
    `trainer` is a `PolicyAndCritic` (in DDP under torchrun): each rank forwards the rows of a
    mini-batch it owns, all ranks running equally many micro-batches (a short rank a zero-weight one)."""
    loss_cfg, update, critic_cfg = config.loss, config.update, config.critic
    N, T = rollout.completion_ids.shape
    P = rollout.prompt_ids.shape[1]
    temperature = config.sampling.temperature
    sums = torch.zeros(8, dtype=torch.float64)  # loss, value loss, clip low, clip high, value clipped, ratio, entropy, tokens
    grad_norms = []
    policy_params = optimizer.param_groups[0]["params"]
    critic_params = optimizer.param_groups[1]["params"]
    generator = torch.Generator().manual_seed(derived_seed(config.seed, "minibatch", str(step)))
    for _ in range(update.epochs):
        order = torch.randperm(N, generator=generator) if update.mini_batches > 1 else torch.arange(N)
        for mini in torch.tensor_split(order, update.mini_batches):
            global_tokens, global_sequences = mask[mini].sum(), len(mini)
            for rows, weight, last in rank_micro_batches(mini, owners, world, update.micro_batch_size):
                micro_mask = mask[rows] & bool(weight)
                with gradient_sync(trainer, last):
                    logits, values = trainer(inputs, rows, P, T, detach_hidden=critic_only)
                    value_per_token, value_clipped = clipped_value_loss(values, old_values[rows], returns[rows], critic_cfg.value_clip)
                    value_loss = aggregate(value_per_token, micro_mask, loss_cfg.aggregation, global_tokens, global_sequences, max_length=config.sampling.max_new_tokens)
                    loss = critic_cfg.value_coef * value_loss
                    logprobs = token_logprobs(logits, rollout.completion_ids[rows], temperature)
                    per_token, stats = clipped_surrogate(logprobs, old_logprobs[rows], advantages[rows], loss_cfg.clip_low, loss_cfg.clip_high, loss_cfg.dual_clip)
                    if ref_logprobs is not None and loss_cfg.kl_placement == "loss":
                        per_token = per_token + loss_cfg.kl_beta * kl_estimate(logprobs, ref_logprobs[rows], loss_cfg.kl_estimator)
                    if not critic_only:
                        loss = loss + aggregate(per_token, micro_mask, loss_cfg.aggregation, global_tokens, global_sequences, max_length=config.sampling.max_new_tokens)
                    # Every parameter in the graph each backward (DDP waits for all); DDP averages over ranks.
                    (loss * (weight * world.size) + 0.0 * logits.sum()).backward()
                scale = update.epochs * update.mini_batches
                sums[0] += weight * float(loss.detach()) / scale
                sums[1] += weight * float(value_loss.detach()) / scale
                sums[7] += float(micro_mask.sum())
                for index, key in ((2, "clipped_low"), (3, "clipped_high"), (5, "ratio")):
                    sums[index] += float((stats[key].float() * micro_mask).sum())
                sums[4] += float((value_clipped.float() * micro_mask).sum())
                sums[6] += float((token_entropy(logits, temperature) * micro_mask).sum())
            if critic_only:
                for parameter in policy_params:
                    parameter.grad = None  # AdamW skips parameters without a gradient
            max_norm = config.optim.max_grad_norm if config.optim.max_grad_norm is not None else float("inf")
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_([p for p in policy_params if p.grad is not None], max_norm)))
            torch.nn.utils.clip_grad_norm_([p for p in critic_params if p.grad is not None], max_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    loss_sum, value_sum, clip_low, clip_high, value_clipped, ratio, entropy, tokens = world.reduce(sums).tolist()
    tokens = max(1.0, tokens)
    return {
        "loss": loss_sum, "value_loss": value_sum, "critic_only": critic_only,
        "clip/low": clip_low / tokens, "clip/high": clip_high / tokens,
        "clip/value": value_clipped / tokens, "ratio/mean": ratio / tokens,
        "entropy": entropy / tokens, "grad_norm": sum(grad_norms) / len(grad_norms),
    }


def make_card(config: Config, train, held_out, verifier, reference, reward) -> dict[str, Any]:
    card = new_card("ppo", config.seed, model=config.model, lora_rank=config.lora_rank, config=to_dict(config))
    card["links"]["data"] = {
        "source": "online: the policy's own samples", "task": config.data.task, "options": config.data.task_options,
        "train_prompts": len(train), "heldout_prompts": len(held_out), "duplicates_removed": train.duplicates_removed,
        "prompts_per_step": config.data.prompts_per_step, "samples_per_prompt": config.data.group_size,
        "sampling": section_dict(config.sampling),
    }
    card["links"]["reward"] = {**verifier.describe(), "passed_as": "python object" if reward is not None else "config name",
                               "placement": "verifier score on the last response token"}
    card["links"]["loss"] = {
        "algorithm": "PPO with a learned critic (GAE advantages, clipped surrogate, clipped value loss)",
        **section_dict(config.loss), **{f"critic_{k}": v for k, v in section_dict(config.critic).items()},
        **section_dict(config.update),
        "reference": "none (kl_beta = 0)" if reference is None else ("LoRA base (adapters disabled)" if reference.adapter_disabled else "frozen copy of the initial policy"),
        "old_logprobs": "recomputed by a no-grad forward before the update",
        "logprob_distribution": f"softmax(logits / {config.sampling.temperature}) over the full vocabulary",
    }
    card["links"]["acceptance"] = {
        "heldout": f"{config.data.task} held-out split ({len(held_out)} prompts, disjoint from training)",
        **section_dict(config.acceptance), "checker_is_training_reward": config.acceptance.checker == config.reward,
    }
    return card
