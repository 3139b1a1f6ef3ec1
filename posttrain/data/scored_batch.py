"""The data and reward links of an online step (GRPO, PPO): sample B prompts x G completions with
the policy, score them, optionally refill groups without signal (DAPO), and, under torchrun, gather
each rank's share so every rank holds the same global batch. The result is one record, `ScoredBatch`.
`PromptSource` is the online recipe's data section; `online_data_card` the run card's data link of
such a run: the prompts, how many per step, the group size and the sampling settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from posttrain.algorithms.advantages import informative_groups
from posttrain.data import render_prompt
from posttrain.data.examples import Example, Task, derived_seed, verifier_input
from posttrain.data.prompts import convention_record
from posttrain.data.source import TaskSource
from posttrain.data.stream import PromptStream
from posttrain.data.tasks import heldout_size_from
from posttrain.distributed import World
from posttrain.errors import UserError
from posttrain.rewards import Verdict, Verifier
from posttrain.rewards.overlong import Overlong, overlong_metrics
from posttrain.rewards.scores import Scores, score_rows
from posttrain.rollout import Rollout, SamplingConfig
from posttrain.rollout.transcripts import episode_metrics, episode_verdicts, transcript_text
from posttrain.rollout.sampler import Sampler, single_turn


@dataclass
class PromptSource(TaskSource):
    """The online recipe's data section (`posttrain grpo`, `posttrain ppo`: `data.*`): which prompts
    (the shared `TaskSource`: task, format, columns, split, system_prompt, eval_size), how many per
    step and per group, code screening, and DAPO's dynamic sampling."""

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
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more prompts to refill the batch."""
    max_refill_rounds: int = 3
    """Dynamic sampling: at most this many extra sampling rounds per step."""
    max_staleness: int = 0
    """k: the batch trained at step t may have been sampled by the weights of step t-k (k steps old; `data/staleness.py`); 0: on-policy, each step samples with the weights it trains. Simulated, synchronous and deterministic unless `async_generation`: step t samples the batch of step t+k, and trains the oldest one sampled."""
    async_generation: bool = False
    """With max_staleness k >= 1: sample in a producer thread while the trainer trains (`data/async_generation.py`), each batch by weights at most k steps old; the built-in engine then runs in a worker process (`rollout.engine worker`). Faster where generation and training can run at once; which version samples which batch depends on timing."""

    def validate(self, prefix: str = "data.") -> None:
        """`TaskSource.validate`, `max_staleness` at least 0, and asynchronous generation only with k >= 1."""
        super().validate(prefix)
        if self.max_staleness < 0:
            raise UserError(f"{prefix}max_staleness must be 0 (on-policy) or more, got {self.max_staleness}")
        if self.async_generation and self.max_staleness < 1:
            raise UserError(f"{prefix}async_generation needs {prefix}max_staleness >= 1 (with 0 every batch needs the update "
                            "before it, so nothing can overlap)")


@dataclass
class ScoredBatch:
    """One step's sampled and scored rows, N = B * G, group-contiguous (row b*G + g answers
    `examples[b]`). The rollout's tensors and the rewards lie on one device (`sample_and_score`
    puts the rewards where the sampler left the rollout; `to` moves both); `owners` on the CPU."""

    rollout: Rollout
    """The N completions, their masks and the sampler's log-probs."""
    examples: list[Example]
    """The B prompts' examples."""
    rendered: list[str]
    """The B prompts as the model saw them (chat template applied)."""
    scores: Scores
    """(N,) rewards (NaN: not scorable), verdicts, error counts."""
    owners: torch.Tensor
    """(N,) long: the rank that sampled each row, and so trains on it (all 0 in one process)."""
    stats: dict[str, Any]
    """Group statistics of the sampling (dropped / refilled / trained groups, errors, rounds)."""
    rows_sampled: int = 0
    """Every row sampled this step, those of groups dynamic sampling dropped included (what the
    error counts of `stats` are out of)."""
    failures: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Up to `FAILURES_KEPT` rows the reward could not score (infra or data error), each as
    `posttrain verify --input` reads it: the completion, the verifier's row, status and reason."""
    version: int = 0
    """The policy version that sampled every row: the training steps (updates) its weights had taken. Its
    behaviour log-probs are `rollout.sampler_logprobs`."""
    serves: int = 1
    """The step (1-based) whose prompts and sampling seeds the batch has: the step that trains it.
    On-policy `serves = version + 1`; `serves - 1 - version` is its staleness when trained then."""

    def to(self, device: torch.device | str) -> ScoredBatch:
        """The same batch with the rollout and the rewards on `device` (the step's one boundary);
        `owners` stays on the CPU (row bookkeeping, which indexes device tensors)."""
        return dataclasses.replace(self, rollout=self.rollout.to(device), scores=self.scores.to(device))

    @property
    def valid(self) -> torch.Tensor:
        """(N,) bool: rows with a reward (infra and data errors never reach the loss)."""
        return ~torch.isnan(self.scores.rewards)

    def metrics(self) -> dict[str, Any]:
        """The data and reward links' step metrics (see docs/metrics.md; the step's timings are its
        clock's: `throughput` says what they count)."""
        rewards = self.scores.rewards[self.valid]
        lengths = self.rollout.lengths.float()
        return {
            **self.stats,
            "reward/mean": float(rewards.mean()) if rewards.numel() else None,
            "reward/std": float(rewards.std(correction=0)) if rewards.numel() else None,
            **{f"reward/{name}": value for name, value in self.scores.components.items()},
            "length/mean": float(lengths.mean()), "length/max": int(lengths.max()),
            "truncated_fraction": float(self.rollout.truncated.float().mean()),
            **episode_metrics(self.rollout),
            **overlong_metrics(self.scores.verdicts),
        }

    def throughput(self) -> tuple[float, dict[str, tuple[float, tuple[str, ...]]]]:
        """What the step's clock divides by its seconds (`StepClock.metrics(tokens, rates)`): the
        sampled completion tokens of the batch over the step; those over the `generation` phase;
        and the real (prompt + completion) positions the training forwards and backwards go over,
        over the `logprobs` and `update` phases."""
        generated = float(self.rollout.mask.sum())
        positions = float(self.rollout.prompt_attention_mask.sum()) + float(self.rollout.completion_attention_mask.sum())
        return float(self.rollout.lengths.sum()), {"generation": (generated, ("generation",)),
                                                   "training": (positions, ("logprobs", "update"))}

    def sample_rows(self, limit: int, with_version: bool = False) -> list[dict[str, Any]]:
        """The first `limit` rows for samples.jsonl: prompt, completion, verdict, reason (and, with
        `with_version`, the policy version that sampled them)."""
        rows = []
        for row in range(min(limit, len(self.rollout.texts))):
            b = int(self.rollout.prompt_index[row])
            verdict = self.scores.verdicts[row]
            rows.append({
                "example": self.examples[b].id, "prompt": self.rendered[b], "completion": self.rollout.texts[row],
                "reward": verdict.reward, "status": verdict.status, "reason": verdict.reason,
                "truncated": bool(self.rollout.truncated[row]),
                **({"overlong": verdict.details["overlong"]} if "overlong" in verdict.details else {}),
                **({"version": self.version} if with_version else {}),
                **({"transcript": transcript_text(self.rollout.episodes[row]),
                    "turns": self.rollout.episodes[row]["turns"]} if self.rollout.episodes else {}),
            })
        return rows


def sample_and_score(policy, tokenizer, stream: PromptStream, verifier: Verifier, *, prompts: int, group_size: int,
                     sampling: SamplingConfig, seed: int, step: int, timer, system_prompt: str | None = None,
                     refill_rounds: int | None = None, world: World | None = None,
                     sampler: Sampler = single_turn, truncated: str = "score", version: int | None = None,
                     overlong: Overlong | None = None) -> ScoredBatch:
    """Sample (with `sampler`: one turn by default) and score `prompts` (B) x `group_size` (G) rows. With `refill_rounds` (DAPO dynamic
    sampling), groups without signal are dropped and replaced by fresh prompts for up to that many
    extra rounds (the batch may stay short). Under torchrun each rank samples and scores its block
    of each round's prompts and the results are gathered, so every rank returns the same global
    batch (the one a single process would sample) and takes the same refill decisions. `truncated`:
    what a completion that hit max_new_tokens without stopping gets (`rewards.scores.truncation_policy`);
    `overlong`, DAPO's soft overlong punishment, then shapes the ok rewards by the policy's own tokens.
    `step` (the steps done before the one the batch serves) seeds the rounds; `version`, the
    training steps `policy`'s weights had taken, is recorded in the batch (None: `step`, on-policy).
    A dense reward (`verifier.dense`: a teacher's) then scores every token of the final batch
    (`Scores.dense`)."""
    world = world or World()
    B, G = prompts, group_size
    dynamic = refill_rounds is not None
    parts, kept_examples, kept_rendered, verdict_parts, owner_parts = [], [], [], [], []
    dropped = refilled = infra_errors = data_errors = sampled = 0
    failures: list[dict[str, Any]] = []
    wanted, rounds = B, 0
    policy.eval()
    while wanted > 0:
        examples = stream.take(wanted)
        rendered = [render_prompt(tokenizer, e.prompt_input, system_prompt=system_prompt, tools=getattr(sampler, "tools", None)) for e in examples]
        mine = world.block(len(examples))
        round_seed = derived_seed(seed, "rollout", str(step), str(rounds))
        rollout = scores = None
        if len(mine):  # a short refill round may leave a rank nothing to sample
            with timer("generation"):
                rollout = sampler(policy, tokenizer, examples[mine.start:mine.stop], rendered[mine.start:mine.stop], group_size=G,
                                  sampling=sampling, seed=round_seed, shard=(mine.start, len(examples)) if world.active else None)
            with timer("scoring"):
                rows = [verifier_input(e, r) for e, r in zip(examples[mine.start:mine.stop], rendered[mine.start:mine.stop])]
                index = rollout.prompt_index.tolist()
                if rollout.episodes is not None:  # the verifier reads the last turn and, in its row, the whole episode
                    rows = [{**rows[b], "transcript": episode["transcript"]} for b, episode in zip(index, rollout.episodes)]
                    index = list(range(len(rows)))
                scores = score_rows(verifier, rollout.texts, rows, index, rollout.truncated.tolist(), truncated)
                if rollout.episodes is not None:  # a row whose tool broke is infra_error, whatever it answered
                    scores = Scores.of(episode_verdicts(rollout, scores.verdicts))
                if overlong is not None and overlong.enabled:  # L: the policy's own tokens (the loss mask), not the tools'
                    scores = Scores.of(overlong.shape(scores.verdicts, rollout.mask.sum(-1)))
        owners = torch.arange(world.size).repeat_interleave(torch.tensor([len(b) for b in world.blocks(len(examples))]) * G)
        if world.active:  # every rank gets the whole round, in global row order (through the CPU: a pickled
            # CUDA tensor would unpickle onto the sender's GPU index)
            local = rollout.to("cpu") if rollout is not None else None
            gathered = [part for part in world.gather((local, scores.verdicts if scores else [])) if part[0] is not None]
            rollout = Rollout.concat([(part, list(range(part.prompt_ids.shape[0] // G))) for part, _ in gathered])
            scores = Scores.of([verdict for _, verdicts in gathered for verdict in verdicts])
        infra_errors, data_errors = infra_errors + scores.infra_errors, data_errors + scores.data_errors
        sampled += len(scores.verdicts)
        failures += _failures(scores.verdicts, rollout.texts, examples, rendered, G, FAILURES_KEPT - len(failures))
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
    merged = Rollout.concat(parts) if len(parts) > 1 or dynamic else rollout
    merged_scores = Scores.of(verdict_parts)
    groups = len(kept_examples)
    # Error counts cover every sampled row, including groups dynamic sampling dropped.
    stats = {"groups/dropped": dropped, "groups/refilled": refilled, "groups/trained": groups, "sampling_rounds": rounds,
             "errors/infra": infra_errors, "errors/data": data_errors}
    if G > 1:
        stats["groups/zero_variance_fraction"] = 1 - len(informative_groups(merged_scores.rewards, G)) / groups
    # One device for the batch's tensors (the rollout's, where the sampler left it): the verifier scores
    # on the host, and a batch whose rewards and masks lie apart breaks whatever combines them.
    merged_scores = dataclasses.replace(merged_scores, rewards=merged_scores.rewards.to(merged.mask.device))
    if verifier.dense:  # a teacher scores every sampled token of the final batch (each rank its own rows)
        with timer("scoring"):
            merged_scores.dense = [term.to(merged.mask.device) for term in verifier.token_terms(merged, torch.cat(owner_parts), world)]
    return ScoredBatch(rollout=merged, examples=kept_examples, rendered=kept_rendered, scores=merged_scores,
                       owners=torch.cat(owner_parts), stats=stats, rows_sampled=sampled, failures=failures,
                       version=step if version is None else version, serves=step + 1)


FAILURES_KEPT = 3
"""How many unscorable rows a step keeps for the training-signal check's messages."""


def _failures(verdicts: list[Verdict], texts: list[str], examples: list[Example], rendered: list[str], group_size: int,
              limit: int) -> list[dict[str, Any]]:
    """The first `limit` rows of one round whose verdict is an infra or data error (row i answers
    examples[i // group_size]), as `posttrain verify --input` reads a row."""
    rows = []
    for i, verdict in enumerate(verdicts):
        if len(rows) >= limit:
            break
        if verdict.status in ("infra_error", "data_error"):
            b = i // group_size
            rows.append({**verifier_input(examples[b], rendered[b]), "completion": texts[i], "status": verdict.status,
                         "reason": verdict.reason})
    return rows


def online_data_card(data: Any, train: Task, held_out: Task, sampling: SamplingConfig, *, grouped: bool,
                     screening: dict | None = None) -> dict[str, Any]:
    """The run card's data link of an online run: `data` (the recipe's data section, a
    `data.source.TaskSource` with prompts_per_step, group_size, dynamic_sampling and
    max_refill_rounds), the sizes of the `train` and `held_out` splits and the duplicates removed,
    the `sampling` settings, the answer convention a data file's rows carry (`data.prompts.convention_record`:
    how answers are read, the instruction the prompts end with), the rows `data.strict: false` dropped
    from a data file (`rows_bad`, `rows_bad_reasons`: counted by kind), and `screening` (what the code
    problems' screening removed; None: left out). G is `group_size` when `grouped` (several samples of each prompt, or advantages
    that compare a prompt's completions: the same data link whatever the estimator makes of it), else `samples_per_prompt`. With `data.max_staleness` k >= 1 the source says the samples may be
    up to k steps old, and `staleness` how they were produced (`data/staleness.py`)."""
    k = data.max_staleness
    return {
        "source": "online: the policy's own samples" + (f", up to {k} step{'s' if k > 1 else ''} old" if k else ""),
        **({"max_staleness": k, "staleness": stale_samples_note(k, data.async_generation)} if k else {}),
        "task": data.task, "options": data.load_options(),
        "train_prompts": len(train), "heldout_prompts": len(held_out), "heldout_size_from": heldout_size_from(data.eval_size),
        "duplicates_removed": train.duplicates_removed, "rows_bad": train.rows_bad, "rows_bad_reasons": train.rows_bad_reasons,
        "prompts_per_step": data.prompts_per_step, "dynamic_sampling": data.dynamic_sampling,
        **({"max_refill_rounds": data.max_refill_rounds} if data.dynamic_sampling else {}),
        ("group_size" if grouped else "samples_per_prompt"): data.group_size,
        "sampling": dataclasses.asdict(sampling),
        **({"answer_convention": convention_record(train)} if convention_record(train) else {}),
        **({"screening": screening} if screening is not None else {}),
    }


def stale_samples_note(k: int, asynchronous: bool = False) -> str:
    """The run card's account of how a run with `data.max_staleness` k >= 1 produced its samples
    (`asynchronous`: `data.async_generation`, mode b)."""
    if asynchronous:
        return (f"asynchronous (mode b): a generation thread samples the batches in step order while the trainer trains, "
                f"the batch of step t with the newest weights published when it starts, never older than step t-{k}'s "
                f"(version >= t-1-{k}); which version sampled which batch depends on timing (each row's version is in "
                f"samples.jsonl); the prompts and sampling seeds of step t; its behaviour log-probs are the sampler's")
    return (f"simulated, synchronous and deterministic (mode a): step t samples, with the weights it starts from, the batch of "
            f"step t+{k} and trains the oldest batch sampled (the first step samples those of steps 1..{k + 1}); the batch "
            f"trained at step t was sampled by the weights of step max(t-{k}, 1), {k} step{'s' if k > 1 else ''} old from step {k + 1} on, "
            f"with the prompts and sampling seeds of step t; its behaviour log-probs are the sampler's")
