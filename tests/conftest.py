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

