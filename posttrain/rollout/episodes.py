"""Multi-turn episodes: the sampler that lets the model call tools and read their results.

One episode per row: generate a turn; when the turn holds tool calls (`tool_calls.parse_tool_calls`, the
Hermes / Qwen `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` form), run them
(`tools.Toolbox.execute`, every row's calls of the turn in one batch), append the observation
tokens and generate the next turn; until a turn without a tool call, `tools.max_turns` model turns
(the last turn's calls are then not run, counted), the episode's token budget, or a sandbox or
worker failure (the row becomes `infra_error`: out of the baselines and the loss, counted).

Token in, token out: the policy's generated ids are never re-tokenised. The observation is the ids
the model's chat template gives for the turn's tool messages, found by the dummy-conversation
difference (`ObservationFormat`): what the template adds after an assistant turn, minus the EOS the
model already wrote, then the tool messages and the next assistant header. A template that does not
render a conversation's prefix as a prefix of the whole (one that rewrites earlier turns) is refused
at set-up with one line. Observation tokens are attended (`Rollout.attention` True) and never
trained (`Rollout.mask` False, log-probs 0): their gradient is exactly zero. A tool result longer than
`max_observation_tokens` keeps its head and tail around a marker, exactly that many tokens, counted.

Randomness: turn 1 is `generate` on the prompts with the step's seed (an episode without tool calls
is the single-turn rollout, token for token); turn k draws its uniform numbers from a table seeded
by (seed, k) and indexed by the row's place in the whole batch, so a row samples the same tokens
whichever rank runs it and whichever other rows are still going.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from posttrain.errors import UserError
from posttrain.rewards.verdict import Verdict
from posttrain.rollout.batch import Rollout
from posttrain.rollout.engine import generate, stop_token_ids
from posttrain.rollout.environments import Step, environment_factory, environment_schemas, environment_step
from posttrain.rollout.sampling import SamplingConfig
from posttrain.rollout.tool_calls import parse_tool_calls

logger = logging.getLogger(__name__)

TRUNCATION_MARKER = "\n...[truncated]...\n"
"""Put between the head and the tail of a tool result cut to `max_observation_tokens`."""


@dataclass
class ToolSettings:
    """The `tools` section of an online run (`posttrain grpo` / `ppo`) and of `posttrain eval`: which
    tools the model may call and how an episode ends. No tools: one turn per row, as always."""

    PRIMARY: ClassVar[dict[str, Any]] = {"names": None}
    """What a value given to the section itself meant (`config._primary_hint`): `--tools '[add]'` is --tools.names '[add]'."""

    names: list[str] = field(default_factory=list)
    """Tools the model may call: `python` (runs in the bubblewrap sandbox), `calculator`, `add`, or a user callable `module:function` (its signature and docstring give the schema). Empty: single-turn rollouts."""
    max_turns: int = 4
    """Model turns per episode; a tool call in the last one is not run (counted in episodes/max_turns_hit)."""
    max_observation_tokens: int = 256
    """A tool result longer than this keeps its head and tail around a marker, exactly this many tokens (counted)."""
    max_episode_tokens: int | None = None
    """The completion's budget, generated and observation tokens together: a turn that passes it is cut there and the row is truncated. None: only max_turns x sampling.max_new_tokens and the observations bound it."""
    timeout_s: float = 10.0
    """Wall-clock deadline of one tool call (the python tool: of one program run)."""
    describe: Literal["auto", "none"] = "auto"
    """auto: the prompts carry the tools' schemas (through the chat template's tools=, or a system message when the template ignores them); none: the model is not told (it learned the tools from SFT transcripts)."""
    environment: str | None = None
    """Instead of names: a stateful environment `module:Class` (rollout/environments.py: tools(), reset(example), step(call) -> Step), one instance per episode, reset from the row's example."""
    reward: Literal["verifier", "environment"] = "verifier"
    """Who gives a row's reward: the run's verifier on the last assistant turn, or the environment's step rewards."""
    step_rewards: Literal["last", "sum"] = "last"
    """reward environment: the last reward a step gave, or their sum."""

    @property
    def enabled(self) -> bool:
        return bool(self.names) or self.environment is not None

    def validate(self, prefix: str = "tools.") -> None:
        if self.max_turns < 1:
            raise UserError(f"{prefix}max_turns must be at least 1, got {self.max_turns}")
        if self.max_observation_tokens < len(TRUNCATION_MARKER) + 2:
            raise UserError(f"{prefix}max_observation_tokens must be at least {len(TRUNCATION_MARKER) + 2}, "
                            f"got {self.max_observation_tokens}")
        if self.max_episode_tokens is not None and self.max_episode_tokens < 1:
            raise UserError(f"{prefix}max_episode_tokens must be at least 1 (or null), got {self.max_episode_tokens}")
        if self.timeout_s <= 0:
            raise UserError(f"{prefix}timeout_s must be > 0, got {self.timeout_s}")
        if self.describe not in ("auto", "none"):
            raise UserError(f"{prefix}describe must be auto or none, got {self.describe!r}")
        if len(set(self.names)) != len(self.names):
            raise UserError(f"{prefix}names lists a tool twice: {self.names}")
        if self.names and self.environment:
            raise UserError(f"give {prefix}names (stateless tools) or {prefix}environment (whose tools() the model calls), not both")
        if self.reward not in ("verifier", "environment") or self.step_rewards not in ("last", "sum"):
            raise UserError(f"{prefix}reward must be verifier or environment and {prefix}step_rewards last or sum, "
                            f"got {self.reward!r} and {self.step_rewards!r}")
        if self.reward == "environment" and not self.environment:
            raise UserError(f"{prefix}reward environment needs {prefix}environment (module:Class)")


# ---------------------------------------------------------------------------------------------
# Observation tokens from the chat template.
_SENTINEL = "\x00posttrain-{}\x00"


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def truncate_middle(ids: list[int], cap: int, marker: list[int]) -> tuple[list[int], bool]:
    """`ids` if at most `cap` long, else its head, `marker` and its tail: exactly `cap` ids (the head
    gets the odd one). Returns (ids, whether it was cut)."""
    if len(ids) <= cap:
        return ids, False
    room = cap - len(marker)
    if room < 2:
        return ids[:cap], True
    head = (room + 1) // 2
    return ids[:head] + marker + ids[len(ids) - (room - head):], True


class ObservationFormat:
    """The ids a model's chat template gives for a turn's tool results, by the dummy-conversation
    difference. Built once per tokenizer (set-up): a template that cannot give them is one line."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("tools need a chat template (the model's tokenizer has none): the tool results' tokens come from it")
        user = [{"role": "user", "content": "U"}]
        answer = _SENTINEL.format("answer")
        opened = self._render(user, add_generation_prompt=True)
        self.closed = self._render(user + [{"role": "assistant", "content": answer}])
        self.messages = user + [{"role": "assistant", "content": answer}]
        if not self.closed.startswith(opened + answer):
            raise UserError("the chat template does not write an assistant turn where its generation prompt ends "
                            "(its rendering of the conversation's prefix is not a prefix of the whole): tool episodes need "
                            "a template that preserves prefixes")
        self.closing = self.closed[len(opened) + len(answer):]
        """What the template writes after an assistant turn's text (ChatML: `<|im_end|>\\n`)."""
        eos = tokenizer.eos_token or ""
        self.after_eos = self.closing[len(eos):] if eos and self.closing.startswith(eos) else None
        """The closing once the model's EOS is written (None: the closing does not start with the EOS)."""
        self.marker = _encode(tokenizer, TRUNCATION_MARKER)
        self._pieces: dict[tuple[str, ...], list[str]] = {}
        self.pieces(("tool",))  # checks the template now, at set-up

    def _render(self, messages, **kwargs) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)

    def pieces(self, names: tuple[str, ...]) -> list[str]:
        """The k + 1 texts around the k results of one turn (tools `names`, in call order): what
        follows the assistant turn up to the first result, between results, and after the last
        one up to the next assistant turn's first token."""
        if names not in self._pieces:
            sentinels = [_SENTINEL.format(i) for i in range(len(names))]
            tools = [{"role": "tool", "name": name, "content": s} for name, s in zip(names, sentinels)]
            full = self._render(self.messages + tools, add_generation_prompt=True)
            if not full.startswith(self.closed):
                raise UserError("the chat template rewrites the earlier turns when a tool message follows (its rendering "
                                "of the conversation's prefix is not a prefix of the whole): tool episodes need a template "
                                "that preserves prefixes")
            rest, pieces = full[len(self.closed):], []
            for sentinel in sentinels:
                if rest.count(sentinel) != 1:
                    raise UserError("the chat template does not render each tool message's content exactly once")
                before, rest = rest.split(sentinel)
                pieces.append(before)
            self._pieces[names] = pieces + [rest]
        return self._pieces[names]

    def ids(self, contents: Sequence[str], names: Sequence[str], after_eos: bool, cap: int) -> tuple[list[int], int]:
        """The observation ids of one turn's results `contents` (tools `names`), the turn having
        ended with the model's EOS (`after_eos`) or not. Each content is cut to `cap` tokens
        (`truncate_middle`). Returns (ids, how many contents were cut)."""
        pieces = self.pieces(tuple(names))
        glue = self.after_eos if after_eos and self.after_eos is not None else self.closing
        ids, cut = _encode(self.tokenizer, glue + pieces[0]), 0
        for content, piece in zip(contents, pieces[1:]):
            content_ids, was_cut = truncate_middle(_encode(self.tokenizer, content), cap, self.marker)
            ids += content_ids + _encode(self.tokenizer, piece)
            cut += was_cut
        return ids, cut


# ---------------------------------------------------------------------------------------------
# The sampler.
@dataclass
class _Row:
    """One episode being built: its completion so far, in segments."""

    ids: list[int] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampler_logprobs: list[float] = field(default_factory=list)
    transcript: list[dict[str, Any]] = field(default_factory=list)
    last_text: str = ""
    turns: int = 0
    calls: int = 0
    failures: int = 0
    parse_errors: int = 0
    observation_tokens: int = 0
    observations_cut: int = 0
    truncated: bool = False
    max_turns_hit: bool = False
    infra_error: str | None = None
    done: bool = False
    rewards: list[float] = field(default_factory=list)

    def add(self, ids: list[int], trained: bool, logprobs: list[float] | None = None, sampler: list[float] | None = None):
        self.ids += ids
        self.trained += [trained] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.sampler_logprobs += sampler if sampler is not None else [0.0] * len(ids)

    def cut(self, length: int) -> None:
        for name in ("ids", "trained", "logprobs", "sampler_logprobs"):
            setattr(self, name, getattr(self, name)[:length])

    def record(self) -> dict[str, Any]:
        """What `Rollout.episodes` keeps of the row (samples.jsonl, the review sheet, the metrics)."""
        return {"turns": self.turns, "tool_calls": self.calls, "tool_failures": self.failures,
                "parse_errors": self.parse_errors, "observation_tokens": self.observation_tokens,
                "observations_truncated": self.observations_cut, "max_turns_hit": self.max_turns_hit,
                "infra_error": self.infra_error, "environment_rewards": self.rewards, "environment_done": self.done,
                "transcript": self.transcript}


def _turn_seed(seed: int, turn: int) -> int:
    """Turn k's table seed: turn 1 is the step's own seed (single-turn rollouts unchanged)."""
    return seed if turn == 1 else (seed * 1_000_003 + turn * 7_919) % (1 << 62)


class EpisodeSampler:
    """The `rollout.sampler.Sampler` of tool episodes (see the module docstring).

    Args:
        tokenizer: the policy's tokenizer (its chat template gives the observation tokens).
        toolbox: `tools.Toolbox` (or anything with `execute(calls) -> results` and `schemas()`).
        settings: `ToolSettings`.
        generate_fn: the turn generator, `rollout.generate`'s signature (tests script it).
    """

    def __init__(self, tokenizer, toolbox, settings: ToolSettings, generate_fn: Callable[..., Rollout] = generate,
                 environment: Callable[[], Any] | None = None):
        self.toolbox, self.settings, self.generate, self.environment = toolbox, settings, generate_fn, environment
        self.observations = ObservationFormat(tokenizer)
        schemas = environment_schemas(environment) if environment is not None else toolbox.schemas()
        self.tools = schemas if settings.describe == "auto" else None
        """The schemas the prompts are rendered with (`data.tokenize.render_prompt`'s tools=); None: not described."""

    def __call__(self, policy, tokenizer, examples: Sequence[Any], prompts: Sequence[str], *, group_size: int,
                 sampling: SamplingConfig, seed: int, shard: tuple[int, int] | None = None) -> Rollout:
        """B x G episodes for the B rendered `prompts` (a `Rollout` whose `episodes` holds each row's
        transcript and counts); `seed` and `shard` as in `generate`."""
        settings, G = self.settings, group_size
        first, total = shard if shard is not None else (0, len(prompts))
        turn_rollout = self.generate(policy, tokenizer, list(prompts), group_size=G, sampling=sampling, seed=seed, shard=shard)
        N = turn_rollout.prompt_ids.shape[0]
        eos_ids = set(stop_token_ids(policy, tokenizer, sampling))
        prompt_ids = [ids[keep].tolist() for ids, keep in zip(turn_rollout.prompt_ids.cpu(), turn_rollout.prompt_attention_mask.cpu())]
        first_turn, rows, active, turn = turn_rollout, [_Row() for _ in range(N)], list(range(N)), 1
        budget = settings.max_episode_tokens
        environments = None
        if self.environment is not None:  # one per episode, the G rows of a group reset from the same example
            environments = [self.environment() for _ in range(N)]
            for r, environment in enumerate(environments):
                environment.reset(examples[r // G])
        while True:
            pending = []  # (row, its calls, the turn ended with the EOS)
            lengths = turn_rollout.mask.sum(-1).tolist()
            completion = turn_rollout.completion_ids.cpu()
            logprobs, sampler_logprobs = turn_rollout.logprobs.cpu(), turn_rollout.sampler_logprobs.cpu()
            for j, r in enumerate(active):
                row, n = rows[r], lengths[j]
                ids = completion[j, :n].tolist()
                row.add(ids, True, logprobs[j, :n].tolist(), sampler_logprobs[j, :n].tolist())
                row.turns += 1
                row.last_text = turn_rollout.texts[j]
                row.transcript.append({"role": "assistant", "content": turn_rollout.texts[j]})
                if bool(turn_rollout.truncated[j]):
                    row.truncated = True
                    continue
                if budget is not None and len(row.ids) > budget:
                    row.cut(budget)
                    row.truncated = True
                    continue
                calls = parse_tool_calls(turn_rollout.texts[j])
                if not calls:
                    continue
                if row.turns >= settings.max_turns:
                    row.max_turns_hit = True
                    continue
                pending.append((r, calls, bool(ids) and ids[-1] in eos_ids))
            if not pending:
                break
            if environments is None:
                results = self.toolbox.execute([call for _, calls, _ in pending for call in calls])
            else:
                results = [_EnvironmentResult.of(*environment_step(environments[r], call)) for r, calls, _ in pending for call in calls]
            still, at = [], 0
            for r, calls, after_eos in pending:
                row, mine = rows[r], results[at:at + len(calls)]
                at += len(calls)
                row.calls += len(calls)
                row.parse_errors += sum(result.status == "parse_error" for result in mine)
                row.failures += sum(result.status == "error" for result in mine)
                for call, result in zip(calls, mine):
                    row.transcript.append({"role": "tool", "name": call.name, "content": result.content, "status": result.status})
                broken = [result for result in mine if result.status == "infra_error"]
                if broken:
                    row.infra_error = f"tool {broken[0].reason or broken[0].content}"
                    continue
                row.rewards += [result.reward for result in mine if getattr(result, "reward", None) is not None]
                if any(getattr(result, "done", False) for result in mine):
                    row.done = True  # the environment ended the episode: its last words are not appended
                    continue
                names = [call.name or "tool" for call in calls]
                ids, cut = self.observations.ids([result.content for result in mine], names, after_eos,
                                                 settings.max_observation_tokens)
                row.add(ids, False)
                row.observation_tokens += len(ids)
                row.observations_cut += cut
                if budget is not None and len(row.ids) >= budget:
                    row.cut(budget)
                    row.truncated = True
                    continue
                still.append(r)
            if not still:
                break
            turn += 1
            contexts = [prompt_ids[r] + rows[r].ids for r in still]
            turn_rollout = self.generate(policy, tokenizer, contexts, group_size=1, sampling=sampling,
                                         seed=_turn_seed(seed, turn), draws=([first * G + r for r in still], total * G))
            active = still
        rollout = _assemble(first_turn, rows)
        if settings.reward == "environment":
            for episode, row in zip(rollout.episodes, rows):
                episode["reward"] = (row.rewards[-1] if settings.step_rewards == "last" else sum(row.rewards)) if row.rewards else None
        return rollout


@dataclass(frozen=True)
class _EnvironmentResult:
    """An environment step as a tool result (content, status) with its reward and end."""

    content: str
    status: str
    reward: float | None = None
    done: bool = False
    reason: str = ""

    @classmethod
    def of(cls, step: Step, status: str) -> _EnvironmentResult:
        return cls(step.observation, status, step.reward, step.done)


def _assemble(first_turn: Rollout, rows: list[_Row]) -> Rollout:
    """The episodes as one `Rollout`: turn 1's prompts, each row's segments right-padded."""
    device, pad = first_turn.completion_ids.device, first_turn.pad_token_id
    width = max(1, max(len(row.ids) for row in rows))
    N = len(rows)
    ids = torch.full((N, width), pad, dtype=torch.long)
    mask = torch.zeros((N, width), dtype=torch.bool)
    attention = torch.zeros((N, width), dtype=torch.bool)
    logprobs, sampler_logprobs = torch.zeros(N, width), torch.zeros(N, width)
    for i, row in enumerate(rows):
        n = len(row.ids)
        ids[i, :n] = torch.tensor(row.ids, dtype=torch.long)
        mask[i, :n] = torch.tensor(row.trained, dtype=torch.bool)
        attention[i, :n] = True
        logprobs[i, :n] = torch.tensor(row.logprobs)
        sampler_logprobs[i, :n] = torch.tensor(row.sampler_logprobs)
    truncated = torch.tensor([row.truncated for row in rows], dtype=torch.bool)
    return dataclasses.replace(
        first_turn, completion_ids=ids.to(device), mask=mask.to(device), attention=attention.to(device),
        logprobs=logprobs.to(device), sampler_logprobs=sampler_logprobs.to(device),
        finished=(~truncated).to(device), truncated=truncated.to(device), texts=[row.last_text for row in rows],
        episodes=[row.record() for row in rows])


def make_sampler(settings: ToolSettings, tokenizer, sandbox=None, generate_fn: Callable[..., Rollout] = generate):
    """The sampler `settings` ask for: `sampler.single_turn` without tools, else an `EpisodeSampler`
    over `tools.resolve_tools(settings.names)`, its python tool under `sandbox` (a
    `rewards.sandbox.SandboxConfig`: the run's limits and unsafe flag). Bad tool names, and a
    python tool without isolation, are one line here, at set-up. Every turn is drawn by `generate_fn`
    (the engine, `rollout/engines.make_engine`: the built-in `generate` or vLLM), token ids in and out."""
    from posttrain.rollout.sampler import SingleTurn, single_turn
    from posttrain.rollout.tools import resolve_tools

    if not settings.enabled:
        return single_turn if generate_fn is generate else SingleTurn(generate_fn)
    if settings.environment:
        return EpisodeSampler(tokenizer, None, settings, generate_fn, environment=environment_factory(settings.environment))
    return EpisodeSampler(tokenizer, resolve_tools(settings.names, timeout_s=settings.timeout_s, sandbox=sandbox), settings, generate_fn)


# ---------------------------------------------------------------------------------------------
# What the rest of a step reads of the episodes.
def episode_verdicts(rollout: Rollout, verdicts: Sequence[Verdict]) -> list[Verdict]:
    """`verdicts` with the rows whose tools broke (a sandbox or worker failure) as `infra_error`:
    never scored as if the model had failed, out of the baselines and the loss, counted; with
    `tools.reward: environment`, the environment's reward (the verifier's kept in the details; an
    episode whose environment gave none is a data_error, never a silent 0)."""
    if rollout.episodes is None:
        return list(verdicts)
    return [_verdict(verdict, episode) for verdict, episode in zip(verdicts, rollout.episodes)]


def _verdict(verdict: Verdict, episode: dict[str, Any]) -> Verdict:
    if episode["infra_error"]:
        return Verdict.infra_error(episode["infra_error"])
    if "reward" not in episode:  # the verifier's
        return verdict
    if episode["reward"] is None:
        return Verdict.data_error("the environment gave this episode no reward (tools.reward environment)")
    return Verdict.ok(float(episode["reward"]), "the environment's reward", verifier_reward=verdict.reward)


def episode_summary(episodes: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Counts over episode records (`Rollout.episodes`, from any number of rollouts): turns/mean and
    tools/calls (means per row); tools/failures, tools/parse_errors, tools/observations_truncated,
    episodes/max_turns_hit, episodes/infra_errors (counts). Empty: {}."""
    if not episodes:
        return {}
    return {
        "turns/mean": sum(e["turns"] for e in episodes) / len(episodes),
        "tools/calls": sum(e["tool_calls"] for e in episodes) / len(episodes),
        "tools/failures": sum(e["tool_failures"] for e in episodes),
        "tools/parse_errors": sum(e["parse_errors"] for e in episodes),
        "tools/observations_truncated": sum(e["observations_truncated"] for e in episodes),
        "episodes/max_turns_hit": sum(e["max_turns_hit"] for e in episodes),
        "episodes/infra_errors": sum(bool(e["infra_error"]) for e in episodes),
    }


def episode_metrics(rollout: Rollout) -> dict[str, float]:
    """A step's episode metrics (docs/metrics.md): `episode_summary` of its rows and
    tokens/observation_fraction (observation tokens / attended completion tokens). Single turn: {}."""
    if not rollout.episodes:
        return {}
    attended = float(rollout.completion_attention_mask.sum())
    observed = float((rollout.completion_attention_mask & ~rollout.mask).sum())
    return {**episode_summary(rollout.episodes), "tokens/observation_fraction": observed / attended if attended else 0.0}


def tools_card(settings: ToolSettings, toolbox) -> dict[str, Any]:
    """The run card's account of the tools (the data link: how each row's episode was sampled)."""
    tools = toolbox.describe() if toolbox is not None else {
        "environment": settings.environment, "reward": settings.reward, "step_rewards": settings.step_rewards,
        "runs": "in the trainer's process, one instance per episode (trusted code)"}
    return {"tools": tools, "max_turns": settings.max_turns,
            "max_observation_tokens": settings.max_observation_tokens, "max_episode_tokens": settings.max_episode_tokens,
            "timeout_s": settings.timeout_s, "described_to_model": settings.describe,
            "observation_tokens": "attended, never trained (loss mask False)"}


def transcript_text(episode: dict[str, Any]) -> str:
    """A row's whole transcript as plain text, the model's and the tools' spans marked."""
    lines = []
    for entry in episode["transcript"]:
        if entry["role"] == "assistant":
            lines.append(f"[model] {entry['content']}")
        else:
            lines.append(f"[tool {entry.get('name') or '?'} {entry.get('status', 'ok')}] {entry['content']}")
    return "\n".join(lines)


__all__ = ["EpisodeSampler", "make_sampler", "ObservationFormat", "ToolSettings", "episode_metrics", "episode_summary", "episode_verdicts",
           "tools_card", "transcript_text", "truncate_middle"]
