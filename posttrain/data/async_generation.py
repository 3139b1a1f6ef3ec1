"""Generation overlapping training: the online data link's mode (b) (`data.async_generation`, issue 42).

Mode (a) (`data/staleness.PendingBatches`) samples the batches of later steps between updates: the
same run every time, but generation and training still take turns. Here a producer thread samples
the batches, in the order of the steps they serve, while the trainer trains, under one rule: the
batch of step s is sampled by weights of version v >= s - 1 - k (k = `data.max_staleness`), so no
batch the trainer takes is more than k steps old. The trainer publishes its weights after every
update (`published`: a CPU copy, taken between updates so never half-written); the producer loads
the newest into its own copy of the policy before each batch, and samples with the engine the run
names (the built-in engine runs in a worker process of its own, `rollout/worker_engine.py`; a vLLM
server is a process of its own already), so the trainer's forwards and the generation run at once.
This is AReaL's bounded staleness (Fu et al., arXiv:2505.24298) and verl's one-step-off-policy
pipeline; which version sampled which batch depends on timing, so a run is not reproducible to the
token the way mode (a) is (each batch still has the prompts and seeds of the step it serves).

    pending = AsyncBatches(max_staleness=1, draw=produce, model=generation_copy, version=state.step)
    batch = pending.next(step, last_step)        # waits for the batch of `step`
    ...update...
    pending.published(step, policy)              # the producer may now sample up to step + 1 + k
    pending.close()                              # at the end of the run

A checkpoint does not keep the batches in flight (their sampling weights are gone after a restart):
a resumed run samples them again from the prompts of the steps they serve (the stream position after
the last trained batch, `stream_position`), counted in `regenerated_on_resume` and the run card.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from posttrain.data.scored_batch import ScoredBatch
from posttrain.data.staleness import staleness

logger = logging.getLogger(__name__)

Draw = Callable[[int, torch.nn.Module, int], tuple[ScoredBatch, dict[str, float], int]]
"""(serves, model, version) -> (the batch of step `serves` sampled by `model`, the seconds of its
phases (generation, scoring), the prompt stream's position after it)."""


def generation_copy(policy: torch.nn.Module) -> torch.nn.Module:
    """The producer's own copy of the policy, on the CPU, without gradients: it only carries weights
    to the engine (which fingerprints it and sends them when they change), so the trainer's policy is
    never read while an update writes it."""
    model = copy.deepcopy(policy).to("cpu")
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


class AsyncBatches:
    """The batches a producer thread samples ahead of the steps that train them (module docstring).
    `next`, `metrics`, `state`, `restore`, `published`, `stream_position` and `close` are what the
    online recipe calls (as on `PendingBatches`, whose `next` samples in the caller's thread)."""

    asynchronous = True

    def __init__(self, max_staleness: int, draw: Draw | None = None, model: torch.nn.Module | None = None):
        if max_staleness < 1:
            raise ValueError("asynchronous generation needs max_staleness >= 1: with 0 each step waits for the update before it")
        self.max_staleness = max_staleness
        self.draw, self.model = draw, model
        self.dropped = 0
        """Batches dropped for being older than k when taken (the version rule makes none; counted all the same)."""
        self.regenerated_on_resume = 0
        """Batches that were in flight when the checkpoint this run resumed from was written, sampled again."""
        self._ready: queue.Queue = queue.Queue()
        self._published = threading.Condition()
        self._version = 0
        self._weights: dict[str, torch.Tensor] | None = None
        self._loaded = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self._last_step = 0
        self._positions: dict[int, int] = {}
        self._trained_position: int | None = None
        self._seconds: dict[int, dict[str, float]] = {}
        self._waited_for_weights = 0.0
        self._step_waits: dict[int, float] = {}
        self._in_flight = 0

    # -- the trainer's side ---------------------------------------------------------------------
    def start(self, step: int, last_step: int, version: int, position: int) -> None:
        """Start the producer at the batch of step `step` (1-based), sampling up to `last_step`, its
        copy of the weights at `version` (the updates they have taken), the stream at `position`."""
        if self._thread is not None:
            return
        self._version = self._loaded = version
        self._last_step, self._trained_position = last_step, position
        self._thread = threading.Thread(target=self._produce, args=(step,), name="posttrain-generation", daemon=True)
        self._thread.start()
        logger.info("generation overlaps training: a producer samples steps %d-%d, at most %d step(s) old", step, last_step,
                    self.max_staleness)

    def next(self, step: int, last_step: int, draw: Callable[[int], ScoredBatch] | None = None) -> ScoredBatch:
        """The batch step `step` trains, waiting for the producer if it is behind (`draw`, the
        synchronous sampler `PendingBatches` takes, is not used: the producer samples with its own).
        An exception raised while sampling (the engine lost, a reward that broke) is raised here."""
        if self._thread is None:
            raise RuntimeError("AsyncBatches.next before start")
        started = time.perf_counter()
        while True:
            item = self._ready.get()
            if isinstance(item, BaseException):
                raise item
            batch = item
            if batch.serves != step:
                raise RuntimeError(f"the producer handed the batch of step {batch.serves} to step {step}")
            if staleness(batch, step) <= self.max_staleness:
                break
            self.dropped += 1  # not reachable under the version rule; a batch too old is never trained
            logger.warning("dropped the batch of step %d: sampled by version %d, %d steps old (max %d)", step, batch.version,
                           staleness(batch, step), self.max_staleness)
        self._step_waits[step] = time.perf_counter() - started
        self._in_flight = self._ready.qsize()
        self._trained_position = self._positions.pop(step)
        return batch

    def published(self, step: int, policy: torch.nn.Module) -> None:
        """After update `step`: hand the producer a CPU copy of the weights (version `step`)."""
        weights = {name: tensor.detach().to("cpu", copy=True) for name, tensor in policy.state_dict().items()}
        with self._published:
            self._version, self._weights = step, weights
            self._published.notify_all()

    def metrics(self, batch: ScoredBatch, step: int) -> dict[str, Any]:
        """Step `step`'s off-policy metrics: the staleness of `batch` (mean and max over its rows, all of
        one version), the batches dropped, those sampled ahead and waiting when the step took its batch
        (`in_flight`), the seconds the trainer waited for it (`wait_generation_s`), the seconds the
        producer waited for weights since the step before (`wait_training_s`: the overlap not achieved,
        from the generator's side), and the producer's own seconds for this batch (`generation_s`,
        `scoring_s`) with its generation rate."""
        old = staleness(batch, step)
        seconds = self._seconds.pop(batch.serves, {})
        with self._published:
            waited, self._waited_for_weights = self._waited_for_weights, 0.0
        metrics = {"offpolicy/staleness_mean": float(old), "offpolicy/staleness_max": old, "offpolicy/dropped_batches": self.dropped,
                   "offpolicy/in_flight": self._in_flight, "offpolicy/wait_generation_s": self._step_waits.pop(step, 0.0),
                   "offpolicy/wait_training_s": waited}
        for phase in ("generation", "scoring"):
            if phase in seconds:
                metrics[f"offpolicy/{phase}_s"] = seconds[phase]
        if seconds.get("generation"):
            metrics["tokens_per_second/generation"] = float(batch.rollout.mask.sum()) / seconds["generation"]
        return metrics

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the counts, and how many batches were sampled ahead and not trained
        (they are not kept: a resumed run samples them again)."""
        return {"dropped": self.dropped, "in_flight": len(self._positions), "asynchronous": True}

    def restore(self, saved: dict[str, Any] | None) -> None:
        """Take back `state()`'s record (or `PendingBatches.state()`'s, from a mode (a) run: its
        batches are not trained either, and count as in flight)."""
        saved = saved or {}
        self.dropped = saved.get("dropped", 0)
        self.regenerated_on_resume = saved.get("in_flight", len(saved.get("batches", [])))

    def stream_position(self, stream) -> int:
        """The prompt stream's position a checkpoint saves: after the last batch trained (the
        producer's stream has run ahead by the batches in flight, which a resume samples again)."""
        return stream.position if self._trained_position is None else self._trained_position

    def close(self, timeout: float = 600.0) -> None:
        """Stop the producer after the batch it is sampling (if any) and wait for it."""
        with self._published:
            self._stop = True
            self._published.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the generation thread did not stop within %.0f s", timeout)
        self._thread = None

    # -- the producer's side --------------------------------------------------------------------
    def _weights_for(self, serves: int) -> int | None:
        """Wait until weights young enough for the batch of step `serves` are published; load the
        newest into the producer's copy. Returns its version (None: stopping)."""
        started = time.perf_counter()
        with self._published:
            while not self._stop and self._version < serves - 1 - self.max_staleness:
                self._published.wait()
            self._waited_for_weights += time.perf_counter() - started
            if self._stop:
                return None
            version, weights = self._version, self._weights
        if version != self._loaded and weights is not None:
            self.model.load_state_dict(weights)
            self._loaded = version
        return self._loaded

    def _produce(self, first: int) -> None:
        serves = first
        try:
            while serves <= self._last_step:
                version = self._weights_for(serves)
                if version is None:
                    return
                batch, seconds, position = self.draw(serves, self.model, version)
                self._seconds[serves], self._positions[serves] = seconds, position
                self._ready.put(batch)
                serves += 1
        except BaseException as error:  # noqa: BLE001 (handed to the trainer, which raises it)
            logger.debug("the generation thread stopped: %s", error)
            self._ready.put(error)
