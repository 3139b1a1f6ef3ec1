"""What every recipe shares: optimizer and LR schedule, seeding, timing, checkpoint and resume.

Every recipe config has the fields `output_dir`, `max_steps` and `seed` (the command-line side,
`--config/--output-dir/--max-steps/--seed/--resume`, is `posttrain/commands/_recipe.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posttrain.distributed import World, is_sharded, load_model_state, load_optimizer_state, model_state, optimizer_state, unwrap
from posttrain.errors import UserError
from posttrain.models import LoraSettings, apply_lora, lean_mlp, load_model

logger = logging.getLogger(__name__)

@dataclasses.dataclass
class Optimization:
    """AdamW with linear warm-up then a constant or cosine schedule, and gradient clipping."""

    lr: float = 1e-5
    """Peak learning rate."""
    warmup_steps: int = 0
    """Linear warm-up from 0 to lr over this many optimizer steps."""
    schedule: str = "constant"
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


def load_policy(spec: str, lora_rank: int = 0, lora_alpha: float = 16.0):
    """The model a training recipe trains, and its tokenizer: `load_model(spec)`, its SwiGLU MLPs
    made lean (`lean_mlp`: the same gradients, half the MLP activations kept for backward), and
    LoRA adapters when `lora_rank` > 0."""
    policy, tokenizer = load_model(spec)
    lean_mlp(policy)
    if lora_rank:
        policy = apply_lora(policy, LoraSettings(rank=lora_rank, alpha=lora_alpha))
    return policy, tokenizer


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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Timer:
    """Accumulates wall seconds per phase: `with timer("generation"): ...`; `timer.seconds`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def __call__(self, phase: str):
        timer = self

        class _Phase:
            def __enter__(self):
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[phase] = timer.seconds.get(phase, 0.0) + time.perf_counter() - self.start

        return _Phase()


def default_output_dir(recipe: str, world: World | None = None) -> str:
    """runs/<recipe>-<time>; under torchrun rank 0's name on every rank."""
    return (world or World()).broadcast(str(Path("runs") / f"{recipe}-{time.strftime('%Y%m%d-%H%M%S')}"))


def save_training(
    run_dir, step: int, model, tokenizer, optimizer, scheduler,
    extra_models: dict[str, Any] | None = None, extra_state: dict[str, Any] | None = None, keep: int = 2,
    world: World | None = None,
) -> Path | None:
    """Checkpoint everything a resume needs: the model (a Hugging Face directory, or a LoRA
    adapter), other models (e.g. `critic`), optimizer, scheduler, RNG states (every rank's) and
    `extra_state` (data position...). Under torchrun every rank calls it (FSDP2 gathers the shards)
    and rank 0 writes whole, unsharded weights; returns the checkpoint path on rank 0."""
    from posttrain.runs import rng_state, save_checkpoint

    world = world or World()
    rngs = world.gather(rng_state())
    weights = model_state(model)
    if weights is not None and getattr(unwrap(model).config, "tie_word_embeddings", False):
        weights = {k: v for k, v in weights.items() if not k.endswith("lm_head.weight")}  # tied: saved once, as HF does
    extra_weights = {name: model_state(extra) for name, extra in (extra_models or {}).items()}
    optim = optimizer_state(model, optimizer)
    if not world.main:
        return None

    def write_models(directory: Path) -> None:
        unwrap(model).save_pretrained(directory / "model", safe_serialization=True, **({"state_dict": weights} if weights is not None else {}))
        tokenizer.save_pretrained(directory / "model")
        for name, extra in (extra_models or {}).items():
            torch.save(extra_weights[name] if extra_weights[name] is not None else unwrap(extra).state_dict(), directory / f"{name}.pt")

    state = {
        "optimizer": optim,
        "scheduler": scheduler.state_dict(),
        "rng": rngs[0],
        "rng_by_rank": rngs,
        "world_size": world.size,
        **(extra_state or {}),
    }
    return save_checkpoint(run_dir.checkpoints, step, write_models, state, keep=keep)


def _load_weights(model, directory: Path) -> None:
    """Copy the weights saved in `directory` into `model` in place (full model or LoRA adapter)."""
    from safetensors.torch import load_file

    plain = unwrap(model)
    if hasattr(plain, "peft_config"):
        from peft import set_peft_model_state_dict

        if is_sharded(model):
            raise UserError("resuming a LoRA run under FSDP2 is not supported; resume it with parallel.strategy ddp")
        set_peft_model_state_dict(plain, load_file(directory / "adapter_model.safetensors"))
        return
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(directory, dtype=next(plain.parameters()).dtype)
    load_model_state(model, saved.state_dict())


def restore_training(run_dir, model, optimizer, scheduler, extra_models: dict[str, Any] | None = None,
                     world: World | None = None) -> dict[str, Any]:
    """Load the newest complete checkpoint of `run_dir` into the given objects (in place), restore
    the RNG states, drop log lines written after it, and return its trainer state (`step`, data
    position...). With no complete checkpoint the run starts over from step 0. Under torchrun every
    rank calls it after wrapping its models; a checkpoint of another world size resumes too (a step
    does not depend on the world size), each rank taking rank 0's RNG state with a warning."""
    from posttrain.runs import latest_checkpoint, load_trainer_state, set_rng_state

    world = world or World()
    checkpoint = latest_checkpoint(run_dir.checkpoints)
    if checkpoint is None:
        logger.warning("%s: no complete checkpoint; starting from step 0", run_dir.path)
        run_dir.truncate_logs(0)
        return {"step": 0}
    state = load_trainer_state(checkpoint)
    _load_weights(model, checkpoint / "model")
    for name, extra in (extra_models or {}).items():
        load_model_state(extra, torch.load(checkpoint / f"{name}.pt", weights_only=True))
    load_optimizer_state(model, optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rngs = state.get("rng_by_rank", [state["rng"]])
    if len(rngs) != world.size:
        logger.warning("%s was saved by %d process(es), resumed by %d: each rank restarts from rank 0's RNG state",
                       checkpoint, len(rngs), world.size)
    set_rng_state(rngs[world.rank] if len(rngs) == world.size else rngs[0])
    run_dir.truncate_logs(state["step"])
    logger.info("resuming from %s (step %d)", checkpoint, state["step"])
    return state
