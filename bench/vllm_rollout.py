"""rollout.engine vllm against the built-in engine, and the weight sync, in one process.

Setting (issue 39): SmolLM2-135M-Instruct, float32, 16 chat prompts x G = 8 = 128 rows, 64 new tokens
each (EOS banned until then in both engines: `min_new_tokens=64` in ours, vLLM's `min_tokens` in
vLLM's request, so both produce exactly 128 x 64 tokens), temperature 1. Both engines run on the same
prompts, interleaved for `--rounds` rounds; each engine's best round is reported. vLLM is called
through posttrain's own backend (`VLLMEngine`'s requests, `to_rollout`), the built-in engine through
`generate`.

Weight sync: the policy's weights changed in place (as an optimizer step changes them), then
`VLLMEngine.sync` (the names and tensors of `hf_weights`, vLLM's in-place reload, the prefix cache
reset); the peer is the way round through the disk: `save_pretrained` of the policy, then vLLM's
reload from that directory. Also printed: the sampler-trainer mismatch on vLLM's tokens (the policy's
own fp32 log-probs of one round's rows against vLLM's).

Run in .venv-vllm (`make vllm-env`): .venv-vllm/bin/python bench/vllm_rollout.py [--rounds 3] [--model smollm2-135m]
Ends with: RESULT vllm_rollout: ours=<vLLM tokens/s> peer=<built-in tokens/s> unit=tokens/s ratio=R
           RESULT vllm_sync: ours=<sync s> peer=<save + reload from disk s> unit=s ratio=R
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
import time

import torch

from posttrain.algorithms import sampler_mismatch
from posttrain.data.tokenize import render_prompt
from posttrain.models.forward import completion_logprobs
from posttrain.models import load_model
from posttrain.rollout import SamplingConfig, generate
from posttrain.rollout.engine import stop_token_ids
from posttrain.rollout.vllm_backends import VLLMSettings
from posttrain.rollout.vllm_engine import VLLMEngine, request_seed, sampling_params, to_rollout

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child.",
    "List three prime numbers.", "Name a fruit that is red.", "What is 12 times 7?", "Describe a cat in one sentence.",
    "Why is the sky blue?", "Give me a synonym for happy.", "How many legs does a spider have?",
    "What is the boiling point of water?", "Translate 'hello' into French.", "What is a triangle?",
    "Name the largest planet.", "Suggest a name for a dog.", "What does a bee make?",
]


def vllm_round(engine: VLLMEngine, model, tokenizer, prompts, group_size: int, new_tokens: int, seed: int) -> tuple[float, int]:
    sampling = SamplingConfig(max_new_tokens=new_tokens)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    stops = stop_token_ids(model, tokenizer, sampling)
    params = [{**sampling_params(sampling, group_size, request_seed(seed, i), stops), "min_tokens": new_tokens} for i in range(len(ids))]
    started = time.perf_counter()
    rollout = to_rollout(ids, engine.backend.generate(ids, params), group_size, sampling, tokenizer, stops, torch.device("cpu"))
    return time.perf_counter() - started, int(rollout.mask.sum())


def builtin_round(model, tokenizer, prompts, group_size: int, new_tokens: int, seed: int) -> tuple[float, int]:
    sampling = SamplingConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    started = time.perf_counter()
    rollout = generate(model, tokenizer, prompts, group_size=group_size, sampling=sampling, seed=seed)
    return time.perf_counter() - started, int(rollout.mask.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    model.eval()
    prompts = [render_prompt(tokenizer, q) for q in (QUESTIONS * 4)[:args.prompts]]
    engine = VLLMEngine(VLLMSettings(kv_cache_gb=2.0, max_model_len=512))
    started = time.perf_counter()
    engine(model, tokenizer, prompts[:1], sampling=SamplingConfig(greedy=True, max_new_tokens=2))  # load + warm up
    load_s = time.perf_counter() - started
    generate(model, tokenizer, prompts[:1], sampling=SamplingConfig(greedy=True, max_new_tokens=2))  # pack the weights

    results = {"vllm": [], "builtin": []}
    for round_ in range(args.rounds):
        seconds, tokens = vllm_round(engine, model, tokenizer, prompts, args.group_size, args.new_tokens, round_)
        results["vllm"].append(tokens / seconds)
        seconds, tokens = builtin_round(model, tokenizer, prompts, args.group_size, args.new_tokens, round_)
        results["builtin"].append(tokens / seconds)
        print(f"round {round_ + 1}: vllm {results['vllm'][-1]:.1f} tokens/s, builtin {results['builtin'][-1]:.1f} tokens/s", flush=True)

    # The sampler-trainer mismatch on vLLM's tokens: the policy's own log-probs of one round's rows
    # (the training forward, fp32) against vLLM's, over every completion token.
    sampling = SamplingConfig(max_new_tokens=args.new_tokens)
    rollout = engine(model, tokenizer, prompts, group_size=args.group_size, sampling=sampling, seed=99)
    with torch.no_grad():
        ours = completion_logprobs(model, rollout, rollout.forward_inputs(), sampling.temperature, 16)
    mismatch = sampler_mismatch(ours, rollout.logprobs, rollout.mask)

    syncs, disk = [], []
    runner = engine.backend.llm.llm_engine.model_executor.driver_worker.worker.model_runner
    for _ in range(args.rounds):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1e-4)  # an in-place change, as an optimizer step makes
        syncs.append(engine.sync(model))
        with tempfile.TemporaryDirectory() as directory:
            started = time.perf_counter()
            model.save_pretrained(directory)
            runner.reload_weights(weights_path=directory)
            disk.append(time.perf_counter() - started)

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, {datetime.date.today()}")
    print(f"{args.model}: {args.prompts} prompts x {args.group_size} x {args.new_tokens} tokens; vLLM load + warm-up {load_s:.1f} s")
    best = {name: max(values) for name, values in results.items()}
    print(f"tokens/s best of {args.rounds}: vllm {best['vllm']:.1f}, builtin {best['builtin']:.1f}")
    print(f"weight sync: {min(syncs):.3f} s (in place), save + reload from disk {min(disk):.3f} s")
    print(f"mismatch |trainer - vLLM| log-prob over {int(rollout.mask.sum())} tokens: mean {float(mismatch['logprob_abs_mean']):.2e}, "
          f"max {float(mismatch['logprob_abs_max']):.2e}, largest sequence ratio {float(mismatch['seq_ratio_max']):.6f}")
    print(f"RESULT vllm_rollout: ours={best['vllm']:.1f} peer={best['builtin']:.1f} unit=tokens/s ratio={best['vllm'] / best['builtin']:.2f}")
    print(f"RESULT vllm_sync: ours={min(syncs):.3f} peer={min(disk):.3f} unit=s ratio={min(disk) / min(syncs):.2f}")


if __name__ == "__main__":
    main()
