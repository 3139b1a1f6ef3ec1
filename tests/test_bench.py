"""Smoke runs of the benchmark scripts on the tiny model: they mirror the recipes' loops, so an API
change that breaks them fails here, not on the next benchmark day. Numbers are not checked (timing
is never asserted); the output's last line must be the RESULT line `make bench` reads."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULT = re.compile(r"^RESULT (\w+): ours=[\d.]+ peer=[\d.]+ unit=\S+ ratio=[\d.]+$")


def bench(name: str, *arguments: str) -> str:
    result = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), *arguments], capture_output=True,
                            text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize("name, arguments", [
    ("rollout", ["--model", "tiny", "--rounds", "1", "--new-tokens", "4"]),
    ("grpo", ["--model", "tiny", "--steps", "1", "--warmup", "0"]),
    ("verify_humaneval", ["--repeats", "1", "--workers", "1"]),
    pytest.param("dpo", ["--model", "tiny", "--steps", "1", "--warmup", "1"], marks=pytest.mark.slow),
    pytest.param("distributed", ["--steps", "3", "--warmup", "1", "--rounds", "1"], marks=pytest.mark.slow),
])
def test_bench_script_ends_with_its_result_line(name, arguments):
    last = bench(name, *arguments).strip().splitlines()[-1]
    match = RESULT.match(last)
    assert match and match.group(1) == name, last


@pytest.mark.parametrize("side", ["ours", "ours-precomputed"])
def test_dpo_bench_runs_our_side(side):
    """Our side of bench/dpo.py (the recipe's train_step) in the default suite; the whole script,
    TRL's sides included, is the slow case above."""
    result = json.loads(bench("dpo", "--side", side, "--model", "tiny", "--steps", "1", "--warmup", "1").strip().splitlines()[-1])
    assert result["steps_per_second"] > 0 and result["peak_rss_mb"] > 0
