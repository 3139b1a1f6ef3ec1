"""One RLOO step, ours vs TRL's RLOOTrainer, side by side in one run: seconds per step, peak RSS, FLOP floor.

bench/grpo.py's setting (its model, prompts, reward, sampling, optimizer, process per side, interleaved
steps, one torch thread, FLOP floor: see its docstring), with RLOO's loss on both sides. Ours: the
tiny-rloo preset's `loss` section as shipped (`loss.advantage rloo`: the leave-one-out baseline;
`loss.kl` k1 at beta 0.01 placed in the reward, summed per sequence; `loss.aggregation
seq_mean_token_sum`: the summed log-probs of a sequence; the per-token clip at 0.2, which never binds
at mu = 1). TRL: `RLOOTrainer` with the same beta (its k1 in the reward), num_generations = G,
epsilon 0.2, num_iterations 1, normalize_advantages False (its default).

Ours is the library's step (bench/grpo.py's `library_step`): the recipe's sampling and scoring
(`posttrain.recipes.online.sample`), then the loss link's `losses.policy_gradient.prepare` (the old
and reference log-probs, the KL in the reward, the leave-one-out advantages) + `step` (the exact-KL
metric, the update): what `posttrain grpo --config tiny-rloo` runs each step, without the run
directory's logging, held-out evaluation and checkpoints; TRL is `RLOOTrainer.train()` timed between
`on_step_end` callbacks.

Both sides run one no-grad forward more than bench/grpo.py's GRPO step: the old policy's log-probs,
which the KL in the reward needs (TRL always computes them; ours because `precomputes_old` says so for
`loss.kl.placement reward`). "no-grad s" is those two forwards (old + reference). The FLOP floor is
grpo.py's (generation, one reference forward, policy forward + backward): the old log-probs are the
sampled tokens' log-probs, which generation has already computed, so the least work needs no extra
forward.

    .venv/bin/python bench/rloo.py [--steps 3] [--warmup 1] [--threads 1] [--sequential] [--model smollm2-135m]

The last line is `RESULT rloo: ours=X peer=Y unit=s/step ratio=R` (R = peer/ours; > 1: we are faster).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo  # noqa: E402  bench/grpo.py: its setting, helpers and the step gate between the sides
from grpo import (  # noqa: E402
    GROUP_SIZE, LR, MAX_NEW_TOKENS, PROMPTS_PER_STEP, ROOT, SEED, TASK, TEMPERATURE, EVAL_SIZE, TRAIN_SIZE,
    examples_in_order, floor_flops, gated_clock, matmul_rate, memory_available_mb, model_shape, numeric_reward, step_done, step_gate,
    summarise,
)

PRESET = "tiny-rloo"


def preset_loss() -> dict:
    """The preset's `loss` section, as shipped."""
    from posttrain.config import load_yaml, preset_path

    return load_yaml(preset_path(PRESET))["loss"]


def run_ours(model_name: str, steps: int, warmup: int) -> dict:
    import torch

    from posttrain.config import build_config
    from posttrain.recipes import online, online_config
    from posttrain.runs.timer import Timer

    total = steps + warmup
    settings = {
        "model": model_name, "max_steps": total, "seed": SEED,
        "data": {"task": TASK, "train_size": TRAIN_SIZE, "eval_size": EVAL_SIZE, "prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP_SIZE},
        "sampling": {"temperature": TEMPERATURE, "max_new_tokens": MAX_NEW_TOKENS},
        "loss": preset_loss(), "optim": {"lr": LR},
        "update": {"epochs": 1, "mini_batches": 1, "micro_batch_size": PROMPTS_PER_STEP * GROUP_SIZE},
    }
    config = build_config(online_config.grpo_config, None, settings)
    state = online.setup(config, reward=lambda completion, example: numeric_reward(completion, example.get("answer")))
    shape = model_shape(state.policy)
    state.policy.train()
    durations, phases, floors, rewards, prompts = [], [], [], [], []
    for _ in range(total):
        step_gate()
        timer = Timer()
        started = time.perf_counter()
        batch = online.sample(state, timer)
        grpo.library_step(state, batch, timer)
        durations.append(time.perf_counter() - started)
        step_done()
        phases.append({**timer.seconds, "reference": timer.seconds.get("logprobs", 0.0)})  # old + reference forwards
        rollout = batch.rollout
        prompt_lengths = rollout.prompt_attention_mask.view(-1, GROUP_SIZE, rollout.prompt_ids.shape[1])[:, 0].sum(-1).tolist()
        floors.append(floor_flops(shape, prompt_lengths, rollout.mask.sum(-1).tolist(), GROUP_SIZE))
        rewards.append(float(batch.scores.rewards.nanmean()))
        prompts.append([e.id for e in batch.examples])
    return summarise(durations, phases, floors, rewards, prompts, warmup, threads=torch.get_num_threads(),
                     loss={key: config.loss.settings().get(key) for key in ("advantage", "aggregation", "kl", "clip")})


def run_trl(model_name: str, steps: int, warmup: int, workdir: str) -> dict:
    import datasets
    import torch
    import trl

    from posttrain.data import render_prompt
    from posttrain.models import load_model
    from posttrain.models.loading import SMOLLM2_SPEC, smollm2_cache_path

    loss = preset_loss()
    total = steps + warmup
    torch.manual_seed(SEED)
    policy, tokenizer = load_model(model_name)
    # TRL loads its reference model from the policy's name_or_path: give it a directory.
    if model_name == SMOLLM2_SPEC:
        policy.name_or_path = policy.config.name_or_path = str(smollm2_cache_path())
    elif not Path(policy.config.name_or_path or "").is_dir():  # a model built in code (tiny)
        policy.save_pretrained(Path(workdir) / "policy")
        policy.name_or_path = policy.config.name_or_path = str(Path(workdir) / "policy")
    examples = examples_in_order(total)
    dataset = datasets.Dataset.from_list([
        {"prompt": render_prompt(tokenizer, e.prompt_input), "answer": e.answer, "id": e.id} for e in examples
    ])
    marks: list[float] = []
    starts: list[float] = []
    phases: list[dict] = [{} for _ in range(total)]
    floors: list[dict] = []
    used: list[list[str]] = []
    shape = model_shape(policy)

    def reward(prompts, completions, answer, **kwargs):
        return [numeric_reward(c, a) for c, a in zip(completions, answer)]

    # The preset's choices in TRL's spelling: k1 in the reward at the same beta (RLOOTrainer's only
    # placement), the same clip, no advantage normalisation, one optimizer step per batch.
    assert loss["advantage"] == "rloo" and loss["kl"]["estimator"] == "k1" and loss["kl"]["placement"] == "reward"
    assert loss["clip"]["low"] == loss["clip"]["high"]
    args = trl.RLOOConfig(
        output_dir=workdir, per_device_train_batch_size=PROMPTS_PER_STEP * GROUP_SIZE, gradient_accumulation_steps=1,
        num_generations=GROUP_SIZE, max_completion_length=MAX_NEW_TOKENS, temperature=TEMPERATURE, top_p=1.0, top_k=0,
        beta=loss["kl"]["beta"], num_iterations=1, epsilon=loss["clip"]["low"], normalize_advantages=False,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0, use_vllm=False,
        bf16=False, use_cpu=True, gradient_checkpointing=False, shuffle_dataset=False, max_steps=total, report_to=[],
        logging_steps=1, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=SEED, log_completions=False,
    )
    trainer = trl.RLOOTrainer(model=policy, reward_funcs=reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[gated_clock(starts, marks, total)])

    def timed(name, function, phase_of=lambda *a, **k: None):
        def wrapper(*a, **k):
            started = time.perf_counter()
            result = function(*a, **k)
            phase = phase_of(*a, **k) or name
            step = phases[min(len(marks), total - 1)]
            step[phase] = step.get(phase, 0.0) + time.perf_counter() - started
            return result
        return wrapper

    generate_and_score = trainer._generate_and_score_completions

    def capture(inputs, *a, **k):
        used.append([row["id"] for row in inputs[::GROUP_SIZE]])
        output = generate_and_score(inputs, *a, **k)
        prompt_lengths = output["prompt_mask"].sum(-1)[::GROUP_SIZE].tolist()
        floors.append(floor_flops(shape, prompt_lengths, output["completion_mask"].sum(-1).tolist(), GROUP_SIZE))
        return output

    trainer._generate_and_score_completions = capture
    trainer._generate = timed("generation", trainer._generate)
    trainer._calculate_rewards = timed("scoring", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed(  # no grad: the old and the reference log-probs
        "policy_forward", trainer._get_per_token_logps_and_entropies,
        lambda *a, **k: "reference" if not torch.is_grad_enabled() else None)
    trainer.train()
    durations = [end - start for start, end in zip(starts, marks)]
    for step, duration in zip(phases, durations):
        step["update"] = duration - step.get("generation", 0) - step.get("scoring", 0) - step.get("reference", 0)
        step.pop("policy_forward", None)
    rewards = [row["reward"] for row in trainer.state.log_history if "reward" in row]
    return summarise(durations, phases, floors, rewards, used, warmup, threads=torch.get_num_threads(), trl=trl.__version__)


class Side(grpo.Side):
    """grpo.Side, started on this file (grpo.Side's command names bench/grpo.py)."""

    def __init__(self, name: str, arguments):
        self.name = name
        self.log = tempfile.TemporaryFile(mode="w+")
        command = [sys.executable, __file__, "--side", name, "--steps", str(arguments.steps),
                   "--warmup", str(arguments.warmup), "--model", arguments.model, "--threads", str(arguments.threads)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                        text=True, cwd=ROOT, bufsize=1)


def run_sides(names: list[str], arguments) -> dict[str, dict]:
    """grpo.run_sides with this file's sides: set-up overlaps, then the steps one at a time, the first
    side to go alternating from step to step (`--sequential`: each side to the end in turn)."""
    if arguments.sequential:
        results = {}
        for name in names:
            side, loads = Side(name, arguments), []
            for _ in range(arguments.warmup + arguments.steps):
                side.step()
                loads.append(os.getloadavg()[0])
            results[name] = {**side.result(), "loads": loads}
        return results
    sides = [Side(name, arguments) for name in names]
    loads = {name: [] for name in names}
    for step in range(arguments.warmup + arguments.steps):
        for side in sides if step % 2 == 0 else sides[::-1]:
            side.step()
            loads[side.name].append(os.getloadavg()[0])
    return {side.name: {**side.result(), "loads": loads[side.name]} for side in sides}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads in every process (0: torch's default); see bench/grpo.py")
    parser.add_argument("--sequential", action="store_true", help="one side after the other instead of interleaved steps")
    parser.add_argument("--side", choices=["ours", "trl"], help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.steps < 1 or arguments.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    import torch

    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    if arguments.side:
        if arguments.side == "trl":
            with tempfile.TemporaryDirectory() as workdir:
                result = run_trl(arguments.model, arguments.steps, arguments.warmup, workdir)
        else:
            result = run_ours(arguments.model, arguments.steps, arguments.warmup)
        print("@@result " + json.dumps(result), flush=True)
        return
    names = ["ours", "trl"]
    if not arguments.sequential and memory_available_mb() < 7500 * len(names) + 1000:
        print(f"only {memory_available_mb():.0f} MB available: running the sides one after the other", flush=True)
        arguments.sequential = True
    load_before = os.getloadavg()
    rate = matmul_rate()
    started = time.perf_counter()
    results = run_sides(names, arguments)
    wall = time.perf_counter() - started
    rate = max(rate, matmul_rate())  # measured before and after the two sides; the better one
    load_after = os.getloadavg()
    ours, peer = results["ours"], results["trl"]
    same = "same prompts" if ours["prompts"] == peer["prompts"] else f"PROMPTS DIFFER: ours {ours['prompts']} trl {peer['prompts']}"
    loss = ours["loss"]
    print(f"date {datetime.date.today()}, machine {platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs, "
          f"{ours['threads']} torch threads, torch {torch.__version__}, trl {peer['trl']}, python {platform.python_version()}; "
          f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; {wall:.0f} s for the sides")
    print(f"model {arguments.model} float32 CPU; {TASK}, {PROMPTS_PER_STEP} prompts x G={GROUP_SIZE}, <= {MAX_NEW_TOKENS} new tokens, "
          f"T={TEMPERATURE}, mu=1; ours: {PRESET}'s loss (advantage {loss['advantage']}, aggregation {loss['aggregation']}, "
          f"kl {loss['kl']}), TRL RLOOTrainer beta={loss['kl']['beta']}; {arguments.warmup} warm-up + {arguments.steps} timed steps, "
          f"median, {'sequential' if arguments.sequential else 'steps interleaved'}; {same}")
    print(f"float32 matmul rate {rate / 1e9:.1f} GFLOP/s (2048^3)")
    print(f"{'side':<6} {'s/step':>7} {'best':>6} {'gen s':>6} {'score s':>7} {'no-grad s':>9} {'update s':>8} {'peak RSS MB':>11} "
          f"{'tokens':>6} {'floor GFLOP':>11} {'floor s':>7} {'x floor':>7}  all steps s (1-min load after each)")
    for label, result in (("ours", ours), ("TRL", peer)):
        phases, floor_seconds = result["phases"], result["floor_flops"] / rate
        print(f"{label:<6} {result['seconds']:>7.2f} {min(result['all_seconds'][arguments.warmup:]):>6.2f} {phases['generation']:>6.2f} "
              f"{phases['scoring']:>7.3f} {phases['reference']:>9.2f} {phases['update']:>8.2f} {result['peak_rss_mb']:>11.0f} "
              f"{result['floor_parts']['tokens']:>6.0f} {result['floor_flops'] / 1e9:>11.1f} {floor_seconds:>7.2f} "
              f"{result['seconds'] / floor_seconds:>7.1f}  " + " ".join(f"{s:.1f} ({load:.1f})" for s, load in zip(result["all_seconds"], result["loads"])))
    parts = ours["floor_parts"]
    print(f"ours floor split: generation {parts['generation'] / rate:.2f} s, reference {parts['reference'] / rate:.2f} s, "
          f"policy fwd+bwd {parts['policy'] / rate:.2f} s; mean reward per step: ours {[round(r, 3) for r in ours['rewards']]}, "
          f"TRL {[round(r, 3) for r in peer['rewards']]}")
    print(f"ratio (TRL/ours): time {peer['seconds'] / ours['seconds']:.2f}x, peak RSS {peer['peak_rss_mb'] / ours['peak_rss_mb']:.2f}x")
    print(f"RESULT rloo: ours={ours['seconds']:.2f} peer={peer['seconds']:.2f} unit=s/step ratio={peer['seconds'] / ours['seconds']:.2f}")


if __name__ == "__main__":
    main()
