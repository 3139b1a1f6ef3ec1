"""rollout.engine worker against in-process `generate`: the per-call overhead of the worker process.

Setting: the tiny model (`load_model("tiny")`), 4 prompts x G = 4 = 16 rows, 16 new tokens, the
caller's torch threads in both. Each measurement is the median of `--calls` calls: in-process
`generate`, the worker with the weights unchanged (the pipe and the Rollout's return), and the worker
after an in-place weight change (plus the full-weight sync). The worker's start (spawn, imports,
load) is printed once.

Run: python bench/worker_rollout.py [--calls 20]
Ends with: RESULT worker_rollout: ours=<worker ms> peer=<in-process ms> unit=ms ratio=R
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from posttrain.models import load_model
from posttrain.rollout.engine import generate
from posttrain.rollout.sampling import SamplingConfig
from posttrain.rollout.worker_engine import WorkerEngine


def median_seconds(call, calls: int) -> float:
    times = []
    for index in range(calls):
        started = time.perf_counter()
        call(index)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    calls = parser.parse_args().calls
    model, tokenizer = load_model("tiny")
    prompts = ["12 + 7 =", "The cat", "hello there, my", "3 * 4 ="]
    sampling = SamplingConfig(max_new_tokens=16)
    engine = WorkerEngine()
    started = time.perf_counter()
    engine(model, tokenizer, prompts, group_size=4, sampling=sampling)
    start_s = time.perf_counter() - started

    def changed_then_call(index: int) -> None:
        with torch.no_grad():
            next(model.parameters()).add_(1e-6)  # as an optimizer step would: the next call syncs
        engine(model, tokenizer, prompts, group_size=4, sampling=sampling, seed=index)

    local = median_seconds(lambda i: generate(model, tokenizer, prompts, group_size=4, sampling=sampling, seed=i), calls)
    worker = median_seconds(lambda i: engine(model, tokenizer, prompts, group_size=4, sampling=sampling, seed=i), calls)
    synced = median_seconds(changed_then_call, calls)
    engine.close()
    print(f"threads {torch.get_num_threads()}; worker start {start_s:.2f}s; in-process {local * 1e3:.1f} ms; "
          f"worker {worker * 1e3:.1f} ms (+{(worker - local) * 1e3:.1f} ms); after a weight change {synced * 1e3:.1f} ms")
    print(f"RESULT worker_rollout: ours={worker * 1e3:.1f} peer={local * 1e3:.1f} unit=ms ratio={local / worker:.2f}")


if __name__ == "__main__":
    main()
