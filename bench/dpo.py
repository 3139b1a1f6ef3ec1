"""DPO optimizer steps per second, ours vs TRL's DPOTrainer, side by side in one run.

SmolLM2-135M-Instruct, float32, CPU; the same pairs (plain string prompts, no chat template, so both
sides tokenise alike), a batch of 8 pairs per step, no truncation (same lengths), AdamW at the same
learning rate, gradient clipping at 1.0. Each side runs in its own process (so its peak RSS is its
own): `warmup` steps, then `steps` timed steps. Variants: live reference (a frozen copy) and
precomputed reference log-probs (the one-off pass is timed separately).

    .venv/bin/python bench/dpo.py [--steps 8] [--warmup 2] [--threads 1] [--model smollm2-135m]

Threads: one torch thread per process by default (`--threads 0`: torch's default, one per core), as in
bench/grpo.py: on a shared 2-core machine two OpenMP threads collapse when any other process wants a
core, so two-thread numbers measure the neighbours (docs/dpo.md, "Benchmark", has the run that showed it).

The last line is `RESULT dpo: ours=X peer=Y unit=steps/s ratio=R` (live reference, R = ours/peer).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BATCH = 8


def make_rows(count: int) -> list[dict]:
    """Arithmetic-style pairs with responses of a few dozen tokens."""
    rows = []
    for index in range(count):
        a, b = 17 * index + 23, 31 * index + 11
        prompt = f"Question {index}: what is {a} + {b}? Explain briefly, then give the answer."
        chosen = f"We add the two numbers: {a} plus {b}. Adding the units and the tens gives {a + b}. The answer is {a + b}."
        rejected = f"Let me guess. {a} and {b} together make about {a + b + 10}, maybe more. I think the answer is {a + b + 10}."
        rows.append({"id": f"r{index}", "prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_ours(model_name: str, steps: int, warmup: int, precomputed: bool) -> dict:
    import torch

    from posttrain.config import build_config
    from posttrain.data import PreferencePair, tokenize_preference_pairs
    from posttrain.models import make_reference
    from posttrain.losses.preference import PreferenceModels, PreferenceSettings
    from posttrain.losses.preference import step as loss_step
    from posttrain.models.forward import TrainingForward
    from posttrain.models.loading import load_policy
    from posttrain.models.pair_forward import pair_logprobs, reference_logprobs
    from posttrain.optim import Trainable, make_optimizer
    from posttrain.recipes import dpo_config

    policy, tokenizer = load_policy(model_name)  # as the recipe loads it
    total = steps + warmup
    rows = make_rows(BATCH * total)
    pairs = [PreferencePair(r["id"], r["prompt"], r["chosen"], r["rejected"]) for r in rows]
    config = build_config(dpo_config.Config, None, {
        "data": {"pairs": "bench", "use_chat_template": False}, "batch_size": BATCH, "micro_batch_size": BATCH,
        "optim": {"lr": 1e-6}, "loss": {"reference": "precomputed" if precomputed else "live"},
    })
    def encode(rows):  # as the recipe tokenises (no system prompt: the pairs file has no provenance)
        return tokenize_preference_pairs(tokenizer, rows, truncation=config.data.truncation(), use_chat_template=config.data.use_chat_template)

    started = time.perf_counter()
    if precomputed:
        batches = (encode(pairs[start : start + BATCH]) for start in range(0, len(pairs), BATCH))
        cache, reference = reference_logprobs(policy, batches), None
    else:
        cache, reference = None, make_reference(policy)
    setup_seconds = time.perf_counter() - started
    trainer = TrainingForward(policy, pair_logprobs)  # what the recipe trains through, in one process
    optimizer, scheduler = make_optimizer(trainer.parameters(), config.optim, total)
    models = PreferenceModels(Trainable(trainer, optimizer, scheduler, config.optim.max_grad_norm), reference)
    policy.train()
    tokens = 0
    for step in range(total):
        if step == warmup:
            started = time.perf_counter()
        rows_of_step = slice(step * BATCH, (step + 1) * BATCH)
        batch = encode(pairs[rows_of_step])
        tokens += int(batch.chosen.attention_mask.sum() + batch.rejected.attention_mask.sum()) if step >= warmup else 0
        batch.reference = cache[rows_of_step] if cache is not None else None
        loss_step(models, batch, PreferenceSettings(config.loss, config.micro_batch_size))
    seconds = time.perf_counter() - started
    return {"steps_per_second": steps / seconds, "tokens_per_step": tokens / steps, "reference_seconds": setup_seconds,
            "peak_rss_mb": peak_rss_mb(), "threads": torch.get_num_threads()}


def run_trl(model_name: str, steps: int, warmup: int, precomputed: bool, workdir: str) -> dict:
    import datasets
    import torch
    import trl
    from transformers import TrainerCallback

    from posttrain.models import load_model

    policy, tokenizer = load_model(model_name)
    total = steps + warmup
    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

    args = trl.DPOConfig(
        output_dir=workdir, beta=0.1, loss_type=["sigmoid"], learning_rate=1e-6, max_steps=total,
        per_device_train_batch_size=BATCH, gradient_accumulation_steps=1, max_length=None, bf16=False, use_cpu=True,
        precompute_ref_log_probs=precomputed, precompute_ref_batch_size=BATCH, report_to=[], logging_strategy="no",
        save_strategy="no", disable_tqdm=True, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
        dataloader_num_workers=0, seed=0, dataset_num_proc=None,
    )
    dataset = datasets.Dataset.from_list(make_rows(BATCH * total))
    started = time.perf_counter()
    trainer = trl.DPOTrainer(model=policy, ref_model=None if precomputed else copy.deepcopy(policy), args=args,
                             train_dataset=dataset, processing_class=tokenizer, callbacks=[Clock()])
    setup_seconds = time.perf_counter() - started
    trainer.train()
    seconds = marks[-1] - marks[warmup - 1] if warmup else marks[-1] - marks[0]
    timed = steps if warmup else steps - 1
    return {"steps_per_second": timed / seconds, "reference_seconds": setup_seconds, "peak_rss_mb": peak_rss_mb(),
            "threads": torch.get_num_threads(), "trl": trl.__version__}


def side(name: str, arguments) -> dict:
    """Run one side in a fresh process; returns its JSON result."""
    command = [sys.executable, __file__, "--side", name, "--steps", str(arguments.steps), "--warmup", str(arguments.warmup),
               "--model", arguments.model, "--threads", str(arguments.threads)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per side (0: torch's default)")
    parser.add_argument("--side", choices=["ours", "ours-precomputed", "trl", "trl-precomputed"])
    arguments = parser.parse_args()
    if arguments.side:
        if arguments.threads:
            import torch

            torch.set_num_threads(arguments.threads)
        import tempfile

        precomputed = arguments.side.endswith("precomputed")
        if arguments.side.startswith("ours"):
            result = run_ours(arguments.model, arguments.steps, arguments.warmup, precomputed)
        else:
            with tempfile.TemporaryDirectory() as workdir:
                result = run_trl(arguments.model, arguments.steps, arguments.warmup, precomputed, workdir)
        print(json.dumps(result))
        return
    results = {}
    for name in ("ours", "trl", "ours-precomputed", "trl-precomputed"):
        results[name] = side(name, arguments)
        print(f"side {name}: {json.dumps(results[name])}", flush=True)  # kept if a later side dies
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {results['ours']['threads']} torch threads, "
          f"python {platform.python_version()}, trl {results['trl']['trl']}; model {arguments.model} float32 CPU, "
          f"batch {BATCH} pairs (~{results['ours']['tokens_per_step']:.0f} tokens/step), {arguments.steps} timed steps after {arguments.warmup} warm-up")
    print(f"{'reference':<12} {'ours steps/s':>12} {'TRL steps/s':>12} {'ratio':>7} {'ours peak MB':>13} {'TRL peak MB':>12} {'ours ref s':>11} {'TRL setup s':>12}")
    for label, ours, peer in (("live", "ours", "trl"), ("precomputed", "ours-precomputed", "trl-precomputed")):
        a, b = results[ours], results[peer]
        print(f"{label:<12} {a['steps_per_second']:>12.3f} {b['steps_per_second']:>12.3f} {a['steps_per_second'] / b['steps_per_second']:>7.2f} "
              f"{a['peak_rss_mb']:>13.0f} {b['peak_rss_mb']:>12.0f} {a['reference_seconds']:>11.1f} {b['reference_seconds']:>12.1f}")
    ours, peer = results["ours"]["steps_per_second"], results["trl"]["steps_per_second"]
    print(f"RESULT dpo: ours={ours:.3f} peer={peer:.3f} unit=steps/s ratio={ours / peer:.2f}")


if __name__ == "__main__":
    main()
