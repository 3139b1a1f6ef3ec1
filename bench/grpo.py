"""One GRPO step, ours vs TRL's GRPOTrainer, side by side in one run: seconds per step, peak RSS, FLOP floor.

Setting (issue 6): SmolLM2-135M-Instruct, float32, CPU; reasoning-gym basic_arithmetic prompts rendered
with the model's chat template (the same text, in the same order, on both sides); 2 prompts x G=8 = 16
completions per step, at most 32 new tokens, temperature 1 (no top-k / top-p), beta 0.04 (k3 KL in the
loss, a frozen reference model), mu = 1 (one optimizer step per batch, old log-probs = the detached
on-policy ones), token-mean loss (TRL: loss_type "dapo"), AdamW at lr 1e-6, gradient clipping at 1.0,
no gradient checkpointing. Both sides use the same reward: 1 if the last number in the completion
equals the gold answer, else 0 (a plain Python function, scored in-process).

Ours is the library's step (`library_step`): the recipe's sampling and scoring
(`posttrain.recipes.online.sample`), then the loss link's `losses.policy_gradient.prepare`
(reference log-probs, group advantages) + `step` (the exact-KL metric, the update with its
optimizer step), the models and settings built from the recipe's set-up (`online.setup`,
`online.loss_inputs`): what `posttrain grpo` runs each step, without the run directory's logging,
held-out evaluation and checkpoints; TRL is `GRPOTrainer.train()` timed between `on_step_end`
callbacks. Each side runs in its own process (so its peak RSS is its own): `--warmup` steps, then
`--steps` timed steps; the median step is reported.

FLOP floor of a step, from the step's actual prompt and completion lengths (P_b, L_r): generation =
each distinct prompt prefilled once + (L_r - 1) decode positions per row; reference forward = the same
positions (each group's prompt once, then every row's completion; LM head only where a completion
token is scored: the least work any implementation must do, and what our shared-prefix forward does);
policy forward + backward = 3 x that forward. A position costs 2 x the matmul parameters it touches (q/k/v/o and MLP
projections of every layer, plus the LM head where logits are needed) + 4 x layers x heads x head_dim
x context (attention scores and values). Divided by this machine's float32 matmul rate, measured in
this run with a 2048^3 matmul; "x floor" = measured seconds / floor seconds.

Threads: one torch thread per process by default (`--threads 0`: torch's default, one per core). On
this shared 2-core machine two OpenMP threads collapse as soon as any other process wants a core (a
generation of 16 x 32 tokens went from ~3 s to 25-60 s, ours and transformers' generate alike, next to
one busy-looping process), so two-thread numbers measure the neighbours; one thread is ~2x slower on
an idle machine but stable. The sides' steps are interleaved (ours, TRL, TRL, ours, ...), only one
running at a time, so bursts of outside load fall on both alike; `--sequential` runs one side after the
other (it is chosen automatically when memory is short for both processes at once).

    .venv/bin/python bench/grpo.py [--steps 3] [--warmup 1] [--threads 1] [--extra] [--model smollm2-135m]
    .venv-vllm/bin/python bench/grpo.py --engine vllm     # both sides generating with vLLM (RESULT grpo_vllm)

The last line is `RESULT grpo: ours=X peer=Y unit=s/step ratio=R` (R = peer/ours; > 1: we are faster).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASK = "rg:basic_arithmetic"
PROMPTS_PER_STEP, GROUP_SIZE, MAX_NEW_TOKENS = 2, 8, 32
TEMPERATURE, BETA, LR, SEED = 1.0, 0.04, 1e-6, 0
TRAIN_SIZE, EVAL_SIZE = 256, 2
VLLM_KV_CACHE_GB = 1  # --engine vllm: each side's KV cache on the CPU (vLLM's own default takes most of the memory)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def numeric_reward(completion: str, answer) -> float:
    """1.0 if the last number in `completion` equals `answer` (as floats), else 0.0."""
    numbers = NUMBER.findall(completion.replace(",", ""))
    try:
        return float(bool(numbers) and float(numbers[-1]) == float(answer))
    except (TypeError, ValueError):
        return 0.0


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def matmul_rate(size: int = 2048, repeats: int = 5, rounds: int = 5) -> float:
    """Best float32 FLOP/s of a (size x size) @ (size x size) matmul on this machine."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = min(best, (time.perf_counter() - started) / repeats)
    return 2 * size ** 3 / best


def model_shape(model) -> dict:
    """Matmul parameter counts and attention sizes the FLOP floor needs."""
    import torch

    config = model.config
    heads = config.num_attention_heads
    return {
        "body": sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)),
        "head": model.get_output_embeddings().weight.numel(),
        "layers": config.num_hidden_layers,
        "attention": heads * (getattr(config, "head_dim", None) or config.hidden_size // heads),
    }


def floor_flops(shape: dict, prompt_lengths: list[int], completion_lengths: list[int], group_size: int) -> dict:
    """FLOPs a GRPO step needs (see the module docstring): generation, reference forward, policy fwd+bwd."""
    body, head, attention = 2 * shape["body"], 2 * shape["head"], 4 * shape["layers"] * shape["attention"]

    def forward(positions: int, logits: int, context_start: int = 0) -> float:
        # `positions` consecutive positions whose contexts are context_start+1 ... context_start+positions.
        contexts = positions * context_start + positions * (positions + 1) // 2
        return positions * body + attention * contexts + logits * head

    generation = reference = 0.0
    for row, length in enumerate(completion_lengths):
        prompt = prompt_lengths[row // group_size]
        if row % group_size == 0:  # a group's prompt, once (its last logits score completion token 0)
            generation += forward(prompt, logits=1)
            reference += forward(prompt, logits=1)
        generation += forward(max(length - 1, 0), logits=max(length - 1, 0), context_start=prompt)
        reference += forward(max(length - 1, 0), logits=max(length - 1, 0), context_start=prompt)
    return {"generation": generation, "reference": reference, "policy": 3 * reference,
            "total": generation + 4 * reference, "tokens": sum(completion_lengths)}


def examples_in_order(total_steps: int):
    """The training examples in the order the recipe's PromptStream hands them out."""
    from posttrain.data.tasks import load_splits
    from posttrain.data.stream import PromptStream

    train, _ = load_splits(TASK, train_size=TRAIN_SIZE, eval_size=EVAL_SIZE, seed=SEED)
    return PromptStream(train, SEED).take(PROMPTS_PER_STEP * total_steps)


def step_gate() -> None:
    """Interleaving: say this side is ready for its next step and wait for the parent's `go`."""
    print("@@ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("parent went away")


def step_done() -> None:
    print("@@done", flush=True)


def gated_clock(starts: list[float], marks: list[float], total: int):
    """A transformers TrainerCallback timing a peer trainer's steps between the gates: each step
    from the parent's `go` (appended to `starts`) to on_step_end (to `marks`: the next batch's
    loading included), `total` steps in all. bench/grpo.py, rloo.py and rm.py time TRL with it."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            step_gate()
            starts.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())
            step_done()
            if len(marks) < total:
                step_gate()
                starts.append(time.perf_counter())

    return Clock()


def library_step(state, batch, timer) -> dict:
    """Steps 3-4 of one online step through the library: `losses.policy_gradient.prepare` + `step`
    on the sampled `batch`, the models and settings from the recipe's `state` (`online.loss_inputs`),
    timed in the recipe's phases (`logprobs`, `update`); advances `state.step` (the next sample's
    seed). Returns the step's metrics. bench/grpo.py, rloo.py and gpu.py time their GRPO step with it."""
    from posttrain.losses import policy_gradient
    from posttrain.recipes import online

    models, settings = online.loss_inputs(state)
    with timer("logprobs"):
        update_batch, metrics = policy_gradient.prepare(models, batch.to(state.placement.device), settings, state.world)
    with timer("update"):
        metrics.update(policy_gradient.step(models, update_batch, settings, state.world))
    state.step += 1
    return metrics


def run_ours(model_name: str, steps: int, warmup: int, exact_kl_tokens: int | None = None, engine: str = "builtin") -> dict:
    import torch

    from posttrain.config import build_config
    from posttrain.recipes import online, online_config
    from posttrain.runs.timer import Timer

    total = steps + warmup
    settings = {
        "model": model_name, "max_steps": total, "seed": SEED,
        "data": {"task": TASK, "train_size": TRAIN_SIZE, "eval_size": EVAL_SIZE, "prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP_SIZE},
        "sampling": {"temperature": TEMPERATURE, "max_new_tokens": MAX_NEW_TOKENS},
        "loss": {"kl": {"beta": BETA}}, "optim": {"lr": LR},
        "update": {"epochs": 1, "mini_batches": 1, "micro_batch_size": PROMPTS_PER_STEP * GROUP_SIZE},
    }
    if exact_kl_tokens is not None:
        settings["exact_kl_tokens"] = exact_kl_tokens
    if engine == "vllm":
        settings["rollout"] = {"engine": "vllm", "vllm": {"kv_cache_gb": VLLM_KV_CACHE_GB}}
    config = build_config(online_config.grpo_config, None, settings)
    # The recipe's set-up and sampling, the library's step (what `posttrain grpo` runs), without the
    # run directory's logging, held-out evaluation and checkpoints.
    state = online.setup(config, reward=lambda completion, example: numeric_reward(completion, example.get("answer")))
    shape = model_shape(state.policy)
    state.policy.train()
    durations, phases, floors, rewards, prompts = [], [], [], [], []
    for _ in range(total):
        step_gate()
        timer = Timer()
        started = time.perf_counter()
        batch = online.sample(state, timer)
        library_step(state, batch, timer)
        durations.append(time.perf_counter() - started)
        step_done()
        phases.append({**timer.seconds, "reference": timer.seconds.get("logprobs", 0.0)})  # the no-grad log-prob forwards
        rollout = batch.rollout
        prompt_lengths = rollout.prompt_attention_mask.view(-1, GROUP_SIZE, rollout.prompt_ids.shape[1])[:, 0].sum(-1).tolist()
        floors.append(floor_flops(shape, prompt_lengths, rollout.mask.sum(-1).tolist(), GROUP_SIZE))
        rewards.append(float(batch.scores.rewards.nanmean()))
        prompts.append([e.id for e in batch.examples])
    return summarise(durations, phases, floors, rewards, prompts, warmup, threads=torch.get_num_threads())


def run_trl(model_name: str, steps: int, warmup: int, workdir: str, engine: str = "builtin") -> dict:
    import datasets
    import torch
    import trl

    from posttrain.data import render_prompt
    from posttrain.models import load_model
    from posttrain.models.loading import SMOLLM2_SPEC, smollm2_cache_path

    total = steps + warmup
    if engine == "vllm":  # TRL's colocated vLLM on the CPU build: the same KV cache as ours (GiB)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(VLLM_KV_CACHE_GB))
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
    phases: list[dict] = [{} for _ in range(total)]
    floors: list[dict] = []
    used: list[list[str]] = []
    shape = model_shape(policy)

    starts: list[float] = []

    def reward(prompts, completions, answer, **kwargs):
        return [numeric_reward(c, a) for c, a in zip(completions, answer)]

    args = trl.GRPOConfig(
        output_dir=workdir, per_device_train_batch_size=PROMPTS_PER_STEP * GROUP_SIZE, gradient_accumulation_steps=1,
        num_generations=GROUP_SIZE, max_completion_length=MAX_NEW_TOKENS, temperature=TEMPERATURE, top_p=1.0, top_k=0,
        beta=BETA, num_iterations=1, loss_type="dapo", scale_rewards="group", epsilon=0.2, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0, bf16=False,
        use_vllm=engine == "vllm", vllm_mode="colocate", vllm_enable_sleep_mode=False,
        use_cpu=True, gradient_checkpointing=False, shuffle_dataset=False, max_steps=total, report_to=[], logging_steps=1,
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=SEED, log_completions=False,
    )
    trainer = trl.GRPOTrainer(model=policy, reward_funcs=reward, args=args, train_dataset=dataset,
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
    trainer._generate = timed("generation", trainer._generate)  # with vLLM: its weight sync inside
    trainer._calculate_rewards = timed("scoring", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed(
        "policy_forward", trainer._get_per_token_logps_and_entropies,
        lambda *a, **k: "reference" if not torch.is_grad_enabled() else None)
    trainer.train()
    durations = [end - start for start, end in zip(starts, marks)]
    for step, duration in zip(phases, durations):
        step["update"] = duration - step.get("generation", 0) - step.get("scoring", 0) - step.get("reference", 0)
        step.pop("policy_forward", None)
    rewards = [row["reward"] for row in trainer.state.log_history if "reward" in row]
    return summarise(durations, phases, floors, rewards, used, warmup, threads=torch.get_num_threads(), trl=trl.__version__)


def summarise(durations, phases, floors, rewards, prompts, warmup, **extra) -> dict:
    timed = range(warmup, len(durations))
    median = statistics.median(durations[i] for i in timed)
    return {
        "seconds": median, "all_seconds": durations, "peak_rss_mb": peak_rss_mb(),
        "phases": {name: statistics.median(phases[i].get(name, 0.0) for i in timed) for name in ("generation", "scoring", "reference", "update")},
        "floor_flops": statistics.median(floors[i]["total"] for i in timed),
        "floor_parts": {k: statistics.median(floors[i][k] for i in timed) for k in ("generation", "reference", "policy", "tokens")},
        "rewards": rewards, "prompts": prompts, **extra,
    }


class Side:
    """One side in its own process, stepped by the parent through stdin (`go`) and stdout (`@@ready`,
    `@@done`, `@@result <json>`); its stderr goes to a temporary file, shown if it fails."""

    def __init__(self, name: str, arguments):
        import tempfile

        self.name = name
        self.log = tempfile.TemporaryFile(mode="w+")
        command = [sys.executable, __file__, "--side", name, "--steps", str(arguments.steps),
                   "--warmup", str(arguments.warmup), "--model", arguments.model, "--threads", str(arguments.threads),
                   "--engine", arguments.engine]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                        text=True, cwd=ROOT, bufsize=1)

    def expect(self, tag: str) -> str:
        """Read stdout until a line starting with `tag`; returns the rest of that line."""
        for line in self.process.stdout:
            if line.startswith(tag):
                return line[len(tag):].strip()
        self.process.wait()
        self.log.seek(0)
        raise SystemExit(f"{self.name} exited ({self.process.returncode}) before {tag}:\n{self.log.read()[-4000:]}")

    def step(self) -> None:
        """Run one step of this side while the other sides wait."""
        self.expect("@@ready")
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        self.expect("@@done")

    def result(self) -> dict:
        output = json.loads(self.expect("@@result"))
        self.process.wait()
        return output


def run_sides(names: list[str], arguments) -> dict[str, dict]:
    """Start every side (set-up overlaps), then run their steps one at a time, interleaved (the first
    side to go alternates from step to step), so a shared machine's load falls on all sides alike.
    `--sequential` instead runs each side to the end before starting the next (less memory at once)."""
    if arguments.sequential:
        results = {}
        for name in names:
            side = Side(name, arguments)
            loads = []
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


def memory_available_mb() -> float:
    try:
        with open("/proc/meminfo") as meminfo:
            return next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable")) / 1024
    except (OSError, StopIteration):
        return float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads in every process (0: torch's default, 2 here); see the module docstring")
    parser.add_argument("--sequential", action="store_true", help="one side after the other instead of interleaved steps")
    parser.add_argument("--extra", action="store_true", help="also run ours with exact_kl_tokens=0 (no exact-KL metric; it runs no forward of its own since 90c75bd, so this measures only its (k, V) logits and KL)")
    parser.add_argument("--engine", choices=["builtin", "vllm"], default="builtin",
                        help="vllm: both sides generate with vLLM in their process (ours: rollout.engine vllm; TRL: use_vllm, "
                             "vllm_mode colocate); run with .venv-vllm/bin/python (make vllm-env)")
    parser.add_argument("--side", choices=["ours", "ours-nokl", "trl"], help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.steps < 1 or arguments.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    import torch

    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    if arguments.side:
        if arguments.side == "trl":
            import tempfile

            with tempfile.TemporaryDirectory() as workdir:
                result = run_trl(arguments.model, arguments.steps, arguments.warmup, workdir, arguments.engine)
        else:
            result = run_ours(arguments.model, arguments.steps, arguments.warmup, 0 if arguments.side == "ours-nokl" else None,
                              arguments.engine)
        print("@@result " + json.dumps(result), flush=True)
        return
    names = ["ours", "trl"] + (["ours-nokl"] if arguments.extra else [])
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
    print(f"date {datetime.date.today()}, machine {platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs, "
          f"{ours['threads']} torch threads, torch {torch.__version__}, trl {peer['trl']}, python {platform.python_version()}; "
          f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; {wall:.0f} s for the sides")
    print(f"model {arguments.model} float32 CPU; {TASK}, {PROMPTS_PER_STEP} prompts x G={GROUP_SIZE}, <= {MAX_NEW_TOKENS} new tokens, "
          f"T={TEMPERATURE}, beta={BETA}, mu=1; {arguments.warmup} warm-up + {arguments.steps} timed steps, median, {'sequential' if arguments.sequential else 'steps interleaved'}; {same}")
    print(f"float32 matmul rate {rate / 1e9:.1f} GFLOP/s (2048^3)")
    print(f"{'side':<24} {'s/step':>7} {'best':>6} {'gen s':>6} {'score s':>7} {'ref s':>6} {'update s':>8} {'peak RSS MB':>11} "
          f"{'tokens':>6} {'floor GFLOP':>11} {'floor s':>7} {'x floor':>7}  all steps s (1-min load after each)")
    rows = [("ours", ours), ("TRL", peer)] + ([("ours, exact_kl_tokens=0", results["ours-nokl"])] if "ours-nokl" in results else [])
    for label, result in rows:
        phases, floor_seconds = result["phases"], result["floor_flops"] / rate
        print(f"{label:<24} {result['seconds']:>7.2f} {min(result['all_seconds'][arguments.warmup:]):>6.2f} {phases['generation']:>6.2f} {phases['scoring']:>7.3f} {phases['reference']:>6.2f} "
              f"{phases['update']:>8.2f} {result['peak_rss_mb']:>11.0f} {result['floor_parts']['tokens']:>6.0f} "
              f"{result['floor_flops'] / 1e9:>11.1f} {floor_seconds:>7.2f} {result['seconds'] / floor_seconds:>7.1f}  "
              + " ".join(f"{s:.1f} ({load:.1f})" for s, load in zip(result["all_seconds"], result["loads"])))
    parts = ours["floor_parts"]
    print(f"ours floor split: generation {parts['generation'] / rate:.2f} s, reference {parts['reference'] / rate:.2f} s, "
          f"policy fwd+bwd {parts['policy'] / rate:.2f} s; mean reward per step: ours {[round(r, 3) for r in ours['rewards']]}, "
          f"TRL {[round(r, 3) for r in peer['rewards']]}")
    print(f"ratio (TRL/ours): time {peer['seconds'] / ours['seconds']:.2f}x, peak RSS {peer['peak_rss_mb'] / ours['peak_rss_mb']:.2f}x")
    name = "grpo" if arguments.engine == "builtin" else "grpo_vllm"
    print(f"RESULT {name}: ours={ours['seconds']:.2f} peer={peer['seconds']:.2f} unit=s/step ratio={peer['seconds'] / ours['seconds']:.2f}")


if __name__ == "__main__":
    main()
