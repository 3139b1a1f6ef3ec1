"""Multi-turn episodes: the sampler that lets the model call tools and read their results.

One episode per row: generate a turn; when the turn holds tool calls (`tool_calls.parse_tool_calls`, the
Hermes / Qwen `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` form), run them
(`tools.Toolbox.execute`, every row's calls of the turn in one batch, or the row's environment),
append the observation tokens and generate the next turn; until a turn without a tool call,
`tools.max_turns` model turns (the last turn's calls are then not run, counted), the room the row has
left, or a sandbox or worker failure (the row becomes `infra_error`: out of the baselines and the
loss, counted). A row's room is the episode's token budget `tools.max_episode_tokens` and the model's
positions after its prompt (`max_position_embeddings`: the set-up check `data.context.check_prompts_fit`
sees the first turn only), whichever is smaller: a turn or an observation that passes it is cut
there and the row is truncated (as a turn that hits `sampling.max_new_tokens`), and no turn is
generated from a context that fills the positions.

Token in, token out: the policy's generated ids are never re-tokenised; which tokens are the
model's and which the tools', the observation ids and each row's record are `rollout/transcripts.py`.

Randomness: turn 1 is `generate` on the prompts with the step's seed (an episode without tool calls
is the single-turn rollout, token for token); turn k draws its uniform numbers from a table seeded
by (seed, k) and indexed by the row's place in the whole batch, so a row samples the same tokens
whichever rank runs it and whichever other rows are still going.

The KV cache: with the built-in engine an episode batch's turns go through one `engine.Session`,
so a later turn reads only its new tokens (the last sampled token and the observation) on top of
the row's cache instead of re-prefilling prompt and earlier turns; the same tokens either way
(tests/test_episode_cache.py). Other engines re-prefill each turn.

Also here: `ToolSettings` (the `tools` section), `make_sampler` (a tools section -> a sampler) and
`tools_card` (the run card's account of the tools).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from posttrain.data.context import context_limit
from posttrain.errors import UserError
from posttrain.rollout.batch import Rollout
from posttrain.rollout.engine import Session, generate, stop_token_ids
from posttrain.rollout.environments import Step, environment_factory, environment_schemas, environment_step
from posttrain.rollout.sampling import SamplingConfig
from posttrain.rollout.tool_calls import ToolCall, parse_tool_calls
from posttrain.rollout.transcripts import TRUNCATION_MARKER, EpisodeRow, ObservationFormat, assemble_rollout

logger = logging.getLogger(__name__)


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
    """The completion's budget, generated and observation tokens together: a turn that passes it is cut there and the row is truncated. None: only max_turns x sampling.max_new_tokens, the observations and the model's positions bound it."""
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
# The sampler.
def _room(budget: int | None, limit: int | None, prompt_length: int) -> int | None:
    """The most completion tokens a row may hold: the episode's `budget` (`tools.max_episode_tokens`)
    and the positions the model's context `limit` leaves after a prompt of `prompt_length` tokens,
    whichever is smaller; None: neither bounds it."""
    rooms = [room for room in (budget, None if limit is None else max(0, limit - prompt_length)) if room is not None]
    return min(rooms) if rooms else None


def _turn_seed(seed: int, turn: int) -> int:
    """Turn k's table seed: turn 1 is the step's own seed (single-turn rollouts unchanged)."""
    return seed if turn == 1 else (seed * 1_000_003 + turn * 7_919) % (1 << 62)


PendingCalls = tuple[int, list[ToolCall], bool]
"""A row whose turn called tools: (its index, its calls, whether the turn ended with the EOS)."""


class EpisodeSampler:
    """The `rollout.sampler.Sampler` of tool episodes (see the module docstring).

    Args:
        tokenizer: the policy's tokenizer (its chat template gives the observation tokens).
        toolbox: `tools.Toolbox` (or anything with `execute(calls) -> results` and `schemas()`).
        settings: `ToolSettings`.
        generate_fn: the turn generator, `rollout.generate`'s signature (tests script it).
        environment: instead of the toolbox, a factory of environments (`rollout/environments.py`), one per episode.
        continue_cache: with the built-in `generate`, draw an episode batch's turns through one
            `engine.Session`: each row's KV cache goes on from turn to turn (a turn reads only its
            observation). False, or any other engine: every turn re-prefills its whole context.
    """

    def __init__(self, tokenizer, toolbox, settings: ToolSettings, generate_fn: Callable[..., Rollout] = generate,
                 environment: Callable[[], Any] | None = None, continue_cache: bool = True):
        self.toolbox, self.settings, self.generate, self.environment = toolbox, settings, generate_fn, environment
        self.continue_cache = continue_cache
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
        draw = self.generate
        if self.continue_cache and self.generate is generate:
            draw = Session()  # one per episode batch: its rows' caches go on from turn to turn
            draw.keep = settings.max_turns > 1
        turn_rollout = draw(policy, tokenizer, list(prompts), group_size=G, sampling=sampling, seed=seed, shard=shard)
        N = turn_rollout.prompt_ids.shape[0]
        eos_ids = set(stop_token_ids(policy, tokenizer, sampling))
        prompt_ids = [ids[keep].tolist() for ids, keep in zip(turn_rollout.prompt_ids.cpu(), turn_rollout.prompt_attention_mask.cpu())]
        limit = context_limit(policy)
        rooms = [_room(settings.max_episode_tokens, limit, len(ids)) for ids in prompt_ids]
        first_turn, rows, active, turn = turn_rollout, [EpisodeRow() for _ in range(N)], list(range(N)), 1
        environments = self._environments(examples, N, G)
        while True:
            pending = self._read_turn(turn_rollout, active, rows, rooms, eos_ids)
            if not pending:
                break
            still = self._observe(pending, rows, rooms, environments)
            if not still:
                break
            turn += 1
            contexts = [prompt_ids[r] + rows[r].ids for r in still]
            if isinstance(draw, Session):
                draw.keep = turn < settings.max_turns  # no turn follows the last allowed one
            turn_rollout = draw(policy, tokenizer, contexts, group_size=1, sampling=sampling,
                                         seed=_turn_seed(seed, turn), draws=([first * G + r for r in still], total * G))
            active = still
        rollout = assemble_rollout(first_turn, rows)
        if settings.reward == "environment":
            for episode, row in zip(rollout.episodes, rows):
                episode["reward"] = (row.rewards[-1] if settings.step_rewards == "last" else sum(row.rewards)) if row.rewards else None
        return rollout

    def _environments(self, examples: Sequence[Any], N: int, G: int) -> list[Any] | None:
        """One environment per episode, the G rows of a group reset from the same example; None: the toolbox's tools."""
        if self.environment is None:
            return None
        environments = [self.environment() for _ in range(N)]
        for r, environment in enumerate(environments):
            environment.reset(examples[r // G])
        return environments

    def _read_turn(self, turn_rollout: Rollout, active: list[int], rows: list[EpisodeRow], rooms: list[int | None],
                   eos_ids: set[int]) -> list[PendingCalls]:
        """Append turn_rollout's row j to row `active[j]` and end the rows that stop here: the turn
        passed the row's room (cut there) or hit max_new_tokens (both truncated), called no tool, or
        was the last allowed (counted). The rows whose calls are run."""
        pending = []
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
            if rooms[r] is not None and len(row.ids) > rooms[r]:
                row.truncate(rooms[r])
                continue
            if bool(turn_rollout.truncated[j]):
                row.truncated = True
                continue
            calls = parse_tool_calls(turn_rollout.texts[j])
            if not calls:
                continue
            if row.turns >= self.settings.max_turns:
                row.max_turns_hit = True
                continue
            pending.append((r, calls, bool(ids) and ids[-1] in eos_ids))
        return pending

    def _observe(self, pending: list[PendingCalls], rows: list[EpisodeRow], rooms: list[int | None],
                 environments: list[Any] | None) -> list[int]:
        """Run the `pending` rows' calls (all in one batch, or each row's in its environment) and append
        each row's results as observation tokens. A row ends here when a tool broke (infra_error), its
        environment is done, or its observation leaves no room for another turn (cut, truncated).
        The rows that go on to another turn."""
        settings = self.settings
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
            if rooms[r] is not None and len(row.ids) >= rooms[r]:
                row.truncate(rooms[r])
                continue
            still.append(r)
        return still


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


def tools_card(settings: ToolSettings, toolbox) -> dict[str, Any]:
    """The run card's account of the tools (the data link: how each row's episode was sampled)."""
    tools = toolbox.describe() if toolbox is not None else {
        "environment": settings.environment, "reward": settings.reward, "step_rewards": settings.step_rewards,
        "runs": "in the trainer's process, one instance per episode (trusted code)"}
    return {"tools": tools, "max_turns": settings.max_turns,
            "max_observation_tokens": settings.max_observation_tokens, "max_episode_tokens": settings.max_episode_tokens,
            "timeout_s": settings.timeout_s, "described_to_model": settings.describe,
            "observation_tokens": "attended, never trained (loss mask False)"}


__all__ = ["EpisodeSampler", "ToolSettings", "make_sampler", "tools_card"]
