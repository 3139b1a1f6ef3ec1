"""Reusing an evaluation that repeats an earlier one exactly (opt-in, within one process).

A sequence of runs that share a start model evaluates it again and again: the demo scores the SFT
start, then every stage's run scores the same weights at its step 0, and the demo scores each
stage's last checkpoint after the run already did at its last step. Greedy decoding of the same
weights on the same prompts with the same numerics gives the same tokens, so inside
`reuse_evaluations()` `evaluate_task` looks its greedy generation and scoring up by a key of
everything they depend on, and a repeat costs a hash of the weights instead of a generation:

- the weights: every parameter's and buffer's name, dtype, shape and bytes (blake2b);
- the model's config (less the path it was loaded from) and whether it is in training mode;
- the tokenizer: its vocabulary, special tokens and chat template;
- the problems: each rendered prompt, id and gold answer;
- the checker (`Verifier.describe()`), the budget (`max_new_tokens`), the generation batch size;
- the numerics: device, torch threads (float sums are grouped by thread count), autocast state.

Only greedy pass@1 (k = 1) through the single-turn sampler is reused; sampled pass@k and tool
episodes always generate. What the caller writes (the output file, its label, the log line) is
written as for a fresh evaluation, with a note in the log that the answers were reused. Tested:
a reused evaluation's file equals a fresh one's (tests/test_evaluation_reuse.py).

    with reuse_evaluations():
        run_a(...)   # evaluates the start at step 0
        run_b(...)   # the same start at its step 0: reused
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from typing import Any, Iterator, Sequence

import torch

logger = logging.getLogger(__name__)

_MEMO: dict[str, Any] | None = None
"""key -> (texts, lengths, verdicts, label of the evaluation that computed them); None outside `reuse_evaluations`."""


@contextlib.contextmanager
def reuse_evaluations() -> Iterator[None]:
    """Within the block, `evaluate_task` reuses the answers of an exact repeat (see the module doc).
    Nested blocks share the outer one's memory; it is dropped when the outermost block ends."""
    global _MEMO
    outer = _MEMO is not None
    if not outer:
        _MEMO = {}
    try:
        yield
    finally:
        if not outer:
            _MEMO = None


def active() -> bool:
    """Whether evaluations are being reused now."""
    return _MEMO is not None


def weights_fingerprint(model: torch.nn.Module) -> str | None:
    """blake2b of every parameter's and buffer's name, dtype, shape and bytes (None for a model with
    distributed tensors, never reused)."""
    digest = hashlib.blake2b(digest_size=20)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        data = tensor.detach()
        if type(data) is not torch.Tensor:  # a DTensor (FSDP2) or another subclass: its bytes are not all here
            return None
        digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
        digest.update(data.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the tokenizer's vocabulary, special tokens and chat template."""
    parts = {"vocab": sorted(tokenizer.get_vocab().items()), "special": sorted(map(str, tokenizer.all_special_tokens)),
             "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id, "template": getattr(tokenizer, "chat_template", None)}
    return hashlib.blake2b(json.dumps(parts, default=str).encode(), digest_size=20).hexdigest()


def key(model, tokenizer, examples: Sequence[Any], prompts: Sequence[str], checker, max_new_tokens: int, batch_size: int) -> str | None:
    """The memo key of a greedy evaluation, or None when reuse is off or the model cannot be hashed."""
    if _MEMO is None:
        return None
    weights = weights_fingerprint(model)
    if weights is None:
        return None
    config = getattr(model, "config", None)
    config = {k: v for k, v in config.to_dict().items() if k != "_name_or_path"} if hasattr(config, "to_dict") else repr(config)
    device = next(model.parameters()).device
    parts = {
        "weights": weights, "config": config, "training": model.training, "tokenizer": tokenizer_fingerprint(tokenizer),
        "problems": [[getattr(e, "id", None), prompt, repr(getattr(e, "answer", None))] for e, prompt in zip(examples, prompts)],
        "checker": checker.describe(), "max_new_tokens": max_new_tokens, "batch_size": batch_size,
        "device": str(device), "threads": torch.get_num_threads(),
        "autocast": [torch.is_autocast_enabled(device.type), str(torch.get_autocast_dtype(device.type))],
    }
    return hashlib.blake2b(json.dumps(parts, sort_keys=True, default=str).encode(), digest_size=20).hexdigest()


def lookup(memo_key: str | None) -> tuple[list[str], list[int], list, str] | None:
    """The stored (texts, lengths, verdicts, label) of `memo_key`, or None."""
    if memo_key is None or _MEMO is None:
        return None
    return _MEMO.get(memo_key)


def store(memo_key: str | None, texts: list[str], lengths: list[int], verdicts: list, label: str) -> None:
    """Remember an evaluation's answers under `memo_key` (nothing when reuse is off)."""
    if memo_key is not None and _MEMO is not None:
        _MEMO[memo_key] = (list(texts), list(lengths), list(verdicts), label)
