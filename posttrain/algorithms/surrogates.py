"""The policy-gradient surrogates as a table: each entry names its function, the `loss.<section>`
of settings it reads, the per-token statistics it reports (logged as fractions of the counted
tokens) and its run-card text. The loss step (`posttrain/losses/policy_gradient.py`) asks the
entry, never "is it the clipped ratio?".

Adding a surrogate (GSPO, CISPO) is one function of `surrogate(logprobs, old_logprobs, advantages,
**settings) -> (per-token loss, stats)` and one entry in `SURROGATES`, plus its settings section.
Pure tensor math like the rest of `algorithms/`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from posttrain.algorithms.policy import clipped_surrogate


@dataclass(frozen=True)
class Surrogate:
    name: str
    function: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    """function(logprobs (n, T), old_logprobs (n, T), advantages (n,) or (n, T), **settings) ->
    ((n, T) per-token loss, detached per-token stats, `ratio` among them)."""
    section: str
    """The `loss.<section>` whose fields are its keyword settings."""
    fractions: tuple[tuple[str, str], ...]
    """(metric, stats key) pairs: boolean statistics logged as a fraction of the counted tokens."""
    describe: Callable[[dict], str]
    """describe(its settings) -> what the run card says it is."""


def _clip(logprobs, old_logprobs, advantages, low: float, high: float, dual: float | None):
    return clipped_surrogate(logprobs, old_logprobs, advantages, low, high, dual)


SURROGATES: dict[str, Surrogate] = {
    "clip": Surrogate(
        name="clip", function=_clip, section="clip",
        fractions=(("clip/low", "clipped_low"), ("clip/high", "clipped_high"), ("clip/dual", "dual_clipped")),
        describe=lambda s: (f"PPO clipped ratio per token: -min(r A, clip(r, 1 - {s['low']}, 1 + {s['high']}) A) (arXiv:1707.06347 eq. 7)"
                            + (f"; a negative advantage's loss capped at {s['dual']} x |A| (dual clip, arXiv:1912.09729 eq. 5)"
                               if s["dual"] is not None else "")),
    ),
}
"""Every surrogate by its `loss.surrogate` name."""
