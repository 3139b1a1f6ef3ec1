"""Where a reward-model step's time goes: bench/rm.py's setting (same pairs, same seeded order, the
same exported start for TRL's model), each step split into phases (encode, forward, backward, clip,
optimizer, zero_grad), in wall and CPU seconds, for our step under three layouts of the pairs and
for the model TRL trains (AutoModelForSequenceClassification on TRL's right-padded (2M, L) batch),
the steps interleaved so that a shared machine's load falls on all alike. `positions` is how many
token positions the decoder ran per step (what the matmuls scale with).

Layouts of ours (`models.reward_model.batch_rewards` and the paths it falls back to):
  packed: one row a pair, [common prefix | chosen's own | rejected's own] under a 4D mask (the default)
  cache:  each pair's common prefix (prompt + the response tokens both answers begin with) once, through a shared KV cache
  prompt: each pair's prompt once through the shared KV cache (the layout before the common prefix)
  plain:  the (2M, L) right-padded rows, as TRL

    .venv/bin/python bench/rm_phases.py [--steps 3] [--layouts packed,prompt] [--trl] [--ops] [--model smollm2-135m]

Each side holds a model and its AdamW state (~2.2 GB for SmolLM2-135M): four at once need ~10 GB.

`--ops`: a torch.profiler table of the last step of each (the top operators by self CPU time).
Not a benchmark with a RESULT line: bench/rm.py is the number; this says why.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from posttrain.algorithms.reward_model import bradley_terry_loss
from posttrain.config import build_config
from posttrain.data.stream import data_order
from posttrain.models.packing import common_prefix_lengths
from posttrain.models.reward_model import batch_rewards, export, shared_prompt_rewards
from posttrain.recipes import rm
from posttrain.runs.skeleton import start

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rm import BATCH, LR, make_pairs, rm_overrides  # noqa: E402  bench/rm.py's setting

PHASES = ("encode", "forward", "backward", "clip", "optimizer", "zero_grad")


def cache_layout(model, batch, common_prefix: bool = True):
    """Each pair's common prefix (or, with `common_prefix` False, its prompt: the layout before)
    once through the shared KV cache (`shared_prompt_rewards`), the right-padded rows of one width."""
    cat = lambda name: torch.cat([getattr(batch.chosen, name), getattr(batch.rejected, name)])  # noqa: E731
    ids, attention, own = cat("input_ids"), cat("attention_mask"), cat("mask")
    if common_prefix:
        n = ids.shape[0] // 2
        shared = common_prefix_lengths(ids[:n], attention[:n], ids[n:], attention[n:]).repeat(2)
        own = attention.bool() & (attention.long().cumsum(-1) > shared[:, None])
    rewards = shared_prompt_rewards(model, ids, attention, own)
    n = rewards.shape[0] // 2
    return rewards[:n], rewards[n:]


class Side:
    """One trainer of the comparison: a model, its optimizer and a function (step number) -> (2M,) rewards."""

    def __init__(self, name, model, optimizer, rewards, decoder):
        self.name, self.model, self.optimizer, self.rewards = name, model, optimizer, rewards
        self.wall = {phase: [] for phase in PHASES}
        self.cpu = {phase: [] for phase in PHASES}
        self.positions, self.losses = [], []
        decoder.register_forward_pre_hook(self.count, with_kwargs=True)

    def count(self, module, args, kwargs):
        self.positions[-1] += (kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]).numel()

    def step(self, done: int, profile: bool = False):
        self.positions.append(0)
        marks = [(time.perf_counter(), time.process_time())]

        def mark():
            marks.append((time.perf_counter(), time.process_time()))

        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
        if profiler:
            profiler.__enter__()
        inputs = self.rewards.encode(done)
        mark()
        rewards = self.rewards(inputs)
        loss = bradley_terry_loss(rewards[:BATCH], rewards[BATCH:]).mean()
        mark()
        loss.backward()
        mark()
        torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.grad is not None], 1.0)
        mark()
        self.optimizer.step()
        mark()
        self.optimizer.zero_grad(set_to_none=True)
        mark()
        if profiler:
            profiler.__exit__(None, None, None)
            print(f"--- {self.name}, step {done}: top operators by self CPU time")
            print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
        for index, phase in enumerate(PHASES):
            self.wall[phase].append(marks[index + 1][0] - marks[index][0])
            self.cpu[phase].append(marks[index + 1][1] - marks[index][1])
        self.losses.append(float(loss.detach()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per side; the median of those after the first is reported")
    parser.add_argument("--layouts", default="packed,prompt")
    parser.add_argument("--trl", action="store_true", help="also the model TRL trains, on TRL's padded batch")
    parser.add_argument("--ops", action="store_true")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    workdir = Path(tempfile.mkdtemp())
    pairs = make_pairs(BATCH * arguments.steps)
    (workdir / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in pairs))
    config = build_config(rm.Config, None, rm_overrides(arguments.model, str(workdir / "pairs.jsonl"), arguments.steps))
    sides = []
    for layout in arguments.layouts.split(","):
        placement, world = start(config)
        state = rm.setup(config, world, placement)
        rm.build_trainer(state)
        state.model.train()
        if not sides:
            export(state.model, state.tokenizer, workdir / "rm", {})  # TRL's start: the same weights
        function = {"packed": batch_rewards, "cache": cache_layout, "prompt": lambda model, batch: cache_layout(model, batch, False),
                    "plain": lambda model, batch: batch_rewards(model, batch, shared_prompt=False)}[layout]

        def ours(batch, state=state, function=function):
            chosen, rejected = function(state.model, batch)
            return torch.cat([chosen, rejected])

        ours.encode = lambda done, state=state: state.encode([state.train[i] for i in data_order(len(state.train), config.seed,
                                                                                                  (done - 1) * BATCH, BATCH)])
        sides.append(Side(f"ours ({layout})", state.model, state.optimizer, ours, state.model.decoder))
    if arguments.trl:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        model = AutoModelForSequenceClassification.from_pretrained(workdir / "rm", dtype=torch.float32, local_files_only=True).train()
        tokenizer = AutoTokenizer.from_pretrained(workdir / "rm", local_files_only=True)
        by_id = {row["id"]: row for row in pairs}

        def trl(inputs, model=model):
            return model(**inputs).logits.squeeze(-1)

        def trl_encode(done):  # TRL's collator: prompt + response + EOS as one string, right-padded to the longest
            order = data_order(len(pairs), config.seed, (done - 1) * BATCH, BATCH)
            rows = [by_id[f"p{i}"] for i in order]
            texts = [r["prompt"] + r["chosen"] + tokenizer.eos_token for r in rows] + [r["prompt"] + r["rejected"] + tokenizer.eos_token for r in rows]
            return tokenizer(texts, padding=True, return_tensors="pt")

        trl.encode = trl_encode
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
        sides.append(Side("TRL's model", model, optimizer, trl, model.model))
    for done in range(1, arguments.steps + 1):
        for side in sides if done % 2 else sides[::-1]:
            side.step(done, profile=arguments.ops and done == arguments.steps)
    timed = slice(1, None) if arguments.steps > 1 else slice(None)
    print(f"median of steps 2-{arguments.steps}, seconds wall (CPU); {arguments.threads} torch thread(s)")
    print(f"{'side':<16} {'positions':>9} " + " ".join(f"{phase:>15}" for phase in PHASES) + f" {'step':>15}  first loss")
    for side in sides:
        cells = [f"{statistics.median(side.wall[p][timed]):.3f} ({statistics.median(side.cpu[p][timed]):.3f})" for p in PHASES]
        wall = statistics.median([sum(side.wall[p][i] for p in PHASES) for i in range(arguments.steps)][timed])
        cpu = statistics.median([sum(side.cpu[p][i] for p in PHASES) for i in range(arguments.steps)][timed])
        print(f"{side.name:<16} {statistics.median(side.positions):>9.0f} " + " ".join(f"{c:>15}" for c in cells)
              + f" {f'{wall:.3f} ({cpu:.3f})':>15}  {side.losses[0]:.7f}")


if __name__ == "__main__":
    main()
