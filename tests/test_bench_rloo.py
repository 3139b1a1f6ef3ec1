"""Smoke run of bench/rloo.py on the tiny model, as tests/test_bench.py does for the other benchmarks:
an API change in the recipe's step or in TRL's RLOOTrainer that breaks it fails here. Numbers are not
checked (timing is never asserted); the last line must be the RESULT line, and both sides must have
run RLOO on the same prompts."""

import pytest

from tests.test_bench import RESULT, bench


def test_rloo_bench_ends_with_its_result_line():
    if not hasattr(pytest.importorskip("trl"), "RLOOTrainer"):
        pytest.skip("this TRL has no RLOOTrainer")
    lines = bench("rloo", "--model", "tiny", "--steps", "1", "--warmup", "0").strip().splitlines()
    match = RESULT.match(lines[-1])
    assert match and match.group(1) == "rloo", lines[-1]
    settings = next(line for line in lines if line.startswith("model tiny"))
    assert "same prompts" in settings and "advantage rloo" in settings and "'placement': 'reward'" in settings
