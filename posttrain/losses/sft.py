"""The SFT loss step: token-mean NLL of the response tokens (prompt and padding masked out, the
ending EOS counted), normalised by the whole batch's token count so micro-batches and ranks add up
to the batch's mean.

    metrics = step(Trainable(trainer, optimizer, scheduler, max_grad_norm), batch, SFTSettings(micro_batch_size), world)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.data import TokenizedBatch
from posttrain.distributed import World, gradient_sync, rank_micro_batches
from posttrain.models.forward import TrainingForward
from posttrain.optim import Trainable


@dataclass(frozen=True)
class SFTSettings:
    """What an SFT step reads besides the models and the batch."""

    micro_batch_size: int
    """At most this many rows per forward/backward."""


def sft_loss(forward: TrainingForward, batch: TokenizedBatch, rows, global_tokens: torch.Tensor) -> torch.Tensor:
    """Token-mean NLL of the response tokens of `rows` (a slice or an (n,) index tensor),
    normalised by the whole batch's token count `global_tokens` (so micro-batches and ranks add up
    to the batch's token mean). `forward` is a `TrainingForward` over `batch_response_sums`."""
    return -forward(batch, rows).sum() / global_tokens


def step(models: Trainable, batch: TokenizedBatch, settings: SFTSettings, world: World | None = None) -> dict[str, float]:
    """One optimizer step on `batch` ((N, L) rows): forward/backward in micro-batches of at most
    `settings.micro_batch_size` rows, each normalised by the whole batch's response tokens, so the gradient
    does not depend on micro_batch_size or the world size; then clip and step. Under torchrun each
    rank takes its block of the rows (`World.block`), all ranks running as many micro-batches (a
    short rank a zero-weight one). Returns {"loss": the batch's token-mean NLL, "grad_norm": the
    pre-clipping gradient norm}."""
    world = world or World()
    rows_total = batch.input_ids.shape[0]
    global_tokens = batch.mask[:, 1:].sum()
    total_loss = torch.zeros(1, dtype=torch.float64, device=batch.input_ids.device)
    for rows, weight, last in rank_micro_batches(torch.arange(rows_total), world.block_owners(rows_total), world, settings.micro_batch_size):
        with gradient_sync(models.trainer, last):
            loss = sft_loss(models.trainer, batch, rows, global_tokens)
            (loss * weight * world.size).backward()  # DDP / FSDP2 average over ranks
        total_loss += weight * loss.detach().double()
    return {"loss": float(world.reduce(total_loss)), "grad_norm": models.step()}
