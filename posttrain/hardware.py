"""Where a run computes and in which dtypes: the `hardware` and `memory` config sections, and the
`Placement` they resolve to.

    hardware.device:    auto | cpu | cuda | cuda:N   (auto: cuda when a GPU is visible, else cpu)
    hardware.precision: auto | fp32 | bf16-mixed | bf16

| precision  | parameters | optimizer state (AdamW moments) | forward / backward        |
|------------|------------|---------------------------------|---------------------------|
| fp32       | float32    | float32                         | float32                   |
| bf16-mixed | float32    | float32                         | bfloat16 autocast         |
| bf16       | bfloat16   | bfloat16 (torch's AdamW keeps its moments in the parameters' dtype) | bfloat16 |

`auto` is bf16-mixed on a GPU that supports bfloat16 and fp32 on the CPU (bfloat16 matmuls are slow
on most CPUs). Whatever the precision, log-probs, log-softmax, KL, advantages and losses are computed
in float32 (`algorithms.token_logprobs` upcasts each chunk of logits). fp16 is not offered: its
range needs loss scaling, and every GPU this library targets has bfloat16.

Under torchrun every rank takes `cuda:$LOCAL_RANK` (`torch.cuda.set_device`); a `cuda:N` there is an
error (the launcher, not the config, chooses a rank's GPU).

`keep_freed_memory` is the process's side of the host: glibc's malloc keeps what a step frees for the
next step (the reward-model recipe sets it; the others are not measured with it yet).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
from typing import Any, ClassVar

import torch

from posttrain.errors import UserError

logger = logging.getLogger(__name__)

PRECISIONS = ("auto", "fp32", "bf16-mixed", "bf16")
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The `hardware` section every recipe, `posttrain eval` and `posttrain pairs` have."""

    PRIMARY: ClassVar[dict[str, Any]] = {"precision": PRECISIONS, "device": None}
    """What a value given to the section itself meant (`config._primary_hint`): `--hardware cuda` is --hardware.device cuda."""

    device: str = "auto"
    """auto (cuda when a GPU is visible, else cpu) | cpu | cuda | cuda:N. Under torchrun each rank takes cuda:$LOCAL_RANK."""
    precision: str = "auto"
    """auto | fp32 | bf16-mixed | bf16. bf16-mixed: float32 weights and optimizer state, bf16 autocast (the auto choice on a GPU); bf16: bf16 weights; fp32: the auto choice on the CPU."""

    def __post_init__(self):
        if not isinstance(self.device, str) or not DEVICE_PATTERN.fullmatch(self.device):
            raise UserError(f"hardware.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.precision in ("fp16", "16-mixed", "fp16-mixed", "16"):
            raise UserError(f"hardware.precision {self.precision!r} is not offered (float16 needs loss scaling); "
                            "use bf16-mixed or bf16")
        if self.precision not in PRECISIONS:
            raise UserError(f"hardware.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")


@dataclasses.dataclass(frozen=True)
class Memory:
    """The `memory` section: trading compute for activation memory."""

    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (transformers' gradient_checkpointing_enable, use_reentrant=False): same loss and gradients, ~1/3 more compute, far less activation memory."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """A resolved `Hardware`: the device and precision a run uses (never `auto`)."""

    device: torch.device
    precision: str
    """fp32 | bf16-mixed | bf16"""

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype models are loaded in (and the optimizer state follows)."""
        return torch.bfloat16 if self.precision == "bf16" else torch.float32

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matmuls run in."""
        return torch.float32 if self.precision == "fp32" else torch.bfloat16

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def autocast(self):
        """The context a forward runs under: bf16 autocast for bf16-mixed, else nothing (fp32, and
        bf16 whose weights are bf16 already). Backward runs outside it (as torch recommends)."""
        if self.precision == "bf16-mixed":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        """Wait for the device's queued work (for honest timings); a no-op on the CPU."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def reset_peak_memory(self) -> None:
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory_gib(self) -> float | None:
        """Peak allocated device memory since the last reset (`torch.cuda.max_memory_allocated`), in
        GiB; None on the CPU (the run card's peak RSS is the CPU's measure)."""
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.is_cuda else None

    def describe(self) -> dict:
        """What the run card records."""
        card = {
            "device": str(self.device),
            "precision": self.precision,
            "parameters": str(self.param_dtype).removeprefix("torch."),
            "optimizer_state": str(self.param_dtype).removeprefix("torch."),
            "forward_backward": {"fp32": "float32", "bf16-mixed": "bfloat16 autocast (float32 weights)",
                                 "bf16": "bfloat16"}[self.precision],
            "logprobs_kl_advantages_losses": "float32",
        }
        if self.is_cuda:
            card["device_name"] = torch.cuda.get_device_name(self.device)
        if self.precision == "bf16":
            card["note"] = ("bf16 parameters: AdamW's moments are bfloat16 too (torch keeps them in the "
                            "parameters' dtype) and small updates can round away; bf16-mixed keeps both in float32")
        return card


def cpu_placement() -> Placement:
    """fp32 on the CPU: what every function defaults to."""
    return Placement(torch.device("cpu"), "fp32")


def _under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def resolve(hardware: Hardware | None = None) -> Placement:
    """The `Placement` a run uses; a device that is not there or a dtype it cannot run is one
    `UserError` line. Under torchrun a CUDA device is `cuda:$LOCAL_RANK`, made current."""
    hardware = hardware or Hardware()
    requested = hardware.device
    available = torch.cuda.is_available()
    if requested == "auto":
        requested = "cuda" if available else "cpu"
    if requested.startswith("cuda"):
        if not available:
            built = torch.version.cuda is not None
            raise UserError(f"hardware.device {hardware.device}: no CUDA GPU is visible "
                            + ("(CUDA_VISIBLE_DEVICES, or the driver)" if built else f"(torch {torch.__version__} is a CPU build)")
                            + "; use --hardware.device cpu")
        count = torch.cuda.device_count()
        if _under_torchrun():
            if ":" in requested:
                raise UserError(f"hardware.device {requested}: under torchrun each rank takes cuda:$LOCAL_RANK; give cuda or auto")
            index = int(os.environ.get("LOCAL_RANK", "0"))
        else:
            index = int(requested.partition(":")[2] or torch.cuda.current_device())
        if index >= count:
            raise UserError(f"hardware.device cuda:{index}: only {count} GPU(s) visible")
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    precision = hardware.precision
    if precision == "auto":
        precision = "bf16-mixed" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    elif precision.startswith("bf16") and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError(f"hardware.precision {precision}: {torch.cuda.get_device_name(device)} does not support "
                        "bfloat16; use --hardware.precision fp32")
    if precision == "bf16" and device.type == "cpu":
        logger.warning("hardware.precision bf16 on the CPU: bfloat16 matmuls are much slower than float32 here")
    return Placement(device, precision)


TRIM_THRESHOLD_BYTES = 1 << 30
"""Freed memory glibc keeps at the top of the heap before returning it to the system (`keep_freed_memory`)."""
MMAP_THRESHOLD_BYTES = 32 << 20
"""Allocations from this size up get their own mapping (glibc's largest allowed threshold): below it, the heap."""


def keep_freed_memory() -> bool:
    """Make this process's C allocator (glibc's malloc) keep the memory a training step frees for the
    next step, instead of handing it back to the system and taking it again: by default glibc trims
    the heap and maps each large block anew, so every CPU step faults in fresh pages for its
    gradients and activations (the kernel zeroes each 4 KiB page). The thresholds become fixed
    (`TRIM_THRESHOLD_BYTES`, `MMAP_THRESHOLD_BYTES`): blocks under 32 MiB come from the heap and are
    reused, and up to 1 GiB of freed heap stays in the process. Peak memory is what the step needs
    either way; between steps the process keeps it. What it saves is in bench/RESULTS.md (rm).
    Returns False where the C library is not glibc (nothing changed)."""
    import ctypes
    import ctypes.util
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    trim, mmap = -1, -3  # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD (malloc.h)
    kept = bool(libc.mallopt(trim, TRIM_THRESHOLD_BYTES)) and bool(libc.mallopt(mmap, MMAP_THRESHOLD_BYTES))
    logger.debug("glibc malloc keeps freed memory: %s", kept)
    return kept
