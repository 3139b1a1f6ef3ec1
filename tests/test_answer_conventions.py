"""A data format brings its answer convention (issue 27 items 2 and 8): GSM8K's gold follows `####`,
so a model that ends `#### 33` is read as answering 33, by the reward (rewards/extract.py) and the
checker (rewards/checkers.py, read apart) under one named policy that each row carries; the
prompts say where the answer goes; `data check`, the card's verifier settings and `eval` show both;
a gold that does not parse is data_error; eval files and the review sheet show the gold and the
extracted answer beside each completion.

tests/data/gsm8k_small.jsonl is a GSM8K-layout file ({question, answer: "... #### N"}): six
problems in GSM8K's own style and 34 one-step ones."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.data import load_task
from posttrain.data.prompts import CONVENTIONS
from posttrain.errors import UserError
from posttrain.evaluation.heldout_rows import check_extraction, heldout_rows
from posttrain.rewards import Verdict, get_verifier
from posttrain.rewards import checkers, extract
from posttrain.rewards.checkers import final_answer
from posttrain.rewards.extract import extract_answer

ROOT = Path(__file__).resolve().parent.parent
GSM8K = ROOT / "tests" / "data" / "gsm8k_small.jsonl"

# (completion, policy, the one answer both readers find, or None)
POLICY_TABLE = [
    ("Janet sells 16 - 3 - 4 = 9 eggs.\nShe makes 9 * 2 = 18 dollars.\n#### 18", "hashes", "18"),
    ("#### $1,234.", "hashes", "1234"),
    ("####18", "hashes", "18"),
    ("#### 18\nso #### 18", "hashes", "18"),  # the same answer twice is one answer
    ("#### 18\n#### 19", "hashes", None),  # two different answers
    ("#### 33 apples", "hashes", None),  # strict: a number and nothing else
    ("The answer is 33", "hashes", None),
    (r"\boxed{33}", "hashes", None),
    ("#### 33", "marked", "33"),
    (r"so \boxed{33}", "marked", "33"),
    ("<answer>33</answer>", "marked", "33"),
    ("#### 33\n" + r"\boxed{33}", "marked", "33"),
    ("#### 33\n" + r"\boxed{34}", "marked", None),
    ("The answer is 33", "marked", None),  # no silent fallback to the last number
    ("The answer is 33.", "last_number", "33"),
    ("she has 1,234 apples, then -5", "last_number", "-5"),
    ("#### 33", "boxed_or_tags", None),  # the strict default does not read GSM8K's marker
    (r"\boxed{33}", "boxed_or_tags", "33"),
]


@pytest.mark.parametrize("completion, policy, answer", POLICY_TABLE)
def test_reward_and_checker_read_the_same_policy_alike(completion, policy, answer):
    """One table, two readers: extract.py (regular expressions) and checkers.py (line, character
    and HTML-parser reading) find the same answer, or none, under each named policy."""
    assert extract_answer(completion, policy).answer == answer
    assert final_answer(completion, policy)[0] == answer


def test_the_policy_names_are_one_list():
    assert checkers.POLICIES == extract.POLICIES and checkers.ROW_POLICY == extract.ROW_POLICY
    assert set(extract.ABOUT) == set(extract.POLICIES)


@pytest.mark.parametrize("name", ["math", "numeric", "exact", "math_equal", "integer"])
def test_a_gsm8k_row_scores_its_hashes_answer_and_the_setting_overrides(name):
    """The user's case: SmolLM2 ends `#### 33` (1, read by the row's own policy, `marked`) or `The
    answer is 33` (0: strict; 1 once reward_options.extraction is last_number). A row without a
    policy keeps the strict default (the arithmetic runs are unchanged)."""
    row = {"answer": "33", "answer_extraction": "marked"}
    verifier = get_verifier(name)
    assert verifier.describe()["extraction"] == "auto"
    right = verifier("3 * 11 = 33\n#### 33", row)
    assert (right.reward, right.details["extraction"], right.details["extracted"]) == (1.0, "marked", "33")
    unread = verifier("The answer is 33", row)
    assert (unread.reward, unread.details["extracted"]) == (0.0, None)
    assert verifier("#### 33", {"answer": "33"}).reward == 0.0  # no row policy: boxed_or_tags
    lenient = get_verifier(name, extraction="last_number")
    assert lenient.describe()["extraction"] == "last_number"
    assert lenient("The answer is 33", row).reward == 1.0
    assert verifier("#### 33", {"answer": "33", "answer_extraction": "first_number"}).status == "data_error"


@pytest.mark.parametrize("gold", ["Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "#### 33", "3 +", "\\frac{"])
def test_math_equal_on_a_gold_that_does_not_parse_is_data_error(gold):
    verdict = get_verifier("math_equal")(r"\boxed{72}", {"answer": gold})
    assert verdict.status == "data_error" and verdict.reward is None and "cannot be read as math" in verdict.reason


def test_a_gsm8k_file_brings_its_convention():
    """data.format gsm8k: the gold after `####`, the instruction after each question, the policy
    on each row and in the task's options; task_options.instruction replaces it or, "", drops it."""
    task = load_task(str(GSM8K), options={"format": "gsm8k"})
    instruction = CONVENTIONS["gsm8k"].instruction
    assert "####" in instruction and not any(char.isdigit() for char in instruction)  # a small model copies a number
    first = task.examples[0]
    assert first.answer == "18" and first.prompt.startswith("Janet\u2019s ducks lay 16 eggs")
    assert first.prompt.endswith("at the farmers' market?\n\n" + instruction)
    assert first.metadata["answer_extraction"] == "marked"
    assert (task.options["answer_extraction"], task.options["instruction"]) == ("marked", instruction)
    mine = load_task(str(GSM8K), options={"format": "gsm8k", "instruction": "End with: #### N"})
    assert mine.examples[0].prompt.endswith("market?\n\nEnd with: #### N")
    bare = load_task(str(GSM8K), options={"format": "gsm8k", "instruction": ""})
    assert bare.examples[0].prompt.endswith("market?") and bare.options["instruction"] is None
    assert bare.examples[0].metadata["answer_extraction"] == "marked"  # the policy stays the data's
    with pytest.raises(UserError, match=r"task_options.instruction: the text appended to every prompt \(''"):
        load_task(str(GSM8K), options={"format": "gsm8k", "instruction": 3})


def test_plain_answer_files_keep_their_prompts_and_math_files_ask_for_a_box(tmp_path):
    path = tmp_path / "plain.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    task = load_task(str(path))
    assert task.examples[0].prompt == "1+1=" and task.options["instruction"] is None
    assert task.examples[0].metadata["answer_extraction"] == "boxed_or_tags"
    math = tmp_path / "math.jsonl"
    math.write_text(json.dumps({"problem": "What is 1/2 + 1/2?", "solution": r"It is $\boxed{1}$."}) + "\n")
    example = load_task(str(math), options={"format": "math"}).examples[0]
    assert example.prompt == "What is 1/2 + 1/2?\n\n" + CONVENTIONS["boxed"].instruction and "\\boxed{}" in example.prompt
    assert (example.answer, example.metadata["answer_extraction"]) == ("1", "boxed_or_tags")


def test_data_check_shows_the_policy_and_the_instruction(capsys):
    assert main(["data", "check", str(GSM8K), "--format", "gsm8k"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == [
        f"{GSM8K}: 40 rows read, 0 bad",
        "answers read as marked ('#### N', \\boxed{} or <answer>), the gold format gsm8k's, by the reward and the checker "
        "(reward_options.extraction to change)",
        "appended to every prompt (task_options.instruction to change, '' for none):",
    ]
    assert out[3:3 + len(CONVENTIONS["gsm8k"].instruction.splitlines())] == [
        "  " + line for line in CONVENTIONS["gsm8k"].instruction.splitlines()]
    assert main(["data", "check", str(GSM8K), "--format", "gsm8k", "--instruction", ""]) == 0
    assert "no instruction appended to the prompts (task_options.instruction to add one)" in capsys.readouterr().out.splitlines()


def test_verify_reads_gsm8k_rows(tmp_path):
    """verify --verifier math_equal: a raw GSM8K solution as the gold is data_error (with the hint);
    --format gsm8k reads its gold after `####` and the completions as marked."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in [
        {"question": "q", "answer": "3 * 11 = <<3*11=33>>33\n#### 33", "completion": "3 * 11 = 33\n#### 33"},
        {"question": "q", "answer": "3 * 11 = <<3*11=33>>33\n#### 33", "completion": "The answer is 33"},
        {"question": "q", "answer": "forgot the marker", "completion": "#### 33"},
    ]))

    def verify(*flags):
        result = subprocess.run([sys.executable, "-m", "posttrain", "verify", "--verifier", "math_equal", "--input", str(rows),
                                 *flags], capture_output=True, text=True, cwd=ROOT)
        assert result.returncode == 0, result.stderr
        return [json.loads(line) for line in result.stdout.splitlines()], result.stderr

    raw, err = verify()
    assert [(row["reward"], row["status"]) for row in raw] == [(None, "data_error"), (None, "data_error"), (0.0, "ok")]
    assert "--format gsm8k reads the number after it" in err
    read, err = verify("--format", "gsm8k")
    assert [(row["reward"], row["status"]) for row in read] == [(1.0, "ok"), (0.0, "ok"), (None, "data_error")]
    assert read[2]["reason"] == "--format gsm8k: unparseable GSM8K gold: no number after '####' in 'forgot the marker'"
    assert "hint" not in err


def test_heldout_rows_and_the_extraction_warning(caplog):
    """Rows carry the gold and the extracted answer; 3 of 4 unread (> half) is one warning with
    an example and the settings; 1 of 4 is none. Code verdicts (no policy) are not counted."""
    from posttrain.data.examples import Example

    examples = [Example(id=str(i), prompt=f"q{i}", answer=str(i)) for i in range(4)]
    completions = ["#### 0", "The answer is 1", "The answer is 2", "it is 3"]
    checker = get_verifier("math_equal")
    verdicts = checker.batch(completions, [{"answer": e.answer, "answer_extraction": "marked"} for e in examples])
    rows = heldout_rows(examples, ["p"] * 4, completions, verdicts)
    assert [(row["gold"], row["extracted"], row["reward"]) for row in rows] == [
        ("0", "0", 1.0), ("1", None, 0.0), ("2", None, 0.0), ("3", None, 0.0)]
    with caplog.at_level(logging.WARNING, logger="posttrain.evaluation.heldout_rows"):
        assert check_extraction("gsm8k.jsonl", completions, verdicts) == 3
    (record,) = caplog.records
    assert record.getMessage().startswith(
        "held-out gsm8k.jsonl: 3 of 4 completions have no final answer the checker can read (extraction marked), "
        "e.g. 'The answer is 1' (no '#### N', <answer> element or \\boxed{}); say where the answer goes "
        "(task_options.instruction), leave room for it (acceptance.max_new_tokens) or read it another way "
        "(reward_options.extraction: boxed_or_tags | boxed |")
    caplog.clear()
    mostly_read = verdicts[:1] * 3 + verdicts[1:2]
    assert check_extraction("x", completions, mostly_read) == 1 and not caplog.records
    code = [Verdict.ok(0.0, "failed a test")] * 4
    assert check_extraction("x", completions, code) == 0 and not caplog.records


def test_eval_of_a_gsm8k_file_writes_gold_and_extracted_and_warns(tmp_path):
    """`posttrain eval --format gsm8k` on the tiny model (which writes no final answer): every row
    has its gold and `extracted` null, summary.json records the convention and the count, the
    log warns once, and the command says how many it could not read."""
    out = tmp_path / "eval"
    result = subprocess.run([sys.executable, "-m", "posttrain", "eval", "--model", "tiny", "--task", str(GSM8K), "--format", "gsm8k",
                             "--eval-size", "4", "--max-new-tokens", "4", "--output-dir", str(out)],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((out / "eval.json").read_text())["rows"]
    golds = {e.prompt: e.answer for e in load_task(str(GSM8K), options={"format": "gsm8k"}).examples}
    assert all(row["gold"] == next(gold for prompt, gold in golds.items() if prompt in row["prompt"]) for row in rows)
    assert [row["extracted"] for row in rows] == [None] * 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["unextracted"] == 4 and summary["answer_convention"] == {
        "answer_extraction": "marked", "instruction": CONVENTIONS["gsm8k"].instruction, "extraction_used": "marked"}
    assert summary["checker"]["extraction"] == "auto"
    assert result.stderr.count("4 of 4 completions have no final answer the checker can read (extraction marked)") == 1
    assert "  final answer read as marked: none found in 4 of 4 completions" in result.stdout


def test_the_review_sheet_shows_gold_and_extracted(tmp_path):
    """A reviewer sees the gold and what the checker read beside each completion; an older eval
    file (rows without them) says "not recorded"."""
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    rows = [{"id": "a", "prompt": "Tom has 3 apples...", "gold": "8", "completion": "3 + 5 = 8\n#### 8", "extracted": "8",
             "reward": 1.0, "status": "ok", "reason": "same answer"},
            {"id": "b", "prompt": "Mia had 14 pencils...", "gold": "8", "completion": "The answer is 8", "extracted": None,
             "reward": 0.0, "status": "ok", "reason": "no '#### N', <answer> element or \\boxed{}"}]
    (run / "eval" / "step-000001.json").write_text(json.dumps({"summary": {}, "rows": rows}))
    (run / "eval" / "step-000000.json").write_text(json.dumps({"summary": {}, "rows": [
        {key: value for key, value in row.items() if key not in ("gold", "extracted")} for row in rows]}))
    assert main(["review", str(run)]) == 0
    sample = json.loads((run / "review" / "sample.json").read_text())["rows"]
    assert [(row["gold"], row["extracted"]) for row in sample] == [("8", "8"), ("8", None)]
    sheet = (run / "review" / "sheet.html").read_text()
    assert sheet.count("gold: <code>8</code>") == 2
    assert "checker read: <code>8</code>" in sheet and "checker read: <code>none read</code>" in sheet
    (run / "review" / "marks.json").unlink()
    assert main(["review", str(run), "--step", "0"]) == 0
    sheet = (run / "review" / "sheet.html").read_text()
    assert sheet.count("gold: <code>not recorded</code>") == 2 and sheet.count("checker read: <code>not recorded</code>") == 2
