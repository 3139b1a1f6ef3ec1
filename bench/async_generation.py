"""Generation overlapping training (`data.async_generation`, issue 42's mode (b)) against the synchronous
staleness of mode (a) at the same k: what the overlap buys, measured.

Setting: the `tiny-grpo` preset (the demo's GRPO stage: the tiny model after 400 SFT steps,
2-digit addition, 16 prompts x G = 8, 24 new tokens, one mini-batch), `--steps` steps, `--k` steps
of staleness allowed, held-out evaluation only at the end. Each mode is one `online.run` of the
library (nothing re-typed), in its own process, one after the other:
  peer  mode (a): `data.max_staleness k`: generation and training take turns in one thread;
  ours  mode (b): `data.max_staleness k`, `data.async_generation true`: a generation thread samples
        ahead while the trainer trains; the engine is the built-in one in a worker process
        (`--engine builtin`), or a `posttrain vllm-serve` process (`--engine vllm-server`, run in
        .venv-vllm: the server is started here, on the same CPU cores).
Reported per mode: the median of `seconds/step` over the steps after the first, the wall time of the
run, the trainer's wait for its batch and the generator's wait for weights (the `offpolicy/wait_*`
metrics, mode (b)), the mean staleness, and the final held-out pass@1.

    .venv/bin/python bench/async_generation.py [--steps 30] [--k 1] [--engine builtin]
    .venv-vllm/bin/python bench/async_generation.py --engine vllm-server

Needs runs/tiny-sft-start (the preset says: posttrain sft --config tiny-sft --max-steps 400 --output-dir
runs/tiny-sft-start). Ends with:
    RESULT async_generation_<engine>: ours=<mode b s/step> peer=<mode a s/step> unit=s/step ratio=R
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
START = ROOT / "runs/tiny-sft-start/checkpoints/step-000400/model"


def run_mode(asynchronous: bool, arguments, out: Path, url: str | None) -> dict:
    """One `online.run` of the preset in this process; its metrics, summarised."""
    from posttrain.config import build_config
    from posttrain.recipes import online, online_config

    overrides = {"max_steps": arguments.steps, "checkpoint_every": arguments.steps, "output_dir": str(out),
                 "data": {"max_staleness": arguments.k, "async_generation": asynchronous, "eval_size": arguments.eval_size},
                 "acceptance": {"eval_every": 0, "sets": []}}
    if url:
        overrides["rollout"] = {"engine": "vllm", "vllm": {"mode": "server", "url": url}}
    config = build_config(online_config.grpo_config, "tiny-grpo", overrides)
    started = time.perf_counter()
    directory = online.run(config)
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row.get("step", 0) > 0 and "seconds/step" in row]
    last = [row for row in rows if "heldout/pass@1" in row][-1]
    mean = lambda key: statistics.fmean(row.get(key, 0.0) for row in steps[1:])  # noqa: E731
    training = [row.get("seconds/logprobs", 0.0) + row.get("seconds/update", 0.0) for row in steps[1:]]
    generation = [row.get("offpolicy/generation_s", row.get("seconds/generation", 0.0)) for row in steps[1:]]
    return {"seconds_per_step": statistics.median(row["seconds/step"] for row in steps[1:]), "wall": wall,
            "loop": sum(row["seconds/step"] for row in steps), "training_s": statistics.fmean(training),
            "generation_s": statistics.fmean(generation),
            "wait_generation_s": mean("offpolicy/wait_generation_s"), "wait_training_s": mean("offpolicy/wait_training_s"),
            "staleness": mean("offpolicy/staleness_mean"), "pass_at_1": last["heldout/pass@1"], "steps": len(steps)}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(model: Path) -> tuple[subprocess.Popen, str]:
    """`posttrain vllm-serve` of the start model on a free port, waited for (its health route)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "posttrain", "vllm-serve", "--model", str(model), "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=5)
            return server, url
        except OSError:
            if server.poll() is not None:
                raise SystemExit(f"posttrain vllm-serve exited with {server.returncode}")
            time.sleep(2)
    server.kill()
    raise SystemExit("posttrain vllm-serve did not answer within 600 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--k", type=int, default=1, help="data.max_staleness of both modes")
    parser.add_argument("--eval-size", type=int, default=200, help="held-out problems scored at the end")
    parser.add_argument("--engine", choices=["builtin", "vllm-server"], default="builtin")
    parser.add_argument("--mode", choices=["sync", "async"], help=argparse.SUPPRESS)  # one side, in a child process
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.mode:
        result = run_mode(arguments.mode == "async", arguments, Path(arguments.out), arguments.url)
        print("SIDE " + json.dumps(result))
        return
    if not START.exists():
        raise SystemExit(f"no {START}: run `posttrain sft --config tiny-sft --max-steps 400 --output-dir runs/tiny-sft-start` first")
    os.chdir(ROOT)  # the preset's model path is relative to the repository
    server, url = start_server(START) if arguments.engine == "vllm-server" else (None, None)
    results = {}
    try:
        with tempfile.TemporaryDirectory() as work:
            for mode in ("sync", "async"):
                command = [sys.executable, __file__, "--mode", mode, "--steps", str(arguments.steps), "--k", str(arguments.k),
                           "--eval-size", str(arguments.eval_size), "--out", f"{work}/{mode}"] + (["--url", url] if url else [])
                done = subprocess.run(command, capture_output=True, text=True)
                side = [line for line in done.stdout.splitlines() if line.startswith("SIDE ")]
                if done.returncode or not side:
                    raise SystemExit(f"mode {mode} failed:\n{done.stderr[-3000:]}")
                results[mode] = json.loads(side[-1][5:])
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
    print(f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), engine {arguments.engine}")
    print(f"tiny-grpo, {arguments.steps} steps, k = {arguments.k}, held-out {arguments.eval_size} at the end")
    print("| mode | s/step (median) | steps' total s | run's wall s | generation s/step | training s/step "
          "| trainer waits for its batch, s/step | generator waits for weights, s/step | staleness mean | held-out pass@1 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, name in (("sync", "(a) synchronous"), ("async", "(b) generation overlaps training")):
        r = results[mode]
        print(f"| {name} | {r['seconds_per_step']:.3f} | {r['loop']:.1f} | {r['wall']:.1f} | {r['generation_s']:.3f} | {r['training_s']:.3f} "
              f"| {r['wait_generation_s']:.3f} | {r['wait_training_s']:.3f} | {r['staleness']:.2f} | {r['pass_at_1']:.3f} |")
    ours, peer = results["async"]["seconds_per_step"], results["sync"]["seconds_per_step"]
    print(f"RESULT async_generation_{arguments.engine.replace('-', '_')}: ours={ours:.3f} peer={peer:.3f} unit=s/step "
          f"ratio={peer / ours:.2f}")


if __name__ == "__main__":
    main()
