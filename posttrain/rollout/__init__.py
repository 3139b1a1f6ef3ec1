"""Rollout engine: batched sampling with a KV cache that returns the log-probs of what it sampled.

    from posttrain.rollout import generate, SamplingConfig
    rollout = generate(model, tokenizer, prompts, group_size=4, sampling=SamplingConfig(temperature=0.8))

See docs/rollout.md for the two log-prob fields and the layout of a ``Rollout``.

The names below load on first use (PEP 562): a reward or tool worker that imports
`posttrain.rollout.tools` or `.calculator` does not import torch for them (about 2.5 s a worker).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from posttrain.rollout.batch import Rollout
    from posttrain.rollout.engine import generate, stop_token_ids
    from posttrain.rollout.sampling import SamplingConfig

_HOMES = {"Rollout": "posttrain.rollout.batch", "generate": "posttrain.rollout.engine",
          "stop_token_ids": "posttrain.rollout.engine", "SamplingConfig": "posttrain.rollout.sampling"}

__all__ = ["Rollout", "SamplingConfig", "generate", "stop_token_ids"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
