"""A pool of worker processes with a hard deadline per task.

Verifiers that need a process of their own run there: math-verify (it uses signals, so it only
works in a main thread), reasoning-gym scorers and user callables (they may hang), and the code
judges (each worker owns one sandbox slot). The trainer's process only pickles tasks in and
results out.

Why not multiprocessing.Pool / ProcessPoolExecutor: a task that hangs in C code (sympy on
`9^{9^{9^9}}`) must be killed without losing the pool, and a worker that dies must be replaced
and its task retried once. Here each worker is a plain subprocess (`python -m
posttrain.rewards.worker`, no fork of a trainer holding a model) driven by one thread.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<Q")


class WorkerGone(Exception):
    """The worker died or missed its deadline (it has been killed)."""

    def __init__(self, message: str, timed_out: bool):
        super().__init__(message)
        self.timed_out = timed_out


class _Worker:
    """One worker subprocess and its two pipes."""

    def __init__(self):
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "posttrain.rewards.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True,
        )

    def call(self, function: str, args: tuple, timeout_s: float) -> Any:
        """Run `function(*args)` in the worker; raise WorkerGone on death or deadline."""
        data = pickle.dumps((function, args))
        try:
            self.process.stdin.write(_HEADER.pack(len(data)) + data)
            self.process.stdin.flush()
        except (BrokenPipeError, OSError) as error:
            self.kill()
            raise WorkerGone(f"worker pipe closed: {error}", timed_out=False) from None
        deadline = time.monotonic() + timeout_s
        header = self._read(_HEADER.size, deadline)
        status, value = pickle.loads(self._read(_HEADER.unpack(header)[0], deadline))
        if status == "error":
            raise RuntimeError(value)
        return value

    def _read(self, size: int, deadline: float) -> bytes:
        fd = self.process.stdout.fileno()
        chunks, remaining = [], size
        while remaining:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                self.kill()
                raise WorkerGone("worker missed its deadline", timed_out=True)
            chunk = os.read(fd, min(remaining, 1 << 20))
            if not chunk:
                code = self.kill()
                why = ("; killed by SIGKILL, as the kernel's out-of-memory killer does when memory runs out (see dmesg)"
                       if code == -signal.SIGKILL else "")
                raise WorkerGone(f"worker died (exit status {code}{why})", timed_out=False)
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)

    def kill(self) -> int | None:
        """Kill the worker's whole process group (its sandbox dies with it)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        code = self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass
        return code


class WorkerPool:
    """`size` worker processes; `map` runs tasks on them with a per-task deadline and one retry."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError("a worker pool needs at least one worker")
        self.size = size
        self._workers: list[_Worker | None] = [None] * size
        self._lock = threading.Lock()

    def map(self, function: str, argument_tuples: list[tuple], timeout_s: float,
            retry_timeouts: bool = False,
            on_failure: Callable[[WorkerGone | RuntimeError], Any] = None) -> list[Any]:
        """Run `function` ("module:name") on each argument tuple, in order of the input.

        A worker that dies is replaced and the task retried once (also after a missed deadline
        when `retry_timeouts`). What still fails becomes `on_failure(error)`: a WorkerGone
        (`.timed_out` tells which) or a RuntimeError carrying the task's last traceback line.
        """
        results: list[Any] = [None] * len(argument_tuples)
        todo: queue.Queue[int] = queue.Queue()
        for index in range(len(argument_tuples)):
            todo.put(index)

        def drive(slot: int) -> None:
            while True:
                try:
                    index = todo.get_nowait()
                except queue.Empty:
                    return
                for attempt in (1, 2):
                    worker = self._workers[slot] or _Worker()
                    self._workers[slot] = worker
                    try:
                        results[index] = worker.call(function, argument_tuples[index], timeout_s)
                        break
                    except WorkerGone as gone:
                        self._workers[slot] = None
                        logger.warning("worker %d: %s (attempt %d)", slot, gone, attempt)
                        if attempt == 2 or (gone.timed_out and not retry_timeouts):
                            results[index] = on_failure(gone)
                            break
                    except RuntimeError as error:
                        results[index] = on_failure(error)
                        break

        with self._lock:  # one map at a time: each worker (and its sandbox slot) serves one task
            threads = [threading.Thread(target=drive, args=(slot,), daemon=True)
                       for slot in range(min(self.size, max(1, len(argument_tuples))))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        return results

    def close(self) -> None:
        """Kill all workers."""
        for index, worker in enumerate(self._workers):
            if worker is not None:
                worker.kill()
                self._workers[index] = None


_POOLS: dict[int, WorkerPool] = {}


def get_pool(size: int | None = None) -> WorkerPool:
    """The process-wide pool with `size` workers (default: the number of CPUs)."""
    size = size or os.cpu_count() or 1
    if size not in _POOLS:
        _POOLS[size] = WorkerPool(size)
    return _POOLS[size]


@atexit.register
def close_pools() -> None:
    """Kill every pool's workers (also run at interpreter exit)."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
