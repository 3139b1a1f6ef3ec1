"""The checks an online run (`posttrain grpo`, `posttrain ppo`) makes around its loop, and what they
report: held-out acceptance at step 0 and every `acceptance.eval_every` steps, with the divergence
alarm that compares it with the training reward (`evaluate`; `evaluation/acceptance.py`,
`evaluation/alarms.py`); the training-signal watch after every step, which rings once when the
reward gives the loss nothing and stops a run whose reward scores no row (`step_signal`,
`RunChecks`; `evaluation/signal.py`); and what a rollout engine that stopped answering leaves
(`engine_lost`). Each writes its part of the run card. `online.py` is the loop that calls them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from posttrain.algorithms.estimators import ADVANTAGE_ESTIMATORS
from posttrain.data.scored_batch import ScoredBatch
from posttrain.distributed import full_weights
from posttrain.errors import UserError
from posttrain.evaluation.acceptance import evaluate_sets
from posttrain.evaluation.alarms import DivergenceAlarm
from posttrain.evaluation.signal import SignalLost, StepSignal, TrainingSignal
from posttrain.losses.policy_gradient import loss_rows
from posttrain.recipes.online_config import Acceptance, Config
from posttrain.rollout.vllm_backends import EngineUnavailable
from posttrain.runs import RunDirectory

logger = logging.getLogger(__name__)


@dataclass
class RunChecks:
    """The run's two watches, checkpointed with it: the divergence alarm (held-out accuracy against
    the training reward, at each evaluation) and the training-signal check (after each step)."""

    alarm: DivergenceAlarm
    signal: TrainingSignal

    @classmethod
    def restore(cls, acceptance: Acceptance, saved: dict[str, Any], verify: str | None) -> RunChecks:
        """Both watches as the trainer state `saved` left them (fresh at step 0). `verify`: the
        `posttrain verify --verifier` spelling of the reward a stop's message suggests replaying
        (None: a Python callable)."""
        alarm = DivergenceAlarm(acceptance.alarm_window, acceptance.alarm_reward_rise, history=saved.get("alarm_history", []),
                                rings=saved.get("alarm_rings", []), reward_spread=saved.get("alarm_reward_spread"))
        signal = TrainingSignal(stop_after=acceptance.signal_stop_after, window=acceptance.signal_window, verify=verify,
                                **saved.get("training_signal", {}))
        return cls(alarm, signal)

    def rings(self) -> list:
        """Every alarm rung so far, the divergence alarm's first: the card's `alarms`."""
        return list(self.alarm.rings) + self.signal.rings

    def describe(self, card: dict) -> None:
        """The card's account of both watches: the alarm's threshold and the signal's settings and counts."""
        card["links"]["acceptance"]["divergence_alarm_threshold"] = self.alarm.describe()
        card["training_signal"] = self.signal.card()

    def calibrate(self, batch: ScoredBatch, card: dict) -> None:
        """The first scored step sets the alarm's scale (the spread of its valid rows' rewards); a
        resumed run keeps the one it saved."""
        if not self.alarm.reward_spread and not self.alarm.history:
            self.alarm.calibrate(batch.scores.rewards[batch.valid].tolist())
            card["links"]["acceptance"]["divergence_alarm_threshold"] = self.alarm.describe()

    def observe(self, done: int, batch: ScoredBatch, metrics: dict[str, Any], config: Config, card: dict) -> None:
        """Step `done`'s training signal (`step_signal`), into the watch and the card."""
        self.signal.observe(done, step_signal(batch, metrics, config))
        card["training_signal"], card["alarms"] = self.signal.card(), self.rings()

    def stop(self, done: int, batch: ScoredBatch, run_dir: RunDirectory, main: bool, card: dict,
             write_card: Callable[[], None]) -> None:
        """After step `done` is logged and checkpointed: raise `SignalLost` when the reward has
        scored no row for `acceptance.signal_stop_after` steps, its unscorable rows written to the
        run directory (by rank 0, `main`) and the reason noted on the card."""
        try:
            self.signal.stop(done, batch.failures, run_dir.path, write=main)
        except SignalLost as lost:
            card["notes"].append(str(lost))
            write_card()
            raise


def step_signal(batch: ScoredBatch, metrics: dict[str, Any], config: Config) -> StepSignal:
    """What a step gave the loss (`evaluation.signal.StepSignal`): its rows, the unscorable ones and
    their first reasons, the zero-variance group fraction, the estimator's units without reward
    signal (groups, or the whole batch, over the rows that reached the loss) and the update's
    gradient norm."""
    estimator = ADVANTAGE_ESTIMATORS[config.loss.advantage]
    counted = loss_rows(batch, config.loss.mask_truncated) & batch.rollout.mask.any(dim=1)
    silent = estimator.silent_fraction(batch.scores.rewards, counted, config.data.group_size)
    zero_variance = batch.stats.get("groups/zero_variance_fraction")
    if batch.scores.dense and metrics.get("distill/reverse_kl"):
        # A teacher that disagrees with the student rewards every token: the sequence rewards' variance is not the signal.
        silent, zero_variance = 0.0, None
    return StepSignal(rows=batch.rows_sampled, infra_errors=batch.stats["errors/infra"], data_errors=batch.stats["errors/data"],
                      reasons=[f"{row['status']}: {row['reason']}" for row in batch.failures],
                      zero_variance_fraction=zero_variance, grad_norm=metrics.get("grad_norm"),
                      silent_fraction=float(silent), scope=estimator.signal_scope)


def evaluate(state, run_dir: RunDirectory, alarm: DivergenceAlarm, train_reward: float | None) -> dict[str, Any]:
    """Held-out acceptance on rank 0, written to eval/step-N.json, and the divergence alarm (the
    other ranks wait; under FSDP2 every rank lends its shards). `state`: the recipe's `online.State`;
    `train_reward`: this step's mean training reward (None at step 0: no alarm)."""
    config, policy, metrics = state.config, state.policy, {}
    with full_weights(policy), state.placement.autocast():
        if state.world.main:
            was_training = policy.training
            policy.eval()
            result, metrics = evaluate_sets(
                policy, state.tokenizer, state.held_out, state.checker, state.shifted, step=state.step, eval_dir=run_dir.eval_dir,
                seed=config.seed, k=config.acceptance.k, temperature=config.sampling.temperature,
                max_new_tokens=config.acceptance.max_new_tokens or config.sampling.max_new_tokens,
                system_prompt=config.data.system_prompt, sampler=state.sampler)
            policy.train(was_training)
            if train_reward is not None and result["pass@1"] is not None:
                # The alarm compares held-out accuracy with the mean training reward since the previous
                # evaluation (read back from metrics.jsonl, so a resumed run computes the same).
                rows = run_dir.read_metrics()
                last_eval = max([row["step"] for row in rows if row.get("heldout/pass@1") is not None] + [0])
                recent = [row["reward/mean"] for row in rows if row["step"] > last_eval and row.get("reward/mean") is not None]
                message = alarm.observe(state.step, sum(recent + [train_reward]) / (len(recent) + 1), result["pass@1"])
                if message:
                    logger.warning(message)
    state.world.barrier()
    return metrics


def engine_lost(lost: EngineUnavailable, config: Config, done: int, run_dir: RunDirectory, save: Callable[[int], None]) -> UserError:
    """The engine (its server or worker process) stopped answering while sampling after `done`
    steps: checkpoint them (`save`; nothing of the failed step had changed the state) and say how
    to resume."""
    if done > 0:
        save(done)
    resume = f"posttrain {ADVANTAGE_ESTIMATORS[config.loss.advantage].command} --resume {run_dir.path}"
    kept = f"checkpoint step-{done} written" if done > 0 else "no step had finished"
    when = f"while sampling ahead, {done} steps done" if config.data.max_staleness else f"while sampling step {done + 1}"
    return UserError(f"{lost} ({when}; {kept}); to resume (a server once it is back): {resume}")
