"""Pieces shared by the online recipes (GRPO, PPO): config sections, the prompt stream, scoring,
the training forward pass, held-out acceptance with the divergence alarm, and sample logging.

The recipes themselves (`grpo.py`, `ppo.py`) read top to bottom as numbered steps and call these.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from posttrain.algorithms import exact_kl, token_logprobs
from posttrain.data import render_prompt
from posttrain.data.examples import Example, Task, derived_seed
from posttrain.distributed import World, full_weights
from posttrain.errors import UserError
from posttrain.evaluation.acceptance import evaluate_task, verifier_input
from posttrain.evaluation.stats import DivergenceAlarm
from posttrain.recipes.shared_prefix import shared_prefix_logits
from posttrain.rewards import Verdict, Verifier, get_verifier
from posttrain.rollout import Rollout, SamplingConfig, generate

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


class PromptStream:
    """An endless, seeded stream of training examples: epoch after epoch, each a fresh permutation.
    `position` (saved in checkpoints) is how many examples have been taken."""

    def __init__(self, task: Task, seed: int, position: int = 0):
        self.task, self.seed, self.position = task, seed, position

    def take(self, count: int) -> list[Example]:
        size = len(self.task.examples)
        taken = []
        while len(taken) < count:
            epoch, offset = divmod(self.position, size)
            order = list(range(size))
            random.Random(derived_seed(self.seed, "epoch", str(epoch))).shuffle(order)
            step = min(count - len(taken), size - offset)
            taken += [self.task.examples[i] for i in order[offset : offset + step]]
            self.position += step
        return taken


@dataclass
class Scores:
    """Verdicts of N rows as tensors: NaN rewards for rows that could not be scored."""

    rewards: torch.Tensor
    """(N,) float32, NaN where status != ok."""
    verdicts: list[Verdict]
    infra_errors: int
    data_errors: int
    components: dict[str, float]
    """Mean of each weighted-sum component over the scored rows (for metrics)."""


def score_rollout(verifier: Verifier, rollout: Rollout, examples: Sequence[Example]) -> Scores:
    """Score every completion against its prompt's example (row b*G+g -> examples[b])."""
    rows = [verifier_input(examples[b]) for b in rollout.prompt_index.tolist()]
    return scores_from_verdicts(verifier.batch(rollout.texts, rows))


def scores_from_verdicts(verdicts: Sequence[Verdict]) -> Scores:
    """Rewards (NaN unless ok), error counts and component means of a list of verdicts."""
    rewards = torch.tensor([v.reward if v.status == "ok" else math.nan for v in verdicts], dtype=torch.float32)
    components: dict[str, list[float]] = {}
    for verdict in verdicts:
        for name, value in (verdict.details.get("components") or {}).items():
            if isinstance(value, (int, float)):
                components.setdefault(name, []).append(float(value))
    return Scores(
        rewards=rewards,
        verdicts=list(verdicts),
        infra_errors=sum(v.status == "infra_error" for v in verdicts),
        data_errors=sum(v.status == "data_error" for v in verdicts),
        components={name: sum(values) / len(values) for name, values in components.items()},
    )


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


class CompletionForward(torch.nn.Module):
    """The policy as DDP / FSDP2 see it in training: one forward = `completion_logits` of some rows,
    so the shared-prefix forward's two model calls count as one forward (DDP syncs per forward).
    `forward(inputs, rows, prompt_width, T)` returns the (n, T, V) logits."""

    def __init__(self, model, shared_prefix: bool = True):
        super().__init__()
        self.model, self.shared_prefix = model, shared_prefix

    @property
    def sharding_root(self):
        """FSDP2 shards the policy itself (this wrapper holds no parameters of its own)."""
        return self.model

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


def _pad(tensors: list[torch.Tensor], width: int, value, left: bool) -> torch.Tensor:
    padded = []
    for tensor in tensors:
        fill = tensor.new_full((tensor.shape[0], width - tensor.shape[1]), value)
        padded.append(torch.cat([fill, tensor] if left else [tensor, fill], dim=1))
    return torch.cat(padded)


def merge_groups(parts: Sequence[tuple[Rollout, Sequence[int]]]) -> Rollout:
    """One Rollout from chosen whole groups of several rollouts (DAPO dynamic sampling refills),
    re-padded to common widths (prompts on the left, completions on the right) and renumbered so
    group j of the result is row block j."""
    first = parts[0][0]
    G = first.group_size
    rows = [[g * G + i for g in groups for i in range(G)] for _, groups in parts]
    pick = [(rollout, torch.tensor(r, dtype=torch.long)) for (rollout, _), r in zip(parts, rows) if r]
    P = max(r.prompt_ids.shape[1] for r, _ in pick)
    T = max(r.completion_ids.shape[1] for r, _ in pick)
    total_groups = sum(len(groups) for _, groups in parts)
    return Rollout(
        prompt_ids=_pad([r.prompt_ids[i] for r, i in pick], P, first.pad_token_id, left=True),
        prompt_attention_mask=_pad([r.prompt_attention_mask[i] for r, i in pick], P, False, left=True),
        completion_ids=_pad([r.completion_ids[i] for r, i in pick], T, first.pad_token_id, left=False),
        mask=_pad([r.mask[i] for r, i in pick], T, False, left=False),
        sampler_logprobs=_pad([r.sampler_logprobs[i] for r, i in pick], T, 0.0, left=False),
        logprobs=_pad([r.logprobs[i] for r, i in pick], T, 0.0, left=False),
        finished=torch.cat([r.finished[i] for r, i in pick]),
        truncated=torch.cat([r.truncated[i] for r, i in pick]),
        texts=[r.texts[j] for r, i in pick for j in i.tolist()],
        prompt_index=torch.arange(total_groups).repeat_interleave(G),
        group_size=G,
        sampling=first.sampling,
        pad_token_id=first.pad_token_id,
    )


def informative_groups(rewards: torch.Tensor, group_size: int) -> list[int]:
    """Groups whose valid raw rewards are not all equal (at least two valid and some spread): the
    only ones with a policy-gradient signal (DAPO dynamic sampling, arXiv:2503.14476 eq. 11)."""
    grouped = rewards.view(-1, group_size)
    keep = []
    for index, group in enumerate(grouped):
        valid = group[~torch.isnan(group)]
        if valid.numel() >= 2 and bool(valid.max() > valid.min()):
            keep.append(index)
    return keep


def sample_and_score(policy, tokenizer, stream: PromptStream, verifier: Verifier, data: Data, seed: int,
                     sampling: SamplingConfig, step: int, timer, refill_rounds: int | None = None, world: World | None = None):
    """Sample and score B prompts x G. With `refill_rounds` (DAPO dynamic sampling), groups without
    signal are dropped and replaced by fresh prompts for up to that many extra rounds (the batch may
    stay short). Under torchrun each rank samples and scores its block of each round's prompts and
    the results are gathered, so every rank returns the same global batch (the one a single process
    would sample) and every rank takes the same refill decisions.

    Returns (rollout, examples, scores, rendered prompts, group statistics, owners), `owners` (N,)
    long: the rank that sampled each row (the rank that trains on it)."""
    world = world or World()
    B, G = data.prompts_per_step, data.group_size
    dynamic = refill_rounds is not None
    parts, kept_examples, kept_rendered, verdict_parts, owner_parts = [], [], [], [], []
    dropped = refilled = infra_errors = data_errors = 0
    wanted, rounds = B, 0
    policy.eval()
    while wanted > 0:
        examples = stream.take(wanted)
        rendered = [render_prompt(tokenizer, e.prompt_input, system_prompt=data.system_prompt) for e in examples]
        mine = world.block(len(examples))
        round_seed = derived_seed(seed, "rollout", str(step), str(rounds))
        rollout = scores = None
        if len(mine):  # a short refill round may leave a rank nothing to sample
            with timer("generation"):
                rollout = generate(policy, tokenizer, rendered[mine.start:mine.stop], group_size=G, sampling=sampling,
                                   seed=round_seed, shard=(mine.start, len(examples)) if world.active else None)
            with timer("scoring"):
                scores = score_rollout(verifier, rollout, examples[mine.start:mine.stop])
        owners = torch.arange(world.size).repeat_interleave(torch.tensor([len(b) for b in world.blocks(len(examples))]) * G)
        if world.active:  # every rank gets the whole round, in global row order
            gathered = [part for part in world.gather((rollout, scores.verdicts if scores else [])) if part[0] is not None]
            rollout = merge_groups([(part, list(range(part.prompt_ids.shape[0] // G))) for part, _ in gathered])
            scores = scores_from_verdicts([verdict for _, verdicts in gathered for verdict in verdicts])
        infra_errors, data_errors = infra_errors + scores.infra_errors, data_errors + scores.data_errors
        groups = informative_groups(scores.rewards, G) if dynamic else list(range(len(examples)))
        dropped += len(examples) - len(groups)
        refilled += len(groups) if rounds else 0
        parts.append((rollout, groups))
        kept_examples += [examples[g] for g in groups]
        kept_rendered += [rendered[g] for g in groups]
        verdict_parts += [scores.verdicts[g * G + i] for g in groups for i in range(G)]
        owner_parts.append(owners.view(-1, G)[groups].flatten())
        wanted, rounds = B - len(kept_examples), rounds + 1
        if not dynamic or rounds > refill_rounds:
            break
    policy.train()
    if not kept_examples:  # every group lacked signal even after refills: train on the last batch (zero advantages)
        parts, kept_examples, kept_rendered = [(rollout, list(range(len(examples))))], examples, rendered
        verdict_parts, owner_parts = scores.verdicts, [owners]
    merged = merge_groups(parts) if len(parts) > 1 or dynamic else rollout
    merged_scores = scores_from_verdicts(verdict_parts)
    groups = len(kept_examples)
    # Error counts cover every sampled row, including groups dynamic sampling dropped.
    stats = {"groups/dropped": dropped, "groups/refilled": refilled, "groups/trained": groups, "sampling_rounds": rounds,
             "errors/infra": infra_errors, "errors/data": data_errors}
    if G > 1:
        stats["groups/zero_variance_fraction"] = 1 - len(informative_groups(merged_scores.rewards, G)) / groups
    return merged, kept_examples, merged_scores, kept_rendered, stats, torch.cat(owner_parts)


def rows_of(rollout: Rollout, rows: torch.Tensor) -> Rollout:
    """The sub-rollout of `rows` (whole groups, in order), e.g. the rows one rank trains on."""
    G = rollout.group_size
    return dataclasses.replace(
        rollout, prompt_ids=rollout.prompt_ids[rows], prompt_attention_mask=rollout.prompt_attention_mask[rows],
        completion_ids=rollout.completion_ids[rows], mask=rollout.mask[rows],
        sampler_logprobs=rollout.sampler_logprobs[rows], logprobs=rollout.logprobs[rows],
        finished=rollout.finished[rows], truncated=rollout.truncated[rows],
        texts=[rollout.texts[i] for i in rows.tolist()], prompt_index=torch.arange(len(rows) // G).repeat_interleave(G),
    )


def rank_micro_batches(mini: torch.Tensor, owners: torch.Tensor, world: World, micro_batch_size: int):
    """This rank's micro-batches of the mini-batch `mini` (global row indices): yields
    (rows, weight, last). Every rank yields as many as the rank with most rows needs, a short rank a
    one-row stand-in of weight 0, so the ranks' collectives stay paired; `last`: sync gradients."""
    mine = mini[owners[mini] == world.rank]
    count = max(-(-int(n) // micro_batch_size) for n in torch.bincount(owners[mini], minlength=world.size))
    for micro in range(count):
        rows = mine[micro * micro_batch_size : (micro + 1) * micro_batch_size]
        yield (rows, 1.0, micro == count - 1) if len(rows) else (mini[:1], 0.0, micro == count - 1)


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
