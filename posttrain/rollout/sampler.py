"""The sampler seam: what the online data source calls to turn B rendered prompts into B x G rows.

A sampler is any callable with `Sampler`'s signature that returns a `Rollout` (group-contiguous
rows, the log-probs of what was sampled, a loss mask and, where it differs, an attention mask).
`SingleTurn` (one completion per row, on an engine: `generate` or vLLM, `rollout/engines.py`) is the first; `episodes.EpisodeSampler` (tool
calls run between turns, their results appended as attended, untrained tokens) is the second.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from posttrain.rollout.batch import Rollout
from posttrain.rollout.engine import generate
from posttrain.rollout.sampling import SamplingConfig


class Sampler(Protocol):
    tools: list[dict] | None
    """The JSON schemas the prompts are rendered with (`data.tokenize.render_prompt`'s tools=): a tool
    episode sampler's tools; None: none (one turn). Optional: a plain function is a sampler too."""

    def __call__(self, policy, tokenizer, examples: Sequence[Any], prompts: Sequence[str], *, group_size: int,
                 sampling: SamplingConfig, seed: int, shard: tuple[int, int] | None) -> Rollout:
        """B x G rows for the B `examples` (their data records: an episode's environment resets from
        one) whose `prompts` are rendered as the model sees them. `seed` and `shard` as in `generate`:
        the same seed gives each row the same tokens whichever rank samples it."""
        ...


class SingleTurn:
    """One completion per row: an engine (`rollout.engines`: `generate` or vLLM) on the rendered
    prompts (the examples are not read)."""

    tools = None

    def __init__(self, generate_fn=generate):
        self.generate = generate_fn

    def __call__(self, policy, tokenizer, examples: Sequence[Any], prompts: Sequence[str], *, group_size: int,
                 sampling: SamplingConfig, seed: int, shard: tuple[int, int] | None = None) -> Rollout:
        return self.generate(policy, tokenizer, list(prompts), group_size=group_size, sampling=sampling, seed=seed, shard=shard)


single_turn = SingleTurn(generate)
"""One turn on the built-in engine (the default sampler)."""


def engine_of(sampler) -> object:
    """The engine a sampler draws with (`SingleTurn.generate`, `EpisodeSampler.generate`); None: a plain function."""
    return getattr(sampler, "generate", None)
