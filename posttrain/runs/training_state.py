"""Save and restore everything a resumed run needs: the model (a Hugging Face directory or a LoRA
adapter), other models (a critic, a refreshed reference), the optimizer, the scheduler, every rank's
RNG state and the recipe's own state (data position, alarm history...), in one atomic checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from posttrain.distributed import World, is_sharded, load_model_state, load_optimizer_state, model_state, optimizer_state, unwrap
from posttrain.errors import UserError
from posttrain.runs.checkpoint import (PREFIX, complete_checkpoints, latest_checkpoint, load_trainer_state, rng_state,
                                      set_rng_state, write_step_checkpoint)

logger = logging.getLogger(__name__)


def save_training(
    run_dir, step: int, model, tokenizer, optimizer, scheduler,
    extra_models: dict[str, Any] | None = None, extra_state: dict[str, Any] | None = None, keep: int = 2,
    world: World | None = None, extra_objects: dict[str, Any] | None = None,
) -> Path | None:
    """Checkpoint everything a resume needs: the model (a Hugging Face directory, or a LoRA
    adapter), other models (e.g. `critic`), optimizer, scheduler, RNG states (every rank's),
    `extra_state` (data position...) and `extra_objects` (each pickled in `<name>.pt` beside the
    model, inside the same atomic write: e.g. the online recipe's pending batches). Under torchrun
    every rank calls it (FSDP2 gathers the shards) and rank 0 writes whole, unsharded weights;
    returns the checkpoint path on rank 0."""
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
            with open(directory / f"{name}.pt", "wb") as handle:  # a file object: a full disk's OSError reaches the message
                torch.save(extra_weights[name] if extra_weights[name] is not None else unwrap(extra).state_dict(), handle)
        for name, extra in (extra_objects or {}).items():
            with open(directory / f"{name}.pt", "wb") as handle:
                torch.save(extra, handle)

    state = {
        "optimizer": optim,
        "scheduler": scheduler.state_dict(),
        "rng": rngs[0],
        "rng_by_rank": rngs,
        "world_size": world.size,
        **(extra_state or {}),
    }
    return write_step_checkpoint(run_dir.checkpoints, step, write_models, state, keep=keep)


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
                     world: World | None = None, extra_objects: tuple[str, ...] = ()) -> dict[str, Any]:
    """Load the newest complete checkpoint of `run_dir` into the given objects (in place), restore
    the RNG states, drop log lines written after it, and return its trainer state (`step`, data
    position...), with each of `extra_objects` that `save_training` wrote under its name (a
    checkpoint without one: absent). With no complete checkpoint the run starts over from step 0 with clean logs
    (metrics.jsonl and samples.jsonl emptied: no row is logged twice). Under torchrun every
    rank calls it after wrapping its models; a checkpoint of another world size resumes too (a step
    does not depend on the world size), each rank taking rank 0's RNG state with a warning."""
    world = world or World()
    checkpoint = latest_checkpoint(run_dir.checkpoints)
    if checkpoint is None:
        logger.warning("%s: no complete checkpoint to resume from; starting over from step 0 with clean logs", run_dir.path)
        run_dir.truncate_logs(-1)
        return {"step": 0}
    state = load_trainer_state(checkpoint)
    _load_weights(model, checkpoint / "model")
    for name, extra in (extra_models or {}).items():
        load_model_state(extra, torch.load(checkpoint / f"{name}.pt", weights_only=True, map_location="cpu"))
    for name in extra_objects:
        if (checkpoint / f"{name}.pt").exists():  # pickled records (trusted files only, as trainer_state.pt)
            state[name] = torch.load(checkpoint / f"{name}.pt", weights_only=False, map_location="cpu")
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


def check_unfinished(run_dir: str | Path, max_steps: int) -> None:
    """Refuse to resume the run in `run_dir` when its newest complete checkpoint is already at
    `max_steps` or past it: one UserError line saying it is finished (a resume would do nothing, and
    must not rewrite its config.yaml). Cheap: a checkpoint's files are hashed only when its step says
    the run is finished."""
    checkpoints = Path(run_dir) / "checkpoints"
    newest = complete_checkpoints(checkpoints, verify=False)
    if not newest or int(newest[-1].name.removeprefix(PREFIX)) < max_steps:
        return
    checkpoint = latest_checkpoint(checkpoints)  # verified: a torn newest one would be resumed from an older one
    step = int(checkpoint.name.removeprefix(PREFIX)) if checkpoint is not None else 0
    if step >= max_steps:
        raise UserError(f"{run_dir}: finished: its newest checkpoint is step {step} and max_steps is {max_steps}, so there is "
                        f"nothing to resume (--max-steps counts all the run's steps: --max-steps {step + 1} or more trains on)")
