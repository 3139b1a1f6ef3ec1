"""``generate``: G sampled completions per prompt, with the log-probs of what was sampled.

The loop, per chunk of prompts:
1. left-pad the chunk's B prompts and prefill them in one batched forward (each prompt once);
2. copy each prompt's KV cache to its G rows (``decoder.select``);
3. per step: sample a token for every active row (``sampling.sample_step``), record it and its
   log-probs, end rows on EOS / stop token / stop string, drop ended rows from the cache (so they
   cost nothing more), and run one decode step for the rest.

Randomness: one uniform number per (row, step) from a table drawn with the seed for all N rows up
front, so a row's sample does not depend on chunking, compaction or which rows share its batch.

``Session``: the same loop across calls (the turns of tool episodes). Each row's cache is exported
as it ends (step 3), and a later call whose prompt begins with that row's ids resumes it in step 1
(``decoder.resume``: only the new tokens are run) instead of prefilling the whole prompt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from posttrain.errors import UserError
from posttrain.rollout import decoder_weights
from posttrain.rollout.batch import Rollout
from posttrain.rollout.hf_decoder import HFDecoder
from posttrain.rollout.llama_decoder import LlamaDecoder, RowCache, unsupported_reason
from posttrain.rollout.sampling import SamplingConfig, sample_step

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "fast", "hf")


def _as_id_lists(tokenizer, prompts, add_special_tokens: bool) -> list[list[int]]:
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise UserError("prompts must be a non-empty list of strings or of token-id lists")
    id_lists = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids = tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        elif isinstance(prompt, torch.Tensor):
            ids = prompt.tolist()
        else:
            ids = [int(t) for t in prompt]
        if len(ids) == 0:
            raise UserError(f"prompt {index} is empty after tokenisation")
        id_lists.append(ids)
    return id_lists


def stop_token_ids(model, tokenizer, sampling: SamplingConfig) -> list[int]:
    """Ids that end a completion: the tokenizer's EOS, the model's generation-config EOS, and extras."""
    ids = set(sampling.stop_token_ids)
    for source in (getattr(tokenizer, "eos_token_id", None),
                   getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(int(t) for t in source)
    return sorted(ids)


def _left_pad(id_lists: list[list[int]], pad_id: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, width) long ids and (B, width) bool mask, real tokens right-aligned."""
    ids = torch.full((len(id_lists), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(id_lists), width), dtype=torch.bool)
    for row, prompt in enumerate(id_lists):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = True
    return ids, mask


def _device_of(model) -> torch.device:
    """The device of the model's weights (where the rollout runs and its tensors live)."""
    parameter = next(iter(model.parameters()), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _make_decoder(model, backend: str, capacity: int, batch_hint: int):
    if backend == "hf":
        return HFDecoder(model)
    reason = unsupported_reason(model, capacity)
    if reason is None:
        return LlamaDecoder(model, batch_hint=batch_hint)
    if backend == "fast":
        raise UserError(f"backend 'fast' cannot run this model: {reason}")
    logger.info("rollout: generic decoder (%s)", reason)
    return HFDecoder(model)


class _StopStrings:
    """Checks, after each step, whether a row's newest token completed one of the stop strings."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        # A token decodes to at least one character except for partial UTF-8 bytes: 4 tokens per
        # character bounds the window that can contain a freshly completed stop string.
        self.window = 4 * max(len(s) for s in stop_strings) + 4

    def hits(self, completions: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor:
        """(len(rows),) bool. completions: (n, T) long; rows: (k,) long; length: tokens so far."""
        tails = completions[rows, max(0, length - self.window):length].tolist()
        texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True)
        return torch.tensor([any(s in text for s in self.stop_strings) for text in texts], dtype=torch.bool)

    def cut(self, text: str) -> str:
        """The text up to and including the earliest-ending stop string."""
        ends = [text.find(s) + len(s) for s in self.stop_strings if s in text]
        return text[:min(ends)] if ends else text


def _generate_chunk(decoder, logits, group_size, sampling, uniforms, eos_ids, stops, pad_id, on_end=None):
    """Sample G completions for each of the chunk's B prompts, from the decoder's cache of them and
    their (B, V) next-token `logits`. Returns per-row tensors (n = B * G) on the logits' device. One
    host synchronisation per decode step: the (n,) "done" flags (with the tokens, when stop strings
    are checked on the host). on_end: called with (cache rows, chunk rows) of the rows that end, before
    they leave the cache (a `Session` exports them)."""
    B, device = logits.shape[0], logits.device
    n, T = B * group_size, sampling.max_new_tokens
    completions = torch.full((n, T), pad_id, dtype=torch.long, device=device)
    host_completions = torch.full((n, T), pad_id, dtype=torch.long) if stops is not None else None
    sampler_logprobs = torch.zeros(n, T, device=device)
    logprobs = torch.zeros(n, T, device=device)
    lengths = torch.zeros(n, dtype=torch.long, device=device)
    finished = torch.zeros(n, dtype=torch.bool, device=device)
    expand = torch.arange(B).repeat_interleave(group_size)  # prompt b -> rows b*G .. b*G+G-1
    decoder.select(expand)
    logits = logits.index_select(0, expand.to(device))  # (n, V)
    active_host = torch.arange(n)  # chunk rows still generating, in cache order
    active = active_host.to(device)
    for step in range(T):
        banned = eos_ids if step < sampling.min_new_tokens else None
        tokens, step_sampler, step_logprobs = sample_step(logits, sampling, uniforms[active, step], banned)
        completions[active, step] = tokens
        sampler_logprobs[active, step] = step_sampler
        logprobs[active, step] = step_logprobs
        lengths[active] = step + 1
        done = torch.isin(tokens, eos_ids)
        if stops is not None:
            tokens_host, done_host = torch.stack([tokens, done.long()]).cpu()  # the step's one synchronisation
            host_completions[active_host, step] = tokens_host
            done_host = done_host.bool() | stops.hits(host_completions, active_host, step + 1)
        else:
            done_host = done.cpu()  # the step's one synchronisation (a no-op on the CPU)
        finished[active_host[done_host].to(device)] = True
        if on_end is not None and (step == T - 1 or bool(done_host.any())):  # every row, as it leaves the cache
            ended = torch.arange(len(active_host)) if step == T - 1 else done_host.nonzero().squeeze(1)
            on_end(ended.tolist(), active_host[ended].tolist())
        if step == T - 1 or bool(done_host.all()):
            break
        if bool(done_host.any()):  # compact: ended rows leave the cache and stop costing compute
            keep_host = (~done_host).nonzero().squeeze(1)
            keep = keep_host.to(device)
            active_host, active, tokens = active_host[keep_host], active[keep], tokens[keep]
            decoder.select(keep_host)
        logits = decoder.decode(tokens)
    return completions, sampler_logprobs, logprobs, lengths, finished


def _run_chunk(decoder, id_lists, first, count, sampling, uniforms, eos_ids, stops, pad_id, group_size, resume=None):
    """Prompts ``first .. first + count`` (whole groups): left-pad them, prefill them and sample their
    rows. resume: a `_Resume` (a `Session` call): the chunk's rows with a kept cache read only their
    new tokens, and every row is exported as it ends, for the next call."""
    chunk = id_lists[first:first + count]
    rows = slice(first * group_size, (first + len(chunk)) * group_size)
    T, device, n = sampling.max_new_tokens, eos_ids.device, len(chunk) * group_size
    caches = resume.caches[first:first + count] if resume is not None and hasattr(decoder, "resume") else [None]
    if any(cache is not None for cache in caches):
        new = [ids if cache is None else ids[len(cache.ids) - 1:] for ids, cache in zip(chunk, caches)]
        new_ids, new_mask = _left_pad(new, pad_id, max(map(len, new)))
        resume.resumed += sum(cache is not None for cache in caches)
        logits = decoder.resume([None if cache is None else cache.state for cache in caches], new_ids.to(device),
                                new_mask.to(device), T, max_rows=n)
    else:
        prompt_ids, prompt_mask = _left_pad(chunk, pad_id, max(len(ids) for ids in chunk))
        logits = decoder.prefill(prompt_ids.to(device), prompt_mask.to(device), prompt_ids.shape[1] + T, max_rows=n)
    def export(cache_rows, chunk_rows):
        for row, state in zip(chunk_rows, decoder.export(cache_rows)):
            resume.kept[first * group_size + row] = state

    keeps = resume is not None and resume.keep and hasattr(decoder, "export")
    return _generate_chunk(decoder, logits, group_size, sampling, uniforms[rows], eos_ids, stops, pad_id,
                           export if keeps else None)


def batch_places(count: int, shard: tuple[int, int] | None, draws: tuple[Sequence[int], int] | None) -> tuple[list[int], int]:
    """Where `count` prompts sit in the batch their randomness is drawn for: (their indices, the
    batch's size), from `generate`'s `shard` (a contiguous share) or `draws` (any indices); neither:
    the prompts are the whole batch. Every engine seeds a prompt's rows by its index there."""
    if draws is not None:
        if shard is not None:
            raise UserError("generate: pass shard or draws, not both")
        indices, total = list(draws[0]), draws[1]
        if len(indices) != count or any(not 0 <= i < total for i in indices):
            raise UserError(f"draws: {count} prompts need {count} indices below {total}")
        return indices, total
    first, total = shard if shard is not None else (0, count)
    if first < 0 or first + count > total:
        raise UserError(f"shard {shard} does not hold {count} prompts")
    return list(range(first, first + count)), total


def generate(model, tokenizer, prompts, *, group_size: int = 1, sampling: SamplingConfig | None = None,
             seed: int = 0, max_batch_size: int = 64, backend: str = "auto",
             add_special_tokens: bool = False, shard: tuple[int, int] | None = None,
             draws: tuple[Sequence[int], int] | None = None) -> Rollout:
    """Sample ``group_size`` completions for every prompt with a KV cache; return them as a ``Rollout``.

    Args:
        model: a Hugging Face causal LM, or a PEFT model around one. It is put in eval mode while
            sampling (restored afterwards); no gradients are taken. Llama / Mistral / Qwen2 / Qwen3
            (plain or LoRA linear layers) use the fast decoder; anything else the model's own forward.
        tokenizer: its tokenizer; used to tokenise string prompts, find EOS/pad ids, decode texts.
        prompts: B prompts, each a string or a list of token ids. Chat templates are the caller's job:
            pass ``tokenizer.apply_chat_template(..., add_generation_prompt=True)`` text or ids.
            Strings are tokenised exactly as written (``add_special_tokens`` below).
        group_size: G samples per prompt. Rows are group-contiguous: row b*G + g.
        sampling: temperature / top-k / top-p / lengths / stop strings / greedy.
        seed: the same seed, prompts and settings give the same tokens whatever ``max_batch_size``.
        max_batch_size: at most this many rows (whole groups, so at least G) are decoded together;
            bounds the KV cache and activation memory.
        backend: "auto" (fast decoder when supported, else the generic one), "fast" or "hf".
        add_special_tokens: passed to the tokenizer for string prompts (False: no BOS added).
        shard: ``(first, total)``: these prompts are prompts ``first ..`` of a batch of ``total``
            prompts drawn with ``seed`` (one rank's share under torchrun); each row then samples
            exactly what it would in the whole batch.
        draws: ``(indices, total)``: prompt i is prompt ``indices[i]`` of a batch of ``total`` drawn
            with ``seed`` (any subset, in any order: the rows of an episode still going after a tool
            call); each row then samples what it would in that whole batch. Exclusive with ``shard``.

    Returns:
        a ``Rollout`` with N = B * G rows on the model's device; see its field docs for shapes and
        meanings. On a GPU the KV cache, the sampling and the bookkeeping stay on the device (one
        host synchronisation per decode step); under ``torch.autocast`` (bf16-mixed) the fast
        decoder keeps its weight copy and cache in bfloat16. The uniforms are drawn on the CPU, so
        the same seed gives the same draws on every device.
    """
    return _generate(model, tokenizer, prompts, group_size=group_size, sampling=sampling, seed=seed,
                     max_batch_size=max_batch_size, backend=backend, add_special_tokens=add_special_tokens,
                     shard=shard, draws=draws)


def _generate(model, tokenizer, prompts, *, group_size, sampling, seed, max_batch_size, backend, add_special_tokens,
              shard, draws, session: Session | None = None) -> Rollout:
    """`generate`; with a `session`, the rows it kept are resumed and every row is kept as it ends."""
    sampling = sampling or SamplingConfig()
    if backend not in BACKENDS:
        raise UserError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if group_size < 1:
        raise UserError(f"group_size must be >= 1, got {group_size}")
    id_lists = _as_id_lists(tokenizer, prompts, add_special_tokens)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad_id = 0 if pad_id is None else int(pad_id)
    device = _device_of(model)
    eos_ids = torch.tensor(stop_token_ids(model, tokenizer, sampling), dtype=torch.long, device=device)
    stops = _StopStrings(tokenizer, sampling.stop_strings) if sampling.stop_strings else None
    B, G, T = len(id_lists), group_size, sampling.max_new_tokens
    generator = torch.Generator().manual_seed(seed)
    indices, total = batch_places(B, shard, draws)
    uniforms = torch.rand(total * G, T, generator=generator, dtype=torch.float64)  # (N, T), row-owned
    rows = torch.tensor([i * G + g for i in indices for g in range(G)], dtype=torch.long)
    uniforms = uniforms[rows].to(device)  # drawn on the CPU: the same draws on every device
    prompts_per_chunk = max(1, max_batch_size // G)
    resume = session._resume(id_lists, [i * G for i in indices], G) if session is not None else None
    started = time.perf_counter()
    was_training = model.training
    model.eval()  # no dropout while sampling; the caller's mode is restored below
    try:
        with torch.inference_mode():
            decoder = _make_decoder(model, backend, max(map(len, id_lists)) + T,
                                    batch_hint=min(B, prompts_per_chunk) * G)
            pieces = [_run_chunk(decoder, id_lists, first, prompts_per_chunk, sampling, uniforms, eos_ids, stops,
                                 pad_id, G, resume) for first in range(0, B, prompts_per_chunk)]
    finally:
        model.train(was_training)
        if device.type != "cpu":
            # The fast decoder's fused (bf16 under bf16-mixed) weight copy is the model's size again,
            # and the optimizer step that usually follows makes it stale: on a GPU it is freed now
            # rather than held through the update. On the CPU it is kept: the next call with the
            # same weights (evaluation's sets, refill rounds) reuses the packed layout.
            decoder_weights.release(model)
    completions, sampler_logprobs, logprobs, lengths, finished = (torch.cat(parts) for parts in zip(*pieces))
    width = int(lengths.max())
    mask = torch.arange(width, device=device).unsqueeze(0) < lengths.unsqueeze(1)  # (N, T)
    completions = completions[:, :width]
    prompt_width = max(len(ids) for ids in id_lists)
    prompt_ids, prompt_mask = _left_pad([ids for ids in id_lists for _ in range(G)], pad_id, prompt_width)
    texts = tokenizer.batch_decode([row[:length] for row, length in zip(completions.tolist(), lengths.tolist())],
                                   skip_special_tokens=True)
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    if stops is not None:
        texts = [stops.cut(text) if done else text for text, done in zip(texts, finished.tolist())]
    if session is not None:
        session._keep(resume, id_lists, completions, lengths, [i * G + g for i in indices for g in range(G)], G)
    elapsed = time.perf_counter() - started
    logger.debug("rollout: %d rows, %d tokens in %.2fs (%.1f tokens/s)", B * G, int(lengths.sum()), elapsed,
                int(lengths.sum()) / max(elapsed, 1e-9))
    return Rollout(
        prompt_ids=prompt_ids, prompt_attention_mask=prompt_mask, completion_ids=completions, mask=mask,
        sampler_logprobs=sampler_logprobs[:, :width] * mask, logprobs=logprobs[:, :width] * mask,
        finished=finished, truncated=~finished, texts=texts,
        prompt_index=torch.arange(B, device=device).repeat_interleave(G), group_size=G, sampling=sampling, pad_token_id=pad_id)


@dataclass
class _Kept:
    """A row's decoder state between two `Session.generate` calls."""

    ids: list[int]
    """Every token the row has read or sampled: its prompt, then its completion (the last one not yet in the cache)."""
    state: RowCache


@dataclass
class _Resume:
    """One `Session.generate` call's view of the session: what each prompt resumes, what its rows keep."""

    caches: list[_Kept | None]
    """Per prompt: the kept state whose ids begin its prompt; None: prefilled from scratch."""
    kept: dict[int, RowCache] = field(default_factory=dict)
    """Row (b * G + g of this call) -> its cache as the row ended."""
    resumed: int = 0
    """Prompts that read only their new tokens (the decoder could resume them)."""
    keep: bool = True
    """Export the rows as they end (False: no call follows)."""


class Session:
    """The built-in engine across the turns of a batch of episodes: `generate`, keeping each row's KV
    cache from one call to the next, so a turn reads only its new tokens (the observation) instead of
    re-prefilling the prompt and every earlier turn.

    A row is known by its place in the whole batch (`generate`'s `shard` / `draws`: the index its
    uniform numbers are drawn by). A call resumes a prompt from the state kept for its place when the
    ids kept there (the earlier prompt and what was sampled) begin the prompt; anything else (another
    place, other ids, group_size > 1, the generic decoder) is prefilled as `generate` does. What is
    sampled is `generate`'s (same seeds, same uniforms, same stops); the log-probs agree up to float
    rounding (the attention over a cache built in pieces sums in another order: tests/test_episode_cache.py).

    Each call keeps every row's cache as the row ends (on a stop or at max_new_tokens) and forgets what
    the previous call kept: memory is one turn's caches, at most the KV cache `generate` held anyway
    (the prompt that a group's G rows share is kept once and resumed shared: `LlamaDecoder.export`).
    """

    def __init__(self):
        self.kept: dict[int, _Kept] = {}
        """Row place (prompt index * G + g in the whole batch) -> its state after the last call."""
        self.resumed = 0
        """Prompts resumed from a kept cache so far (the tests read it)."""
        self.keep = True
        """Keep the rows of the next call; False: it is the last (an episode's last allowed turn), so
        its rows' caches are not copied out."""

    def generate(self, model, tokenizer, prompts, *, group_size: int = 1, sampling: SamplingConfig | None = None,
                 seed: int = 0, max_batch_size: int = 64, backend: str = "auto", add_special_tokens: bool = False,
                 shard: tuple[int, int] | None = None, draws: tuple[Sequence[int], int] | None = None) -> Rollout:
        """`generate`, same arguments and result; see the class docstring for what is kept."""
        return _generate(model, tokenizer, prompts, group_size=group_size, sampling=sampling, seed=seed,
                         max_batch_size=max_batch_size, backend=backend, add_special_tokens=add_special_tokens,
                         shard=shard, draws=draws, session=self)

    __call__ = generate

    def _resume(self, id_lists: list[list[int]], places: list[int], group_size: int) -> _Resume:
        """Match each prompt (its first row's place in `places`) with the state kept there."""
        caches = []
        for ids, place in zip(id_lists, places):
            kept = self.kept.get(place) if group_size == 1 else None
            caches.append(kept if kept is not None and ids[:len(kept.ids)] == kept.ids else None)
        self.kept = {}  # rows that did not come back have ended their episodes
        return _Resume(caches, keep=self.keep)

    def _keep(self, resume: _Resume, id_lists, completions: torch.Tensor, lengths: torch.Tensor, places: list[int],
              group_size: int) -> None:
        """Store the rows `resume.kept` exported with their ids. completions: (N, T); lengths: (N,)."""
        self.resumed += resume.resumed
        if resume.resumed:
            logger.debug("rollout: %d of %d prompts resumed from their kept cache", resume.resumed, len(id_lists))
        if not resume.kept:
            return
        lengths, completions = lengths.tolist(), completions.tolist()
        for row, state in resume.kept.items():
            ids = id_lists[row // group_size] + completions[row][:lengths[row]]
            self.kept[places[row]] = _Kept(ids, state)
