"""Prompt tasks carry what their verifiers need, are seeded, and their splits never overlap."""

import json

import pytest

from posttrain.data import Example, Task, check_disjoint, load_splits, load_task, remove_overlap, score_reasoning_gym
from posttrain.data import require_examples
from posttrain.errors import UserError
from posttrain.models import build_tiny_tokenizer


def test_arithmetic_is_seeded_and_exact():
    task = load_task("arithmetic", size=50, seed=3, options={"digits": 3})
    again = load_task("arithmetic", size=50, seed=3, options={"digits": 3})
    other = load_task("arithmetic", size=50, seed=4, options={"digits": 3})
    assert [e.prompt for e in task.examples] == [e.prompt for e in again.examples]
    assert [e.prompt for e in task.examples] != [e.prompt for e in other.examples]
    for example in task.examples:
        a, b = example.prompt.removesuffix("=").split("+")
        assert 100 <= int(a) <= 999 and 100 <= int(b) <= 999
        assert example.answer == str(int(a) + int(b))
    assert task.reward_kind == "number"
    subtraction = load_task("arithmetic", size=30, options={"operation": "sub", "digits": 1})
    assert all(int(e.answer) >= 0 for e in subtraction.examples)
    tokenizer = build_tiny_tokenizer()
    assert all(1 not in tokenizer(e.prompt + e.answer)["input_ids"] for e in task.examples)  # no <unk>


def test_arithmetic_bad_options():
    with pytest.raises(UserError, match="unknown option 'digit' \\(known: digits, operation, phrasing\\)"):
        load_task("arithmetic", size=5, options={"digit": 2})
    with pytest.raises(UserError, match="digits must be an integer from 1 to 18, got 0"):
        load_task("arithmetic", size=5, options={"digits": 0})
    with pytest.raises(UserError, match="option phrasing must be symbols, words or question, got 'latin'"):
        load_task("arithmetic", size=5, options={"phrasing": "latin"})
    words = load_task("arithmetic", size=3, seed=4, options={"phrasing": "words", "operation": "mul"})
    symbols = load_task("arithmetic", size=3, seed=4, options={"operation": "mul"})
    assert [e.prompt for e in words.examples] == [e.prompt.replace("*", " times ").replace("=", " =") for e in symbols.examples]
    assert [e.answer for e in words.examples] == [e.answer for e in symbols.examples]
    question = load_task("arithmetic", size=3, seed=4, options={"phrasing": "question", "operation": "mul"})
    assert [e.prompt for e in question.examples] == [f"What is {e.prompt[:-1]}?" for e in symbols.examples]
    with pytest.raises(UserError, match="give a size"):
        load_task("arithmetic")
    with pytest.raises(UserError, match="unknown"):
        load_task("no-such-task")


def test_splits_never_overlap_and_duplicates_are_counted():
    """1-digit addition has only 100 distinct prompts, so 300 training draws must hit the 40
    held-out prompts; every hit is removed from training and counted."""
    train, held_out = load_splits("arithmetic", train_size=300, eval_size=40, seed=0, options={"digits": 1})
    held_out_prompts = {e.prompt for e in held_out.examples}
    assert not held_out_prompts & {e.prompt for e in train.examples}
    assert train.duplicates_removed > 0 and len(train) == 300 - train.duplicates_removed
    assert len(held_out) == 40
    # The held-out split does not depend on the training size.
    _, held_out_again = load_splits("arithmetic", train_size=10, eval_size=40, seed=0, options={"digits": 1})
    assert [e.prompt for e in held_out_again.examples] == [e.prompt for e in held_out.examples]


def test_remove_overlap_by_hand():
    train = Task("t", "train", [Example("1", prompt="a "), Example("2", prompt="b"),
                                Example("3", messages=[{"role": "user", "content": "c"}])], "math")
    held_out = Task("t", "eval", [Example("9", prompt=" a"), Example("8", messages=[{"role": "user", "content": "c "}])], "math")
    assert remove_overlap(train, held_out) == 2
    assert [e.id for e in train.examples] == ["2"] and train.duplicates_removed == 2
    check_disjoint(train, held_out)
    with pytest.raises(UserError, match="2 usable examples, fewer than one batch of 4"):
        require_examples(held_out, batch_size=4)


def test_reasoning_gym_rows_carry_their_scorer():
    train, held_out = load_splits("rg:basic_arithmetic", train_size=8, eval_size=4, seed=1,
                                  options={"max_terms": 2, "max_digits": 2})
    example = train.examples[0]
    assert example.metadata["rg_dataset"] == "basic_arithmetic"
    assert example.metadata["rg_options"] == {"max_terms": 2, "max_digits": 2}
    assert example.metadata["entry"]["answer"] == example.answer
    assert example.prompt == example.metadata["entry"]["question"]
    assert score_reasoning_gym(example, example.answer) == 1.0
    assert score_reasoning_gym(example, str(int(example.answer) + 1)) == 0.0
    assert train.reward_kind == "reasoning_gym"
    json.dumps(example.metadata)  # plain data: can cross to a worker process
    assert not {e.prompt for e in train.examples} & {e.prompt for e in held_out.examples}
    with pytest.raises(UserError, match="reasoning-gym has no dataset 'nope'"):
        load_task("rg:nope", size=2)
    with pytest.raises(UserError, match="bad options"):
        load_task("rg:basic_arithmetic", size=2, options={"bogus": 1})


def test_humaneval_rows_carry_tests_and_entry_points():
    task = load_task("humaneval")
    assert len(task) == 164 and task.reward_kind == "code"
    first = task.examples[0]
    assert first.id == "HumanEval/0" and first.entry_point == "has_close_elements"
    assert first.prompt.startswith("from typing import List") and "def has_close_elements" in first.prompt
    assert first.tests and "def check(candidate)" in first.tests[0]
    assert "canonical_solution" in first.metadata and first.answer is None
    assert all(e.tests and e.entry_point for e in task.examples)
    train, held_out = load_splits("humaneval", eval_size=64, seed=0)
    assert (len(train), len(held_out)) == (100, 64)
    assert not {e.id for e in train.examples} & {e.id for e in held_out.examples}
    with pytest.raises(UserError, match="more than its 164 examples"):
        load_splits("humaneval", train_size=150, eval_size=64)


def test_jsonl_task_splits_and_length_limit(tmp_path):
    path = tmp_path / "math.jsonl"
    rows = [{"prompt": f"{i}*2=", "answer": str(2 * i)} for i in range(20)] + [{"prompt": "0*2=", "answer": "0"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    train, held_out = load_splits(str(path), eval_size=5, seed=2)
    assert len(held_out) == 5 and len(train) + train.duplicates_removed == 16
    assert not {e.prompt for e in train.examples} & {e.prompt for e in held_out.examples}
    # With the tiny chat template "12+34=" is 25 tokens: <|im_start|> "user\n" (5) the 6 characters
    # <|im_end|> "\n" <|im_start|> "assistant\n" (10).
    tokenizer = build_tiny_tokenizer()
    with pytest.raises(UserError, match="arithmetic:1: prompt: 25 tokens, longer than max_prompt_tokens=24"):
        load_task("arithmetic", size=3, tokenizer=tokenizer, max_prompt_tokens=24)
    assert len(load_task("arithmetic", size=3, tokenizer=tokenizer, max_prompt_tokens=25)) == 3
    with pytest.raises(UserError, match="no usable examples \\(40 bad rows dropped\\)"):  # "3+4=" is 23 tokens
        load_task("arithmetic", size=40, options={"digits": 1}, tokenizer=tokenizer, max_prompt_tokens=22,
                  strict=False)


def test_the_epoch_stream_is_one_permutation_per_epoch_and_resumes_by_position():
    """Both seedings go through `epoch_indices`: every epoch visits each row once, a stream read
    in pieces equals one read whole (so a resumed run continues it), and the two seedings differ."""
    from posttrain.data.examples import Example, Task
    from posttrain.data.stream import PromptStream, data_order, epoch_indices

    whole = data_order(7, 3, 0, 21)
    assert all(sorted(whole[e * 7:(e + 1) * 7]) == list(range(7)) for e in range(3))
    assert data_order(7, 3, 0, 5) + data_order(7, 3, 5, 9) + data_order(7, 3, 14, 7) == whole
    assert epoch_indices(7, 0, 21, lambda epoch: 3 * 1_000_003 + epoch) == whole
    task = Task(name="t", split="train", examples=[Example(id=str(i), prompt=str(i)) for i in range(7)], reward_kind="number")
    stream = PromptStream(task, 3)
    pieces = [int(e.id) for count in (5, 9, 7) for e in stream.take(count)]
    assert stream.position == 21 and pieces == [int(e.id) for e in PromptStream(task, 3).take(21)]
    assert [int(e.id) for e in PromptStream(task, 3, position=14).take(7)] == pieces[14:]
    assert pieces != whole  # the online stream's own seeding
