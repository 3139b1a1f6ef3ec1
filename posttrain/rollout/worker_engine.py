"""The built-in engine in a process of its own: `generate`'s signature, the weights pushed when they change.

`WorkerEngine` is a drop-in for `rollout.engine.generate` (as `VLLMEngine` is) whose generation runs
in a `multiprocessing` "spawn" worker holding its own copy of the policy. It is what asynchronous
generation runs the built-in engine as: the trainer's process keeps training while the worker samples.

* **Start** (first call): the policy (LoRA folded) and tokenizer are exported to a temporary
  directory (`export_for_vllm`, the vLLM colocate path) and the worker loads them with
  transformers, in the policy's dtype, on the policy's device (CPU, or the same CUDA index).
* **Weight sync**, as VLLMEngine: before every call the policy is fingerprinted
  (`weights_fingerprint`); when it changed since the last sync the full weights go to the worker as
  CPU tensors under their Hugging Face names (`hf_weights`, LoRA folded) and it copies them in.
  `last_sync_s`, `syncs` and `sync_seconds` as in VLLMEngine.
* **Same tokens**: the worker runs `rollout.engine.generate` itself, so for the same weights, seed and
  settings the Rollout equals the in-process one (tests/test_worker_engine.py asserts it).
* **Threads**: one call at a time (a lock around sync + generate): a producer thread and the
  trainer's evaluation may share one engine.
* **Failure**: a worker that dies or does not answer within `timeout_s` raises `EngineUnavailable`
  (one line: how it stopped); an error raised in the worker comes back as its own type and message.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from posttrain.rollout.batch import Rollout
from posttrain.rollout.decoder_weights import WeightSyncs, weights_fingerprint
from posttrain.rollout.engine import _device_of
from posttrain.rollout.sampling import SamplingConfig
from posttrain.rollout.vllm_backends import EngineUnavailable, export_for_vllm, hf_weights

logger = logging.getLogger(__name__)

_POLL_S = 0.5
"""How often a waiting call checks that the worker is still alive."""


def _serve(connection, model_dir: str, dtype: torch.dtype, device: str, threads: int) -> None:
    """The worker's loop: load the model, then answer ("weights", {name: tensor}) and ("generate",
    args, kwargs) requests with ("ok", result) or ("error", exception type, message) until ("close",)."""
    torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.rollout.engine import generate

    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        connection.send(("ok", None))
    except Exception as error:  # noqa: BLE001 - reported to the caller, which raises it
        connection.send(("error", type(error), str(error)))
        return
    while True:
        try:
            request = connection.recv()
        except EOFError:  # the caller's end closed: nothing more to do
            return
        if request[0] == "close":
            return
        try:
            if request[0] == "weights":
                with torch.no_grad():
                    _, unexpected = model.load_state_dict(request[1], strict=False)  # missing: the tied head, sent once
                if unexpected:
                    raise RuntimeError(f"weights the worker's model does not have: {unexpected[:3]}")
                result = None
            else:
                _, args, kwargs = request
                result = generate(model, tokenizer, *args, **kwargs).to("cpu")
            connection.send(("ok", result))
        except Exception as error:  # noqa: BLE001 - reported to the caller, which raises it
            connection.send(("error", type(error), str(error)))


def _stop(process, connection) -> None:
    """Ask the worker to finish, then wait for it (terminate it if it does not); idempotent."""
    if process is None:
        return
    try:
        if process.is_alive():
            connection.send(("close",))
    except (OSError, ValueError, BrokenPipeError):
        pass
    process.join(timeout=10)
    if process.is_alive():
        process.terminate()
        process.join(timeout=5)
    connection.close()


def _how_stopped(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class WorkerEngine(WeightSyncs):
    """`rollout.engine.generate`'s signature, generation in a worker process (module docstring):
    `engine(model, tokenizer, prompts, group_size=, sampling=, seed=, shard=, draws=) -> Rollout`,
    the weights synced first.

    Args:
        threads: torch threads in the worker; None: the caller's `torch.get_num_threads()`.
        timeout_s: seconds one request (the start, a sync, a generation) may take before the worker
            is declared stuck, stopped, and `EngineUnavailable` raised.
    """

    def __init__(self, threads: int | None = None, timeout_s: float = 600.0):
        self.threads = threads or torch.get_num_threads()
        self.timeout_s = timeout_s
        self.process: Any = None
        self._connection: Any = None
        self._finalizer: Any = None
        self._lock = threading.Lock()
        self.init_syncs()

    @property
    def pid(self) -> int | None:
        """The worker's process id (None before the first call and after `close`)."""
        return self.process.pid if self.process is not None else None

    def _request(self, message: tuple) -> Any:
        """Send one request and wait for its answer; the worker's errors raised here, as their own type."""
        try:
            self._connection.send(message)
        except (OSError, BrokenPipeError):
            self._lost()
        return self._answer()

    def _answer(self) -> Any:
        deadline = time.monotonic() + self.timeout_s
        while not self._connection.poll(_POLL_S):
            if not self.process.is_alive():
                self._lost()
            if time.monotonic() > deadline:
                self._lost(stuck=True)
        try:
            reply = self._connection.recv()
        except (EOFError, OSError):  # the worker's end closed: it died
            self._lost()
        if reply[0] == "ok":
            return reply[1]
        _, kind, message = reply
        try:
            error = kind(message)
        except Exception:  # noqa: BLE001 - a type that cannot be built from its message alone
            error = RuntimeError(f"{kind.__name__}: {message}")
        raise error

    def _lost(self, stuck: bool = False):
        """The worker died or (`stuck`) did not answer in time: end it, forget it (the next call starts
        a new one), raise one line."""
        process = self.process
        if stuck:
            process.kill()
        process.join(timeout=5)  # a killed process's end is seen a moment after its pipe closes
        if stuck:
            how = f"did not answer within {self.timeout_s:g}s and was stopped"
        elif process.exitcode == -signal.SIGKILL:
            how = f"{_how_stopped(process.exitcode)} (out of memory?)"
        else:  # its own traceback went to stderr; a script without `if __name__ == "__main__":` ends so under spawn
            how = f"{_how_stopped(process.exitcode)} (its error is above; a script must start under if __name__ == '__main__')"
        self._forget()
        raise EngineUnavailable(f"rollout: the generation worker (pid {process.pid}) {how}; a run stops here and "
                                "resumes from its checkpoint, a next call starts a new worker") from None

    def _forget(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # joins and closes; idempotent
        self.process = self._connection = self._finalizer = None
        self.forget_weights()

    def _start(self, model, tokenizer) -> None:
        started = time.perf_counter()
        device = _device_of(model)
        dtype = next(model.parameters()).dtype
        with tempfile.TemporaryDirectory(prefix="posttrain-worker-") as directory:
            export_for_vllm(model, tokenizer, directory)
            context = multiprocessing.get_context("spawn")
            ours, theirs = context.Pipe()
            self.process = context.Process(target=_serve, args=(theirs, directory, dtype, str(device), self.threads),
                                           name="posttrain-generation-worker", daemon=True)
            self.process.start()
            theirs.close()
            self._connection = ours
            self._finalizer = weakref.finalize(self, _stop, self.process, ours)
            try:
                self._answer()  # loaded: the directory can go
            except BaseException:
                self._forget()  # a worker that could not load is not kept: the next call starts afresh
                raise
        self.last_sync_s = self.record_sync(model, weights_fingerprint(model), started)
        logger.info("rollout: generation worker (pid %d) loaded the policy in %.1fs", self.process.pid, self.last_sync_s)

    def _push(self, weights: dict[str, torch.Tensor]) -> None:
        """Send full weights (CPU tensors under their HF names) for the worker to copy into its model."""
        self._request(("weights", weights))

    def sync(self, model) -> float | None:
        """Send `model`'s weights to the worker if they changed since the last sync; returns the seconds it took (None: unchanged)."""
        fingerprint = weights_fingerprint(model)
        if self.holds(model, fingerprint):
            return None
        started = time.perf_counter()
        # copies: torch pickles a CPU tensor by moving its storage to shared memory, which would
        # re-home the policy's own parameters (and change their fingerprint) were they sent as they are
        self._push({name: tensor.to("cpu", copy=True).contiguous() for name, tensor in hf_weights(model)})
        return self.record_sync(model, fingerprint, started)

    def __call__(self, model, tokenizer, prompts, *, group_size: int = 1, sampling: SamplingConfig | None = None,
                 seed: int = 0, shard: tuple[int, int] | None = None, draws: tuple[Sequence[int], int] | None = None,
                 max_batch_size: int | None = None, backend: str = "auto", add_special_tokens: bool = False) -> Rollout:
        """As `rollout.engine.generate`, run in the worker on its copy of the weights (synced first).
        Returns a `Rollout` on the model's device: (N, P) prompts, (N, T) completions and log-probs."""
        with self._lock:
            if self.process is None:
                self._start(model, tokenizer)
            else:
                self.last_sync_s = self.sync(model)
            if isinstance(prompts, torch.Tensor):
                prompts = prompts.cpu()
            elif isinstance(prompts, Sequence) and not isinstance(prompts, str):
                prompts = [p.cpu() if isinstance(p, torch.Tensor) else p for p in prompts]
            draws = (list(draws[0]), draws[1]) if draws is not None else None
            kwargs = dict(group_size=group_size, sampling=sampling, seed=seed, shard=shard, draws=draws,
                          backend=backend, add_special_tokens=add_special_tokens)
            if max_batch_size is not None:  # None: generate's own default
                kwargs["max_batch_size"] = max_batch_size
            rollout = self._request(("generate", (prompts,), kwargs))
        return rollout.to(_device_of(model))

    def close(self) -> None:
        """Stop the worker and wait for it (idempotent; also done on garbage collection and at exit)."""
        with self._lock:
            self._forget()
