"""`posttrain explain`'s shared parts: float64 tensors, the command line's numbers, one-line errors,
the printed or JSON result, and the gradient of a one-token surrogate or one pair's loss."""

from __future__ import annotations

import argparse
import json
import math

from posttrain.errors import UserError

# torch and posttrain.algorithms are imported inside the functions, so that `posttrain --help` and
# the other commands start without torch.


def _tensor(values):
    """`values` as a float64 torch.Tensor."""
    import torch

    return torch.tensor(values, dtype=torch.float64)


def _reward(text: str) -> float:
    """A reward on the command line: a number, or `nan`/`none` for an unscorable sample."""
    if text.lower() in ("nan", "none", "null"):
        return math.nan
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _probability(name: str, value: float) -> float:
    if not (0.0 < value <= 1.0) or math.isnan(value):
        raise UserError(f"{name} must be a probability in (0, 1], got {value}")
    return value


def _library_errors_are_user_errors(handler):
    """The library rejects impossible settings (dual_clip <= 1, label_smoothing >= 0.5) with
    ValueError; on the command line those are the user's arguments, so say so in one line."""

    def wrapped(args) -> int:
        try:
            return handler(args)
        except ValueError as error:
            raise UserError(str(error)) from None

    return wrapped


def _emit(args, result: dict, lines: list[str]) -> int:
    print(json.dumps(result) if args.json else "\n".join(lines))
    return 0


def _round(values, digits: int = 4) -> list[float]:
    return [round(v, digits) for v in values]


def _token_grad(surrogate, logprobs, aggregate_mode: str | None = None):
    """The loss and d loss / d log pi_t of a one-row surrogate (mean over the row's tokens when
    `aggregate_mode` is given, else the sum of the per-token losses)."""
    from posttrain.algorithms import aggregate

    logprobs = logprobs.clone().requires_grad_(True)
    per_token, stats = surrogate(logprobs)
    mask = logprobs.new_ones(logprobs.shape, dtype=bool)
    loss = aggregate(per_token, mask, aggregate_mode) if aggregate_mode else per_token.sum()
    loss.backward()
    return loss.item(), logprobs.grad[0].tolist(), stats


def _pair_loss(function, *values, **settings):
    """The loss of one pair from a reference-free objective, and its gradient w.r.t. each input."""
    inputs = [_tensor([value]).requires_grad_(True) for value in values]
    losses, _, _ = function(*inputs, **settings)
    losses.sum().backward()
    return losses.item(), [tensor.grad.item() for tensor in inputs]
