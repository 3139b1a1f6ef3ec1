"""An episode's tokens and record: which completion tokens are the model's and which are the tools'.

The observation tokens: `ObservationFormat` gives the ids a model's chat template writes for a turn's
tool results, by the dummy-conversation difference (what the template adds after an assistant turn,
minus the EOS the model already wrote, then the tool messages and the next assistant header); a
template that does not render a conversation's prefix as a prefix of the whole is refused at set-up
with one line. A tool result longer than `max_observation_tokens` keeps its head and tail around
`TRUNCATION_MARKER`, exactly that many tokens (`truncate_middle`), counted.

The bookkeeping: an `EpisodeRow` holds one episode's completion as segments, the model's turns
(trained, with their log-probs) and the observations (attended, never trained: `Rollout.mask` False,
log-probs 0, so their gradient is exactly zero), with its transcript and counts; `assemble_rollout`
makes the rows one `Rollout` whose `episodes` are the rows' records. What the rest of a step reads of
those records: `episode_verdicts` (a broken tool is `infra_error`; an environment's reward),
`episode_summary` / `episode_metrics` (docs/metrics.md) and `transcript_text` (samples.jsonl, the
review sheet). The loop that builds the rows is `rollout/episodes.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.errors import UserError
from posttrain.rewards.verdict import Verdict
from posttrain.rollout.batch import Rollout

TRUNCATION_MARKER = "\n...[truncated]...\n"
"""Put between the head and the tail of a tool result cut to `max_observation_tokens`."""


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
# One episode's segments, and the episodes as a Rollout.
@dataclass
class EpisodeRow:
    """One episode being built: its completion so far, in segments (the model's turns trained, the
    observations not), its transcript and its counts."""

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
        """Append `ids`: a turn of the model's (`trained`, with its `logprobs` and the `sampler`'s) or
        an observation (not trained, log-probs 0)."""
        self.ids += ids
        self.trained += [trained] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.sampler_logprobs += sampler if sampler is not None else [0.0] * len(ids)

    def truncate(self, length: int) -> None:
        """Keep the completion's first `length` tokens: the episode ends there, truncated."""
        for name in ("ids", "trained", "logprobs", "sampler_logprobs"):
            setattr(self, name, getattr(self, name)[:length])
        self.truncated = True

    def record(self) -> dict[str, Any]:
        """What `Rollout.episodes` keeps of the row (samples.jsonl, the review sheet, the metrics)."""
        return {"turns": self.turns, "tool_calls": self.calls, "tool_failures": self.failures,
                "parse_errors": self.parse_errors, "observation_tokens": self.observation_tokens,
                "observations_truncated": self.observations_cut, "max_turns_hit": self.max_turns_hit,
                "infra_error": self.infra_error, "environment_rewards": self.rewards, "environment_done": self.done,
                "transcript": self.transcript}


def assemble_rollout(first_turn: Rollout, rows: list[EpisodeRow]) -> Rollout:
    """The episodes as one `Rollout` of N rows: turn 1's prompts, each row's segments right-padded to
    the longest (T): completion_ids (N, T), mask (N, T) True on the model's tokens, attention (N, T)
    True on every real token (the observations too), logprobs and sampler_logprobs (N, T) 0 off the
    model's tokens, truncated (N,), texts (each row's last turn) and episodes (`EpisodeRow.record`)."""
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


def transcript_text(episode: dict[str, Any]) -> str:
    """A row's whole transcript as plain text, the model's and the tools' spans marked."""
    lines = []
    for entry in episode["transcript"]:
        if entry["role"] == "assistant":
            lines.append(f"[model] {entry['content']}")
        else:
            lines.append(f"[tool {entry.get('name') or '?'} {entry.get('status', 'ok')}] {entry['content']}")
    return "\n".join(lines)


__all__ = ["TRUNCATION_MARKER", "EpisodeRow", "ObservationFormat", "assemble_rollout", "episode_metrics", "episode_summary",
           "episode_verdicts", "transcript_text", "truncate_middle"]
