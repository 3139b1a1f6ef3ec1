"""Pieces shared by the online recipes (GRPO, PPO): config sections, the verifier, the training
forward pass and log-probs, held-out acceptance with the divergence alarm, metrics and sample
logging. Sampling and scoring a step's batch is in `online_data.py`.

The recipes themselves (`grpo.py`, `ppo.py`) read top to bottom as numbered steps and call these.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from posttrain.algorithms import exact_kl, token_logprobs
from posttrain.data.examples import Example, Task, derived_seed
from posttrain.distributed import World, full_weights
from posttrain.errors import UserError
from posttrain.evaluation.acceptance import evaluate_task
from posttrain.evaluation.alarms import DivergenceAlarm
from posttrain.recipes.online_data import Scores, rows_of
from posttrain.models.forward import TrainingForward, shared_prefix_logits
from posttrain.rewards import Verdict, Verifier, get_verifier
from posttrain.rollout import Rollout, SamplingConfig

logger = logging.getLogger(__name__)


@dataclass
class Data:
    """Link 1, data: which prompts, how many per step, and the held-out split kept apart."""

    task: str = "arithmetic"
    """Task spec: arithmetic | rg:<dataset> | humaneval | a JSONL prompt file."""
    task_options: dict = field(default_factory=dict)
    """Task options, e.g. {digits: 2} for arithmetic or a reasoning-gym dataset's config."""
    train_size: int = 20000
    """Training prompts (procedural tasks generate this many)."""
    eval_size: int = 200
    """Held-out prompts, disjoint from training (checked)."""
    prompts_per_step: int = 8
    """B: prompts sampled per step."""
    group_size: int = 8
    """G: completions per prompt (>= 2)."""
    system_prompt: str | None = None
    """Optional system prompt for chat models."""

    def validate(self, min_group_size: int = 2) -> None:
        if self.group_size < min_group_size:
            why = " (a group of one has no relative signal)" if min_group_size == 2 else ""
            raise UserError(f"data.group_size must be at least {min_group_size}{why}, got {self.group_size}")
        for name in ("train_size", "eval_size", "prompts_per_step"):
            if getattr(self, name) < 1:
                raise UserError(f"data.{name} must be at least 1, got {getattr(self, name)}")


@dataclass
class Sampling:
    """How completions are drawn (the rollout engine's settings)."""

    temperature: float = 1.0
    """Softmax temperature; the training log-probs use the same one."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0: off)."""
    top_k: int = 0
    """Top-k sampling (0: off)."""
    max_new_tokens: int = 32
    """Completion budget; longer completions are truncated (and flagged)."""
    stop_strings: list[str] = field(default_factory=list)
    """Strings that end a completion."""

    def engine_config(self) -> SamplingConfig:
        return SamplingConfig(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_new_tokens=self.max_new_tokens, stop_strings=tuple(self.stop_strings),
        )


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


class ObjectVerifier(Verifier):
    """A Python callable object as the reward, scored in this process: `fn(completion, example)`
    returns a number or a `Verdict`; an exception is an infra_error with its last line."""

    def __init__(self, function: Callable[[str, dict], Any]):
        self.function = function
        self.name = f"python:{getattr(function, '__qualname__', type(function).__name__)}"

    def score(self, completion: str, example) -> Verdict:
        try:
            result = self.function(completion, dict(example))
        except Exception as error:  # noqa: BLE001 - the user's bug, reported, never a silent 0
            return Verdict.infra_error(f"{type(error).__name__}: {error}")
        if isinstance(result, Verdict):
            return result
        if isinstance(result, (bool, int, float)) and math.isfinite(float(result)):
            return Verdict.ok(float(result), "user function")
        return Verdict.infra_error(f"{self.name} returned {result!r}, not a finite number or Verdict")


def make_verifier(reward: str | Verifier | Callable | None, name: str) -> Verifier:
    """The training verifier: a Verifier, a plain callable, or (None) the configured name."""
    if isinstance(reward, Verifier):
        return reward
    if callable(reward):
        return ObjectVerifier(reward)
    try:
        return get_verifier(name)
    except ValueError as error:
        raise UserError(f"reward: {error}") from None


def completion_logits(model, inputs: dict[str, torch.Tensor], rows, prompt_width: int, T: int, shared_prefix: bool = True, **extra):
    """Forward prompt + completion rows; returns the model output and the logits (n, T, V) whose
    position t scores completion token t (see `Rollout.forward_inputs`). Without `extra`, a supported
    model runs `shared_prefix_logits` (each distinct prompt once) and the output is None, unless
    `shared_prefix` is False (one plain model call, whatever the rows)."""
    if not extra and shared_prefix:
        logits = shared_prefix_logits(model, inputs, rows, prompt_width, T)
        if logits is not None:
            return None, logits
    output = model(
        input_ids=inputs["input_ids"][rows], attention_mask=inputs["attention_mask"][rows],
        position_ids=inputs["position_ids"][rows], **extra,
    )
    return output, output.logits[:, prompt_width - 1 : prompt_width - 1 + T]


class CompletionForward(TrainingForward):
    """The policy as DDP / FSDP2 see it in training: one forward = `completion_logits` of some rows,
    so the shared-prefix forward's two model calls count as one forward (DDP syncs per forward).
    `forward(inputs, rows, prompt_width, T)` returns the (n, T, V) logits."""

    def __init__(self, model, shared_prefix: bool = True):
        super().__init__(model)
        self.shared_prefix = shared_prefix

    def forward(self, inputs: dict[str, torch.Tensor], rows, prompt_width: int, T: int) -> torch.Tensor:
        return completion_logits(self.model, inputs, rows, prompt_width, T, shared_prefix=self.shared_prefix)[1]


@torch.no_grad()
def logprobs_of(model, rollout: Rollout, inputs, temperature: float, micro_batch_size: int) -> torch.Tensor:
    """(N, T) log-probs of the sampled tokens under `model` at `temperature`, no grad, micro-batched."""
    prompt_width, T = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    pieces = []
    for start in range(0, rollout.completion_ids.shape[0], micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        _, logits = completion_logits(model, inputs, rows, prompt_width, T)
        pieces.append(token_logprobs(logits, rollout.completion_ids[rows], temperature))
    return torch.cat(pieces).masked_fill(~rollout.mask, 0.0)


def exact_kl_subset(logits, ref_logits, mask, temperature: float, max_tokens: int) -> tuple[float, int]:
    """Exact full-vocabulary KL(policy || reference) summed over the first `max_tokens` valid tokens
    of a micro-batch (cheap enough to log every step); returns (sum, count)."""
    positions = mask.nonzero()[:max_tokens]
    if positions.numel() == 0:
        return 0.0, 0
    rows, columns = positions[:, 0], positions[:, 1]
    kl = exact_kl(logits[rows, columns].detach(), ref_logits[rows, columns], temperature=temperature)
    return float(kl.sum()), int(kl.numel())


def token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(n, T) entropy of softmax(logits / temperature) at each position (detached, for metrics)."""
    with torch.no_grad():
        log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
        return -(log_p.exp() * log_p).sum(-1)


def evaluate_held_out(policy, tokenizer, held_out: Task, config, run_dir, step: int, alarm: DivergenceAlarm, train_reward: float | None) -> dict[str, Any]:
    """Held-out acceptance (written to eval/step-N.json) and the divergence alarm."""
    was_training = policy.training
    policy.eval()
    result = evaluate_task(
        policy, tokenizer, held_out, checker=config.acceptance.checker, k=config.acceptance.k,
        temperature=config.sampling.temperature, max_new_tokens=config.sampling.max_new_tokens,
        seed=derived_seed(config.seed, "eval", str(step)), system_prompt=config.data.system_prompt,
        output_path=run_dir.eval_dir / f"step-{step:06d}.json",
    )
    policy.train(was_training)
    metrics = {"heldout/pass@1": result["pass@1"], "heldout/pass@1_low": result["pass@1_ci95"][0], "heldout/pass@1_high": result["pass@1_ci95"][1]}
    if config.acceptance.k > 1:
        metrics[f"heldout/pass@{config.acceptance.k}"] = result[f"pass@{config.acceptance.k}"]
    if train_reward is not None and result["pass@1"] is not None:
        # The alarm compares held-out accuracy with the mean training reward since the previous
        # evaluation (read back from metrics.jsonl, so a resumed run computes the same).
        rows = run_dir.read_metrics()
        last_eval = max([row["step"] for row in rows if row.get("heldout/pass@1") is not None] + [0])
        recent = [row["reward/mean"] for row in rows if row["step"] > last_eval and row.get("reward/mean") is not None]
        message = alarm.observe(step, sum(recent + [train_reward]) / (len(recent) + 1), result["pass@1"])
        if message:
            logger.warning(message)
    return metrics


def rollout_metrics(rollout: Rollout, scores: Scores, timer) -> dict[str, Any]:
    """Step metrics of the data and reward links, and the step's timings (see docs/metrics.md)."""
    valid = scores.rewards[~torch.isnan(scores.rewards)]
    lengths = rollout.lengths.float()
    return {
        "reward/mean": float(valid.mean()) if valid.numel() else None,
        "reward/std": float(valid.std(correction=0)) if valid.numel() else None,
        **{f"reward/{name}": value for name, value in scores.components.items()},
        "length/mean": float(lengths.mean()), "length/max": int(lengths.max()),
        "truncated_fraction": float(rollout.truncated.float().mean()),
        **{f"seconds/{phase}": seconds for phase, seconds in timer.seconds.items()},
        "tokens_per_second": float(lengths.sum()) / max(1e-9, sum(timer.seconds.values())),
    }


def sample_rows(rollout: Rollout, examples: Sequence[Example], scores: Scores, rendered: Sequence[str], limit: int) -> list[dict]:
    """The first `limit` rows of a step for samples.jsonl: prompt, completion, verdict, reason."""
    rows = []
    for row in range(min(limit, len(rollout.texts))):
        b = int(rollout.prompt_index[row])
        verdict = scores.verdicts[row]
        rows.append({
            "example": examples[b].id, "prompt": rendered[b], "completion": rollout.texts[row],
            "reward": verdict.reward, "status": verdict.status, "reason": verdict.reason,
            "truncated": bool(rollout.truncated[row]),
        })
    return rows


def section_dict(section) -> dict[str, Any]:
    return dataclasses.asdict(section)


def rank_logprobs(model, rollout: Rollout, owners: torch.Tensor, world: World, temperature: float, micro_batch_size: int) -> torch.Tensor:
    """(N, T) log-probs of every sampled token under `model` (no grad): each rank computes the rows
    it owns and the pieces are summed across ranks; in one process simply `logprobs_of`. An
    FSDP2-sharded model is made whole for the pass, so ranks need not run equally many forwards."""
    if not world.active:
        return logprobs_of(model, rollout, rollout.forward_inputs(), temperature, micro_batch_size)
    mine = (owners == world.rank).nonzero().squeeze(1)
    full = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32)
    with full_weights(model):
        if len(mine):
            part = rows_of(rollout, mine)
            full[mine] = logprobs_of(model, part, part.forward_inputs(), temperature, micro_batch_size)
    return world.reduce(full)
