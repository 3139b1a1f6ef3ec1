"""`reward_options.overlong`: DAPO's soft overlong punishment (arXiv:2503.14476 eq. 13) as a named
reward shaping of an online run (docs/rewards.md, Overlong shaping).

The math is `posttrain.algorithms.overlong.overlong_shaping`; here are its settings, how it is
applied to a step's verdicts, its metrics and its run-card text. L is the completion's length in the
policy's own sampled tokens (`Rollout.mask.sum(-1)`): in a tool episode the tools' observation tokens
are not the policy's and do not count. Only an ok verdict is shaped (an infra or data error stays
unscored), after `reward_options.truncated` (so a truncated row under `penalty:x` gets both, and under
`exclude` is a data error and gets neither). This module imports no torch (config and --help read it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.errors import UserError
from posttrain.rewards.verdict import Verdict

FORMULA = ("reward + shaping, shaping = 0 if L <= max_tokens - buffer; ((max_tokens - buffer) - L) / buffer * penalty "
           "if max_tokens - buffer < L <= max_tokens; -penalty if L > max_tokens")
"""The shaping in words (the run card and `posttrain explain overlong`)."""


@dataclass(frozen=True)
class Overlong:
    """DAPO's soft overlong punishment (`reward_options.overlong`): off unless `max_tokens` is set."""

    max_tokens: int | None = None
    """L_max: a completion longer than this (in the policy's own tokens) gets -penalty; None: no shaping. At most the tokens a row can hold (sampling.max_new_tokens; with tools, max_turns x that, or tools.max_episode_tokens)."""
    buffer: int | None = None
    """L_cache: the last `buffer` tokens up to max_tokens, where the penalty grows linearly from 0 to -penalty; in (0, max_tokens]."""
    penalty: float = 1.0
    """The shaping at and past max_tokens is -penalty (DAPO: 1)."""

    def validate(self, budget: int, prefix: str = "reward_options.overlong.") -> None:
        """Once, from the online config's `validate` (a preset may set max_tokens and a flag buffer):
        one UserError line per bad setting. `budget`: the most policy tokens a row can hold. A
        max_tokens above it is refused, not warned about: the full -penalty (and, past the budget, part
        of the ramp) could never apply, so the card would state a shaping the run never gives (DAPO
        itself sets L_max to the generation budget)."""
        if self.max_tokens is None:
            if self.buffer is not None or self.penalty != 1.0:
                raise UserError(f"{prefix}max_tokens: set it to turn the shaping on (buffer and penalty alone do nothing)")
            return
        if self.max_tokens < 1:
            raise UserError(f"{prefix}max_tokens must be at least 1, got {self.max_tokens}")
        if self.buffer is None or not 0 < self.buffer <= self.max_tokens:
            raise UserError(f"{prefix}buffer must be in (0, max_tokens = {self.max_tokens}], got {self.buffer}")
        if self.penalty < 0:
            raise UserError(f"{prefix}penalty must be >= 0, got {self.penalty}")
        if self.max_tokens > budget:
            raise UserError(f"{prefix}max_tokens {self.max_tokens} exceeds the {budget} tokens a completion can hold "
                            f"(sampling.max_new_tokens; with tools, max_turns x it or tools.max_episode_tokens): the full "
                            f"penalty could never apply; set max_tokens <= {budget} (DAPO: max_tokens = the generation budget)")

    @property
    def enabled(self) -> bool:
        return self.max_tokens is not None

    def shape(self, verdicts: Sequence[Verdict], lengths) -> list[Verdict]:
        """`verdicts` with the shaping of `lengths` ((N,) tensor: each row's policy tokens) added to
        each ok reward; `details` keep it apart: `overlong` (the shaping, <= 0) and `task_reward` (the
        reward before it). Not ok: as is. Example (max_tokens 20, buffer 4): an ok 1.0 of 18 tokens -> 0.5."""
        from posttrain.algorithms.overlong import overlong_shaping  # here: torch stays out of config and --help

        shaping = overlong_shaping(lengths, self.max_tokens, self.buffer, self.penalty).tolist()
        return [Verdict.ok(verdict.reward + value, f"{verdict.reason}; overlong: {value:+.4g} (reward_options.overlong)" if value else verdict.reason,
                           **{**verdict.details, "overlong": value, "task_reward": verdict.reward}) if verdict.status == "ok" else verdict
                for verdict, value in zip(verdicts, shaping)]

    def card(self) -> dict[str, Any]:
        """The run card's account (the reward link's `overlong`)."""
        return {"shaping": "DAPO soft overlong punishment (arXiv:2503.14476 eq. 13)", "formula": FORMULA,
                "max_tokens": self.max_tokens, "buffer": self.buffer, "penalty": self.penalty,
                "length": "the policy's own sampled tokens (tool observations do not count)",
                "applies_to": "ok verdicts only, after reward_options.truncated"}


def overlong_metrics(verdicts: Sequence[Verdict]) -> dict[str, float]:
    """`reward/overlong` (the mean shaping over the scored rows) and `overlong_fraction` (the share
    of them with shaping < 0); {} when no verdict was shaped (the shaping is off)."""
    values = [verdict.details["overlong"] for verdict in verdicts if verdict.status == "ok" and "overlong" in verdict.details]
    if not values:
        return {}
    return {"reward/overlong": sum(values) / len(values), "overlong_fraction": sum(value < 0 for value in values) / len(values)}
