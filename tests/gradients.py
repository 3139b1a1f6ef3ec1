"""A stand-in optimizer for testing loss steps (`posttrain/losses/`), which end with the optimizer
step: it keeps a copy of every gradient the step applied and leaves the parameters where they are."""

from __future__ import annotations

import torch

from posttrain.optim import Trainable


class KeptGradients:
    """`step()` copies each parameter's gradient into `grads` (by name); `zero_grad` clears them as
    AdamW's would; the parameters never move. Its own scheduler: `step()` does nothing."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.grads = model, {}

    def step(self) -> None:
        self.grads = {name: p.grad.clone() for name, p in self.model.named_parameters() if p.grad is not None}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)

    def trainable(self, trainer: torch.nn.Module) -> Trainable:
        """A `Trainable` over `trainer` whose optimizer and scheduler are this recorder."""
        return Trainable(trainer, self, self)
