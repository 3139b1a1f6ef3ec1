"""Scores of a rollout: every row's Verdict against its prompt's example, as tensors."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from posttrain.rewards.base import TokenTerm, Verifier
from posttrain.rewards.verdict import Verdict


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
    dense: list[TokenTerm] = field(default_factory=list)
    """The reward's per-token terms (a teacher's log-probs of the sampled tokens), empty for a
    sequence-level reward; the loss link turns them into token rewards against the student's log-probs."""

    def to(self, device) -> Scores:
        """The same scores with the rewards and the dense terms' tensors on `device`."""
        return dataclasses.replace(self, rewards=self.rewards.to(device), dense=[term.to(device) for term in self.dense])

    @classmethod
    def of(cls, verdicts: Sequence[Verdict]) -> Scores:
        """Rewards (NaN unless ok), error counts and component means of a list of verdicts."""
        rewards = torch.tensor([v.reward if v.status == "ok" else math.nan for v in verdicts], dtype=torch.float32)
        components: dict[str, list[float]] = {}
        for verdict in verdicts:
            for name, value in (verdict.details.get("components") or {}).items():
                if isinstance(value, (int, float)):
                    components.setdefault(name, []).append(float(value))
        return cls(
            rewards=rewards,
            verdicts=list(verdicts),
            infra_errors=sum(v.status == "infra_error" for v in verdicts),
            data_errors=sum(v.status == "data_error" for v in verdicts),
            components={name: sum(values) / len(values) for name, values in components.items()},
        )


def score_rows(verifier: Verifier, texts: Sequence[str], rows: Sequence[Mapping[str, Any]], prompt_index: Sequence[int],
               truncated: Sequence[bool] | None = None, policy: str = "score") -> Scores:
    """Score completion `texts[i]` against `rows[prompt_index[i]]` (row b*G+g -> rows[b]); the
    completions that reached max_new_tokens without stopping (`truncated`) then follow `policy`
    (`truncation_policy`)."""
    verdicts = verifier.batch(list(texts), [rows[b] for b in prompt_index])
    if truncated is not None and policy != "score":
        verdicts = truncation_policy(verdicts, truncated, policy)
    return Scores.of(verdicts)


def truncation_policy(verdicts: Sequence[Verdict], truncated: Sequence[bool], policy: str) -> list[Verdict]:
    """`reward_options.truncated` for the completions that hit max_new_tokens without an EOS:
    `score` (as scored) | `penalty:<x>` (an ok reward minus x: TRL's missing_eos_penalty) | `exclude`
    (data_error: out of the group baselines and the loss, counted). Verdicts that are not ok stay.
    Example: penalty:1 turns a truncated reward 0.7 into -0.3."""
    if policy == "score":
        return list(verdicts)
    penalty = float(policy.removeprefix("penalty:")) if policy.startswith("penalty:") else None
    out = []
    for verdict, cut in zip(verdicts, truncated):
        if not cut or verdict.status != "ok":
            out.append(verdict)
        elif penalty is not None:
            out.append(Verdict.ok(verdict.reward - penalty, f"{verdict.reason}; truncated: -{penalty:g} (reward_options.truncated)",
                                  **verdict.details, unpenalised=verdict.reward))
        else:
            out.append(Verdict.data_error("truncated at max_new_tokens: excluded (reward_options.truncated exclude)",
                                          **verdict.details, unexcluded=verdict.reward))
    return out
