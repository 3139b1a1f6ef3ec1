"""OPTIONAL vLLM backend (GPU only). NOT TESTED in this project's CI: there is no GPU and no vllm here.

Used only through ``generate(llm, tokenizer, prompts, backend="vllm")`` where ``llm`` is a
``vllm.LLM``; the built-in engine stays the default and the reference. Differences from the built-in
engine, by design of vLLM rather than of this module:

* vLLM returns one log-prob per sampled token. Create the engine with
  ``LLM(..., logprobs_mode="processed_logprobs")`` so that it is the sampler's (after temperature and
  top-k / top-p); it fills ``sampler_logprobs``. ``logprobs`` (temperature only) is filled with the
  same values only when nothing truncates the distribution and is NaN otherwise: recompute it with the
  policy's forward, as a training step does anyway.
* Seeds are vLLM's per-request seeds: deterministic for vLLM, not token-identical to the built-in engine.
* The policy's weights live in the vLLM engine: syncing them after each optimizer step is the
  caller's job (for example ``llm.llm_engine.model_executor`` weight loading, version-dependent).
"""

from __future__ import annotations

import importlib.util

import torch

from posttrain.errors import UserError
from posttrain.rollout.batch import Rollout
from posttrain.rollout.sampling import SamplingConfig


def vllm_available() -> bool:
    """True when vllm is importable and a CUDA device is present."""
    return importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


def generate_vllm(llm, tokenizer, id_lists: list[list[int]], *, group_size: int, sampling: SamplingConfig,
                  seed: int, pad_id: int) -> Rollout:
    """Sample with a ``vllm.LLM``; same ``Rollout`` layout as the built-in engine (rows b*G + g)."""
    if not vllm_available():
        raise UserError("backend 'vllm' needs the vllm package and a CUDA GPU")
    from vllm import SamplingParams  # noqa: PLC0415 (optional dependency)

    params = SamplingParams(
        n=group_size, temperature=0.0 if sampling.greedy else sampling.temperature, top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else -1, max_tokens=sampling.max_new_tokens,
        min_tokens=sampling.min_new_tokens, stop=list(sampling.stop_strings) or None,
        stop_token_ids=list(sampling.stop_token_ids) or None, include_stop_str_in_output=True,
        logprobs=0, seed=seed)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in id_lists], params)
    rows = [completion for request in outputs for completion in request.outputs]  # group-contiguous
    N, T = len(rows), max(len(row.token_ids) for row in rows)
    completions = torch.full((N, T), pad_id, dtype=torch.long)
    sampler_logprobs = torch.zeros(N, T)
    for index, row in enumerate(rows):
        completions[index, :len(row.token_ids)] = torch.tensor(row.token_ids, dtype=torch.long)
        picked = [step[token].logprob for step, token in zip(row.logprobs, row.token_ids)]
        sampler_logprobs[index, :len(picked)] = torch.tensor(picked)
    lengths = torch.tensor([len(row.token_ids) for row in rows])
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    finished = torch.tensor([row.finish_reason == "stop" for row in rows])
    plain = sampler_logprobs if not sampling.truncates else torch.full((N, T), float("nan"))
    width = max(len(ids) for ids in id_lists)
    prompt_ids = torch.full((N, width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((N, width), dtype=torch.bool)
    for index in range(N):
        ids = id_lists[index // group_size]
        prompt_ids[index, width - len(ids):] = torch.tensor(ids)
        prompt_mask[index, width - len(ids):] = True
    return Rollout(
        prompt_ids=prompt_ids, prompt_attention_mask=prompt_mask, completion_ids=completions, mask=mask,
        sampler_logprobs=sampler_logprobs * mask, logprobs=torch.where(mask, plain, 0.0), finished=finished, truncated=~finished,
        texts=[row.text for row in rows], prompt_index=torch.arange(len(id_lists)).repeat_interleave(group_size),
        group_size=group_size, sampling=sampling, pad_token_id=pad_id)
