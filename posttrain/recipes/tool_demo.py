"""`posttrain demo --tools`: a tool lets the tiny model solve what it could not.

The demo's SFT model learned 2-digit addition as a format, not as addition: it scores 0 on 3-digit
sums. Give it a calculator (the `add` tool, `rollout/tools.py`):

1. the SFT start (the demo's: SFT from scratch to partial competence, or `--sft-run DIR`);
2. SFT on tool transcripts (`tool_transcripts`: the user's sum, the assistant's call of `add`, the
   tool's result, the answer), 2- and 3-digit sums from the training splits, never a held-out one;
3. GRPO with the tool (tool episodes, `rollout/episodes.py`) on 2- and 3-digit sums, the program
   reward `exact` on the last assistant turn;
4. held-out acceptance, the same `integer` checker and sets as the main demo (in distribution:
   2-digit; `digits_3`), for the start without the tool and for both tool stages with it, paired
   intervals against the start; `report.md`, `summary.json` and a plot.

Stage settings are tiny-sft.yaml / tiny-grpo.yaml plus the overrides below (`TOOL_SFT`, `TOOL_GRPO`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from posttrain.atomic import write_text_atomically
from posttrain.data import load_splits
from posttrain.data.examples import Example
from posttrain.evaluation.acceptance import IN_DISTRIBUTION, evaluate_task
from posttrain.evaluation.stats import paired_difference_ci
from posttrain.models import load_model
from posttrain.recipes import online, online_config, sft, stages
from posttrain.rollout.episodes import EpisodeSampler, ToolSettings
from posttrain.rollout.tools import resolve_tools

TOOLS = ToolSettings(names=["add"], max_turns=3, max_observation_tokens=64, describe="none")
"""The episodes of the GRPO stage and of acceptance: the `add` tool, at most 3 model turns. The
tiny model learns the tool from the transcripts, told nothing in its prompts (`describe: none`, and
no `data.tools` in its SFT): its template ignores tools=, and the Hermes description would be 600
characters of its tokenizer in front of every 7-character sum."""
TURN_TOKENS = 96
"""Tokens per turn: a call of `add` on two 3-digit numbers is 66 characters of the tiny tokenizer."""
HELD_ROWS = 64
"""Rows of the transcripts (and of the prompts) that the tool stages' own held-out splits keep apart
(an eighth of them when there are fewer than 512)."""
SETS = (IN_DISTRIBUTION, "digits_3")
"""The held-out sets compared (the main demo's, scored by the same `integer` checker)."""

TOOL_SFT = stages.Stage("tool_sft", sft.Config, "tiny-sft", "tool_sft_steps", starts_from="sft", overrides={
    "data": {"task_options": {}, "train_size": None, "loss_on": "assistant"},
    "batch_size": 16, "micro_batch_size": 16,
    "optim": {"lr": 1.0e-3, "warmup_steps": 10, "schedule": "constant"},
    "acceptance": {"eval_every": 0, "sets": []},
})
"""SFT on the transcripts file (given where it is built), from the demo's SFT start."""
TOOL_GRPO = stages.Stage("tool_grpo", online_config.grpo_config, "tiny-grpo", "tool_grpo_steps", starts_from="tool_sft", overrides={
    "tools": {"names": TOOLS.names, "max_turns": TOOLS.max_turns, "max_observation_tokens": TOOLS.max_observation_tokens,
              "describe": TOOLS.describe},
    "sampling": {"max_new_tokens": TURN_TOKENS},
    "data": {"task_options": {}, "prompts_per_step": 8},
    "acceptance": {"eval_every": 0, "sets": [], "max_new_tokens": TURN_TOKENS},
})
"""GRPO with the tool on the 2- and 3-digit prompts file (given where it is built)."""


def tool_transcripts(examples: list[Example]) -> list[dict[str, Any]]:
    """One SFT row per sum "a+b=": the user's prompt, the assistant's call of add(a, b), the tool's
    result and the answer `<answer>a+b</answer>` (the transformers chat format)."""
    rows = []
    for example in examples:
        a, b = (int(part) for part in example.prompt.removesuffix("=").split("+"))
        rows.append({"id": example.id, "messages": [
            {"role": "user", "content": example.prompt},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}]},
            {"role": "tool", "name": "add", "content": str(a + b)},
            {"role": "assistant", "content": f"<answer>{a + b}</answer>"},
        ]})
    return rows


def training_sums(seed: int, size: int, held_out: set[str]) -> list[Example]:
    """`size` training sums, half 2-digit and half 3-digit, from the arithmetic task's training
    splits, none of them a held-out prompt, interleaved."""
    halves = []
    for digits in (2, 3):
        train, _ = load_splits("arithmetic", train_size=size, eval_size=1, seed=seed + digits, options={"digits": digits})
        halves.append([dataclasses.replace(e, id=f"digits{digits}-{e.id}") for e in train.examples if e.prompt not in held_out][: size // 2])
    return [e for pair in zip(*halves) for e in pair]


def run(config: Any, out: Path, started: float, timings: dict[str, float] | None = None) -> Path:
    """The tool demo into `out` (made empty by the caller, or holding a stopped tool demo with the same settings, whose
    finished stages are kept: `stages.run_stage`); returns it. `timings`: the wall seconds an earlier, stopped run spent."""
    timings = {} if timings is None else timings
    held_out_size = {"data": {"eval_size": config.eval_size}}
    with stages.timed(timings, "sft"):
        sft_config = stages.stage_config(stages.SFT, config, {}, held_out_size)
        sft_dir = Path(config.sft_run) if config.sft_run else stages.train_sft(config, held_out_size)
        starts = {"sft": stages.last_checkpoint(sft_dir, stages.newest_step(sft_dir))}
    data = sft_config.data
    torch.set_num_threads(config.tool_threads)  # after the SFT start, which runs as the main demo's does
    sets = {name: task for name, task in stages.heldout_sets(data.task, data.task_options, config.seed, config.eval_size).items()
            if name in SETS}
    sets = {name: dataclasses.replace(task, examples=task.examples[:config.tool_eval_size]) for name, task in sets.items()}
    held_prompts = {e.prompt for task in sets.values() for e in task.examples}

    sums = training_sums(config.seed, 2 * config.tool_transcripts, held_prompts)
    transcripts, prompts = out / "transcripts.jsonl", out / "prompts.jsonl"
    write_text_atomically(transcripts, "".join(json.dumps(row) + "\n" for row in tool_transcripts(sums[: config.tool_transcripts])))
    write_text_atomically(prompts, "".join(json.dumps({"id": e.id, "prompt": e.prompt, "answer": e.answer}) + "\n"
                                           for e in sums[config.tool_transcripts:]))

    run_dirs = {"sft": sft_dir}
    held = min(HELD_ROWS, max(1, config.tool_transcripts // 8))  # each file's rows the stage's own held-out split keeps apart
    with stages.timed(timings, "tool_sft"):
        run_dirs["tool_sft"] = stages.run_stage(sft.run, stages.stage_config(TOOL_SFT, config, starts, {"data": {"task": str(transcripts), "eval_size": held}}))
        starts["tool_sft"] = stages.last_checkpoint(run_dirs["tool_sft"], config.tool_sft_steps)
    with stages.timed(timings, "tool_grpo"):
        run_dirs["tool_grpo"] = stages.run_stage(online.run, stages.stage_config(TOOL_GRPO, config, starts, {"data": {"task": str(prompts), "eval_size": held}}))
    with stages.timed(timings, "acceptance"):
        results = {
            "sft": acceptance(starts["sft"], sets, config, out, "sft", tools=False),
            "tool_sft": acceptance(starts["tool_sft"], sets, config, out, "tool_sft", tools=True),
            "tool_grpo": acceptance(stages.last_checkpoint(run_dirs["tool_grpo"], config.tool_grpo_steps), sets, config, out,
                                    "tool_grpo", tools=True),
        }
    write_tool_report(out, results, run_dirs, timings, time.perf_counter() - started, config)
    return out


def acceptance(model_dir: str, sets: dict, config: Any, out: Path, stage: str, tools: bool) -> dict[str, dict[str, Any]]:
    """Greedy pass@1 of one model on each set, with the tool (episodes) or without (one turn)."""
    model, tokenizer = load_model(model_dir)
    sampler = EpisodeSampler(tokenizer, resolve_tools(TOOLS.names), TOOLS) if tools else None
    extra = {"sampler": sampler} if sampler is not None else {}
    return {name: evaluate_task(model, tokenizer, task, checker=stages.checker(None, task), max_new_tokens=TURN_TOKENS,
                                seed=config.seed, output_path=out / f"eval_{stage}_{name}.json", label=f"{stage} {name}", **extra)
            for name, task in sets.items()}


ROWS = (("sft", "SFT start, no tool"), ("tool_sft", "SFT on tool transcripts, with the tool"),
        ("tool_grpo", "then GRPO with the tool"))


def write_tool_report(out: Path, results: dict, run_dirs: dict, timings: dict, seconds: float, config: Any) -> None:
    """summary.json (every number), report.md (the table: pass@1 with its interval per set, the
    paired change against the start without the tool) and tool_demo.png."""
    table = {}
    for stage, _ in ROWS:
        table[stage] = {}
        for name in SETS:
            result, start = results[stage][name], results["sft"][name]
            entry = {"pass@1": result["pass@1"], "ci95": result["pass@1_ci95"], "n": result["n"],
                     **({"episodes": result["episodes"]} if "episodes" in result else {})}
            if stage != "sft":
                before, after = start["correct"], result["correct"]
                pairs = [(b, a) for b, a in zip(before, after) if b is not None and a is not None]
                value, low, high = paired_difference_ci([b for b, _ in pairs], [a for _, a in pairs])
                entry["change"] = {"value": value, "ci95": [low, high], "paired": True}
            table[stage][name] = entry
    summary = {"kind": "tool demo", "seed": config.seed, "tools": TOOLS.names, "max_turns": TOOLS.max_turns,
               "tool_transcripts": config.tool_transcripts, "tool_sft_steps": config.tool_sft_steps,
               "tool_grpo_steps": config.tool_grpo_steps, "results": table,
               "run_dirs": {k: str(v) for k, v in run_dirs.items()}, "timings": timings, "seconds": seconds}
    write_text_atomically(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    lines = ["# posttrain demo --tools", "",
             "The tiny model's SFT start learned 2-digit addition as a format. With the `add` tool (SFT on "
             f"{config.tool_transcripts} tool transcripts, {config.tool_sft_steps} steps, then {config.tool_grpo_steps} GRPO steps "
             "with tool episodes), held-out greedy pass@1, the `integer` checker (independent of the `exact` reward), "
             "paired 95% intervals against the start without the tool:", "",
             "| stage | " + " | ".join(SETS) + " | turns / calls per row |", "|---|" + "---|" * (len(SETS) + 1)]
    for stage, label in ROWS:
        cells = []
        for name in SETS:
            entry = table[stage][name]
            low, high = entry["ci95"]
            cell = f"{entry['pass@1']:.3f} [{low:.3f}, {high:.3f}]"
            if "change" in entry:
                change = entry["change"]
                cell += f" ({change['value']:+.3f} [{change['ci95'][0]:+.3f}, {change['ci95'][1]:+.3f}])"
            cells.append(cell)
        episodes = table[stage][IN_DISTRIBUTION].get("episodes")
        cells.append(f"{episodes['turns/mean']:.2f} / {episodes['tools/calls']:.2f}" if episodes else "1 / 0")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", f"Wall time {seconds:.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + ").",
              "Each evaluation's rows, with the whole transcript, are in eval_<stage>_<set>.json."]
    write_text_atomically(out / "report.md", "\n".join(lines) + "\n")
    _plot(out / "tool_demo.png", table)


def _plot(path: Path, table: dict) -> None:
    """Grouped bars: pass@1 with its interval for each stage, one group per held-out set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(ROWS)
    for index, (stage, label) in enumerate(ROWS):
        xs = [position + index * width for position in range(len(SETS))]
        values = [table[stage][name]["pass@1"] for name in SETS]
        errors = [[v - table[stage][name]["ci95"][0] for v, name in zip(values, SETS)],
                  [table[stage][name]["ci95"][1] - v for v, name in zip(values, SETS)]]
        axis.bar(xs, values, width, yerr=errors, label=label, capsize=3)
    axis.set_xticks([position + 0.4 - width / 2 for position in range(len(SETS))], SETS)
    axis.set_ylabel("held-out pass@1")
    axis.set_ylim(0, 1)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
