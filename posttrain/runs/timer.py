"""Wall seconds per phase of a step, for the `seconds/<phase>` metrics."""

from __future__ import annotations

import time


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
