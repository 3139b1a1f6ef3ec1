"""Code problems from users' files: the MBPP layout (a prompt in words, assert lines, the function
name read from them), stdin/stdout cases (CodeContests' nested tests or plain inputs / outputs), each
verified in the sandbox with honest-passes / exploit-fails rows, and a GRPO run that trains on
tests/data/mbpp_small.jsonl with sandboxed rewards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.config import build_config
from posttrain.data import load_splits, load_task
from posttrain.data.examples import verifier_input
from posttrain.errors import UserError
from posttrain.recipes import online, online_config
from posttrain.rewards import get_verifier
from posttrain.rewards.code import mbpp_entry_point
from posttrain.rewards.sandbox import check_isolation

MBPP = Path(__file__).parent / "data" / "mbpp_small.jsonl"


def sandbox_available() -> bool:
    try:
        check_isolation()
        return True
    except Exception:  # noqa: BLE001
        return False


needs_sandbox = pytest.mark.skipif(not sandbox_available(), reason="needs bubblewrap (installed by .ci/run)")


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}\n```"


def test_mbpp_layout_loads_with_the_format():
    task = load_task(str(MBPP), options={"format": "mbpp"})
    assert len(task.examples) == 24 and task.reward_kind == "mbpp"
    first = task.examples[0]
    assert first.id == "1" and first.prompt.startswith("Write a function add_one") and first.tests[0] == "assert add_one(1) == 2"
    assert first.metadata["code"].startswith("def add_one")  # the reference, for audits; never in the prompt


def test_mbpp_prompt_shows_the_first_test_naming_the_function(tmp_path):
    """data.format mbpp shows the task and its first test (task_options.show_tests first, the
    format's default), whose call names the function; `none` is the task text alone; `all` is refused
    (the shown tests would be the only ones scored). A file without the format shows a test only
    when asked, and a chat prompt gets it at the end of its last user message."""
    task = load_task(str(MBPP), options={"format": "mbpp"})
    first = task.examples[0]
    assert first.prompt == ("Write a function add_one(x) that returns x plus one.\n\n"
                            "Your code should pass this test:\n\nassert add_one(1) == 2")
    assert first.tests == ["assert add_one(1) == 2", "assert add_one(-1) == 0", "assert add_one(10) == 11"]
    assert first.metadata["shown_tests"] == [0] and task.options["show_tests"] == "first"
    hidden = load_task(str(MBPP), options={"format": "mbpp", "show_tests": "none"})
    assert hidden.examples[0].prompt == "Write a function add_one(x) that returns x plus one."
    assert "shown_tests" not in hidden.examples[0].metadata and hidden.options["show_tests"] == "none"
    for value, message in (("all", "task_options.show_tests all: every test would be shown, so the shown tests would be "
                                   r"the only ones scored \(a program returning the asserted values passes them\); choose first or none"),
                           ("some", "task_options.show_tests: one of first, none, got 'some'")):
        with pytest.raises(UserError, match=message):
            load_task(str(MBPP), options={"format": "mbpp", "show_tests": value})
    own = tmp_path / "own.jsonl"
    own.write_text(json.dumps({"messages": [{"role": "user", "content": "Add one."}, {"role": "assistant", "content": "Sure."}],
                               "tests": ["assert inc(1) == 2", "assert inc(2) == 3"]}) + "\n")
    assert load_task(str(own)).examples[0].messages[0]["content"] == "Add one."
    asked = load_task(str(own), options={"show_tests": "first"}).examples[0]
    assert asked.messages == [{"role": "user", "content": "Add one.\n\nYour code should pass this test:\n\nassert inc(1) == 2"},
                              {"role": "assistant", "content": "Sure."}]


def test_entry_point_from_the_tests():
    assert mbpp_entry_point(["assert remove_Occ('hello', 'l') == 'heo'"]) == "remove_Occ"
    assert mbpp_entry_point(["assert len(set(f([1]))) == 1"]) == "f"
    assert mbpp_entry_point(["assert 1 == 1"]) is None


@needs_sandbox
@pytest.mark.parametrize("completion, reward, reason", [
    (fenced("def add_one(x):\n    return x + 1"), 1.0, "all tests passed"),
    (fenced("def add_one(x):\n    return 2"), 0.0, "2 of 3 tests failed"),
    (fenced("class Yes:\n    def __eq__(self, other):\n        return True\ndef add_one(x):\n    return Yes()"), 0.0, "cannot cross the sandbox boundary"),
    (fenced("def add_one(x):\n    return float(x + 1)"), 0.0, "tests failed"),  # 2.0 == 2 is not type-strict equal
    (fenced("import sys\nsys.exit(0)"), 0.0, ""),
    (fenced("def add_one(x):\n    while True:\n        pass"), 0.0, "timed out"),
    (fenced("def add_one(x):\n    return open('/etc/passwd').read()"), 0.0, ""),
])
def test_mbpp_verifier_honest_passes_exploits_fail(completion, reward, reason):
    example = verifier_input(load_task(str(MBPP), options={"format": "mbpp"}).examples[0])
    verdict = get_verifier("mbpp").batch([completion], [example])[0]
    assert verdict.status == "ok" and verdict.reward == reward, verdict
    assert reason in verdict.reason


def test_mbpp_rows_without_tests_are_data_errors():
    verdict = get_verifier("mbpp").batch([fenced("def f(): pass")], [{"tests": []}])[0]
    assert verdict.status == "data_error" and "an empty test list proves nothing" in verdict.reason


@pytest.fixture
def stdio_file(tmp_path) -> Path:
    rows = [
        {"name": "sum", "description": "Read two integers and print their sum.",
         "public_tests": {"input": ["1 2\n"], "output": ["3\n"]}, "private_tests": {"input": ["10 -4\n"], "output": ["6\n"]}},
        {"name": "echo", "description": "Print the input line reversed.", "inputs": ["abc\n", "xy\n"], "outputs": ["cba\n", "yx\n"]},
        {"name": "hello", "description": "Print hello.", "inputs": ["\n"], "outputs": ["hello\n"]},
    ]
    path = tmp_path / "contests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_stdio_cases_from_code_contests_layouts(stdio_file):
    task = load_task(str(stdio_file), options={"format": "code_contests"})
    assert task.reward_kind == "stdio"
    assert task.examples[0].metadata["cases"] == [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "10 -4\n", "stdout": "6\n"}]
    assert len(task.examples[1].metadata["cases"]) == 2
    # The public cases stay in metadata (what the description shows: the audit's lookup table), the private ones do not.
    assert task.examples[0].metadata["public_tests"] == {"input": ["1 2\n"], "output": ["3\n"]}
    assert "private_tests" not in task.examples[0].metadata


@needs_sandbox
def test_mbpp_test_imports_and_setup_code_run_in_the_judge():
    code = fenced("def area(r):\n    return 3.14159 * r * r")
    example = {"tests": ["assert math.isclose(area(1), 3.14159, rel_tol=1e-3)", "assert area(UNIT) == 3.14159"],
               "test_imports": ["import math"], "test_setup_code": "UNIT = 1"}
    verdict = get_verifier("mbpp")(code, example)
    assert (verdict.status, verdict.reward, verdict.details["tests_total"]) == ("ok", 1.0, 2)
    bad = get_verifier("mbpp")(code, {**example, "test_imports": 3})
    assert bad.status == "data_error" and "test_imports" in bad.reason


def test_bad_cases_are_reported(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "p", "inputs": ["1"], "outputs": ["1", "2"]}) + "\n"
                    + json.dumps({"prompt": "q", "inputs": [], "outputs": []}) + "\n")
    with pytest.raises(UserError) as error:
        load_task(str(path))
    assert f"{path}:1: outputs: 2 outputs for 1 inputs" in str(error.value)
    assert f"{path}:2: inputs: empty case list" in str(error.value)


@needs_sandbox
def test_stdio_verifier_on_those_cases(stdio_file):
    examples = [verifier_input(e) for e in load_task(str(stdio_file), options={"format": "code_contests"}).examples]
    honest = fenced("a, b = map(int, input().split())\nprint(a + b)")
    constant = fenced("print(3)")  # passes the visible public case only
    verdicts = get_verifier("stdio").batch([honest, constant, fenced("print(input()[::-1])")], [examples[0], examples[0], examples[1]])
    assert [v.reward for v in verdicts] == [1.0, 0.0, 1.0] and all(v.status == "ok" for v in verdicts)


@needs_sandbox
def test_grpo_trains_on_a_code_set_with_sandboxed_rewards(tmp_path):
    overrides = {
        "data": {"task": str(MBPP), "format": "mbpp", "eval_size": 4, "prompts_per_step": 2, "group_size": 2},
        "sampling": {"max_new_tokens": 8}, "max_steps": 2, "output_dir": str(tmp_path / "run"), "acceptance": {"eval_every": 0},
    }
    run_dir = online.run(build_config(online_config.grpo_config, None, overrides))
    card = json.loads((run_dir / "run_card.json").read_text())
    assert card["links"]["reward"]["verifier"] == "mbpp" and card["links"]["reward"]["sandbox"] == "bubblewrap"
    assert card["links"]["acceptance"]["checker_resolved"] == "mbpp"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and rows[-1]["errors/infra"] == 0 and rows[-1]["errors/data"] == 0
    assert rows[-1]["heldout/pass@1"] is not None
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["status"] == "ok" for s in samples)  # judged in the sandbox (the tiny model's code fails)
    held = json.loads(sorted((run_dir / "eval").glob("step-*.json"))[-1].read_text())
    assert held["summary"]["checker"]["verifier"] == "mbpp" and held["summary"]["data_errors"] == 0


def test_splits_of_the_code_set(tmp_path):
    train, held_out = load_splits(str(MBPP), eval_size=4, seed=0, options={"format": "mbpp"})
    assert len(train.examples) == 20 and len(held_out.examples) == 4 and train.reward_kind == "mbpp"


@needs_sandbox
def test_reward_options_reach_the_training_reward_and_the_checker():
    overrides = {
        "data": {"task": str(MBPP), "format": "mbpp", "eval_size": 4, "prompts_per_step": 2, "group_size": 2},
        "reward_options": {"timeout_s": 3.0, "memory_mb": 512, "partial_credit": True, "extraction": "fenced"},
    }
    state = online.setup(build_config(online_config.grpo_config, None, overrides))
    assert state.verifier.describe()["fraction"] is True and state.checker.describe()["fraction"] is False
    assert (state.verifier.describe()["tests"], state.checker.describe()["tests"]) == ("half", "all")
    for verifier in (state.verifier, state.checker):
        settings = verifier.describe()
        assert (settings["timeout_s"], settings["memory_mb"], settings["code_policy"]) == (3.0, 512, "fenced")
    example = verifier_input(state.train.examples[0])
    name = example["tests"][0].split("(")[0].removeprefix("assert ")
    half = fenced(f"def {name}(*args):\n    return None")
    verdict = state.verifier.batch([half], [example])[0]
    assert verdict.status == "ok" and verdict.reward == 0.0 and verdict.details["tests_total"] == 2  # the shown 1st, the hidden 2nd
    assert state.checker.batch([half], [example])[0].details["tests_total"] == 3


@pytest.mark.parametrize("options, message", [
    ({"timeout_s": 0}, "reward_options: timeout_s must be > 0"),
    ({"extraction": "last_line"}, "reward_options.extraction 'last_line': a code verifier takes one of auto, raw, fenced"),
])
def test_bad_reward_options_are_one_line(options, message):
    overrides = {"data": {"task": str(MBPP), "format": "mbpp", "eval_size": 4}, "reward_options": options}
    with pytest.raises(UserError, match=message):
        online.setup(build_config(online_config.grpo_config, None, overrides))


def test_unsafe_no_sandbox_is_loud(tmp_path, caplog):
    overrides = {
        "data": {"task": str(MBPP), "format": "mbpp", "eval_size": 4, "prompts_per_step": 2, "group_size": 2},
        "unsafe_no_sandbox": True,
    }
    config = build_config(online_config.grpo_config, None, overrides)
    with caplog.at_level("WARNING"):
        state = online.setup(config)
    assert any("UNSAFE" in record.message for record in caplog.records)
    assert state.verifier.describe()["sandbox"] == "none (--unsafe-no-sandbox)"
    card = online.make_card(config, state, None)
    assert card["notes"][0].startswith("UNSAFE: model-written code ran WITHOUT the bubblewrap sandbox")


@needs_sandbox
def test_posttrain_verify_reads_public_layouts(tmp_path):
    import subprocess
    import sys

    rows = [
        {"text": "add one", "test_list": ["assert add_one(1) == 2"], "completion": fenced("def add_one(x):\n    return x + 1")},
        {"text": "add one", "test_list": ["assert add_one(1) == 2"], "completion": fenced("def add_one(x):\n    return 5")},
    ]
    mbpp = tmp_path / "mbpp.jsonl"
    mbpp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    contests = tmp_path / "contests.jsonl"
    contests.write_text(json.dumps({"description": "sum", "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
                                    "completion": fenced("print(sum(map(int, input().split())))")}) + "\n")
    root = Path(__file__).resolve().parent.parent
    for verifier, layout, path, rewards in (("mbpp", "mbpp", mbpp, [1.0, 0.0]), ("stdio", "code_contests", contests, [1.0])):
        result = subprocess.run([sys.executable, "-m", "posttrain", "verify", "--verifier", verifier, "--format", layout,
                                 "--input", str(path)], capture_output=True, text=True, cwd=root)
        assert result.returncode == 0, result.stderr
        assert [json.loads(line)["reward"] for line in result.stdout.splitlines()] == rewards


WEAK = Path(__file__).parent / "data" / "weak_tests.jsonl"


@needs_sandbox
def test_screening_removes_failing_references_and_weak_training_problems(tmp_path):
    """Pre-flight: the problem whose own reference fails its tests is removed from whichever split
    holds it; exclude_weak_tests: training drops the problems a trivial program passes (the
    held-out split stays whole); both counted in the run card."""
    config = build_config(online_config.grpo_config, None, {
        "data": {"task": str(WEAK), "format": "mbpp", "eval_size": 2, "prompts_per_step": 2, "group_size": 2,
                 "exclude_weak_tests": True},
        "max_steps": 1, "output_dir": str(tmp_path / "run")})
    train, held_out = load_splits(str(WEAK), eval_size=2, seed=config.seed, options={"format": "mbpp"})
    state = online.setup(config)
    weak = {"sort_visible_only", "prime_all_true", "next_prime_identity", "count_primes_catch_all"}
    wrong = "max_of_three_wrong_reference"
    assert {e.id for e in state.train.examples} == {e.id for e in train.examples} - weak - {wrong}
    assert {e.id for e in state.held_out.examples} == {e.id for e in held_out.examples} - {wrong}
    screening = online.make_card(config, state, None)["links"]["data"]["screening"]
    assert screening["preflight"]["checked"] == 8 and screening["preflight"]["data_errors"] == 1
    assert screening["preflight"]["faults"] == [{"id": wrong, "reason": "reference fails its tests: 1 of 3 tests failed"}]
    assert screening["weak_tests"]["excluded"] == len({e.id for e in train.examples} & weak)
    plain = online.setup(build_config(online_config.grpo_config, None, {
        "data": {"task": str(MBPP), "format": "mbpp", "eval_size": 4, "prompts_per_step": 2, "group_size": 2}}))
    assert plain.screening["preflight"] == {"checked": 24, "without_reference": 0, "data_errors": 0,
                                            "removed": {"train": 0, "heldout": 0}, "faults": []}
    assert "weak_tests" not in plain.screening and len(plain.train.examples) == 20


@needs_sandbox
def test_mbpp_grpo_run_scores_its_correct_samples_and_never_the_shown_test_alone(tmp_path):
    """A GRPO step on the tiny model whose sampler puts each prompt's reference solution (MBPP's
    `code`, under the function name the prompt now shows) in sample 0 of its group: those rows score
    1 through the training reward, the tiny model's own samples 0, and the update has signal.
    add_one's tests are 1 -> 2 (shown), -1 -> 0, 10 -> 11: the training reward (tests: half) runs the
    shown one and the hidden 1st (2 of 3), the checker all 3; a lookup of the shown value earns 0
    from both, and the same correct code named plus_one fails to load."""
    from posttrain.rollout.sampler import single_turn

    config = build_config(online_config.grpo_config, None, {
        "data": {"task": str(MBPP), "format": "mbpp", "eval_size": 4, "prompts_per_step": 2, "group_size": 2},
        "sampling": {"max_new_tokens": 8}, "max_steps": 1, "output_dir": str(tmp_path / "run")})
    state = online.setup(config)

    def reference_first(policy, tokenizer, examples, prompts, *, group_size, **settings):
        rollout = single_turn(policy, tokenizer, examples, prompts, group_size=group_size, **settings)
        for b, example in enumerate(examples):
            rollout.texts[b * group_size] = fenced(example.metadata["code"])
        return rollout

    state.sampler = reference_first
    batch = online.sample(state)
    assert batch.scores.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert [v.details["tests_total"] for v in batch.scores.verdicts[::2]] == [2, 2]  # the shown test and the hidden 1st
    metrics = online.step(state, batch)
    assert metrics["grad_norm"] > 0
    example = {e.id: e for e in [*state.train.examples, *state.held_out.examples]}["1"]
    row = verifier_input(example)
    for completion, trained, checked in ((fenced("def add_one(x):\n    return x + 1"), (1.0, 2), (1.0, 3)),
                                         (fenced("def add_one(*args):\n    return {(1,): 2}.get(args)"), (0.0, 2), (0.0, 3))):
        verdicts = state.verifier.batch([completion], [row])[0], state.checker.batch([completion], [row])[0]
        assert [(v.reward, v.details["tests_total"]) for v in verdicts] == [trained, checked]
    renamed = state.verifier.batch([fenced("def plus_one(x):\n    return x + 1")], [row])[0]
    assert (renamed.reward, renamed.reason) == (0.0, "code failed to load: KeyError: 'add_one'")


@needs_sandbox
def test_exclude_weak_tests_drops_single_test_problems_whose_test_is_shown(tmp_path, caplog):
    """The three one-test problems of a user's MBPP file, among mbpp_small's 24: with the first
    test shown, a lookup of its asserted value passes each, so exclude_weak_tests drops those in the
    training split (counted in the card's screening, beside the shown-tests record that counts the
    problems scored on their shown test alone); mbpp_small's 10 and 20 go too (their hidden tests
    expect 0: the catch-all's default). The held-out split stays whole, its checker running every test."""
    path = tmp_path / "mixed.jsonl"
    path.write_text((MBPP.parent / "mbpp_single_tests.jsonl").read_text() + MBPP.read_text())
    data = {"task": str(path), "format": "mbpp", "eval_size": 4, "prompts_per_step": 2, "group_size": 2}
    train, held_out = load_splits(str(path), eval_size=4, seed=0, options={"format": "mbpp"})
    config = build_config(online_config.grpo_config, None, {"data": {**data, "exclude_weak_tests": True}, "max_steps": 1,
                                                             "output_dir": str(tmp_path / "run")})
    with caplog.at_level("WARNING"):
        state = online.setup(config)
    ones = {"even", "factorial", "add_numbers"} & {e.id for e in train.examples}
    weak = {e.id for e in train.examples} & (ones | {"10", "20"})
    assert ones and {e.id for e in state.train.examples} == {e.id for e in train.examples} - weak
    screening = online.make_card(config, state, None)["links"]["data"]["screening"]
    assert screening["weak_tests"]["excluded"] == len(weak)
    assert {w["id"] for w in screening["weak_tests"]["problems"]} == weak
    shown = screening["shown_tests"]
    assert (shown["policy"], shown["train"], shown["train_only_shown"]) == ("first", 23, len(ones))
    assert sorted(shown["train_only_shown_ids"]) == sorted(ones)
    assert any(f"{len(ones)} of 23 training problems have no test beyond the one their prompt shows" in r.message
               for r in caplog.records)
    for example in state.held_out.examples:
        verdict = state.checker.batch([fenced(example.metadata["code"])], [verifier_input(example)])[0]
        assert (verdict.reward, verdict.details["tests_total"]) == (1.0, len(example.tests))


def test_every_recipe_takes_reward_options_and_unsafe_no_sandbox(tmp_path, caplog):
    """The same two settings, the same way, in sft, dpo, grpo/ppo and pairs; sft's held-out checker
    is built with them (recorded in its card, which shouts about unsafe)."""
    from posttrain.recipes import dpo_config, pairs, sft

    values = {"reward_options": {"timeout_s": 4.0, "memory_mb": 256}, "unsafe_no_sandbox": True}
    required = {dpo_config.Config: {"data": {"pairs": "pairs.jsonl"}},
                pairs.PairSettings: {"model": "tiny", "data": {"task": "arithmetic"}, "out": str(tmp_path / "p.jsonl")}}
    for config_type in (sft.Config, dpo_config.Config, online_config.grpo_config, online_config.ppo_config, pairs.PairSettings):
        config = build_config(config_type, None, {**values, **required.get(config_type, {})})
        assert config.reward_options.timeout_s == 4.0 and config.unsafe_no_sandbox is True
    config = build_config(sft.Config, None, {**values, "data": {"train_size": 8, "eval_size": 4}, "max_steps": 1, "batch_size": 4,
                                             "micro_batch_size": 4, "acceptance": {"max_new_tokens": 2}, "output_dir": str(tmp_path / "sft")})
    with caplog.at_level("WARNING"):
        run_dir = sft.run(config)
    card = json.loads((run_dir / "run_card.json").read_text())
    settings = card["links"]["acceptance"]["checker_settings"]
    assert settings["verifier"] == "integer" and card["notes"][0].startswith("UNSAFE")
    assert any("UNSAFE" in record.message for record in caplog.records)
    with pytest.raises(UserError, match="acceptance.checker: unknown verifier 'nope'"):
        sft.run(build_config(sft.Config, None, {"acceptance": {"checker": "nope"}, "data": {"train_size": 8, "eval_size": 4},
                                                 "output_dir": str(tmp_path / "bad")}))
    assert not (tmp_path / "bad").exists()


@needs_sandbox
def test_training_reward_runs_half_the_tests_and_the_checker_all():
    """reward_options.tests: half runs the 1st, 3rd ... test of each problem (HumanEval asserts as
    they run, stdio cases), so a program that is right only there earns the reward and fails the
    checker, which runs all of them."""
    from posttrain.rewards import RewardOptions, as_verifier

    humaneval = {"prompt": "def f(x):\n", "entry_point": "f",
                 "test": "def check(candidate):\n    for x in range(4):\n        assert candidate(x) == x * x\n"}
    even_only = "    return x * x if x % 2 == 0 else -1\n"  # right for x = 0, 2: the asserts half runs
    stdio = {"cases": [{"stdin": f"{x}\n", "stdout": f"{x * x}\n"} for x in range(3)]}
    stdio_even = "```python\nx = int(input())\nprint(x * x if x != 1 else 0)\n```"
    for name, completion, example, half_total in (("humaneval", even_only, humaneval, 2), ("stdio", stdio_even, stdio, 2)):
        reward = as_verifier(None, name, RewardOptions())
        checker = as_verifier(None, name, RewardOptions(), for_checker=True)
        trained, checked = reward(completion, example), checker(completion, example)
        assert (trained.reward, trained.details["tests_total"]) == (1.0, half_total), trained
        assert checked.reward == 0.0 and checked.details["tests_passed"] < checked.details["tests_total"], checked
        assert as_verifier(None, name, RewardOptions(tests="all"))(completion, example).reward == 0.0


def test_verify_reads_an_mbpp_row_with_the_tests_its_training_prompt_shows():
    """`posttrain verify --format mbpp`: the row gets the `shown_tests` a training prompt of the
    layout shows (the first), so `reward_options.tests: half` runs what training runs; a row that
    names its own keeps them."""
    from posttrain.commands.verify import public_layout

    tests = ["assert f(1) == 2", "assert f(2) == 3", "assert f(3) == 4"]
    assert public_layout({"text": "t", "test_list": tests}, "mbpp")["shown_tests"] == [0]
    assert public_layout({"text": "t", "test_list": tests, "shown_tests": []}, "mbpp")["shown_tests"] == []
    assert "shown_tests" not in public_layout({"prompt": "p", "test": "def check(c): pass", "entry_point": "f"}, "humaneval")
