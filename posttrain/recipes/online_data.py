"""The data link of an online step (GRPO, PPO): the prompt stream, sampling and scoring a batch of
prompt groups (with DAPO refills and, under torchrun, each rank's share gathered), and the rows
each rank trains on.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from posttrain.data import render_prompt
from posttrain.data.examples import Example, Task, derived_seed
from posttrain.distributed import World
from posttrain.evaluation.acceptance import verifier_input
from posttrain.rewards import Verdict, Verifier
from posttrain.rollout import Rollout, SamplingConfig, generate

if TYPE_CHECKING:
    from posttrain.recipes.online import Data


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
