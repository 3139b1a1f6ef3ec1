"""A step's clock: wall seconds per phase (`Timer`, the `seconds/<phase>` metrics), and `StepClock`,
which every recipe's step loop starts per step (`StepLoop.clock`) for its phases, its wall time, its
throughput and its peak device memory (docs/metrics.md, section 5)."""

from __future__ import annotations

import time


class Timer:
    """Accumulates wall seconds per phase: `with timer("generation"): ...`; `timer.seconds`.
    `synchronize` (e.g. `Placement.synchronize`) is called as a phase starts and ends, so that work
    a GPU still has queued is counted in the phase that queued it."""

    def __init__(self, synchronize=None):
        self.seconds: dict[str, float] = {}
        self.synchronize = synchronize or (lambda: None)
        self.current: str | None = None
        """The phase in progress; after an exception, the phase it was raised in."""

    def __call__(self, phase: str):
        timer = self

        class _Phase:
            def __enter__(self):
                timer.current = phase
                timer.synchronize()
                self.start = time.perf_counter()

            def __exit__(self, kind, *exc):
                if kind is not None:
                    return  # `current` keeps naming the phase that raised (an out-of-memory message reads it)
                timer.current = None
                timer.synchronize()
                timer.seconds[phase] = timer.seconds.get(phase, 0.0) + time.perf_counter() - self.start

        return _Phase()


class StepClock:
    """One training step's clock: a `Timer` for its phases, the wall clock from the step's start, and
    the device's peak memory (reset at the start). `StepLoop` starts one per step (`loop.clock`);
    the recipe times its phases with it (`with loop.clock("train"): ...`) and, before evaluation,
    adds `loop.clock.metrics(tokens, rates)` to the step's metrics (docs/metrics.md, section 5)."""

    def __init__(self, placement=None):
        self.placement = placement
        self.timer = Timer(placement.synchronize if placement is not None else None)
        if placement is not None:
            placement.reset_peak_memory()
        self.started = time.perf_counter()

    def __call__(self, phase: str):
        """The context that adds its wall seconds to `seconds/<phase>`."""
        return self.timer(phase)

    def metrics(self, tokens: float, rates: dict[str, tuple[float, tuple[str, ...]]] | None = None) -> dict[str, float]:
        """The step's timing metrics so far: `seconds/<phase>` for each phase timed, `seconds/step`
        (the wall time since the step began), `tokens_per_second` (`tokens` per second of
        `seconds/step`), for each `name: (count, phases)` of `rates` `tokens_per_second/<name>` (count
        per second of those phases, when they took any time), and on CUDA `memory/peak_allocated_gib`."""
        wall = time.perf_counter() - self.started
        seconds = self.timer.seconds
        metrics = {f"seconds/{phase}": value for phase, value in seconds.items()}
        metrics["seconds/step"] = wall
        metrics["tokens_per_second"] = float(tokens) / max(1e-9, wall)
        for name, (count, phases) in (rates or {}).items():
            spent = sum(seconds.get(phase, 0.0) for phase in phases)
            if spent:
                metrics[f"tokens_per_second/{name}"] = float(count) / spent
        if self.placement is not None and self.placement.is_cuda:
            metrics["memory/peak_allocated_gib"] = self.placement.peak_memory_gib()
        return metrics
