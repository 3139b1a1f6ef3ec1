"""Every bad-input case gets its own `FILE:LINE: field: reason`; strict stops, strict: false drops."""

import json

import pytest

from posttrain.data import (
    load_preference_file,
    load_prompt_file,
    tokenize_preference_pairs,
    validate_preference_file,
    validate_prompt_file,
)
from posttrain.errors import UserError
from posttrain.models import build_tiny_tokenizer


def write_lines(path, lines):
    """Lines are JSON values (dumped) or raw bytes (written as they are)."""
    with open(path, "wb") as handle:
        for line in lines:
            handle.write(line if isinstance(line, bytes) else json.dumps(line).encode())
            handle.write(b"\n")
    return path


PROMPT_CASES = [  # (row, expected "field: reason" for that line)
    ({"prompt": "   ", "answer": "1"}, "prompt: empty or whitespace-only"),
    ({"answer": "1"}, "prompt: missing field (need `prompt` or `messages`)"),
    ({"prompt": "2+2="}, "answer: missing field (need `answer`, `tests`, or `inputs` and `outputs`)"),
    ({"prompt": 7, "answer": "1"}, "prompt: wrong type: expected a string, got number"),
    (b'{"prompt": "2+2=", "answer": 4', "row: invalid JSON: Expecting ',' delimiter (column 31)"),
    (b'{"prompt": "caf\xe9", "answer": "1"}', "row: non-UTF-8 bytes (byte 0xe9 at column 16)"),
    ({"prompt": "write f", "tests": []}, "tests: empty test list"),
    ({"prompt": "2+2=", "answer": "\\frac{1"}, "answer: unparseable gold answer '\\\\frac{1': math-verify finds no expression"),
    ({"prompt": "2+2=", "answer": ["4"]}, "answer: wrong type: expected a string or number, got list"),
    ({"prompt": "2+2=", "answer": ""}, "answer: empty or whitespace-only"),
    ({"prompt": "x", "messages": [], "answer": "1"}, "prompt: give `prompt` or `messages`, not both"),
    ({"messages": "hi", "answer": "1"}, "messages: wrong type: expected a list of {role, content} messages, got string"),
    ({"messages": [{"role": "robot", "content": "hi"}], "answer": "1"}, "messages[0].role: expected one of system, user, assistant, tool, got 'robot'"),
    ({"messages": [{"role": "user", "content": " "}], "answer": "1"}, "messages[0].content: empty or whitespace-only"),
    ({"prompt": "f", "tests": ["assert f() == 1", 3]}, "tests[1]: wrong type: expected a string, got number"),
    ({"prompt": "f", "tests": ["assert f()"], "entry_point": "not valid"}, "entry_point: 'not valid' is not a Python identifier"),
    ([1, 2], "row: expected a JSON object, got list"),
    ({"prompt": "2+2=", "answer": "4", "id": "a"}, None),
    ({"prompt": "3+3=", "answer": "6", "id": "a"}, "id: duplicate id 'a' (first on line 18)"),
    ({"prompt": "1234567890" * 3, "answer": "4"}, "prompt: 30 tokens, longer than max_prompt_tokens=25"),
    ({"messages": [{"role": "user", "content": "1+1="}],  # "User: 1+1=\nAssistant:", 21 tokens
      "answer": 2, "metadata": {"level": 1}, "difficulty": "easy"}, None),
]


def test_every_bad_prompt_row_is_reported_with_file_line_field(tmp_path):
    path = write_lines(tmp_path / "prompts.jsonl", [row for row, _ in PROMPT_CASES])
    parsed, report = validate_prompt_file(
        path, tokenizer=build_tiny_tokenizer(), max_prompt_tokens=25, use_chat_template=False
    )
    expected = [f"{path}:{n}: {message}" for n, (_, message) in enumerate(PROMPT_CASES, 1) if message]
    assert report.lines() == expected
    assert report.rows_read == len(PROMPT_CASES)
    assert report.rows_bad == len(expected)
    assert [line for line, _ in parsed] == [18, 21]
    last = parsed[1][1]
    assert last.answer == "2" and last.metadata["level"] == 1 and last.metadata["difficulty"] == "easy"
    assert last.id == "prompts.jsonl:21"


def test_strict_stops_with_the_whole_report_and_lenient_drops(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [
        {"prompt": "1+1=", "answer": "2"}, {"prompt": "", "answer": "1"}, b"not json", {"prompt": "3+3=", "answer": 6},
    ])
    with pytest.raises(UserError) as error:
        load_prompt_file(path)
    message = str(error.value)
    assert message.splitlines()[0] == f"{path}: 4 rows read, 2 bad (fix them, or set data.strict false to drop bad rows):"
    assert f"{path}:2: prompt: empty or whitespace-only" in message
    assert f"{path}:3: row: invalid JSON: Expecting value (column 1)" in message
    task = load_prompt_file(path, strict=False)
    assert [e.prompt for e in task.examples] == ["1+1=", "3+3="] and task.rows_bad == 2
    assert task.reward_kind == "math"


def test_reasons_count_the_bad_rows_by_kind():
    """Problems of one kind count together whatever the row's own values: two over-long prompts (1059
    and 12 tokens, the limit kept), one unparseable answer (its value left out), one row with two bad
    message roles (counted once), one invalid JSON row (its column left out)."""
    from posttrain.data.validation import ValidationReport

    report = ValidationReport("f.jsonl")
    report.add(1, "prompt", "1059 tokens, longer than max_prompt_tokens=1024")
    report.add(2, "prompt", "12 tokens, longer than max_prompt_tokens=1024")
    report.add(3, "answer", "unparseable gold answer 'ten': not a number")
    report.add(4, "messages[0].role", "expected one of system, user")
    report.add(4, "messages[1].role", "expected one of system, user")
    report.add(5, "row", "invalid JSON: Expecting value (column 1)")
    assert report.reasons() == {"prompt: N tokens, longer than max_prompt_tokens=1024": 2,
                                "answer: unparseable gold answer ...: not a number": 1,
                                "messages[i].role: expected one of system, user": 1, "row: invalid JSON: Expecting value": 1}
    assert report.dropped() == {"rows_bad": 5, "rows_bad_reasons": report.reasons()}


def test_empty_missing_and_number_answers(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        load_prompt_file(tmp_path / "missing.jsonl")
    empty = write_lines(tmp_path / "empty.jsonl", [])
    with pytest.raises(UserError, match=r"empty.jsonl: no rows \(an empty file\)$"):
        load_prompt_file(empty)
    all_bad = write_lines(tmp_path / "bad.jsonl", [{"prompt": " ", "answer": "1"}])
    with pytest.raises(UserError, match="no usable examples \\(1 bad rows dropped\\)"):
        load_prompt_file(all_bad, strict=False)
    numbers = write_lines(tmp_path / "n.jsonl", [{"prompt": "a", "answer": "1,024"}, {"prompt": "b", "answer": "ten"}])
    _, report = validate_prompt_file(numbers, answer_format="number")
    assert report.lines() == [f"{numbers}:2: answer: unparseable gold answer 'ten': not a number"]
    _, report = validate_prompt_file(numbers, answer_format="text")
    assert report.lines() == []


PREFERENCE_CASES = [
    ({"prompt": "Sky?", "chosen": "Blue.", "rejected": "Green."}, None),
    ({"prompt": [{"role": "user", "content": "Sky?"}], "chosen": [{"role": "assistant", "content": "Blue."}],
      "rejected": [{"role": "assistant", "content": "Green."}]}, None),
    ({"chosen": [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Blue."}],
      "rejected": [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Green."}]}, None),
    ({"prompt": "Sky?", "chosen": "Blue.", "rejected": "Blue."}, "chosen: identical to rejected"),
    ({"prompt": "Sky?", "chosen": "", "rejected": "Green."}, "chosen: empty or whitespace-only"),
    ({"prompt": "Sky?", "chosen": "Blue.", "rejected": "  "}, "rejected: empty or whitespace-only"),
    ({"prompt": "Sky?", "chosen": "Blue."}, "rejected: missing field"),
    ({"chosen": "Blue.", "rejected": "Green."}, "prompt: missing field (the standard format needs a prompt string)"),
    ({"prompt": "\t", "chosen": "Blue.", "rejected": "Green."}, "prompt: empty or whitespace-only"),
    ({"prompt": "Sky?", "chosen": 1, "rejected": "Green."}, "chosen: wrong type: expected a string, got number"),
    ({"chosen": [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Blue."}],
      "rejected": [{"role": "user", "content": "Sea?"}, {"role": "assistant", "content": "Green."}]},
     "rejected: implicit prompt differs from chosen's (all messages but the last must match)"),
    ({"prompt": [{"role": "user", "content": "Sky?"}], "chosen": [{"role": "user", "content": "Blue."}],
      "rejected": [{"role": "assistant", "content": "Green."}]},
     "chosen: expected exactly one assistant message after an explicit prompt"),
    (b"\xff\xfe", "row: non-UTF-8 bytes (byte 0xff at column 1)"),
    ({"prompt": "x" * 40, "chosen": "a", "rejected": "b"}, "prompt: 40 tokens, longer than max_prompt_tokens=30"),
]


def test_every_bad_preference_row_is_reported(tmp_path):
    path = write_lines(tmp_path / "pairs.jsonl", [row for row, _ in PREFERENCE_CASES])
    parsed, report = validate_preference_file(
        path, tokenizer=build_tiny_tokenizer(), max_prompt_tokens=30, use_chat_template=False
    )
    expected = [f"{path}:{n}: {message}" for n, (_, message) in enumerate(PREFERENCE_CASES, 1) if message]
    assert report.lines() == expected
    standard, explicit, implicit = (pair for _, pair in parsed)
    assert (standard.prompt, standard.chosen, standard.rejected) == ("Sky?", "Blue.", "Green.")
    assert explicit.prompt == implicit.prompt == [{"role": "user", "content": "Sky?"}]
    assert (implicit.chosen, implicit.rejected) == ("Blue.", "Green.")
    with pytest.raises(UserError, match="14 rows read, 11 bad"):
        load_preference_file(path, tokenizer=build_tiny_tokenizer(), max_prompt_tokens=30, use_chat_template=False)
    data = load_preference_file(path, strict=False)
    assert len(data.pairs) == 4 and data.rows_bad == 10  # no length limit without a tokenizer


def test_preference_pairs_tokenize_to_matching_halves(tmp_path):
    """Prompt "Sky?" (4 tokens) with chosen "Blue." (5 + EOS) and rejected "Green!!" (7 + EOS):
    both halves padded to 4 + 8 = 12, masks over their own responses only, with a shared system prompt."""
    tokenizer = build_tiny_tokenizer()
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "Sky?", "chosen": "Blue.", "rejected": "Green!!"}])
    data = load_preference_file(path)
    batch = tokenize_preference_pairs(tokenizer, data.pairs, use_chat_template=False)
    assert batch.chosen.input_ids.shape == batch.rejected.input_ids.shape == (1, 12)
    assert batch.chosen.mask.tolist() == [[False] * 4 + [True] * 6 + [False] * 2]
    assert batch.rejected.mask.tolist() == [[False] * 4 + [True] * 8]
    assert tokenizer.decode(batch.rejected.input_ids[0]) == "Sky?Green!!<|im_end|>"
    with_system = tokenize_preference_pairs(tokenizer, data.pairs, system_prompt="Be brief.")
    assert tokenizer.decode(with_system.chosen.input_ids[0]).startswith("<|im_start|>system\nBe brief.<|im_end|>")
