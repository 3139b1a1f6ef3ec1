"""Tool episodes: what a tool turn costs, and the python tool's calls per second.

1. Episode overhead. The built-in tiny model, B = 8 prompts x G = 4 rows. An episode batch
   (`rollout.episodes.EpisodeSampler`, the library's own sampler): turn 1 generates `--turn-tokens`
   tokens per row (EOS banned until then, so every row has the same length), every row calls the
   `python` tool (the bubblewrap sandbox: a real round trip per row), the result is appended as
   observation tokens, and turn 2 generates `--turn-tokens` more: through one `engine.Session`, each
   row's KV cache continued from turn 1 (turn 2 reads only the observation), and, beside it, with
   `continue_cache` off (re-prefilling prompt + turn 1 + observation, as before the session). The
   random tiny model writes no tool call, so turn 1's TEXT (never its ids) is replaced by a fixed
   call before the sampler parses it: the tokens, the tool run and the re-prefill are all real.
   Beside it, the floor: one `generate` call producing the same 2 x `--turn-tokens` generated tokens
   per row in a single turn. ratio = floor / episode (1.0: tool turns cost nothing), for the
   continued episode; the bench also prints the bound the token counts set on it (the episode runs
   each row's observation tokens through the model, the floor has none). Twice: with the bench's
   short prompts (the chat template around "i+2i=", ~23 tokens) and, as a run with
   `tools.describe auto` renders them (`data.tokenize.render_prompt(tools=)`), with the python
   tool's schema in a system message
   (~625 tokens: there the prompt is most of each row's context, and the G rows of a prompt share it).
2. The python tool's calls/s (`rollout.tools.python_tool_rate`: a batch of `--calls` programs through
   the worker pool's sandbox slots) vs the unsandboxed way peers run a tool's code: a fresh
   `python -c` subprocess per call, `--workers` at a time.

Usage: .venv/bin/python bench/episodes.py [--turn-tokens 32] [--calls 64] [--rounds 3]
Ends with: RESULT episode_overhead: ... (the continued cache, short prompts), RESULT episode_overhead_described:
... (prompts with the tool's schema) and RESULT python_tool: ... (R > 1: ours is faster).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import os
import platform
import subprocess
import sys
import time

import torch

from posttrain.data.tokenize import render_prompt
from posttrain.models.tiny import build_tiny_model
from posttrain.rollout import SamplingConfig, generate
from posttrain.rollout.engine import Session
from posttrain.rollout.episodes import EpisodeSampler, ToolSettings
from posttrain.rollout.tools import python_tool_rate, resolve_tools

CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(sum(range(100)))"}}</tool_call>'
CODE = "print(sum(range(1000)))"


def first_turn_calls(turn: list[int], draw=generate):
    """`draw` (`generate` or a `Session`) whose turn-1 texts say CALL and count as finished (ids and
    log-probs untouched: the EOS is banned so every row has the same length); later turns as sampled."""

    def wrapped(*args, **kwargs):
        if isinstance(draw, Session):
            draw.keep = turn[0] == 0  # as the sampler's own session: turn 2 is the last (max_turns 2)
        rollout = draw(*args, **kwargs)
        turn[0] += 1
        if turn[0] > 1:
            return rollout
        done = torch.ones_like(rollout.finished)
        return dataclasses.replace(rollout, texts=[CALL] * len(rollout.texts), finished=done, truncated=~done)

    return wrapped


def episode_seconds(model, tokenizer, prompts, group_size, sampling, rounds, continue_cache) -> tuple[float, dict]:
    """Best wall seconds of one episode batch, and the last batch's episode counts."""
    best, counts = float("inf"), {}
    toolbox = resolve_tools(["python"])
    for _ in range(rounds + 1):  # the first round starts the sandbox slots and packs the weights
        turn = [0]
        draw = Session() if continue_cache else generate  # one session per episode batch, as the sampler's own
        sampler = EpisodeSampler(tokenizer, toolbox, ToolSettings(names=["python"], max_turns=2), generate_fn=first_turn_calls(turn, draw))
        started = time.perf_counter()
        rollout = sampler(model, tokenizer, [None] * len(prompts), prompts, group_size=group_size, sampling=sampling, seed=1)
        elapsed = time.perf_counter() - started
        best = min(best, elapsed) if turn[0] else best
        counts = {"turns": sum(e["turns"] for e in rollout.episodes), "calls": sum(e["tool_calls"] for e in rollout.episodes),
                  "observation_tokens": sum(e["observation_tokens"] for e in rollout.episodes),
                  "generated": int(rollout.mask.sum())}
    return best, counts


def single_turn_seconds(model, tokenizer, prompts, group_size, sampling, rounds) -> float:
    best = float("inf")
    for _ in range(rounds + 1):
        started = time.perf_counter()
        generate(model, tokenizer, prompts, group_size=group_size, sampling=sampling, seed=1)
        best = min(best, time.perf_counter() - started)
    return best


def subprocess_rate(calls: int, workers: int) -> float:
    """Calls/s of a fresh unsandboxed `python -c CODE` per call, `workers` at a time."""
    def one(_):
        return subprocess.run([sys.executable, "-c", CODE], capture_output=True, timeout=30).returncode

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, range(workers)))  # warm the page cache
        started = time.perf_counter()
        codes = list(pool.map(one, range(calls)))
    assert all(code == 0 for code in codes)
    return calls / (time.perf_counter() - started)


def episode_overhead(name, model, tokenizer, prompts, args) -> None:
    """Time the episode batch (KV cache continued, and re-prefilled) and the single-turn floor; print the RESULT line."""
    turn = SamplingConfig(max_new_tokens=args.turn_tokens, min_new_tokens=args.turn_tokens, temperature=1.0)
    whole = dataclasses.replace(turn, max_new_tokens=2 * args.turn_tokens, min_new_tokens=2 * args.turn_tokens)
    episode, counts = episode_seconds(model, tokenizer, prompts, args.group_size, turn, args.rounds, continue_cache=True)
    prefilled, _ = episode_seconds(model, tokenizer, prompts, args.group_size, turn, args.rounds, continue_cache=False)
    floor = single_turn_seconds(model, tokenizer, prompts, args.group_size, whole, args.rounds)
    rows = args.prompts * args.group_size
    # Token positions through the model (a group's G rows share their prompt's prefill; a row's last
    # sampled token is never fed back): the floor's are a lower bound on what the episode can cost.
    prompt_positions = sum(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    floor_positions = prompt_positions + rows * (2 * args.turn_tokens - 1)
    episode_positions = prompt_positions + counts["generated"] - rows + counts["observation_tokens"]
    print(f"token positions through the model: episode {episode_positions}, single turn {floor_positions}; at the same cost "
          f"a position (attention aside) the ratio is at most {floor_positions / episode_positions:.2f}")
    print(f"episode batch: {rows} rows, {counts['turns']} turns, {counts['calls']} python calls, {counts['generated']} generated "
          f"+ {counts['observation_tokens']} observation tokens: best {episode:.3f} s (KV cache continued), "
          f"{prefilled:.3f} s (turn 2 re-prefilled, ratio {floor / prefilled:.2f})")
    print(f"single turn, the same {rows} x {2 * args.turn_tokens} generated tokens: best {floor:.3f} s")
    print(f"RESULT {name}: ours={episode:.3f} peer={floor:.3f} unit=s ratio={floor / episode:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{datetime.date.today()} {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, load {os.getloadavg()[0]:.1f}")
    model, tokenizer = build_tiny_model()
    schemas = resolve_tools(["python"]).schemas()
    for name, tools in (("episode_overhead", None), ("episode_overhead_described", schemas)):
        prompts = [render_prompt(tokenizer, f"{i}+{2 * i}=", tools=tools) for i in range(args.prompts)]
        print(f"{name}: prompts of {min(len(tokenizer(p, add_special_tokens=False)['input_ids']) for p in prompts)}+ tokens"
              f"{' (the python tool described)' if tools else ''}")
        episode_overhead(name, model, tokenizer, prompts, args)
    ours = python_tool_rate(args.calls, code=CODE, workers=args.workers)
    peer = subprocess_rate(args.calls, args.workers)
    print(f"python tool, {args.calls} calls, {args.workers} workers: sandboxed {ours:.1f} calls/s, fresh unsandboxed subprocess {peer:.1f} calls/s")
    print(f"RESULT python_tool: ours={ours:.1f} peer={peer:.1f} unit=calls/s ratio={ours / peer:.2f}")


if __name__ == "__main__":
    main()
