"""Rollout throughput: posttrain.rollout.generate vs transformers' model.generate, and the FLOP floor.

Setting (issue 5): SmolLM2-135M-Instruct, float32 on CPU, 4 chat prompts x G=4 = 16 sequences, 64 new
tokens each (EOS banned until then, `min_new_tokens=64`, in both engines, so both produce exactly
16 x 64 tokens), temperature 1, no top-k / top-p. Both engines run in this one process on the same
prompts, interleaved for `--rounds` rounds; each engine's best round is reported (the machine is
shared, so the best round is the one least disturbed by other processes; medians are printed too).

FLOP floor: the forward FLOPs the task needs (each distinct prompt once, then one position per new
token except the first, which comes from the prompt's last position), counted as 2 x the matmul
parameters touched per position (attention and MLP projections; the LM head where logits are needed)
plus 4 x heads x head_dim x context for attention scores and values, divided by this machine's float32
matmul rate, measured here with a large square matmul. "x floor" = measured time / floor time.

Our engine prepacks the weights for oneDNN once per weights version (in RL: once per optimizer
step); the warm-up call does it here, and its cost is printed separately ("weight packing").

Usage: .venv/bin/python bench/rollout.py [--rounds 3] [--new-tokens 64] [--group-size 4] [--model smollm2-135m]
Ends with one line: RESULT rollout: ours=X peer=Y unit=tokens/s ratio=R
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

import torch

from posttrain.models import load_model
from posttrain.rollout import SamplingConfig, generate
from posttrain.rollout import decoder_weights

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "List three prime numbers.",
]


def matmul_rate(size: int = 2048, repeats: int = 10, rounds: int = 5) -> float:
    """Best float32 FLOP/s of an (size x size) @ (size x size) matmul on this machine."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = min(best, (time.perf_counter() - started) / repeats)
    return 2 * size ** 3 / best


def floor_flops(model, prompt_lengths: list[int], group_size: int, new_tokens: int) -> float:
    """Forward FLOPs the task needs: prompts once each, then N x (new_tokens - 1) decode positions."""
    config = model.config
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    body = sum(m.weight.numel() for name, m in model.model.layers.named_modules()
               if isinstance(m, torch.nn.Linear))  # q, k, v, o, gate, up, down of every layer
    head = model.get_output_embeddings().weight.numel()

    def position(context: int, logits: bool) -> float:
        return 2 * body + 4 * layers * heads * head_dim * context + (2 * head if logits else 0)

    total = 0.0
    for length in prompt_lengths:
        total += sum(position(t + 1, logits=t == length - 1) for t in range(length))
        for step in range(1, new_tokens):
            total += group_size * position(length + step, logits=True)
    return total


def matmul_step_seconds(model, rows: int, repeats: int = 20) -> float:
    """Seconds of one decode step's weight matmuls alone, as our decoder runs them (oneDNN-packed,
    fused post-ops, every layer's own weights, so they stream from memory as in a real step): the
    part of a step no attention or elementwise work is in. Best of 3 rounds of ``repeats`` steps."""
    layers, lm_head = decoder_weights.build_layers(model, batch_hint=rows)
    hidden = model.config.hidden_size
    x = torch.randn(rows, hidden)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    attn = torch.randn(rows, config.num_attention_heads * head_dim)
    swiglu = torch.randn(rows, config.intermediate_size)

    def step():
        for layer in layers:
            layer.qkv(x)
            layer.o.plus(attn, x)
            layer.gate_up(x)
            layer.down.plus(swiglu, x)
        lm_head(x)

    best = float("inf")
    with torch.inference_mode():
        step()
        for _ in range(3):
            started = time.perf_counter()
            for _ in range(repeats):
                step()
            best = min(best, (time.perf_counter() - started) / repeats)
    return best


def run_ours(model, tokenizer, prompts, group_size, new_tokens):
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    started = time.perf_counter()
    rollout = generate(model, tokenizer, prompts, group_size=group_size, sampling=sampling, seed=0)
    return time.perf_counter() - started, int(rollout.mask.sum())


def run_peer(model, tokenizer, prompts, group_size, new_tokens):
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             num_return_sequences=group_size, pad_token_id=tokenizer.pad_token_id)
    elapsed = time.perf_counter() - started
    return elapsed, int(out.shape[0] * (out.shape[1] - batch["input_ids"].shape[1]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--model", default="smollm2-135m", help="the issue's model; 'tiny' for a smoke run")
    args = parser.parse_args()

    model, tokenizer = load_model(args.model)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in QUESTIONS]
    lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    G, T = args.group_size, args.new_tokens
    rate = matmul_rate()
    floor_seconds = floor_flops(model, lengths, G, T) / rate

    started = time.perf_counter()
    run_ours(model, tokenizer, prompts[:1], 1, 4)  # warm-up: weight packing, oneDNN kernels
    warm_up = time.perf_counter() - started
    run_peer(model, tokenizer, prompts[:1], 1, 4)
    started = time.perf_counter()
    decoder_weights.PACKED.clear()
    decoder_weights.build_layers(model, batch_hint=len(prompts) * args.group_size)
    packing = time.perf_counter() - started
    matmuls = matmul_step_seconds(model, len(prompts) * G)
    times = {"ours": [], "peer": []}
    for _ in range(args.rounds):
        for name, run in (("ours", run_ours), ("peer", run_peer)):
            seconds, tokens = run(model, tokenizer, prompts, G, T)
            assert tokens == len(prompts) * G * T, (name, tokens)
            times[name].append(seconds)
    tokens = len(prompts) * G * T
    ours, peer = min(times["ours"]), min(times["peer"])

    print(f"rollout benchmark  {datetime.datetime.now():%Y-%m-%d %H:%M}  {platform.processor() or platform.machine()}"
          f"  torch {torch.__version__}  threads {torch.get_num_threads()}  load avg {os.getloadavg()[0]:.2f}")
    print(f"{args.model} float32, {len(prompts)} prompts x G={G}, {T} new tokens, temperature 1; "
          f"best of {args.rounds} rounds; matmul rate {rate / 1e9:.0f} GFLOP/s (2048^3 fp32)")
    print("| engine | best s | median s | tokens/s | vs generate | x FLOP floor |")
    print("|---|---|---|---|---|---|")
    for label, name in (("transformers model.generate", "peer"), ("posttrain.rollout.generate", "ours")):
        best, median = min(times[name]), statistics.median(times[name])
        print(f"| {label} | {best:.2f} | {median:.2f} | {tokens / best:.1f} | {peer / best:.2f}x | "
              f"{best / floor_seconds:.2f} |")
    print(f"| FLOP floor | {floor_seconds:.2f} | | {tokens / floor_seconds:.1f} | {peer / floor_seconds:.2f}x | 1.00 |")
    ceiling = (T - 1) * matmuls
    print(f"weight matmuls alone: {matmuls * 1000:.1f} ms per decode step of {len(prompts) * G} rows, "
          f"{ceiling:.2f} s for the {T - 1} decode steps; even if everything else (prefill, attention, norms, "
          f"sampling) took no time, ours could be at most {peer / ceiling:.2f}x generate")
    print(f"weight packing (once per weights version, not in the times above): {packing:.2f} s; "
          f"first call including it: {warm_up:.2f} s")
    print(f"RESULT rollout: ours={tokens / ours:.1f} peer={tokens / peer:.1f} unit=tokens/s ratio={peer / ours:.2f}")


if __name__ == "__main__":
    main()
