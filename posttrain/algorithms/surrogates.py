"""The policy-gradient surrogates as a table: each entry names its function, the `loss.<section>`
of settings it reads, the per-token statistics it reports (logged as fractions of the counted
tokens) and its run-card text. The loss step (`posttrain/losses/policy_gradient.py`) asks the
entry, never "is it the clipped ratio?".

Adding a surrogate is one function of `surrogate(logprobs, old_logprobs, advantages, mask,
**settings) -> (per-token loss, stats)` and one entry in `SURROGATES`, plus its settings section.
Pure tensor math like the rest of `algorithms/`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from posttrain.algorithms.covariance import clip_cov_surrogate, kl_cov_surrogate
from posttrain.algorithms.policy import cispo_surrogate, clipped_surrogate, sequence_clipped_surrogate


@dataclass(frozen=True)
class Surrogate:
    name: str
    function: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    """function(logprobs (n, T), old_logprobs (n, T), advantages (n,) or (n, T), mask (n, T) bool,
    **settings) -> ((n, T) per-token loss, detached per-token stats, `ratio` among them)."""
    section: str
    """The `loss.<section>` whose fields are its keyword settings."""
    fractions: tuple[tuple[str, str], ...]
    """(metric, stats key) pairs: boolean statistics logged as a fraction of the counted tokens."""
    describe: Callable[[dict], str]
    """describe(its settings) -> what the run card says it is."""
    aggregations: tuple[str, ...] | None = None
    """The `loss.aggregation` values it is defined under (None: any)."""
    peers: str = ""
    """The same surrogate as the peers spell it, for the run card."""
    seeded: bool = False
    """It draws at random: the loss step passes `seed` (from the step's seed and the micro-batch), so a rerun draws alike."""


def _clip(logprobs, old_logprobs, advantages, mask, low: float, high: float, dual: float | None):
    return clipped_surrogate(logprobs, old_logprobs, advantages, low, high, dual)


def _gspo(logprobs, old_logprobs, advantages, mask, low: float, high: float):
    return sequence_clipped_surrogate(logprobs, old_logprobs, advantages, mask, low, high)


def _cispo(logprobs, old_logprobs, advantages, mask, low: float, high: float):
    return cispo_surrogate(logprobs, old_logprobs, advantages, low, high)


def _clip_cov(logprobs, old_logprobs, advantages, mask, low: float, high: float, fraction: float, lower: float, upper: float,
              seed: int = 0):
    return clip_cov_surrogate(logprobs, old_logprobs, advantages, mask, low, high, fraction, lower, upper, seed)


def _kl_cov(logprobs, old_logprobs, advantages, mask, fraction: float, coef: float):
    return kl_cov_surrogate(logprobs, old_logprobs, advantages, mask, fraction, coef)


SURROGATES: dict[str, Surrogate] = {
    "clip": Surrogate(
        name="clip", function=_clip, section="clip",
        fractions=(("clip/low", "clipped_low"), ("clip/high", "clipped_high"), ("clip/dual", "dual_clipped")),
        describe=lambda s: (f"PPO clipped ratio per token: -min(r A, clip(r, 1 - {s['low']}, 1 + {s['high']}) A) (arXiv:1707.06347 eq. 7)"
                            + (f"; a negative advantage's loss capped at {s['dual']} x |A| (dual clip, arXiv:1912.09729 eq. 5)"
                               if s["dual"] is not None else "")),
        peers="TRL GRPOTrainer importance_sampling_level=token; verl loss_mode=vanilla; OpenRLHF policy_loss_type=ppo",
    ),
    "gspo": Surrogate(
        name="gspo", function=_gspo, section="gspo",
        fractions=(("clip/low", "clipped_low"), ("clip/high", "clipped_high")),
        describe=lambda s: (f"GSPO sequence ratio s = exp(mean_t log r_t), clipped to [1 - {s['low']}, 1 + {s['high']}], in its "
                            "GSPO-token form (arXiv:2507.18071 section 4.3: equal to GSPO for per-sequence advantages)"),
        aggregations=("seq_mean_token_mean",),
        peers="TRL GRPOTrainer importance_sampling_level=sequence; verl loss_mode=gspo; OpenRLHF policy_loss_type=gspo",
    ),
    "cispo": Surrogate(
        name="cispo", function=_cispo, section="cispo",
        fractions=(("clip/low", "clipped_low"), ("clip/high", "clipped_high")),
        describe=lambda s: (f"CISPO: -sg(clip(r, {s['low']}, {s['high']})) A log pi per token, absolute bounds on the ratio, "
                            "every token keeps its gradient (arXiv:2506.13585 section 3.1)"),
        peers="TRL GRPOTrainer loss_type=cispo (epsilon_high = our high); open-instruct loss_fn=cispo; verl loss_mode=cispo",
    ),
    "clip_cov": Surrogate(
        name="clip_cov", function=_clip_cov, section="clip_cov",
        fractions=(("clip/low", "clipped_low"), ("clip/high", "clipped_high"), ("clip/cov", "cov_clipped")),
        describe=lambda s: (f"Clip-Cov: the PPO clipped ratio (clip [1 - {s['low']}, 1 + {s['high']}]) with the gradient of a "
                            f"seeded random {s['fraction']:g} of the tokens whose (A - mean A)(log pi - mean log pi) lies in "
                            f"({s['lower']:g}, {s['upper']:g}) removed, over each micro-batch's tokens (arXiv:2505.22617, Clip-Cov)"),
        peers="verl loss_mode=clip_cov (clip_cov_ratio = our fraction, clip_cov_lb / clip_cov_ub = our lower / upper)",
        seeded=True,
    ),
    "kl_cov": Surrogate(
        name="kl_cov", function=_kl_cov, section="kl_cov",
        fractions=(("cov/penalised", "cov_penalised"),),
        describe=lambda s: (f"KL-Cov: -r A per token, unclipped, plus {s['coef']:g} x |log r| on the top {s['fraction']:g} of "
                            "the tokens by (A - mean A)(log pi - mean log pi), over each micro-batch's tokens (arXiv:2505.22617, KL-Cov)"),
        peers="verl loss_mode=kl_cov (kl_cov_ratio = our fraction, ppo_kl_coef = our coef)",
    ),
}
"""Every surrogate by its `loss.surrogate` name."""
