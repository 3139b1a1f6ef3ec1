"""Rollout engine: batched sampling with a KV cache that returns the log-probs of what it sampled.

    from posttrain.rollout import generate, SamplingConfig
    rollout = generate(model, tokenizer, prompts, group_size=4, sampling=SamplingConfig(temperature=0.8))

See docs/rollout.md for the two log-prob fields and the layout of a ``Rollout``.
"""

from posttrain.rollout.batch import Rollout
from posttrain.rollout.engine import generate, stop_token_ids
from posttrain.rollout.sampling import SamplingConfig

__all__ = ["Rollout", "SamplingConfig", "generate", "stop_token_ids"]
