"""GRPO throughput with 2 processes (torchrun, gloo, DDP) vs 1 process, each process one thread.

Setting (issue 9): the `tiny` model (random init, float32, CPU), 2-digit arithmetic prompts, 16 prompts
x G=8 = 128 completions per step, at most 24 new tokens, temperature 1, beta 0.01 (k3 in the loss,
frozen reference), mu = 1, micro-batches of 64 rows. Both sides run the real command
(`posttrain grpo`, the same flags, the same seed, so the same global batch); with 2 processes each
rank samples, scores and trains on its 8 prompt groups and the gradients are all-reduced. A step's
time is the recipe's own `seconds/step` (rank 0's, which waits for the other rank at every
collective), the first `--warmup` steps and the last (held-out evaluation around it) left out; the
median over the rest and over `--rounds` alternating runs (1, 2, 1, 2, ...) is reported.

    .venv/bin/python bench/distributed.py [--steps 8] [--warmup 2] [--rounds 2]

Scaling efficiency = (completions/s with 2 processes) / (2 x completions/s with 1). The last line is
`RESULT distributed: ours=X peer=Y unit=completions/s ratio=R` (ours = 2 processes, peer = 1; R > 1:
two processes are faster).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS, GROUP = 16, 8
FLAGS = [
    "--model", "tiny", "--reward", "exact", "--data.task", "arithmetic", "--data.task_options", "{digits: 2}",
    "--data.train_size", "2000", "--data.eval_size", "8", "--data.prompts_per_step", str(PROMPTS),
    "--data.group_size", str(GROUP), "--sampling.max_new_tokens", "24", "--loss.kl.beta", "0.01",
    "--update.micro_batch_size", "64", "--optim.lr", "1e-4", "--acceptance.eval_every", "0", "--seed", "0",
]


def side(processes: int, steps: int, directory: Path) -> list[float]:
    """Run `posttrain grpo` with `processes` ranks for `steps` steps; per-step seconds."""
    output = directory / f"run-{processes}"
    command = [sys.executable, "-m", "posttrain", "grpo", *FLAGS, "--max-steps", str(steps), "--output-dir", str(output)]
    if processes > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
                   *command[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{processes} process(es) failed:\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    subprocess.run(["rm", "-rf", str(output)], check=True)
    return [row["seconds/step"] for row in rows if "seconds/step" in row]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    arguments = parser.parse_args()
    if arguments.steps < arguments.warmup + 2:
        parser.error("--steps must leave at least one timed step after --warmup and before the last")
    timed: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as directory:
        for round_ in range(arguments.rounds):
            for processes in (1, 2):
                seconds = side(processes, arguments.steps, Path(directory))
                timed[processes] += seconds[arguments.warmup : -1]
                print(f"round {round_ + 1}, {processes} process(es): " + " ".join(f"{s:.2f}" for s in seconds), flush=True)
    one, two = statistics.median(timed[1]), statistics.median(timed[2])
    rate_one, rate_two = PROMPTS * GROUP / one, PROMPTS * GROUP / two
    print(f"date {datetime.date.today()}, machine {platform.machine()} {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"tiny model, {PROMPTS} prompts x G={GROUP}, <= 24 new tokens, one thread per process, gloo, DDP")
    print(f"{'processes':<10} {'s/step':>7} {'completions/s':>14}")
    print(f"{1:<10} {one:>7.2f} {rate_one:>14.1f}")
    print(f"{2:<10} {two:>7.2f} {rate_two:>14.1f}")
    print(f"speed-up {rate_two / rate_one:.2f}x, scaling efficiency {rate_two / (2 * rate_one):.0%}")
    print(f"RESULT distributed: ours={rate_two:.1f} peer={rate_one:.1f} unit=completions/s ratio={rate_two / rate_one:.2f}")


if __name__ == "__main__":
    main()
