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
when rerun, and a prompt's rows do not depend on which rank or batch samples it (`shard`, `draws` as
in `generate`). Tokens differ from the built-in engine's: both draw from the same distribution with
different random streams.

Where vLLM runs (the in-process and server backends), its settings and the weights that cross to it
are `vllm_backends.py`; this module is the engine's side of the contract.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from posttrain.data.examples import derived_seed
from posttrain.errors import UserError
from posttrain.rollout.batch import Rollout
from posttrain.rollout.decoder_weights import WeightSyncs, weights_fingerprint
from posttrain.rollout.engine import _as_id_lists, _device_of, _left_pad, _StopStrings, batch_places, stop_token_ids
from posttrain.rollout.vllm_backends import RemoteBackend, VLLMSettings, hf_weights, in_process_backend
from posttrain.rollout.sampling import SamplingConfig

logger = logging.getLogger(__name__)

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


def request_seed(seed: int, index: int) -> int:
    """The vLLM seed of prompt `index` of a batch drawn with `seed` (its G rows use it + g)."""
    return derived_seed(seed, "vllm", str(index)) >> 2  # room for + g below 2**63


def sampling_params(sampling: SamplingConfig, group_size: int, seed: int, stop_ids: Sequence[int]) -> dict[str, Any]:
    """vLLM `SamplingParams` keyword arguments for one prompt's G rows (a plain dict: it also crosses to a server)."""
    return {"n": group_size, "temperature": 0.0 if sampling.greedy else sampling.temperature,
            "max_tokens": sampling.max_new_tokens, "seed": seed, "stop_token_ids": list(stop_ids), "ignore_eos": True,
            "stop": list(sampling.stop_strings) or None, "include_stop_str_in_output": True,
            "logprobs": 0, "detokenize": bool(sampling.stop_strings), "skip_special_tokens": True}


class VLLMEngine(WeightSyncs):
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
        self.init_syncs()
        self._lock = threading.Lock()  # one call at a time: a generation thread and the trainer's evaluation share an engine

    def _start(self, model, tokenizer) -> None:
        if self.settings.mode == "server":
            self.backend = RemoteBackend(self.settings.url, timeout_s=self.settings.timeout_s,
                                         retries=self.settings.connect_retries)
            return
        started = time.perf_counter()
        self.backend, loaded = in_process_backend(model, tokenizer, self.settings)
        if loaded:  # the exported directory's weights are the model's: no push before the first generation
            self.backend.loaded_by = self
            self.last_sync_s = self.record_sync(model, weights_fingerprint(model), started)
            logger.info("rollout: vLLM loaded the policy in %.1fs (colocate)", self.last_sync_s)

    def sync(self, model) -> float | None:
        """Send `model`'s weights to vLLM if they changed since the last sync; returns the seconds it took (None: unchanged)."""
        fingerprint = weights_fingerprint(model)
        mine = getattr(self.backend, "loaded_by", self) is self  # in-process vLLM may hold another engine's weights
        if mine and self.holds(model, fingerprint):
            return None
        started = time.perf_counter()
        self.backend.load_weights(hf_weights(model))
        if hasattr(self.backend, "loaded_by"):
            self.backend.loaded_by = self
        return self.record_sync(model, fingerprint, started)

    def __call__(self, model, tokenizer, prompts, *, group_size: int = 1, sampling: SamplingConfig | None = None,
                 seed: int = 0, shard: tuple[int, int] | None = None, draws: tuple[Sequence[int], int] | None = None,
                 max_batch_size: int | None = None, backend: str = "auto", add_special_tokens: bool = False) -> Rollout:
        """As `rollout.engine.generate` (`max_batch_size` and `backend` are the built-in engine's and
        are ignored: vLLM schedules its own batches). Returns a `Rollout` on the model's device.
        Calls from several threads take turns (the weights synced are the calling model's)."""
        with self._lock:
            return self._generate(model, tokenizer, prompts, group_size=group_size, sampling=sampling, seed=seed, shard=shard,
                                  draws=draws, add_special_tokens=add_special_tokens)

    def _generate(self, model, tokenizer, prompts, *, group_size: int, sampling: SamplingConfig | None, seed: int,
                  shard: tuple[int, int] | None, draws: tuple[Sequence[int], int] | None, add_special_tokens: bool) -> Rollout:
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
