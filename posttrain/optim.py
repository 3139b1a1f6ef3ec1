"""The optimizer every recipe uses: AdamW (fused where torch has the kernel) with linear warm-up
then a constant, cosine or linear schedule, and gradient clipping."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import torch

from posttrain.errors import UserError


@dataclasses.dataclass
class Optimization:
    """AdamW with linear warm-up then a constant or cosine schedule, and gradient clipping."""

    lr: float = 1e-5
    """Peak learning rate."""
    warmup_steps: int = 0
    """Linear warm-up from 0 to lr over this many optimizer steps."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """After warm-up: constant | cosine (to 10% of lr at max_steps) | linear (to 0 at max_steps)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: list[float] = dataclasses.field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this (None: no clipping)."""

    def validate(self, where: str = "optim") -> None:
        if self.lr <= 0:
            raise UserError(f"{where}.lr must be > 0, got {self.lr}")
        if self.schedule not in ("constant", "cosine", "linear"):
            raise UserError(f"{where}.schedule must be constant, cosine or linear, got {self.schedule!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise UserError(f"{where}.betas must be two numbers in [0, 1), got {self.betas}")
        if self.warmup_steps < 0:
            raise UserError(f"{where}.warmup_steps must be >= 0, got {self.warmup_steps}")


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """The LR factor at optimizer step `step` (0-based): warm-up, then the schedule's decay."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - progress
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def fused_adamw_supported(parameters: list[torch.Tensor]) -> bool:
    """torch's fused AdamW (one kernel per tensor, no parameter-sized temporaries) handles plain
    floating-point tensors on the CPU and CUDA; FSDP2's sharded DTensors keep the default kernel."""
    from torch.distributed.tensor import DTensor

    floating = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    return bool(parameters) and all(
        not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda") and p.dtype in floating for p in parameters)


def make_optimizer(parameters, optim: Optimization, total_steps: int):
    """AdamW over the trainable `parameters` and its LambdaLR scheduler. `parameters` is an
    iterable of tensors (one group at `optim.lr`) or a list of parameter-group dicts
    (`{"params": [...], "lr": ...}`, e.g. a policy and a critic at their own rates, one schedule).

    The fused kernel where torch has one (the default in Hugging Face's Trainer too): the step
    allocates no parameter-sized temporaries (the largest tensor, the embedding, would otherwise set
    the peak memory of a step) and is faster.
    """
    parameters = list(parameters)
    if parameters and isinstance(parameters[0], dict):
        groups = parameters
        tensors = [p for group in groups for p in group["params"]]
    else:
        groups = tensors = [p for p in parameters if p.requires_grad]
    optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                                  fused=fused_adamw_supported(tensors) or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, optim.warmup_steps, total_steps, optim.schedule)
    )
    return optimizer, scheduler


def clip_and_step(parameters, optimizer, scheduler, max_grad_norm: float | None) -> float:
    """Clip gradients (if configured), step optimizer and scheduler, zero grads; returns the
    pre-clipping global gradient norm."""
    trainable = [p for p in parameters if p.requires_grad and p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm if max_grad_norm is not None else float("inf"))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def clip_groups_and_step(optimizer, scheduler, max_grad_norm: float | None) -> list[float]:
    """`clip_and_step` with each of the optimizer's parameter groups clipped on its own (a policy
    and its critic: neither's gradient scale limits the other's); returns each group's
    pre-clipping norm."""
    max_norm = max_grad_norm if max_grad_norm is not None else float("inf")
    norms = [float(torch.nn.utils.clip_grad_norm_([p for p in group["params"] if p.grad is not None], max_norm))
             for group in optimizer.param_groups]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norms


@dataclasses.dataclass
class Trainable:
    """What a loss step (`posttrain/losses/`) moves: the module forward/backward goes through (a
    `TrainingForward`, possibly in DDP / FSDP2), its optimizer and schedule, and the clip."""

    trainer: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    max_grad_norm: float | None = None

    def step(self) -> float:
        """Clip, step, zero (`clip_and_step`); returns the pre-clipping gradient norm."""
        return clip_and_step(self.trainer.parameters(), self.optimizer, self.scheduler, self.max_grad_norm)
