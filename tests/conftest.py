"""Test-wide settings.

One intra-op thread per process: the tests' models are tiny, and on this 2-core machine several
processes (pytest, CLI subprocesses, verifier workers, sandboxes) run at once. Two OpenMP threads
per process then wait on each other at every op and a tiny forward pass gets ~20x slower.
Set before torch is imported, so CLI subprocesses inherit it too.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


LONGEST_FIRST = ("tests/test_demo.py",)
"""Files run before the rest: under `make test`'s two workers (`-n 2 --dist loadfile`) one worker
runs the shortened demo (about 6 minutes alone) while the other takes the other files, instead of
the demo starting last and running alone (14.3 minutes in all that way, 19.4 with one process)."""


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in LONGEST_FIRST)  # stable: every other order kept
