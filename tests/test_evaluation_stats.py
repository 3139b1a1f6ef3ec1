"""Acceptance statistics by hand: Wilson interval, pass@k, paired gain, divergence alarm."""

import math
from itertools import combinations

import pytest

from posttrain.evaluation.alarms import DivergenceAlarm
from posttrain.evaluation.stats import paired_difference_ci, pass_at_k, wilson_interval


def test_wilson_by_hand():
    """50/100: centre (0.5 + z^2/200) / (1 + z^2/100) = 0.5; half-width
    z sqrt(0.25/100 + z^2/40000) / (1 + z^2/100) = 1.96 * 0.050960 / 1.038415 ~ 0.0962."""
    low, high = wilson_interval(50, 100)
    assert (low, high) == pytest.approx((0.5 - 0.09617, 0.5 + 0.09617), abs=1e-4)
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_pass_at_k_matches_enumeration():
    """pass@k = fraction of k-subsets of the n samples containing at least one pass."""
    samples = [True, False, False, True, False, False]
    for k in range(1, 7):
        subsets = list(combinations(samples, k))
        expected = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(6, 2, k) == pytest.approx(expected)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(5, 0, 3) == 0.0
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_paired_difference_by_hand():
    """Differences [1, 0, 1, 0]: gain 0.5, sample variance (4 * 0.25) / 3 = 1/3,
    half-width 1.96 * sqrt(1/12) ~ 0.5658."""
    gain, low, high = paired_difference_ci([0, 1, 0, 1], [1, 1, 1, 1])
    assert gain == 0.5
    half = 1.959963984540054 * math.sqrt(1 / 12)
    assert (low, high) == pytest.approx((0.5 - half, 0.5 + half))


def test_divergence_alarm():
    alarm = DivergenceAlarm(window=3, reward_rise=0.1)
    assert alarm.observe(10, 0.2, 0.30) is None
    assert alarm.observe(20, 0.3, 0.31) is None
    assert alarm.observe(30, 0.5, 0.30) is not None  # reward +0.3, held-out 0.0
    assert "divergence" in alarm.rings[0]
    assert alarm.observe(40, 0.7, 0.30) is None and len(alarm.rings) == 1  # still diverging: it rang already
    resumed = DivergenceAlarm(window=3, reward_rise=0.1, history=[list(h) for h in alarm.history], rings=alarm.rings)
    assert resumed.observe(50, 0.9, 0.30) is None and resumed.history[0] == (10, 0.2, 0.30)
    healthy = DivergenceAlarm(window=2, reward_rise=0.1)
    healthy.observe(1, 0.2, 0.3)
    assert healthy.observe(2, 0.5, 0.4) is None  # both rose


def test_divergence_alarm_threshold_is_relative_for_a_reward_off_zero_one():
    """Rewards [-1.2, 0.3, 0.9, -0.4]: mean -0.1, population std sqrt((1.21 + 0.16 + 1.0 + 0.09) / 4)
    = 0.784219; reward_rise 0.1 rings at a rise of 0.0784. A 0/1 verifier's rewards keep the absolute 0.1."""
    alarm = DivergenceAlarm(window=2, reward_rise=0.1)
    alarm.calibrate([-1.2, 0.3, 0.9, -0.4])
    assert alarm.reward_spread == pytest.approx(0.784219, abs=1e-6) and alarm.threshold == pytest.approx(0.0784219, abs=1e-7)
    alarm.calibrate([0.0, 100.0])  # once only
    assert alarm.reward_spread == pytest.approx(0.784219, abs=1e-6) and "relative" in alarm.describe()
    alarm.observe(1, 0.0, 0.5)
    assert alarm.observe(2, 0.08, 0.5) is not None  # +0.08 >= 0.0784: rings, where an absolute 0.1 would not
    binary = DivergenceAlarm(window=2, reward_rise=0.1)
    binary.calibrate([0.0, 1.0, 1.0, 0.0])
    assert binary.reward_spread is None and binary.threshold == 0.1 and "absolute" in binary.describe()
    resumed = DivergenceAlarm(window=2, reward_rise=0.1, reward_spread=alarm.reward_spread)
    assert resumed.threshold == alarm.threshold


@pytest.mark.parametrize("reward, checker, independent, shared", [
    ("exact", "integer", True, None),
    ("0.9*exact+0.1*format", "integer", True, None),
    ("exact", "exact", False, "the checker is the training reward itself"),
    ("exact", "numeric", False, "posttrain.rewards.extract"),
    ("math", "rg", False, "posttrain.rewards.extract"),
    ("mbpp", "humaneval", False, "all of the row's tests"),
    ("math", "math_equal", True, None),
    ("rg", "rg_answer", True, None),
    ("callable:tests.rewards_for_tests.digits", "integer", True, None),
])
def test_independence_compares_the_resolved_implementations(reward, checker, independent, shared):
    from posttrain.evaluation.acceptance import independence
    from posttrain.rewards import get_verifier

    result, why = independence(get_verifier(reward), get_verifier(checker))
    assert result is independent and (shared is None or shared in why)


@pytest.mark.parametrize("completion, reward, reason", [
    ("<answer>42</answer>", 1.0, "same integer"), ("so \\boxed{ 42 }.", 1.0, "same integer"),
    ("<answer>42</answer> and \\boxed{42}", 1.0, "same integer"), ("<answer>041</answer>", 0.0, "different integer"),
    ("<answer>41 or 42</answer>", 0.0, "answer '41 or 42' is not an integer"), ("<answer>42.0</answer>", 0.0, "answer '42.0' is not an integer"),
    ("<answer>4</answer><answer>2</answer>", 0.0, "2 different answers"), ("\\boxed{42} \\boxed{43}", 0.0, "2 different answers"),
    ("<answer>42", 0.0, "an <answer> element is not closed"), ("42", 0.0, "no <answer> element or \\boxed{}"),
    ("<answer>+-42</answer>", 0.0, "answer '+-42' is not an integer"), ("<answer>٤٢</answer>", 0.0, "answer '٤٢' is not an integer"),
    ("<answer>" + "9" * 300 + "</answer>", 0.0, None),
])
def test_integer_checker(completion, reward, reason):
    from posttrain.rewards import get_verifier

    verdict = get_verifier("integer")(completion, {"answer": "42"})
    assert verdict.status == "ok" and verdict.reward == reward and (reason is None or verdict.reason == reason)
    assert get_verifier("integer")("<answer>1</answer>", {"answer": "1.5"}).status == "data_error"


@pytest.mark.parametrize("completion, reward, reason", [
    ("\\boxed{B}", 1.0, "same option"), ("<answer>(b) Paris</answer>", 1.0, "same option"), ("<answer>Option B</answer>", 1.0, "same option"),
    ("\\boxed{B. Paris}", 1.0, "same option"), ("\\boxed{A}", 0.0, "option A, not B"), ("\\boxed{A} \\boxed{B}", 0.0, "2 different answers"),
    ("\\boxed{A or B}", 0.0, "answer 'A or B' is not one option letter"), ("\\boxed{AB}", 0.0, "answer 'AB' is not one option letter"),
    ("\\boxed{Paris}", 0.0, "answer 'Paris' is not one option letter"), ("The answer is B.", 0.0, "no <answer> element or \\boxed{}"),
])
def test_letter_checker(completion, reward, reason):
    from posttrain.evaluation.acceptance import independence
    from posttrain.rewards import get_verifier

    verdict = get_verifier("letter")(completion, {"answer": "B"})
    assert (verdict.status, verdict.reward, verdict.reason) == ("ok", reward, reason)
    assert get_verifier("letter")("\\boxed{B}", {"answer": "42"}).status == "data_error"
    assert independence(get_verifier("choice"), get_verifier("letter"))[0] is True


def test_text_match_checker_and_the_default_checkers_are_independent():
    """Each kind's default checker against its default reward: written apart where we have one."""
    from posttrain.evaluation.acceptance import independence
    from posttrain.rewards.defaults import DEFAULT_CHECKERS, DEFAULT_REWARDS
    from posttrain.rewards import RewardOptions, as_verifier, get_verifier

    checker = get_verifier("text_match")
    assert checker("<answer> paris </answer>", {"answer": "Paris"}).reward == 1.0
    assert checker("<answer>Parisian</answer>", {"answer": "Paris"}).reward == 0.0
    assert checker("x", {"answer": " "}).status == "data_error"
    verdicts = {kind: independence(as_verifier(None, DEFAULT_REWARDS[kind]), as_verifier(None, DEFAULT_CHECKERS[kind], for_checker=True))
                for kind in DEFAULT_REWARDS}
    assert all(independent for independent, _ in verdicts.values()), verdicts
    # code: the same sandboxed judge, other tests (the reward runs half of them), and the card says so
    assert "every other test" not in verdicts["code"][1] and "same harness" in verdicts["code"][1]
    # training on all the tests, the checker holds nothing the policy was not rewarded on
    same = independence(as_verifier(None, "humaneval", RewardOptions(tests="all")), as_verifier(None, "humaneval", for_checker=True))
    assert same == (False, "the checker is the training reward itself (humaneval, same settings)")


@pytest.mark.parametrize("completion, gold, reward, reason", [
    ("<answer>1/2</answer>", "\\frac{1}{2}", 1.0, "equal by sympy"), ("\\boxed{0.5}", "\\frac12", 1.0, "equal by sympy"),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0, "equal by sympy"), ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0, "equal by sympy"),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0, "equal by sympy"), ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", 1.0, "equal by sympy"),
    ("\\boxed{x = 5}", "5", 1.0, "same answer"), ("\\boxed{5\\text{ cm}}", "5", 1.0, "same answer"),
    ("\\boxed{1,234}", "1234", 1.0, "same answer"), ("\\boxed{50\\%}", "50", 1.0, "same answer"),
    ("\\boxed{(1, 2)}", "(1,2)", 1.0, "same answer"), ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}", 1.0, "same answer"),
    ("\\boxed{41 or 42}", "41", 0.0, "not equal"),  # math-verify reads a hedge's first number
    ("\\boxed{(2,1)}", "(1,2)", 0.0, "not equal"), ("\\boxed{-3}", "3", 0.0, "not equal"),
    ("\\boxed{(0,1)}", "[0,1)", 0.0, "different shape (count of items or brackets)"),
    ("\\boxed{3} \\boxed{4}", "3", 0.0, "2 different answers"), ("The answer is 3", "3", 0.0, "no <answer> element or \\boxed{}"),
    ("\\boxed{9^{9^{9^9}}}", "3", 0.0, "cannot read as math: exponent over 10000"),
    ("\\boxed{2^{10}}", "1024", 1.0, "equal by sympy"), ("\\boxed{\\frac{1}{0}}", "1", 0.0, None),
])
def test_math_equal_checker(completion, gold, reward, reason):
    """The math checker's own reading (no math-verify): equal values, units and separators dropped,
    hedges, pairs in the wrong order and powers too large to check score 0."""
    from posttrain.rewards import get_verifier

    verdict = get_verifier("math_equal")(completion, {"answer": gold})
    assert verdict.status == "ok" and verdict.reward == reward and (reason is None or verdict.reason == reason), verdict
    assert get_verifier("math_equal")("\\boxed{1}", {"answer": ""}).status == "data_error"


def test_reasoning_gym_checker_and_its_default():
    """rg_answer compares with the stored answer; it is the default only where reasoning-gym's own
    scorer is that rule (leg_counting), else the dataset's scorer stays the checker (simple_integration)."""
    from posttrain.data.tasks import load_task
    from posttrain.evaluation.acceptance import default_checker
    from posttrain.rewards import get_verifier

    checker = get_verifier("rg_answer")
    assert [checker(c, {"answer": "12"}).reward for c in ("\\boxed{12}", "<answer>12.0</answer>", "\\boxed{12 legs}", "12")] == [1.0, 1.0, 0.0, 0.0]
    assert default_checker(load_task("rg:leg_counting", size=4, seed=0, split="eval")) == "rg_answer"
    assert default_checker(load_task("rg:simple_integration", size=4, seed=0, split="eval")) == "rg"


def test_harder_reasoning_gym_config_is_the_next_curriculum_level():
    from posttrain.data.tasks import harder_reasoning_gym_options
    from posttrain.evaluation.acceptance import default_shifts

    assert harder_reasoning_gym_options("leg_counting", {"min_animals": 1, "max_animals": 3}) == {
        "min_animals": 4, "max_animals": 4, "min_instances": 16, "max_instances": 16}
    assert harder_reasoning_gym_options("basic_arithmetic", {}) is None  # its defaults are the top levels
    assert default_shifts("rg:leg_counting", {"max_animals": 3}) == [
        {"name": "harder", "task": "rg:leg_counting", "task_options": {"max_animals": 4, "min_animals": 4, "min_instances": 16, "max_instances": 16}}]
    assert default_shifts("rg:basic_arithmetic", {}) == []
