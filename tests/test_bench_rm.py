"""Smoke run of bench/rm.py on the tiny model, as tests/test_bench.py does for the other benchmarks:
an API change in the rm recipe's set-up or step, in `rm:DIR` scoring or in TRL's RewardTrainer that
breaks it fails here. Numbers are not checked (timing is never asserted); the output ends with the
three RESULT lines, and the script itself fails unless both training sides saw the same pairs and
tokens with the same first-step loss, and both scorers gave the same rewards."""

import pytest

from tests.test_bench import RESULT, bench


def test_rm_bench_ends_with_its_three_result_lines():
    if not hasattr(pytest.importorskip("trl"), "RewardTrainer"):
        pytest.skip("this TRL has no RewardTrainer")
    lines = bench("rm", "--model", "tiny", "--steps", "1", "--warmup", "1", "--repeats", "1", "--completions", "16").strip().splitlines()
    matches = [RESULT.match(line) for line in lines[-3:]]
    assert all(matches), lines[-3:]
    assert [match.group(1) for match in matches] == ["rm_step", "rm_step_memory", "rm_scoring"]
    assert [line.split(" unit=")[1].split()[0] for line in lines[-3:]] == ["s/step", "MiB", "completions/s"]
    settings = next(line for line in lines if line.startswith("model tiny"))
    assert "same pairs and tokens every step" in settings and "raw rewards equal" in settings
