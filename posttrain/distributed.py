"""Scale out on PyTorch's own stack: `torchrun` starts one process per rank, `torch.distributed`
connects them, DDP or FSDP2 (`fully_shard`) keeps their models in step.

    torchrun --nproc_per_node 2 -m posttrain grpo --config tiny-grpo
    torchrun --nnodes 2 --node_rank 0 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        --nproc_per_node 8 -m posttrain dpo --config my.yaml          # the same on every node

Without torchrun (no WORLD_SIZE in the environment, or 1) nothing here does anything: `World()` is a
world of one and every collective is the identity, so the recipes read the same either way.

How the recipes share work (the contract: same global batch and seed -> the same steps as one
process, to float tolerance; tested with 2 processes vs 1):
- Every rank reads the same seeded data stream; rank r takes its contiguous block of each batch
  (`World.block`): whole prompt groups in GRPO/PPO (group statistics never cross ranks), whole pairs
  in DPO, whole examples in SFT. Rollouts are seeded per global row, so which rank samples a group
  does not change its tokens.
- Small per-row results (rewards, verdicts, texts, log-probs) are gathered so every rank holds the
  global batch: batch-level statistics (batch-scaled advantages, token counts of `token_mean`,
  metrics) are then the one-process ones.
- Losses are normalised by global counts; each rank scales its loss by the world size because DDP
  and FSDP2 average gradients, so the summed gradient is the one-process gradient.
- Rank 0 alone writes the run directory; a checkpoint holds full (unsharded) weights and optimizer
  state plus every rank's RNG state, so a run resumes with the same or another world size.
- Collectives time out after `Parallel.timeout_seconds`; a rank that dies makes torchrun stop the
  others and exit non-zero (it prints which rank and why): never a hang.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from posttrain.errors import UserError
from posttrain.hardware import Placement, cpu_placement

logger = logging.getLogger(__name__)

STRATEGIES = ("ddp", "fsdp2")


@dataclass
class Parallel:
    """How a torchrun launch shares the work between processes (ignored in a single process)."""

    strategy: Literal["ddp", "fsdp2"] = "ddp"
    """ddp: every rank holds the whole model, gradients all-reduced (small models); fsdp2: parameters,
    gradients and optimizer state sharded per decoder layer with `fully_shard` (large models)."""
    timeout_seconds: int = 1800
    """A collective waiting longer than this fails the job (a stuck rank never hangs it); it must
    exceed the longest stretch one rank works alone (rank 0's held-out evaluation)."""

    def validate(self) -> None:
        if self.strategy not in STRATEGIES:
            raise UserError(f"parallel.strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.timeout_seconds < 1:
            raise UserError(f"parallel.timeout_seconds must be >= 1, got {self.timeout_seconds}")


class World:
    """This process's place among `size` ranks; every method is the identity in a world of one."""

    def __init__(self, rank: int = 0, size: int = 1, strategy: str = "ddp"):
        self.rank, self.size, self.strategy = rank, size, strategy

    @property
    def main(self) -> bool:
        """True on rank 0, the only rank that writes the run directory and prints."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.size > 1

    def blocks(self, count: int) -> list[range]:
        """`count` items split into `size` contiguous blocks, as even as possible (earlier ranks get
        the remainder). Rank r's share of a batch is `blocks(count)[r]`."""
        base, extra = divmod(count, self.size)
        starts = [r * base + min(r, extra) for r in range(self.size + 1)]
        return [range(starts[r], starts[r + 1]) for r in range(self.size)]

    def block(self, count: int) -> range:
        """This rank's contiguous share of `count` items."""
        return self.blocks(count)[self.rank]

    def block_owners(self, count: int) -> torch.Tensor:
        """(count,) the rank whose `block` holds each item (the `owners` of `rank_micro_batches`)."""
        return torch.repeat_interleave(torch.arange(self.size), torch.tensor([len(block) for block in self.blocks(count)]))

    def reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """All-reduce `tensor` in place with `op` (sum | max | min) and return it."""
        if self.active:
            dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return tensor

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (any picklable object), in rank order, on every rank."""
        if not self.active:
            return [value]
        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value)
        return values

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        if not self.active:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def close(self) -> None:
        """Leave the job: wait for every rank, then destroy the process group. Drop DDP wrappers
        first (their destructors talk to the group)."""
        if self.active and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def init_world(parallel: Parallel | None = None, placement: Placement | None = None) -> World:
    """Join the job torchrun started (RANK / WORLD_SIZE / MASTER_ADDR in the environment), or return
    a world of one. Backends: `cpu:gloo,cuda:nccl` when the run is on CUDA (NCCL moves the GPU
    tensors; gloo keeps the CPU ones, e.g. gathered objects, working), gloo on the CPU. Call it after
    `hardware.resolve` (which makes cuda:$LOCAL_RANK current). Library logging below warnings is
    silenced on ranks other than 0 so a run prints one log, not one per rank."""
    parallel = parallel or Parallel()
    parallel.validate()
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World(strategy=parallel.strategy)
    if not dist.is_initialized():
        on_cuda = placement is not None and placement.is_cuda
        options = {"device_id": placement.device} if on_cuda else {}  # binds NCCL to this rank's GPU
        dist.init_process_group("cpu:gloo,cuda:nccl" if on_cuda else "gloo", timeout=timedelta(seconds=parallel.timeout_seconds),
                                **options)
    world = World(dist.get_rank(), dist.get_world_size(), parallel.strategy)
    if not world.main:
        logging.getLogger("posttrain").setLevel(logging.WARNING)
    logger.info("rank %d of %d (%s, %s backend)", world.rank, world.size, parallel.strategy, dist.get_backend())
    return world


def decoder_layers(model) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (or a PEFT / value-head model around one):
    FSDP2's unit of sharding."""
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) and module is not model:
            return list(layers)
    raise UserError(f"parallel.strategy fsdp2: cannot find the decoder layers of {type(model).__name__}")


def wrap(model, world: World, placement: Placement | None = None):
    """The module to train through: the model itself (one process), DDP around it, or the model
    sharded in place with FSDP2 (each decoder layer, then the root: `model.sharding_root` when the
    model is a parameter-free wrapper such as models.forward.TrainingForward). On CUDA, DDP gets
    `device_ids=[the rank's GPU]`; FSDP2 gets the `MixedPrecisionPolicy` of the run's precision
    (bf16-mixed: bf16 all-gathered parameters for compute, float32 gradient reduction and master
    weights). Generation and evaluation use the plain model; under FSDP2
    inside `full_weights(model)`."""
    if not world.active:
        return model
    if world.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        placement = placement or cpu_placement()
        return DistributedDataParallel(model, device_ids=[placement.device.index] if placement.is_cuda else None)
    from torch.distributed.fsdp import fully_shard

    options = {"mp_policy": mixed_precision_policy(placement)} if placement is not None else {}
    root = getattr(model, "sharding_root", model)
    layers = decoder_layers(root)
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(root, **options)
    # Backward prefetch named explicitly, each unit the one that runs before it in forward (what
    # FSDP2's default does for a decoder), so that it never reads the recorded forward order: forwards
    # run by some ranks only (rank 0's evaluation inside full_weights) leave that order different
    # between ranks, and the ranks' prefetch all-gathers would pair up out of order. Public API, the
    # same on every torch we accept (no private FSDP state to clear afterwards).
    root.set_modules_to_backward_prefetch([layers[-1]])
    for previous, layer in zip([root, *layers[:-1]], layers):
        layer.set_modules_to_backward_prefetch([previous])
    # Settle which unit is the root now: code that calls the decoder directly (DPO's response-only
    # LM head) would otherwise make a layer the root on its first forward. The one private FSDP call
    # here (no public one exists); the same in torch 2.11 and 2.13 (tests/test_distributed.py).
    root._get_fsdp_state()._lazy_init()
    return model


def mixed_precision_policy(placement: Placement):
    """FSDP2's `MixedPrecisionPolicy` for a precision: bf16-mixed all-gathers bf16 parameters for the
    forward and backward and reduce-scatters gradients in float32 into float32 shards (the master
    weights the optimizer steps); fp32 and bf16 compute in the parameters' own dtype. On the CPU
    (gloo) bf16-mixed keeps the float32 collectives and relies on autocast alone."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if placement.precision == "bf16-mixed" and placement.is_cuda:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def unwrap(module):
    """The model inside a DDP wrapper (FSDP2 shards in place: the same object)."""
    return getattr(module, "module", module) if type(module).__name__ == "DistributedDataParallel" else module


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def full_weights(model):
    """Make every parameter of an FSDP2-sharded `model` whole on every rank for the duration (for
    generation with the rollout engine, which reads weights directly). Every rank must enter it.
    A no-op for DDP and one process."""
    model = getattr(model, "model", model) if model is not None and not isinstance(model, torch.nn.Module) else model
    if not is_sharded(model):
        yield model
        return
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:  # kept whole through forwards, so a forward needs no collective
        unit.set_reshard_after_forward(False)
        unit.unshard()
    try:
        yield model
    finally:
        for unit in units:
            unit.reshard()
        for unit in units[1:]:  # the root (first) stays whole after forward, as FSDP2 sets it up
            unit.set_reshard_after_forward(True)


@contextlib.contextmanager
def gradient_sync(module, enabled: bool):
    """Gradient accumulation: with `enabled` False, backward keeps gradients local (DDP `no_sync`,
    FSDP2 `set_requires_gradient_sync(False)`); the last micro-batch of a step syncs."""
    if enabled:
        yield
    elif type(module).__name__ == "DistributedDataParallel":
        with module.no_sync():
            yield
    elif is_sharded(module):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        yield


def model_state(model) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict for a checkpoint: gathered onto rank 0 under FSDP2 (every rank
    must call this; the others get an empty dict); None otherwise (use the model's own saving)."""
    if not is_sharded(model):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_model_state(model, state: dict[str, torch.Tensor]) -> None:
    """Load a whole (unsharded) state dict into `model`, sharding it under FSDP2."""
    if not is_sharded(model):
        unwrap(model).load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def optimizer_state(model, optimizer) -> dict[str, Any]:
    """The optimizer's state for a checkpoint; under FSDP2 gathered whole onto rank 0 (keyed by
    parameter names; every rank must call this)."""
    if not is_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return {"fsdp2_full": get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))}


def load_optimizer_state(model, optimizer, state: dict[str, Any]) -> None:
    """Inverse of `optimizer_state`; a checkpoint of the other layout (FSDP2 vs not) is refused."""
    sharded, saved_sharded = is_sharded(model), "fsdp2_full" in state
    if sharded != saved_sharded:
        raise UserError(
            f"this checkpoint's optimizer state was saved {'with' if saved_sharded else 'without'} FSDP2; "
            f"resume it with parallel.strategy {'fsdp2 under torchrun' if saved_sharded else 'ddp or in one process'}"
        )
    if not sharded:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state["fsdp2_full"], options=StateDictOptions(full_state_dict=True))


def rank_micro_batches(mini: torch.Tensor, owners: torch.Tensor, world: World, micro_batch_size: int):
    """This rank's micro-batches of the mini-batch `mini` ((m,) global row indices; `owners` (N,)
    the rank each row belongs to): yields (rows, weight, last). Every rank yields as many as the
    rank with most rows needs, a short rank a one-row stand-in of weight 0, so the ranks'
    collectives stay paired; `last`: sync gradients on this one."""
    mine = mini[owners[mini] == world.rank]
    count = max(-(-int(n) // micro_batch_size) for n in torch.bincount(owners[mini], minlength=world.size))
    for micro in range(count):
        rows = mine[micro * micro_batch_size : (micro + 1) * micro_batch_size]
        yield (rows, 1.0, micro == count - 1) if len(rows) else (mini[:1], 0.0, micro == count - 1)
