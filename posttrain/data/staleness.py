"""Batches sampled ahead of the step that trains them: the off-policy middle of the online data link
(`data.max_staleness`, issue 42's mode (a): simulated, synchronous and deterministic).

With k = `data.max_staleness`, the online step t samples, with the weights it starts from (version
t-1: t-1 training steps), the batch of step t+k, and trains the oldest batch sampled; the first step
samples the batches of steps 1 .. k+1, all with version 0. So the batch trained at step t was sampled
by the weights of step max(t-k, 1), and its staleness (t - 1 - version) is 0, 1, ..., k over the
first k+1 steps, then k: the one-step-off-policy pipeline of verl and the bounded staleness of AReaL
(Fu et al., arXiv:2505.24298), without the overlap: generation and training still take
turns, so a run is the same every time and resumes exactly. Each batch has the prompts and sampling
seeds of the step it serves (`ScoredBatch.serves`), so step t trains on the prompts an on-policy run
trains on at step t; only the weights that sampled them differ. k = 0 is the on-policy step.

    pending = PendingBatches(max_staleness=2)
    batch = pending.next(step=state.step + 1, last_step=max_steps, draw=lambda serves: sample(state, serves))
    metrics.update(pending.metrics(batch, step))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from posttrain.data.scored_batch import ScoredBatch


def staleness(batch: ScoredBatch, step: int) -> int:
    """How many training steps (updates) the weights that sampled `batch` are behind those that start step
    `step` (1-based): `step - 1 - batch.version`; 0 on-policy."""
    return step - 1 - batch.version


@dataclass
class PendingBatches:
    """The batches sampled and not yet trained, in the order of the steps they serve, and how many
    were dropped. A batch is dropped, never trained, when at the step that would train it it is more
    than `max_staleness` steps old (`stale`): the synchronous pipeline of `next` never makes one, a
    generator running on its own can; the count is the run's `offpolicy/dropped_batches`."""

    max_staleness: int = 0
    """k (`data.max_staleness`): 0 on-policy."""
    batches: list[ScoredBatch] = field(default_factory=list)
    """Sampled, not yet trained, oldest first (`ScoredBatch.serves` increasing)."""
    dropped: int = 0
    """Batches dropped so far for being older than k (cumulative over the run, resumes included)."""

    asynchronous = False
    """Mode (a): `next` samples in the caller's thread (`async_generation.AsyncBatches`: a producer thread)."""

    def start(self, step: int, last_step: int, version: int, position: int) -> None:
        """Nothing to start: `next` samples when it is called (`AsyncBatches.start` starts its producer)."""

    def published(self, step: int, policy) -> None:
        """Nothing to hand over: `next` samples with the weights the caller holds."""

    def stream_position(self, stream) -> int:
        """The prompt stream's position a checkpoint saves: after the pending batches, which it keeps."""
        return stream.position

    def close(self) -> None:
        """Nothing runs between calls."""

    def stale(self, batch: ScoredBatch, step: int) -> bool:
        """Whether `batch`, trained at step `step`, would be more than k steps old."""
        return staleness(batch, step) > self.max_staleness

    def next(self, step: int, last_step: int, draw: Callable[[int], ScoredBatch]) -> ScoredBatch:
        """The batch step `step` trains: drop (and count) the pending batches too old for it, sample
        with `draw(serves)` (the current weights) the batches of the steps after the newest pending
        one up to `step + k` (never past `last_step`: no batch is sampled for a step the run will not
        take), then take the oldest. With k = 0 that is `draw(step)`, the on-policy step."""
        kept = [batch for batch in self.batches if not self.stale(batch, step)]
        self.dropped += len(self.batches) - len(kept)
        self.batches = kept
        following = self.batches[-1].serves + 1 if self.batches else step
        for serves in range(following, min(step + self.max_staleness, last_step) + 1):
            self.batches.append(draw(serves))
        return self.batches.pop(0)

    def metrics(self, batch: ScoredBatch, step: int) -> dict[str, Any]:
        """The off-policy metrics of step `step`, which trained `batch` (none when k = 0: an
        on-policy run logs what it always did): its staleness over its rows (mean and max; every
        row of a batch has the batch's version) and the batches dropped so far."""
        if not self.max_staleness:
            return {}
        old = staleness(batch, step)
        return {"offpolicy/staleness_mean": float(old), "offpolicy/staleness_max": old, "offpolicy/dropped_batches": self.dropped}

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (the batches on the CPU): the weights that sampled them are gone
        after a restart, so a resumed run trains these very batches."""
        return {"batches": [batch.to("cpu") for batch in self.batches], "dropped": self.dropped}

    def restore(self, saved: dict[str, Any] | None) -> None:
        """Take back `state()`'s record (None: nothing pending, a checkpoint of an on-policy run)."""
        self.batches, self.dropped = list((saved or {}).get("batches", [])), (saved or {}).get("dropped", 0)
