"""`posttrain grpo` and `posttrain ppo`: one online recipe, the advantage estimator an argument.

The four links: data = the model's own G completions per prompt; reward = the configured verifier
(or a Python callable passed to `run`); loss = the clipped surrogate on advantages that are
group-relative (`loss.advantage: group`, GRPO, DeepSeekMath arXiv:2402.03300 section 4.1, no
critic) or per-token GAE from a learned critic (`gae`, PPO, Ouyang et al. arXiv:2203.02155), every
variant an argument; acceptance = held-out prompts scored by a separately configured checker.

Each step: 1. sample, 2. score (`sample`: the data and reward links, refilling zero-signal groups
when asked), 3. old / reference log-probs (and values), KL in the reward when placed there,
advantages (the loss link's `losses.policy_gradient.prepare`), 4. update (mu epochs over
mini-batches, old log-probs fixed: `losses.policy_gradient.step`), 5. log, evaluate, checkpoint
(`run`; the checks around the loop, held-out acceptance with the divergence alarm, the training
signal and a lost engine, are `online_checks.py`). Steps 3-4 are `step(state, batch) -> metrics`:
the loss link on the models and settings `loss_inputs(state)` builds, then the run's own part (the
step count, the reference's refresh, the learning rates); bench/grpo.py times the loss link's
prepare + step on the same inputs.
With `data.max_staleness` k >= 1 steps 1-2 sample, with the weights the step starts from, the
batch of the step k ahead, and the step trains the oldest batch sampled (`next_batch`,
`data/staleness.py`): simulated staleness, the same run every time, its pending batches checkpointed.

    posttrain grpo --config tiny-grpo --max-steps 20
    posttrain ppo --config tiny-ppo --max-steps 20
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from posttrain.algorithms.estimators import ADVANTAGE_ESTIMATORS
from posttrain.data.async_generation import AsyncBatches, generation_copy
from posttrain.data.context import PromptSet, check_prompts_fit, heldout_budget
from posttrain.data.examples import Task, derived_seed, require_examples
from posttrain.data.prompts import convention_record
from posttrain.data.scored_batch import ScoredBatch, sample_and_score
from posttrain.data.screening import LAYOUTS, screen_problems
from posttrain.data.staleness import PendingBatches
from posttrain.data.stream import PromptStream
from posttrain.data.tasks import load_splits
from posttrain.distributed import World, full_weights, wrap
from posttrain.errors import UserError
from posttrain.hardware import Placement, cpu_placement, resolve
from posttrain.evaluation.acceptance import IN_DISTRIBUTION, HeldOutSet, heldout_checker, independence, shifted_sets
from posttrain.evaluation.stats import least_squares_slope
from posttrain.models import make_critic, make_reference
from posttrain.models.forward import TrainingForward, policy_and_critic, policy_scores
from posttrain.models.loading import load_policy
from posttrain.losses.policy_gradient import PolicyModels, UpdateSettings, prepare
from posttrain.losses.policy_gradient import step as loss_step
from posttrain.optim import Trainable, make_optimizer
from posttrain.recipes.online_card import make_card, teacher_heldout
from posttrain.recipes.online_checks import RunChecks, engine_lost, evaluate
from posttrain.recipes.online_config import Config, sampling_engine
from posttrain.rewards import Verifier, as_verifier
from posttrain.rewards.defaults import default_reward
from posttrain.runs import RunDirectory, plot_metrics
from posttrain.runs.plots import plot_sets
from posttrain.runs.checkpoint import seed_everything
from posttrain.runs.faults import memory_guard
from posttrain.runs.timer import Timer
from posttrain.rollout.sampler import Sampler, engine_of, single_turn
from posttrain.rollout.vllm_backends import EngineUnavailable
from posttrain.runs.skeleton import StepLoop, card_writer, closing, open_run, start, warn_if_unsafe
from posttrain.runs.training_state import restore_training, save_training

logger = logging.getLogger(__name__)



@dataclass
class State:
    """Everything an online step reads and changes. `setup` builds it; `step` advances `step`."""

    config: Config
    world: World
    policy: Any
    tokenizer: Any
    trainer: torch.nn.Module
    """What forward/backward goes through: a `TrainingForward` (in DDP / FSDP2 under torchrun)."""
    reference: Any
    """The frozen reference (None when loss.kl.beta = 0)."""
    critic: Any
    """The value model (None for group advantages)."""
    optimizer: torch.optim.Optimizer
    scheduler: Any
    verifier: Verifier
    checker: Verifier
    """The held-out checker (the same sandbox settings, never partial credit)."""
    stream: PromptStream
    train: Task
    held_out: Task
    shifted: list[HeldOutSet] = field(default_factory=list)
    """The shifted held-out sets evaluated beside `held_out` (acceptance.sets)."""
    screening: dict | None = None
    """What the load-time screening of code problems removed (`screening.screen_problems`); None: not code."""
    step: int = 0
    reference_refreshed_at: list[int] = field(default_factory=list)
    placement: Placement = field(default_factory=cpu_placement)
    """The device and precision every model, batch and forward of the run uses."""
    sampler: Sampler = single_turn
    """What turns the step's prompts into rows (`rollout/sampler.py`): one turn by default."""
    pending: PendingBatches | AsyncBatches = field(default_factory=PendingBatches)
    """The batches sampled ahead of the steps that train them (`data.max_staleness` k >= 1; `data/staleness.py`), by a
    generation thread with `data.async_generation` (`data/async_generation.py`)."""
    entropy_history: list[float] = field(default_factory=list)
    """The last ENTROPY_WINDOW steps' `entropy`, for `entropy/slope` (checkpointed: a resumed run fits the same steps)."""


def setup(config: Config, reward: Any = None, world: World | None = None, placement: Placement | None = None) -> State:
    """Load the policy (and reference and critic) on the run's device and precision
    (`config.hardware`, or `placement` when given), the data and the verifier, wrap the trainer and
    make the optimizer: a State at step 0. `reward` may be a Verifier or a callable
    `fn(completion, example) -> float | Verdict`, used instead of `config.reward`."""
    world = world or World()
    placement = placement or resolve(config.hardware)
    seed_everything(config.seed)
    policy, tokenizer = load_policy(config.model, config.lora_rank, config.lora_alpha, placement,
                                    gradient_checkpointing=config.memory.gradient_checkpointing)
    critic = make_critic(policy, share_backbone=config.critic.share_backbone) if ADVANTAGE_ESTIMATORS[config.loss.advantage].needs_critic else None
    train, held_out = load_splits(config.data.task, train_size=config.data.train_size, eval_size=config.data.eval_size,
                                  seed=config.seed, options=config.data.load_options())
    screening = None
    if train.reward_kind in LAYOUTS:
        # References and the trivial programs are plain code, not completions: read raw, all-or-nothing.
        judge_options = dataclasses.replace(config.reward_options, extraction="raw", partial_credit=False)
        judge = as_verifier(None, default_reward(train.reward_kind), judge_options, config.unsafe_no_sandbox, for_checker=True)
        screening = screen_problems(train, held_out, judge, preflight=config.data.preflight,
                                    exclude_weak_tests=config.data.exclude_weak_tests)
    require_examples(train, config.data.prompts_per_step, setting="data.prompts_per_step")  # a step would repeat them
    verifier = as_verifier(reward, training_reward(config, train), config.reward_options, config.unsafe_no_sandbox,
                           placement=placement, world=world, tokenizer=tokenizer, temperature=config.sampling.temperature)
    if verifier.dense and config.data.dynamic_sampling:
        raise UserError(f"data.dynamic_sampling drops groups whose sequence rewards are equal, but {verifier.name} rewards each "
                        "token (a teacher's reward differs within every group): set data.dynamic_sampling false")
    checker = heldout_checker(config.acceptance.checker, held_out, config.reward_options, config.unsafe_no_sandbox,
                              placement=placement, world=world)
    warn_if_unsafe(config.unsafe_no_sandbox)
    convention = convention_record(train).get("answer_extraction")
    logger.info("training reward %s, held-out checker %s (task %s%s; answer kind %s%s)", verifier.name, checker.name, config.data.task,
                f", format {config.data.format}" if config.data.format else "", train.reward_kind,
                f", read as {convention}" if convention else "")
    independent, why = independence(verifier, checker)
    if not independent:
        logger.warning("acceptance is not independent: %s", why)
    verifier.prepare()

    shifted = shifted_sets(config.acceptance.sets, train, config.data.task, config.data.load_options(), config.seed,
                           len(held_out), config.reward_options, config.unsafe_no_sandbox)
    sampler = tool_sampler(config, tokenizer)
    budget, setting = heldout_budget(config.acceptance.max_new_tokens, config.sampling.max_new_tokens)
    heldout = {"held-out": held_out, **{f"held-out '{s.name}'": s.task for s in shifted}}
    check_prompts_fit(policy, tokenizer, [PromptSet("training", train.examples, config.sampling.max_new_tokens, "sampling.max_new_tokens"),
                                          *(PromptSet(name, task.examples, budget, setting) for name, task in heldout.items())],
                      system_prompt=config.data.system_prompt, tools=getattr(sampler, "tools", None))
    reference = make_reference(policy) if config.loss.kl.beta > 0 else None
    if reference is not None and not reference.adapter_disabled and world.strategy == "fsdp2":
        wrap(reference.model, world, placement)  # the frozen copy sharded like the policy
    trainer, optimizer, scheduler = build_trainer(config, policy, critic, world, placement)
    state = State(config=config, world=world, policy=policy, tokenizer=tokenizer, trainer=trainer, reference=reference,
                  critic=critic, optimizer=optimizer, scheduler=scheduler, verifier=verifier, checker=checker,
                  stream=PromptStream(train, config.seed), train=train, held_out=held_out, shifted=shifted, screening=screening,
                  placement=placement, sampler=sampler, pending=PendingBatches(config.data.max_staleness))
    if config.data.async_generation:
        state.pending = AsyncBatches(config.data.max_staleness, functools.partial(produce, state), generation_copy(policy))
    return state


def build_trainer(config: Config, policy, critic, world: World, placement: Placement):
    """What the update goes through: the `TrainingForward` over the policy (with a critic, over
    both: `policy_and_critic`), wrapped for DDP / FSDP2 under torchrun, and its optimizer and
    schedule over every update of the run (max_steps x epochs x mini-batches). Returns (trainer,
    optimizer, scheduler)."""
    total = config.max_steps * config.update.epochs * config.update.mini_batches
    # FSDP2 pairs every model call across ranks, so it skips the shared-prefix forward, whose number of
    # model calls depends on the rows, and the fused LM head, which reads the head's weight outside its module.
    sharded = world.active and world.strategy == "fsdp2"
    if critic is None:
        trainer = wrap(TrainingForward(policy, policy_scores, placement, shared_prefix=not sharded, full_forward=sharded), world, placement)
        optimizer, scheduler = make_optimizer(trainer.parameters(), config.optim, total)
        return trainer, optimizer, scheduler
    models = torch.nn.ModuleDict({"policy": policy, "critic": critic})
    trainer = wrap(TrainingForward(models, policy_and_critic, placement, share_backbone=config.critic.share_backbone, full_forward=sharded),
                   world, placement)
    # Two parameter groups, one schedule; a shared-backbone critic contributes only its value head.
    optimizer, scheduler = make_optimizer([
        {"params": [p for p in policy.parameters() if p.requires_grad], "lr": config.optim.lr},
        {"params": [p for p in critic.parameters() if p.requires_grad], "lr": config.critic.lr},
    ], config.optim, total)
    return trainer, optimizer, scheduler


def tool_sampler(config: Config, tokenizer) -> Sampler:
    """One turn per row, or, with `config.tools.names`, tool episodes (`rollout/episodes.py`) whose
    tools run with the run's sandbox settings (`reward_options`: timeout, memory, unsafe flag); each
    drawn by the engine `config.rollout` names (`rollout/engines.py`)."""
    from posttrain.rollout.engines import make_engine
    from posttrain.rollout.episodes import make_sampler

    return make_sampler(config.tools, tokenizer, config.reward_options.sandbox(config.unsafe_no_sandbox), make_engine(sampling_engine(config)))


def sample(state: State, timer: Timer | None = None, serves: int | None = None, policy=None, version: int | None = None) -> ScoredBatch:
    """Steps 1-2: sample B prompts x G completions with the policy and score them (`timer`
    collects the generation and scoring seconds): the batch of step `serves` (its sampling seeds;
    None: the next step, `state.step + 1`, on-policy), recorded as sampled by version `state.step`.
    `policy` and `version`: another model samples (the generation thread's copy), of that version."""
    config, timer = state.config, timer or Timer(state.placement.synchronize)
    serves = state.step + 1 if serves is None else serves
    policy, version = (state.policy, state.step) if policy is None else (policy, version)
    refill_rounds = config.data.max_refill_rounds if config.data.dynamic_sampling else None
    with full_weights(policy), state.placement.autocast():
        return sample_and_score(
            policy, state.tokenizer, state.stream, state.verifier, prompts=config.data.prompts_per_step,
            group_size=config.data.group_size, sampling=config.sampling, seed=config.seed, step=serves - 1, timer=timer,
            system_prompt=config.data.system_prompt, refill_rounds=refill_rounds, world=state.world, sampler=state.sampler,
            truncated=config.reward_options.truncated, overlong=config.reward_options.overlong, version=version,
        )


def produce(state: State, serves: int, policy, version: int) -> tuple[ScoredBatch, dict[str, float], int]:
    """The generation thread's draw (`data/async_generation.AsyncBatches`): the batch of step
    `serves` sampled by `policy` (its copy of the weights, `version`), its phases' seconds, and the
    prompt stream's position after it."""
    timer = Timer()
    batch = sample(state, timer, serves, policy, version)
    return batch, dict(timer.seconds), state.stream.position


def next_batch(state: State, timer: Timer) -> ScoredBatch:
    """Steps 1-2 of step `state.step + 1`: the batch it trains. On-policy (`data.max_staleness` 0)
    sampled now; with k >= 1 the oldest of those sampled ahead, after sampling with the current
    weights the batches of the steps up to k ahead (`data/staleness.PendingBatches`, each with the
    prompts and seeds of the step it serves)."""
    return state.pending.next(state.step + 1, state.config.max_steps, lambda serves: sample(state, timer, serves))


def step(state: State, batch: ScoredBatch, timer: Timer | None = None) -> dict[str, Any]:
    """Steps 3-4 on a sampled and scored batch, through the loss link (`losses/policy_gradient.py`):
    `prepare` (old and reference log-probs, values, the KL in the reward when placed there,
    advantages), then the update (`loss_step`); advances `state.step`, refreshes the reference on
    its schedule and returns the step's named metrics (floats) with the learning rates."""
    batch = batch.to(state.placement.device)  # the step's one host-to-device boundary
    config, timer = state.config, timer or Timer(state.placement.synchronize)
    models, settings = loss_inputs(state)
    with timer("logprobs"):
        update_batch, metrics = prepare(models, batch, settings, state.world)
    with timer("update"):
        metrics.update(loss_step(models, update_batch, settings, state.world))
    state.entropy_history = (state.entropy_history + [metrics["entropy"]])[-ENTROPY_WINDOW:]
    metrics["entropy/slope"] = least_squares_slope(state.entropy_history)  # per step; None until two steps
    state.step += 1
    state.pending.published(state.step, state.policy)  # mode (b): the generation thread may sample with these weights
    refresh_every = config.loss.kl.reference_refresh_every
    if state.reference is not None and refresh_every and state.step % refresh_every == 0:
        state.reference.refresh(state.policy)
        state.reference_refreshed_at.append(state.step)
    metrics["lr"] = state.scheduler.get_last_lr()[0]
    if state.critic is not None:
        metrics["critic_lr"] = state.scheduler.get_last_lr()[1]
    return metrics


ENTROPY_WINDOW = 10
"""The steps `entropy/slope` is fitted over."""


def loss_inputs(state: State) -> tuple[PolicyModels, UpdateSettings]:
    """The loss link's models and what it reads of the run's config at this step: the mini-batch
    order's seed (from the run's seed and `state.step`), critic warm-up (the critic alone trains
    while `state.step < critic.warmup_steps`) and how stale a batch may be (`data.max_staleness`)."""
    config = state.config
    models = PolicyModels(Trainable(state.trainer, state.optimizer, state.scheduler, config.optim.max_grad_norm), state.policy,
                          reference=state.reference, critic=state.critic, placement=state.placement)
    settings = UpdateSettings(config.loss, config.update, config.critic, config.sampling.temperature, config.sampling.max_new_tokens,
                              config.data.group_size, minibatch_seed=derived_seed(config.seed, "minibatch", str(state.step)),
                              exact_kl_tokens=config.exact_kl_tokens,
                              critic_only=state.critic is not None and state.step < config.critic.warmup_steps,
                              max_staleness=config.data.max_staleness)
    return models, settings


def training_reward(config: Config, train: Task) -> str:
    """`config.reward`, or with `auto` the default reward of the task's gold format
    (`rewards.defaults`): exact for arithmetic, math for math / GSM8K / MATH golds, humaneval for code."""
    if config.reward != "auto":
        return config.reward
    name = default_reward(train.reward_kind)
    if name is None:
        raise UserError(f"task {config.data.task}: no default reward for its kind {train.reward_kind!r}; set --reward")
    return name


MEMORY_KNOBS = {
    "generation": ["sampling.max_new_tokens", "data.prompts_per_step", "data.group_size", "hardware.precision"],
    "reference": ["update.micro_batch_size", "hardware.precision"],
    "update": ["update.micro_batch_size", "memory.gradient_checkpointing", "hardware.precision"],
    "evaluation": ["acceptance.max_new_tokens", "acceptance.k", "hardware.precision"],
}
"""The settings that shrink each phase's memory, for the out-of-memory message (`runs/faults.py`)."""


def run(config: Config, resume: bool = False, reward: Any = None, resume_changed_config: bool = False) -> Path:
    """Train (GRPO or PPO, as `config.loss.advantage` says); returns the run directory. `reward` may
    be a Verifier or any callable `fn(completion, example) -> float | Verdict`, used instead of
    `config.reward`. `config` is read, never changed. A resume refuses a config that changes the
    data order or the loss unless `resume_changed_config` (`runs/faults.py`). SIGTERM / SIGINT stop
    it after the step in progress, with a checkpoint (`RunStopped`); memory running out is one line
    (`OutOfMemory`)."""
    # 0. Set-up: everything that can fail on bad input fails before the run directory exists.
    estimator = ADVANTAGE_ESTIMATORS[config.loss.advantage]
    if estimator.needs_critic and int(os.environ.get("WORLD_SIZE", "1")) > 1 and config.parallel.strategy != "ddp":
        raise UserError(f"{estimator.command} under torchrun supports parallel.strategy ddp only (its critic is not sharded with FSDP2)")
    if config.data.async_generation and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("data.async_generation runs in one process; under torchrun use data.max_staleness alone "
                        "(the synchronous mode, which every rank runs alike)")
    placement, world = start(config)
    state = setup(config, reward, world, placement)
    recipe = estimator.command
    run_dir, _, changes = open_run(recipe, config, world, resume, resume_changed_config)
    # A refreshed reference and a critic are state of their own: checkpointed with the policy, restored exactly.
    extra_models = {}
    if state.critic is not None:
        extra_models["critic"] = state.critic
    if state.reference is not None and config.loss.kl.reference_refresh_every:
        extra_models["reference"] = state.reference.model
    saved = restore_training(run_dir, state.policy, state.optimizer, state.scheduler, extra_models=extra_models, world=world,
                             extra_objects=(PENDING,)) if resume else {"step": 0}
    state.step, state.stream.position = saved["step"], saved.get("stream_position", 0)
    state.pending.restore(saved.get(PENDING))  # mode (a): trained as they were; mode (b): sampled again
    state.reference_refreshed_at = saved.get("reference_refreshed_at", [])
    state.entropy_history = saved.get("entropy_history", [])
    checks = RunChecks.restore(config.acceptance, saved,
                               verify=None if reward is not None else config.reward if config.reward != "auto" else state.verifier.name)
    card = make_card(config, state, reward, changes)
    regenerated = getattr(state.pending, "regenerated_on_resume", 0)
    if regenerated:  # mode (b): the batches in flight at the checkpoint, whose sampling weights are gone
        card["run"]["batches_regenerated_on_resume"] = regenerated
        card["notes"].append(f"resumed at step {state.step}: {regenerated} batch(es) sampled ahead and not trained were "
                             "dropped and are sampled again with the restored weights")
    if state.verifier.dense:  # the teacher's own held-out score, for reference beside the student's
        card["links"]["reward"]["teacher_heldout"] = teacher_heldout(config, state)
    checks.describe(card)

    write_card = card_writer(run_dir, card, world)

    write_card()
    try:
        with closing(run_dir, card, write_card), StepLoop(recipe, run_dir, world, state.step, config.max_steps,
                                                     config.checkpoint_every, config.acceptance.eval_every, state.placement) as loop:
            _train(state, RunParts(run_dir, card, write_card, checks, extra_models), loop)
    finally:
        state.pending.close()  # the generation thread (mode (b)), then the engine's process or server connection
        close = getattr(engine_of(state.sampler), "close", None)
        if close is not None:
            close()
    del state.trainer  # DDP wrappers first, then the process group
    world.close()
    return run_dir.path


PENDING = "pending_batches"
"""The checkpoint file (`<name>.pt` beside the model) of the batches sampled and not yet trained (k >= 1)."""


@dataclass
class RunParts:
    """What `run` opened around the loop: the run directory, the card and its writer, the run's
    checks (divergence alarm and training-signal watch, `online_checks.RunChecks`), and the models
    checkpointed beside the policy (critic, refreshed reference)."""

    directory: RunDirectory
    card: dict
    write_card: Callable[[], None]
    checks: RunChecks
    extra_models: dict


def _train(state: State, parts: RunParts, loop: StepLoop) -> None:
    """`run`'s loop: step 0's evaluation, then sample, step, log, evaluate, checkpoint until max_steps
    or a stop signal (a checkpoint at that step, then `RunStopped`)."""
    config, world = state.config, state.world
    run_dir, card, write_card, checks, extra_models = parts.directory, parts.card, parts.write_card, parts.checks, parts.extra_models
    if state.step == 0:
        with memory_guard(0, MEMORY_KNOBS, phase="evaluation"):
            run_dir.log_metrics(0, evaluate(state, run_dir, checks.alarm, None))
    state.policy.train()
    if state.critic is not None:
        state.critic.train()

    def plot() -> None:
        plot_metrics(run_dir.read_metrics(), list(ADVANTAGE_ESTIMATORS[config.loss.advantage].plotted), run_dir.plots)
        plot_sets(run_dir.read_metrics(), [IN_DISTRIBUTION] + [held.name for held in state.shifted], run_dir.plots / "heldout_sets.png")

    def save(done: int) -> None:
        save_training(
            run_dir, done, state.policy, state.tokenizer, state.optimizer, state.scheduler, extra_models=extra_models, world=world,
            extra_state={"stream_position": state.pending.stream_position(state.stream), "alarm_history": checks.alarm.history,
                         "alarm_rings": checks.alarm.rings, "alarm_reward_spread": checks.alarm.reward_spread,
                         "reference_refreshed_at": state.reference_refreshed_at, "training_signal": checks.signal.state(),
                         "entropy_history": state.entropy_history},
            extra_objects={PENDING: state.pending.state()} if config.data.max_staleness else None)

    engine = engine_of(state.sampler)
    state.pending.start(state.step + 1, config.max_steps, state.step, state.stream.position)  # mode (b)'s generation thread
    synced = getattr(engine, "sync_seconds", 0.0)  # evaluation's syncs before the first step are not a step's
    for _ in loop:
        timer = loop.clock.timer
        with memory_guard(state.step + 1, MEMORY_KNOBS, timer):
            try:
                batch = next_batch(state, timer)  # 1-2
            except EngineUnavailable as lost:
                raise engine_lost(lost, config, state.step, run_dir, save) from lost
            metrics = step(state, batch, timer)  # 3-4
        done = state.step
        if hasattr(engine, "sync_seconds"):  # an engine with weights of its own (vLLM, worker): its syncs during the step
            metrics["rollout/sync_s"], synced = engine.sync_seconds - synced, engine.sync_seconds
        card["run"]["reference_refreshed_at"] = state.reference_refreshed_at
        checks.calibrate(batch, card)  # the first scored step sets the alarm's scale
        # 5. Log, evaluate, checkpoint.
        metrics.update(batch.metrics())
        metrics.update(state.pending.metrics(batch, done))
        metrics.update(loop.clock.metrics(*batch.throughput()))  # the whole step before evaluation and logging
        run_dir.log_samples(done, batch.sample_rows(config.samples_per_step, with_version=config.data.max_staleness > 0))
        if loop.evaluates(done):
            with memory_guard(done, MEMORY_KNOBS, phase="evaluation"):
                metrics.update(evaluate(state, run_dir, checks.alarm, metrics["reward/mean"]))
            card["alarms"] = checks.rings()
            write_card()
        checks.observe(done, batch, metrics, config, card)
        loop.end_step(done, metrics, save=lambda: save(done),
            after_log=plot if "heldout/pass@1" in metrics and world.main else None,
            reward="n/a" if metrics["reward/mean"] is None else f"{metrics['reward/mean']:.3f}",
            **({"reverse_kl": f"{metrics['distill/reverse_kl']:.4f}"} if metrics.get("distill/reverse_kl") is not None else {}))
        checks.stop(done, batch, run_dir, world.main, card, write_card)
