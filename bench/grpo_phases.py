"""Where one GRPO update's time goes: bench/grpo.py's setting (SmolLM2-135M, float32, CPU, 2 prompts x
G = 8, 32 new tokens, k3 KL in the loss, the exact-KL metric), our side only, under torch.profiler.

The recipe's set-up and sampling (`online.setup`, `online.sample`), then the loss link's `prepare`
(timed: the no-grad reference forward) and `step` (profiled: the exact-KL metric on kept logits, the policy's forward,
the log-probs and entropy over the vocabulary, the surrogate, backward, clipping and AdamW). The
operators are grouped by what they are (matmuls, the vocabulary-wide softmax family, attention,
elementwise, the optimizer, copies and allocation) and summed as self CPU time, so the groups add up to
the profiled step. `--steps` steps are profiled after `--warmup` unprofiled ones; the table is their
mean per step. One torch thread by default, as bench/grpo.py.

    OMP_NUM_THREADS=1 .venv/bin/python bench/grpo_phases.py [--steps 2] [--warmup 1] [--threads 1] [--top 15]
"""

from __future__ import annotations

import argparse
import collections
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GROUPS = (
    ("matmul (linear layers, LM head)", ("addmm", "mm", "bmm", "matmul", "linear", "baddbmm")),
    ("vocabulary-wide softmax / logsumexp / log-softmax", ("logsumexp", "softmax", "log_softmax", "exp")),
    ("attention (SDPA)", ("scaled_dot_product", "flash_attention", "efficient_attention")),
    ("optimizer (AdamW, clipping, zero_grad)", ("fused_adam", "adam", "foreach", "linalg_vector_norm", "clip", "zero_")),
    ("copies, fills, casts, allocation", ("copy_", "to_copy", "empty", "zeros", "clone", "contiguous", "cat", "stack", "fill_", "new_",
                                           "masked_fill", "index", "gather", "scatter")),
)


def group_of(name: str) -> str:
    """The group an aten operator's self time is counted in ('elementwise and other' for the rest)."""
    short = name.removeprefix("aten::").lower().lstrip("_")
    for label, keys in GROUPS:
        if any(short == key or short.startswith(key) for key in keys):
            return label
    return "elementwise and other"


def phase_of(event) -> str:
    """backward (under autograd's engine), optimizer (under an optimizer's step) or forward (the rest:
    the forwards, log-probs, entropy, losses and metrics), from the event's parents."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("autograd::engine::evaluate_function"):
            return "backward"
        if parent.name.startswith("Optimizer.step"):
            return "optimizer"
        parent = parent.cpu_parent
    return "forward and the rest"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=15, help="operators listed by self CPU time")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.grpo import BETA, EVAL_SIZE, GROUP_SIZE, LR, MAX_NEW_TOKENS, PROMPTS_PER_STEP, SEED, TASK, TEMPERATURE, TRAIN_SIZE
    from bench.grpo import numeric_reward
    from posttrain.config import build_config
    from posttrain.losses import policy_gradient
    from posttrain.recipes import online, online_config

    torch.set_num_threads(args.threads)
    config = build_config(online_config.grpo_config, None, {
        "model": args.model, "max_steps": args.steps + args.warmup, "seed": SEED,
        "data": {"task": TASK, "train_size": TRAIN_SIZE, "eval_size": EVAL_SIZE, "prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP_SIZE},
        "sampling": {"temperature": TEMPERATURE, "max_new_tokens": MAX_NEW_TOKENS},
        "loss": {"kl": {"beta": BETA}}, "optim": {"lr": LR},
        "update": {"epochs": 1, "mini_batches": 1, "micro_batch_size": PROMPTS_PER_STEP * GROUP_SIZE}})
    state = online.setup(config, reward=lambda completion, example: numeric_reward(completion, example.get("answer")))
    totals: collections.Counter = collections.Counter()
    by_op: collections.Counter = collections.Counter()
    phases: collections.Counter = collections.Counter()
    prepare_s = update_s = plain_s = 0.0
    positions = 0
    for index in range(args.warmup + args.steps):
        batch = online.sample(state).to(state.placement.device)
        models, settings = online.loss_inputs(state)
        started = time.perf_counter()
        update_batch, _ = policy_gradient.prepare(models, batch, settings, state.world)
        prepared = time.perf_counter()
        timed = index >= args.warmup
        if timed:
            with profile(activities=[ProfilerActivity.CPU]) as profiler:
                policy_gradient.step(models, update_batch, settings, state.world)
            for event in profiler.events():
                if event.name.startswith("aten::"):
                    seconds = event.self_cpu_time_total / 1e6
                    totals[group_of(event.name)] += seconds
                    by_op[event.name] += seconds
                    phases[(phase_of(event), group_of(event.name) if group_of(event.name).startswith("matmul") else "other")] += seconds
        else:
            policy_gradient.step(models, update_batch, settings, state.world)
        finished = time.perf_counter()
        if not timed:
            plain_s += finished - prepared
        state.step += 1
        if timed:
            prepare_s += prepared - started
            update_s += finished - prepared
            positions += int(batch.rollout.prompt_attention_mask.sum()) + int(batch.rollout.completion_attention_mask.sum())

    steps = args.steps
    profiled = sum(totals.values()) / steps
    print(f"# grpo_phases: {platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{args.threads} thread(s), {args.model}, {steps} profiled step(s) after {args.warmup}")
    print(f"prepare (no-grad reference forward): {prepare_s / steps:.3f} s/step (unprofiled); "
          f"step (exact KL + update): {update_s / steps:.3f} s/step profiled, {profiled:.3f} s of aten self CPU time; "
          f"{positions / steps:.0f} real positions per step; unprofiled, the warm-up steps' step took "
          f"{plain_s / max(1, args.warmup):.3f} s")
    print("| group | s/step (self CPU) | share |")
    print("|---|---|---|")
    for label, seconds in totals.most_common():
        print(f"| {label} | {seconds / steps:.3f} | {seconds / steps / profiled:.1%} |")
    print("\n| phase | matmul s/step | other s/step |")
    print("|---|---|---|")
    for phase in ("forward and the rest", "backward", "optimizer"):
        matmul = phases[(phase, "matmul (linear layers, LM head)")] / steps
        print(f"| {phase} | {matmul:.3f} | {phases[(phase, 'other')] / steps:.3f} |")
    print("\n| operator | s/step (self CPU) | group |")
    print("|---|---|---|")
    for name, seconds in by_op.most_common(args.top):
        print(f"| {name} | {seconds / steps:.3f} | {group_of(name)} |")


if __name__ == "__main__":
    main()
