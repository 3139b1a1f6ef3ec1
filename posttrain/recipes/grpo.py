"""`posttrain grpo`: GRPO with any verifier as the reward (RLVR when it is a program).

The four links: data = the model's own G completions per prompt (online); reward = the configured
verifier (or a Python callable passed to `run`); loss = clipped surrogate on group-relative
advantages, no critic (DeepSeekMath, arXiv:2402.03300 section 4.1), every variant an argument;
acceptance = held-out prompts scored by a separately configured checker.

Each step: 1. sample, 2. score, 3. advantages (optionally refilling zero-signal groups),
4. update (mu epochs over mini-batches, old log-probs fixed), 5. log, evaluate, checkpoint.

    posttrain grpo --config presets/tiny-grpo.yaml --max-steps 20
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm

from posttrain.algorithms import AGGREGATIONS, aggregate, clipped_surrogate, grpo_advantages, kl_estimate, masked_mean, token_logprobs
from posttrain.config import save_yaml, to_dict
from posttrain.data.examples import derived_seed
from posttrain.data.tasks import load_splits
from posttrain.distributed import Parallel, World, full_weights, gradient_sync, init_world, wrap
from posttrain.errors import UserError
from posttrain.evaluation.alarms import DivergenceAlarm
from posttrain.models import make_reference
from posttrain.recipes.common import (
    Optimization, Timer, clip_and_step, default_output_dir, load_policy, make_optimizer, restore_training, save_training, seed_everything,
)
from posttrain.recipes.online import (
    Acceptance, CompletionForward, Data, Sampling, completion_logits, evaluate_held_out, exact_kl_subset, make_verifier, rank_logprobs,
    rollout_metrics, sample_rows, section_dict, token_entropy,
)
from posttrain.recipes.online_data import PromptStream, rank_micro_batches, sample_and_score
from posttrain.runs import RunDirectory, new_card, plot_metrics, write_run_card

logger = logging.getLogger(__name__)

PLOTTED = ["reward/mean", "heldout/pass@1", "kl/exact", "kl/estimate", "length/mean", "loss", "entropy"]


@dataclass
class Loss:
    """Link 3, loss: every setting that makes two "GRPO"s differ, each named."""

    clip_low: float = 0.2
    """Ratio clipped below at 1 - clip_low."""
    clip_high: float = 0.2
    """Ratio clipped above at 1 + clip_high (DAPO clip-higher: 0.28)."""
    dual_clip: float | None = None
    """Cap negative-advantage losses at dual_clip * |A| (c > 1; None: off)."""
    advantage_scale: Literal["group", "batch", "none"] = "group"
    """Divide by the group std (GRPO), the batch std, or nothing (Dr. GRPO)."""
    advantage_eps: float = 1e-6
    """Added to the std before dividing."""
    unbiased_std: bool = False
    """False: population std (denominator G, as in the seed); True: denominator G - 1."""
    aggregation: str = "token_mean"
    """token_mean | seq_mean_token_mean (GRPO paper) | seq_mean_token_sum | seq_mean_token_sum_norm (Dr. GRPO)."""
    kl_beta: float = 0.0
    """KL coefficient; 0 loads no reference model at all."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Sampled KL estimator."""
    kl_placement: Literal["loss", "reward"] = "loss"
    """KL as a loss term (GRPO) or subtracted from each sequence's reward before advantages."""
    reference_refresh_every: int = 0
    """Copy the policy into the reference every N steps (0: never; recorded in the run card)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more prompts to refill the batch."""
    max_refill_rounds: int = 3
    """Dynamic sampling: at most this many extra sampling rounds per step."""
    mask_truncated: bool = False
    """Leave completions that hit max_new_tokens out of the loss (DAPO overlong filtering)."""


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
class Config:
    model: str = "tiny"
    """Model spec: tiny | smollm2-135m | a local Hugging Face directory | a hub id."""
    lora_rank: int = 0
    """LoRA rank (0: train all weights)."""
    lora_alpha: float = 16.0
    """LoRA alpha."""
    data: Data = field(default_factory=Data)
    """Link 1: prompts and groups."""
    sampling: Sampling = field(default_factory=Sampling)
    """Rollout sampling settings."""
    reward: str = "exact"
    """Link 2: the training verifier (posttrain.rewards name, weighted sum, or callable:<path>)."""
    loss: Loss = field(default_factory=Loss)
    """Link 3: the loss settings."""
    update: Update = field(default_factory=Update)
    """Epochs, mini-batches and micro-batches."""
    optim: Optimization = field(default_factory=lambda: Optimization(lr=1e-5))
    """Optimizer and schedule."""
    acceptance: Acceptance = field(default_factory=Acceptance)
    """Link 4: held-out evaluation."""
    parallel: Parallel = field(default_factory=Parallel)
    """Under torchrun: DDP or FSDP2 (see posttrain/distributed.py); ignored in one process."""
    max_steps: int = 50
    """Training steps (one batch of rollouts each)."""
    checkpoint_every: int = 50
    """Save a checkpoint every N steps (and at the end)."""
    samples_per_step: int = 4
    """Rows per step written to samples.jsonl."""
    exact_kl_tokens: int = 64
    """Tokens per step on which the exact full-vocabulary KL is logged (needs kl_beta > 0)."""
    seed: int = 0
    """Seeds data order, sampling and initialisation."""
    output_dir: str | None = None
    """Run directory (default runs/grpo-<time>)."""
    tensorboard: bool = False
    """Also write the metrics as TensorBoard event files in <run>/tensorboard (needs `pip install tensorboard`)."""

    def validate(self) -> None:
        self.data.validate()
        self.optim.validate()
        self.parallel.validate()
        loss, update = self.loss, self.update
        if loss.aggregation not in AGGREGATIONS:
            raise UserError(f"loss.aggregation must be one of {', '.join(AGGREGATIONS)}, got {loss.aggregation!r}")
        if loss.clip_low < 0 or loss.clip_low >= 1 or loss.clip_high < 0:
            raise UserError(f"loss.clip_low must be in [0, 1) and clip_high >= 0, got {loss.clip_low}, {loss.clip_high}")
        if loss.dual_clip is not None and loss.dual_clip <= 1:
            raise UserError(f"loss.dual_clip must be > 1, got {loss.dual_clip}")
        if loss.kl_beta < 0 or loss.advantage_eps < 0:
            raise UserError("loss.kl_beta and loss.advantage_eps must be >= 0")
        if loss.reference_refresh_every and loss.kl_beta == 0:
            raise UserError("loss.reference_refresh_every needs a reference: set loss.kl_beta > 0")
        rows = self.data.prompts_per_step * self.data.group_size
        if update.epochs < 1 or update.mini_batches < 1 or update.micro_batch_size < 1:
            raise UserError("update.epochs, update.mini_batches and update.micro_batch_size must be >= 1")
        if rows % update.mini_batches:
            raise UserError(f"{rows} rows per step (prompts_per_step x group_size) do not split into {update.mini_batches} mini-batches")
        for name in ("max_steps", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        self.sampling.engine_config()  # raises UserError on impossible sampling settings


def run(config: Config, resume: bool = False, reward: Any = None) -> Path:
    """Train with GRPO; returns the run directory. `reward` may be a Verifier or any callable
    `fn(completion, example) -> float | Verdict`, used instead of `config.reward`."""
    # 0. Set-up: everything that can fail on bad input fails before the run directory exists.
    config.validate()
    world = init_world(config.parallel)
    seed_everything(config.seed)
    policy, tokenizer = load_policy(config.model, config.lora_rank, config.lora_alpha)
    train, held_out = load_splits(
        config.data.task, train_size=config.data.train_size, eval_size=config.data.eval_size, seed=config.seed,
        options=config.data.task_options,
    )
    verifier = make_verifier(reward, config.reward)
    verifier.prepare()
    reference = make_reference(policy) if config.loss.kl_beta > 0 else None
    if reference is not None and not reference.adapter_disabled and world.strategy == "fsdp2":
        wrap(reference.model, world)  # the frozen copy sharded like the policy
    # What forward/backward goes through: one call = completion logits of some rows (DDP, FSDP2 or
    # the policy itself). FSDP2 pairs every model call across ranks, so it skips the shared-prefix
    # forward, whose number of model calls depends on the rows.
    trainer = wrap(CompletionForward(policy, shared_prefix=not (world.active and world.strategy == "fsdp2")), world)
    run_dir = RunDirectory(config.output_dir or default_output_dir("grpo", world), resume=resume, writer=world.main, tensorboard=config.tensorboard)
    config.output_dir = str(run_dir.path)
    if world.main:
        save_yaml(config, run_dir.path / "config.yaml")
    optimizer, scheduler = make_optimizer(trainer.parameters(), config.optim, config.max_steps * config.update.epochs * config.update.mini_batches)
    # A refreshed reference is state of its own: checkpointed with the policy, restored exactly.
    reference_state = {"reference": reference.model} if reference is not None and config.loss.reference_refresh_every else None
    state = restore_training(run_dir, policy, optimizer, scheduler, extra_models=reference_state, world=world) if resume else {"step": 0}
    stream = PromptStream(train, config.seed, state.get("stream_position", 0))
    alarm = DivergenceAlarm(config.acceptance.alarm_window, config.acceptance.alarm_reward_rise, history=state.get("alarm_history", []))
    card = make_card(config, train, held_out, verifier, reference, reward)
    card["run"]["reference_refreshed_at"] = state.get("reference_refreshed_at", [])
    card["run"]["world_size"] = world.size
    if world.main:
        write_run_card(run_dir.path, card)
    sampling = config.sampling.engine_config()
    G = config.data.group_size

    if state["step"] == 0:
        run_dir.log_metrics(0, evaluate(policy, tokenizer, held_out, config, run_dir, 0, alarm, None, world))
    policy.train()
    progress = tqdm(range(state["step"], config.max_steps), desc="grpo", initial=state["step"], total=config.max_steps, disable=not world.main)
    for step in progress:
        done, timer, metrics, started = step + 1, Timer(), {}, time.perf_counter()
        # 1-3. Sample B prompts x G completions, score them, keep groups with signal (refilling if asked).
        refill_rounds = config.loss.max_refill_rounds if config.loss.dynamic_sampling else None
        with full_weights(policy):
            rollout, examples, scores, rendered, group_stats, owners = sample_and_score(
                policy, tokenizer, stream, verifier, config.data, config.seed, sampling, step, timer, refill_rounds, world
            )
        metrics.update(group_stats)
        inputs = rollout.forward_inputs()
        # Rows that reach the loss: scored (not infra/data errors) and, optionally, not truncated.
        valid_rows = ~torch.isnan(scores.rewards)
        if config.loss.mask_truncated:
            valid_rows &= ~rollout.truncated
        mask = rollout.mask & valid_rows[:, None]
        precompute_old = config.update.epochs > 1 or config.update.mini_batches > 1 or config.loss.kl_placement == "reward"
        with timer("training"):
            old_logprobs = rank_logprobs(policy, rollout, owners, world, sampling.temperature, config.update.micro_batch_size) if precompute_old else None
            ref_logprobs = rank_logprobs(reference, rollout, owners, world, sampling.temperature, config.update.micro_batch_size) if reference else None
        rewards = scores.rewards
        if ref_logprobs is not None and config.loss.kl_placement == "reward":
            # KL folded into the reward: each sequence pays beta * its summed per-token estimate.
            penalty = (kl_estimate(old_logprobs, ref_logprobs, config.loss.kl_estimator) * rollout.mask).sum(-1)
            rewards = rewards - config.loss.kl_beta * penalty
        advantages = grpo_advantages(
            rewards, G, scale=config.loss.advantage_scale, eps=config.loss.advantage_eps, unbiased_std=config.loss.unbiased_std
        )
        # 4. Update: mu epochs over mini-batches, old log-probs fixed.
        with timer("training"):
            if reference is not None:
                metrics["kl/exact"] = exact_kl_metric(policy, reference, rollout, mask, owners, world, sampling.temperature, config.exact_kl_tokens)
            metrics.update(update_policy(trainer, optimizer, scheduler, rollout, inputs, mask, advantages, old_logprobs, ref_logprobs, owners, world, config, step))
        if reference is not None and config.loss.reference_refresh_every and done % config.loss.reference_refresh_every == 0:
            reference.refresh(policy)
            card["run"]["reference_refreshed_at"].append(done)
        # 5. Log, evaluate, checkpoint.
        metrics.update(rollout_metrics(rollout, scores, timer))
        metrics["lr"] = scheduler.get_last_lr()[0]
        metrics["seconds/step"] = time.perf_counter() - started  # the whole step before evaluation and logging
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
            save_training(run_dir, done, policy, tokenizer, optimizer, scheduler, extra_models=reference_state, world=world, extra_state={
                "stream_position": stream.position, "alarm_history": alarm.history,
                "reference_refreshed_at": card["run"]["reference_refreshed_at"],
            })
    if world.main:
        write_run_card(run_dir.path, card)
    del trainer
    world.close()
    return run_dir.path


def evaluate(policy, tokenizer, held_out, config: Config, run_dir, step: int, alarm, train_reward, world: World) -> dict[str, Any]:
    """Held-out acceptance on rank 0 (the others wait; under FSDP2 every rank lends its shards)."""
    with full_weights(policy):
        metrics = evaluate_held_out(policy, tokenizer, held_out, config, run_dir, step, alarm, train_reward) if world.main else {}
    world.barrier()
    return metrics


@torch.no_grad()
def exact_kl_metric(policy, reference, rollout, mask, owners, world: World, temperature: float, max_tokens: int) -> float | None:
    """Exact full-vocabulary KL(policy || reference) per token before the update, averaged over the
    first `max_tokens` counted tokens of each rank's rows (cheap enough to log every step)."""
    if max_tokens <= 0:
        return None
    mine = (owners == world.rank).nonzero().squeeze(1)
    mine = mine[: int((mask[mine].sum(-1).cumsum(0) < max_tokens).sum()) + 1]
    inputs, P, T = rollout.forward_inputs(), rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    total = torch.zeros(2, dtype=torch.float64)
    with full_weights(policy), full_weights(reference):
        if len(mine):
            _, logits = completion_logits(policy, inputs, mine, P, T)
            _, ref_logits = completion_logits(reference, inputs, mine, P, T)
            total += torch.tensor(exact_kl_subset(logits, ref_logits, mask[mine], temperature, max_tokens), dtype=torch.float64)
    kl_sum, count = world.reduce(total).tolist()
    return kl_sum / count if count else None


def update_policy(trainer, optimizer, scheduler, rollout, inputs, mask, advantages, old_logprobs, ref_logprobs,
                  owners: torch.Tensor, world: World, config: Config, step: int) -> dict[str, Any]:
    """Step 4: `epochs` passes over `mini_batches` mini-batches, each accumulated over micro-batches
    with the mini-batch's global token and sequence counts, so the gradient does not depend on the
    micro-batch size or the world size. Mini-batches are drawn over the global batch; each rank
    forwards the rows of a mini-batch it owns (`owners`), all ranks running equally many
    micro-batches (a rank short of rows runs a zero-weight one) with the gradient synced on the last.
    Returns the step's loss and per-token statistics, summed over ranks."""
    loss_cfg, update = config.loss, config.update
    N, T = rollout.completion_ids.shape
    P = rollout.prompt_ids.shape[1]
    temperature = config.sampling.temperature
    sums = torch.zeros(8, dtype=torch.float64)  # loss, clip low, clip high, dual clip, ratio, kl, entropy, tokens
    extremes = torch.tensor([float("inf"), float("inf")], dtype=torch.float64)  # (min ratio, -max ratio)
    grad_norms = []
    generator = torch.Generator().manual_seed(derived_seed(config.seed, "minibatch", str(step)))
    for epoch in range(update.epochs):
        order = torch.randperm(N, generator=generator) if update.mini_batches > 1 else torch.arange(N)
        # Exactly `mini_batches` optimizer steps even when dynamic sampling left the batch short.
        for mini in torch.tensor_split(order, update.mini_batches):
            if len(mini) == 0:
                continue
            global_tokens, global_sequences = mask[mini].sum(), len(mini)
            for rows, weight, last in rank_micro_batches(mini, owners, world, update.micro_batch_size):
                with gradient_sync(trainer, last):
                    logits = trainer(inputs, rows, P, T)
                    logprobs = token_logprobs(logits, rollout.completion_ids[rows], temperature)
                    old = old_logprobs[rows] if old_logprobs is not None else logprobs.detach()
                    per_token, stats = clipped_surrogate(logprobs, old, advantages[rows], loss_cfg.clip_low, loss_cfg.clip_high, loss_cfg.dual_clip)
                    micro_mask = mask[rows] & bool(weight)
                    if ref_logprobs is not None:
                        kl = kl_estimate(logprobs, ref_logprobs[rows], loss_cfg.kl_estimator)
                        if loss_cfg.kl_placement == "loss":
                            per_token = per_token + loss_cfg.kl_beta * kl
                        sums[5] += float((kl.detach() * micro_mask).sum())
                    loss = aggregate(per_token, micro_mask, loss_cfg.aggregation, global_tokens, global_sequences, max_length=config.sampling.max_new_tokens)
                    # DDP and FSDP2 average gradients over ranks; the loss is a share of a global sum.
                    (loss * (weight * world.size)).backward()
                sums[0] += weight * float(loss.detach()) / (update.epochs * update.mini_batches)
                sums[7] += float(micro_mask.sum())
                for index, key in ((1, "clipped_low"), (2, "clipped_high"), (3, "dual_clipped"), (4, "ratio")):
                    sums[index] += float((stats[key].float() * micro_mask).sum())
                sums[6] += float((token_entropy(logits, temperature) * micro_mask).sum())
                if micro_mask.any():
                    ratios = stats["ratio"][micro_mask]
                    extremes = torch.minimum(extremes, torch.tensor([float(ratios.min()), -float(ratios.max())], dtype=torch.float64))
            grad_norms.append(clip_and_step(trainer.parameters(), optimizer, scheduler, config.optim.max_grad_norm))
    world.reduce(sums)
    world.reduce(extremes, "min")
    tokens = max(1.0, float(sums[7]))
    loss_sum, clip_low, clip_high, dual, ratio, kl_sum, entropy, _ = sums.tolist()
    metrics = {
        "loss": loss_sum,
        "clip/low": clip_low / tokens, "clip/high": clip_high / tokens, "clip/dual": dual / tokens,
        "ratio/mean": ratio / tokens, "ratio/min": float(extremes[0]) if math.isfinite(extremes[0]) else None,
        "ratio/max": -float(extremes[1]) if math.isfinite(extremes[1]) else None,
        "entropy": entropy / tokens, "grad_norm": sum(grad_norms) / len(grad_norms),
        "advantages/abs_mean": float(masked_mean(advantages.abs()[:, None].expand_as(mask), mask)),
    }
    if ref_logprobs is not None:
        metrics["kl/estimate"] = kl_sum / tokens
    return metrics


def make_card(config: Config, train, held_out, verifier, reference, reward) -> dict[str, Any]:
    """The run card: the four links and every loss setting."""
    card = new_card("grpo", config.seed, model=config.model, lora_rank=config.lora_rank, config=to_dict(config))
    card["links"]["data"] = {
        "source": "online: the policy's own samples", "task": config.data.task, "options": config.data.task_options,
        "train_prompts": len(train), "heldout_prompts": len(held_out), "duplicates_removed": train.duplicates_removed,
        "prompts_per_step": config.data.prompts_per_step, "group_size": config.data.group_size,
        "sampling": section_dict(config.sampling),
    }
    card["links"]["reward"] = {**verifier.describe(), "passed_as": "python object" if reward is not None else "config name"}
    card["links"]["loss"] = {
        "algorithm": "GRPO (group-relative advantages, clipped surrogate, no critic)",
        **section_dict(config.loss), **section_dict(config.update),
        "std": "sample (n-1)" if config.loss.unbiased_std else "population (n)",
        "reference": "none (kl_beta = 0)" if reference is None else ("LoRA base (adapters disabled)" if reference.adapter_disabled else "frozen copy of the initial policy"),
        "old_logprobs": "recomputed by a no-grad forward" if (config.update.epochs > 1 or config.update.mini_batches > 1 or config.loss.kl_placement == "reward") else "the on-policy forward, detached (ratio exactly 1)",
        "logprob_distribution": f"softmax(logits / {config.sampling.temperature}) over the full vocabulary" + (" (sampling truncated by top-p/top-k: the sampler's distribution differs)" if config.sampling.top_p < 1 or config.sampling.top_k else ""),
    }
    card["links"]["acceptance"] = {
        "heldout": f"{config.data.task} held-out split ({len(held_out)} prompts, disjoint from training)",
        **section_dict(config.acceptance), "checker_is_training_reward": config.acceptance.checker == config.reward,
    }
    if config.acceptance.checker == config.reward:
        card["notes"].append("the held-out checker is the training reward itself: acceptance is not independent")
    return card
