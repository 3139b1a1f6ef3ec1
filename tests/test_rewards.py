"""Verifier tables: input, expected verdict (reward, status, reason), including known exploits.

The exploit suites of `posttrain audit` are tested in tests/test_audit.py; the sandbox's
containment in tests/test_sandbox_containment.py.
"""

from __future__ import annotations

import math
import time

import pytest

from posttrain.errors import UserError
from posttrain.rewards import Verdict, Verifier, as_verifier, get_verifier
from posttrain.rewards._zygote import decode_value, encode_value
from posttrain.rewards.answers import parse_number
from posttrain.rewards.code import extract_code, normalize_output, strict_equal
from posttrain.rewards.extract import extract_answer, hedge


# --- user callables for the callable: verifier (imported by dotted path in a worker) ----------
def reward_short(completion, example):
    return len(completion) <= example["limit"]


def reward_raises(completion, example):
    raise ValueError(f"bad row {example['id']}")


def reward_hangs(completion, example):
    time.sleep(60)


# --- Verdict -----------------------------------------------------------------------------------
def test_verdict_statuses_and_json():
    assert Verdict.ok(1, "fine").to_json() == {"reward": 1.0, "status": "ok", "reason": "fine"}
    assert Verdict.infra_error("dead worker").reward is None
    with pytest.raises(ValueError):
        Verdict(None, "ok", "an ok verdict needs a reward")
    with pytest.raises(ValueError):
        Verdict(0.0, "data_error", "an error has no reward")
    with pytest.raises(ValueError):
        Verdict(0.0, "maybe", "unknown status")


# --- extraction policy -------------------------------------------------------------------------
@pytest.mark.parametrize("text, policy, answer, reason", [
    (r"so \boxed{\frac{1}{2}}.", "boxed_or_tags", r"\frac{1}{2}", ""),
    (r"\boxed{3} then \boxed{4}", "boxed_or_tags", None, "2 different final answers"),
    (r"\boxed{3} and again \boxed{ 3 }", "boxed_or_tags", "3", ""),
    ("<answer>7</answer>", "boxed_or_tags", "7", ""),
    (r"<answer>7</answer> \boxed{8}", "boxed_or_tags", "8", ""),  # boxes win, by policy
    ("it is 5", "boxed_or_tags", None, r"no \boxed{} or <answer>"),
    ("it is 5, no 6", "last_number", "6", ""),
    ("total 1,234 apples", "last_number", "1234", ""),
    (r"\boxed{}", "boxed", None, r"empty \boxed{} answer"),
    ("<answer>7</answer>", "boxed", None, r"no \boxed{} answer"),
    (r"\boxed{" + "9" * 600 + "}", "boxed", None, "answer longer than 500 characters"),
    (r"\boxed{\frac{a}{b^{2}}}", "boxed", r"\frac{a}{b^{2}}", ""),
])
def test_extract_answer_table(text, policy, answer, reason):
    found = extract_answer(text, policy)
    assert (found.answer, found.reason, found.policy) == (answer, reason, policy)


@pytest.mark.parametrize("answer, gold, hedged", [
    ("3 or 4", "3", "'or' in the answer"),
    (r"3 \lor 4", "3", "'or' in the answer"),
    ("3, 4", "3", "a list where the gold answer is one value"),
    ("3, 4", "3, 4", None),
    (r"\pm 3", "3", "a ± in the answer"),
    ("maybe 3", "3", "a hedge word in the answer"),
    ("1,234", "1234", None),
    ("3", "3", None),
])
def test_hedge_table(answer, gold, hedged):
    assert hedge(answer, gold) == hedged


# --- exact / numeric / math --------------------------------------------------------------------
@pytest.mark.parametrize("name, completion, gold, reward, status", [
    ("exact", r"\boxed{Paris}", "Paris", 1.0, "ok"),
    ("exact", r"\boxed{\text{Paris}}.", "Paris", 1.0, "ok"),
    ("exact", r"\boxed{paris}", "Paris", 0.0, "ok"),
    ("exact", r"\boxed{Paris}", "", None, "data_error"),
    ("numeric", r"\boxed{0.5}", "1/2", 1.0, "ok"),
    ("numeric", r"\boxed{\frac{1}{2}}", "0.5", 1.0, "ok"),
    ("numeric", r"\boxed{1,000}", "1000", 1.0, "ok"),
    ("numeric", r"\boxed{0.5000000001}", "0.5", 1.0, "ok"),
    ("numeric", r"\boxed{0.51}", "0.5", 0.0, "ok"),
    ("numeric", r"\boxed{nan}", "0.5", 0.0, "ok"),
    ("numeric", r"\boxed{1/0}", "0.5", 0.0, "ok"),
    ("numeric", r"\boxed{1}", "one", None, "data_error"),
])
def test_string_verifiers_table(name, completion, gold, reward, status):
    verdict = get_verifier(name)(completion, {"answer": gold})
    assert (verdict.reward, verdict.status) == (reward, status), verdict


def test_parse_number_is_exact():
    assert parse_number("0.1") * 3 == parse_number("0.3")
    assert parse_number(r"\dfrac{3}{4}") == parse_number("0.75")
    assert parse_number("inf") is None and parse_number("1e5") == 100000


def test_math_verifier_table_runs_in_workers():
    """math-verify's timeouts are signals: it must run in a worker's main thread (it does)."""
    rows = [
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0, "ok"),
        (r"\boxed{\sqrt{3}/2}", r"\frac{\sqrt{3}}{2}", 1.0, "ok"),
        (r"\boxed{x^2+1}", "1+x^2", 1.0, "ok"),
        (r"\boxed{2}", "3", 0.0, "ok"),
        (r"\boxed{3 \text{ or } 2}", "3", 0.0, "ok"),
        (r"\boxed{3} \boxed{2}", "3", 0.0, "ok"),
        (r"\boxed{9^{9^{9^{9}}}}", "5", 0.0, "ok"),
        (r"\boxed{3}", r"\frac{", None, "data_error"),
        (r"\boxed{3}", None, None, "data_error"),
    ]
    started = time.monotonic()
    verdicts = get_verifier("math").batch([r[0] for r in rows], [{"answer": r[1]} for r in rows], workers=2)
    assert [(v.reward, v.status) for v in verdicts] == [(r[2], r[3]) for r in rows], verdicts
    assert verdicts[0].details == {"extraction": "boxed_or_tags", "extracted": r"\frac{1}{2}"}
    assert time.monotonic() - started < 60


# --- format, composition, callable, reasoning-gym ---------------------------------------------
@pytest.mark.parametrize("completion, reward", [
    ("<think>a</think><answer>b</answer>", 1.0),
    ("<think>a</think>\n<answer>b</answer>\n", 1.0),
    ("<answer>b</answer>", 0.0),
    ("<think>a</think><answer>b</answer><answer>c</answer>", 0.0),
    ("<think>a<answer>b</answer></think>", 0.0),
    ("<answer>b</answer><think>a</think>", 0.0),
    ("<think></think><answer>b</answer>", 0.0),
])
def test_format_table(completion, reward):
    assert get_verifier("format")(completion, {}).reward == reward


def test_weighted_sum_keeps_components():
    verifier = get_verifier("0.9*numeric+0.1*format")
    verdicts = verifier.batch(["<think>t</think><answer>4</answer>", r"\boxed{4}", r"\boxed{5}"],
                              [{"answer": "4"}] * 3)
    assert [v.reward for v in verdicts] == [pytest.approx(1.0), pytest.approx(0.9), 0.0]
    assert verdicts[1].details["components"] == {"numeric": 1.0, "format": 0.0}
    broken = verifier("<think>t</think><answer>4</answer>", {"answer": ""})
    assert broken.status == "data_error" and broken.reason.startswith("numeric:")


def test_callable_verifier_values_errors_and_timeouts():
    good = get_verifier("callable:tests.test_rewards.reward_short")
    assert [v.reward for v in good.batch(["ab", "abcd"], [{"limit": 3}] * 2)] == [1.0, 0.0]
    raising = get_verifier("callable:tests.test_rewards.reward_raises")(".", {"id": 7})
    assert (raising.status, raising.reward, raising.reason) == ("infra_error", None, "ValueError: bad row 7")
    hanging = get_verifier("callable:tests.test_rewards.reward_hangs")
    hanging.timeout_s = 1.0
    verdict = hanging(".", {})
    assert verdict.status == "infra_error" and "deadline" in verdict.reason
    with pytest.raises(ValueError, match="cannot load"):
        get_verifier("callable:tests.test_rewards.no_such_function")(".", {})


def reward_killed(completion, example):
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer does to a worker


def test_a_worker_killed_by_sigkill_is_infra_error_naming_the_oom_killer():
    """A worker that dies by SIGKILL (the kernel's OOM killer) is retried once, then its row is
    infra_error saying what a SIGKILL usually means; the pool goes on scoring other rows."""
    verdicts = get_verifier("callable:tests.test_rewards.reward_killed").batch([".", "."], [{}, {}], workers=1)
    assert all(v.status == "infra_error" for v in verdicts)
    assert "exit status -9; killed by SIGKILL, as the kernel's out-of-memory killer does" in verdicts[0].reason
    assert get_verifier("callable:tests.test_rewards.reward_short")("ab", {"limit": 3}).reward == 1.0


def test_as_verifier_wraps_a_plain_callable_in_this_process():
    """A plain callable scores in this process (no worker) on a dict copy of the example; its result
    is read by the rule `callable:` uses, with "user function" as the ok reason."""
    def length_reward(completion, example):
        assert type(example) is dict
        return example["value"]

    verifier = as_verifier(length_reward, "math")
    assert verifier.name.startswith("python:") and verifier.name.endswith("length_reward")
    assert not verifier.in_worker
    rows = [(1, (1.0, "ok", "user function")),
            (True, (1.0, "ok", "user function")),
            (False, (0.0, "ok", "user function")),
            (Verdict.ok(0.25, "partial", steps=3), (0.25, "ok", "partial")),
            (Verdict.data_error("no gold"), (None, "data_error", "no gold")),
            (math.nan, (None, "infra_error", f"{verifier.name} returned nan, not a finite number or Verdict")),
            ("1", (None, "infra_error", f"{verifier.name} returned '1', not a finite number or Verdict"))]
    verdicts = verifier.batch(["x"] * len(rows), [{"value": value} for value, _ in rows])
    assert [(v.reward, v.status, v.reason) for v in verdicts] == [expected for _, expected in rows]
    assert verdicts[3].details == {"steps": 3}


def test_as_verifier_reports_a_raising_callable_as_infra_error():
    def broken(completion, example):
        raise KeyError("answer")

    verdict = as_verifier(broken, "math")("x", {})
    assert (verdict.reward, verdict.status, verdict.reason) == (None, "infra_error", "KeyError: 'answer'")


def test_as_verifier_passes_verifiers_through_and_builds_names():
    exact = get_verifier("exact")
    assert as_verifier(exact, "math") is exact
    assert isinstance(as_verifier(None, "0.9*math+0.1*format"), Verifier)
    assert as_verifier(None, "format").name == "format"

    class Scorer:  # an instance with __call__ has no __qualname__: its type names it
        def __call__(self, completion, example):
            return 0.5

    assert as_verifier(Scorer(), "math").name == "python:Scorer"
    with pytest.raises(UserError, match="^reward: unknown verifier 'nope'"):
        as_verifier(None, "nope")


def test_reasoning_gym_uses_the_task_scorer():
    import reasoning_gym

    entry = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=1)[0]
    entry = {**entry, "metadata": {**entry["metadata"], "difficulty": {}}}
    verifier = get_verifier("rg")
    right, wrong = f"<answer>{entry['answer']}</answer>", "<answer>123456789</answer>"
    verdicts = verifier.batch([right, wrong, entry["answer"]], [entry] * 3)
    assert [(v.reward, v.status) for v in verdicts] == [(1.0, "ok"), (0.0, "ok"), (0.0, "ok")]
    assert verifier(right, {"entry": entry}).reward == 1.0
    assert verifier(right, {"answer": entry["answer"], "metadata": {"entry": entry}}).reward == 1.0
    assert verifier(right, {"answer": "1"}).status == "data_error"


def test_unknown_names_and_policies_are_errors():
    with pytest.raises(ValueError, match="unknown verifier"):
        get_verifier("nope")
    with pytest.raises(ValueError, match="extraction policy"):
        get_verifier("math", extraction="first_number")


# --- code helpers ------------------------------------------------------------------------------
@pytest.mark.parametrize("left, right, equal", [
    (1, 1, True), (True, 1, False), (1.0, 1, False), (float("nan"), float("nan"), False),
    ([1, (2, "a")], [1, (2, "a")], True), ([1, 2], (1, 2), False), ({1: "a"}, {True: "a"}, False),
    ({"a": [1.5]}, {"a": [1.5]}, True), ({1, 2}, {2, 1}, True), ({1}, {1.0}, False), (None, 0, False),
])
def test_strict_equal_table(left, right, equal):
    assert strict_equal(left, right) is equal


def test_codec_round_trips_types_and_refuses_subclasses():
    value = [1, 1.0, True, None, "s", (1, 2), {1: [2.5]}, {3}, frozenset({4}), b"\x00", 1 + 2j, float("inf")]
    decoded = decode_value(encode_value(value))
    assert strict_equal(decoded[:-1], value[:-1]) and math.isinf(decoded[-1])

    class Sneaky(int):
        def __eq__(self, other):
            return True

    with pytest.raises(TypeError):
        encode_value(Sneaky(1))
    with pytest.raises(ValueError):
        decode_value({"__eq__": [1]})


def test_extract_code_and_normalize_output():
    fenced = "Here:\n```python\nprint(1)\n```\nand\n```py\nprint(2)\n```\n"
    assert extract_code(fenced, "auto") == "print(2)\n"
    assert extract_code("print(3)", "auto") == "print(3)"
    assert extract_code("print(3)", "fenced") == ""
    assert normalize_output("1 2 \n3\n\n") == normalize_output("1 2\n3") == "1 2\n3"


def test_a_reward_kind_registered_with_a_factory_gets_the_runs_placement_and_world():
    """The open reward seam: a new kind is one registry entry; its factory gets the spec and a
    context with the run's placement and world (where a reward model would run)."""
    from posttrain.distributed import World
    from posttrain.hardware import cpu_placement
    from posttrain.rewards import registry

    seen = {}

    def factory(spec, context):
        seen.update(spec=spec, device=str(context.placement.device), world=context.world.size, tests=context.tests)
        return registry.get_verifier("exact")

    registry.register_reward("test-rm", factory, usage="test-rm:<directory>")
    try:
        verifier = as_verifier(None, "test-rm:/models/rm", placement=cpu_placement(), world=World())
        assert verifier.name == "exact" and seen == {"spec": "/models/rm", "device": "cpu", "world": 1, "tests": "half"}
        with pytest.raises(ValueError, match="already registered"):
            registry.register_reward("test-rm", factory, usage="test-rm:<directory>")
        with pytest.raises(UserError, match="test-rm:<directory>"):  # the kinds a bad name is told about
            as_verifier(None, "nope")
    finally:
        registry.PREFIXED_KINDS.pop("test-rm")


class BatchScorer:
    """Scores a whole batch at once, as a reward model would; counts its calls."""

    def __init__(self):
        self.calls = []

    def batch(self, completions, examples):
        self.calls.append(len(completions))
        return [float(len(c) % 2) for c in completions]


def test_an_object_that_scores_a_batch_is_one_call_per_batch():
    scorer = BatchScorer()
    verifier = as_verifier(scorer, "exact")
    verdicts = verifier.batch(["a", "bb", "ccc"], [{}, {}, {}])
    assert [v.reward for v in verdicts] == [1.0, 0.0, 1.0] and scorer.calls == [3]
    scorer.batch = lambda completions, examples: [1.0]  # the wrong length: every row infra_error, named
    assert {v.status for v in verifier.batch(["a", "b"], [{}, {}])} == {"infra_error"}
    assert "returned 1 results for 2 rows" in verifier.batch(["a", "b"], [{}, {}])[0].reason


def test_verifier_rows_carry_the_conversation_and_the_rendered_prompt():
    from posttrain.data.examples import Example, verifier_input

    chat = Example(id="c1", messages=[{"role": "user", "content": "2+2?"}], answer="4")
    row = verifier_input(chat, "<|user|>2+2?<|assistant|>")
    assert row["prompt"] is None and row["messages"] == [{"role": "user", "content": "2+2?"}]
    assert row["rendered_prompt"] == "<|user|>2+2?<|assistant|>" and row["answer"] == "4"
