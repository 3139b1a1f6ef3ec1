"""Wall seconds per phase of a step, for the `seconds/<phase>` metrics."""

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
