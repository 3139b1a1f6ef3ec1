"""`posttrain pairs --sft`: SFT rows from a teacher's samples (keep all | correct, repeats, budgets),
the sidecar's token count, the SFT run card reading it, and the refused command lines."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.data.examples import Example
from posttrain.data.provenance import file_sha256, provenance_path
from posttrain.data.teacher_sft import Budget, TeacherRows, select_samples
from posttrain.data.tokenize import encode_response
from posttrain.rewards import Verdict
from tests.flags import with_flags
from tests.rewards_for_tests import digits

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
PAIRS = ["pairs", "--sft", "--model", "tiny", "--data.task", "arithmetic", "--group-size", "4", "--data.max_prompts", "8",
         "--data.eval_size", "8", "--max-new-tokens", "6", "--seed", "3", "--verifier", "callable:tests.rewards_for_tests.digits"]


def ok(reward):
    return Verdict.ok(reward, "test")


@pytest.mark.parametrize(
    "keep, distinct, indices, counts",
    [
        # texts [a, a, "", b, c], rewards [1, 1, 1, 0, error]
        ("all", False, [0, 1, 3, 4], {"rejected": 0, "unscored": 0, "duplicates": 1, "empty": 1}),  # the repeat kept, counted
        ("all", True, [0, 3, 4], {"rejected": 0, "unscored": 0, "duplicates": 1, "empty": 1}),
        ("correct", False, [0, 1], {"rejected": 1, "unscored": 1, "duplicates": 1, "empty": 1}),
        ("correct", True, [0], {"rejected": 1, "unscored": 1, "duplicates": 1, "empty": 1}),
    ],
)
def test_select_samples(keep, distinct, indices, counts):
    texts = ["a", "a", " ", "b", "c"]
    verdicts = [ok(1), ok(1), ok(1), ok(0), Verdict.infra_error("down")]
    selected = select_samples(texts, verdicts, keep, threshold=1.0, distinct=distinct)
    assert selected.indices == indices
    assert {name: getattr(selected, name) for name in counts} == counts


def test_budget_takes_a_prefix_of_whole_rows():
    """Rows of 3, 2, 1 tokens under max_tokens 4: the first (3) fits, the second (3 + 2 = 5) does
    not, and the third (1) is refused too although it would fit: the file is a prefix."""
    budget = Budget(max_tokens=4)
    assert [budget.admits(0, 0, 3), budget.admits(1, 3, 2), budget.admits(1, 3, 1)] == [True, False, False] and budget.full
    rows = Budget(max_rows=2)
    assert [rows.admits(0, 0, 9), rows.admits(1, 9, 9), rows.admits(2, 18, 1)] == [True, True, False]


def test_teacher_rows_count_tokens_and_use_the_prompt_layout():
    """A string prompt gets a string completion, a messages prompt an assistant message list (TRL's
    conversational layout); completion_tokens is the sum of the completions' tokens, EOS excluded."""
    from posttrain.models import build_tiny_model

    _, tokenizer = build_tiny_model(seed=0)
    rows = TeacherRows("all", 1.0, False, Budget(max_rows=3), tokenizer)
    first = rows.add(Example("p0", "1+1="), ["2", "two"], [ok(1), ok(0)], [False, True], {"sampled_from": "tiny"})
    chat = rows.add(Example("p1", messages=[{"role": "user", "content": "2+2="}]), ["4", "5"], [ok(1), ok(0)], [False, False], {})
    assert [row["completion"] for row in first] == ["2", "two"] and first[1]["metadata"]["truncated"] is True
    assert chat[0]["completion"] == [{"role": "assistant", "content": "4"}] and len(chat) == 1  # max_rows 3
    assert rows.completion_tokens == sum(len(encode_response(tokenizer, text, add_eos=False)) for text in ("2", "two", "4")) == 5
    assert rows.provenance()["dropped"]["over_budget"] == 1 and rows.provenance()["budget_reached"] is True


def test_keep_correct_keeps_only_accepted_samples(tmp_path):
    """--keep correct: every row is a sample the verifier accepts (re-scored here), the sidecar's
    counts add up (samples = rows + dropped) and its token count is the tokenised completions'."""
    from posttrain.config import build_config
    from posttrain.models import build_tiny_model
    from posttrain.recipes.pairs import PairSettings, build_pairs

    out = tmp_path / "teacher.jsonl"
    settings = build_config(PairSettings, None, {
        "model": "tiny", "data": {"task": "arithmetic", "max_prompts": 8, "eval_size": 8}, "group_size": 4, "seed": 3,
        "sampling": {"max_new_tokens": 6, "temperature": 1.0}, "verifier": "callable:tests.rewards_for_tests.digits",
        "sft": True, "keep": "correct", "out": str(out)})
    meta = build_pairs(settings)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert meta["rows"] == len(rows) > 0 and meta["keep"] == "correct" and meta["samples"] == 32
    assert all(digits(row["completion"], {}) == 1.0 and row["metadata"]["correct"] for row in rows)
    dropped = meta["dropped"]
    assert meta["samples"] == len(rows) + dropped["rejected"] + dropped["unscored"] + dropped["empty"] + dropped["duplicates"]
    assert meta["samples_correct"] - len(rows) <= dropped["empty"]  # an accepted sample is a row unless empty
    _, tokenizer = build_tiny_model()
    assert meta["completion_tokens"] == sum(len(encode_response(tokenizer, row["completion"], add_eos=False)) for row in rows)
    assert meta["sha256"] == file_sha256(out) and json.loads(provenance_path(out).read_text())["completion_tokens"] == meta["completion_tokens"]


def test_max_tokens_caps_the_file_and_stops_sampling(tmp_path, capsys):
    out = tmp_path / "teacher.jsonl"
    assert main([*PAIRS, "--max-tokens", "30", "--batch-size", "2", "--out", str(out)]) == 0
    meta = json.loads(provenance_path(out).read_text())
    assert meta["budget_reached"] and 24 <= meta["completion_tokens"] <= 30  # rows of at most 6 tokens
    assert meta["prompts"] < 8  # sampling stopped once the budget was reached
    assert f"{meta['rows']} SFT rows, {meta['completion_tokens']} completion tokens" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--keep", "best"], "--keep must be one of all, correct, got 'best'"),
        (["--unpaired"], "--unpaired does not apply with --sft"),
        (["--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
        (["--pairs-per-prompt", "2"], "--pairs-per-prompt does not apply with --sft"),
        (["--group-size", "0"], "--group-size must be at least 1 (samples per prompt), got 0"),
    ],
)
def test_bad_sft_arguments_are_one_line(tmp_path, capsys, extra, message):
    out = tmp_path / "teacher.jsonl"
    argv = with_flags(PAIRS, *extra) if extra[0] in PAIRS else [*PAIRS, *extra]  # the command line refuses a key given twice
    assert main([*argv, "--out", str(out)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("posttrain: ")]
    assert len(errors) == 1 and message in errors[0], errors
    assert not out.exists()


def test_sft_flags_without_sft_and_no_rows_are_one_line(tmp_path, capsys):
    out = tmp_path / "teacher.jsonl"
    plain = [argument for argument in PAIRS if argument != "--sft"]
    assert main([*plain, "--keep", "correct", "--out", str(out)]) == 2
    assert "--keep applies to SFT rows only: add --sft" in capsys.readouterr().err
    assert main(with_flags(PAIRS, "--verifier", "callable:tests.rewards_for_tests.broken", "--keep", "correct", "--out", str(out))) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("posttrain: ")]
    assert len(errors) == 1 and "no SFT rows: of 32 samples (8 prompts x G=4), --keep correct kept none (0 rejected by the verifier, 32 unscored" in errors[0]
    assert not out.exists() and not provenance_path(out).exists()


def test_cli_teacher_rows_then_sft(tmp_path):
    """The offline distillation arm from the command line: `posttrain pairs --sft` prints what it
    wrote and the next command; `posttrain sft --data.task FILE` trains 2 steps on it and its run
    card says which teacher the rows came from."""
    out = tmp_path / "teacher.jsonl"
    command = [sys.executable, "-m", "posttrain", *with_flags(PAIRS, "--verifier", "callable:rewards_for_tests.digits", "--out", str(out))]
    pairs = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert pairs.returncode == 0, pairs.stderr
    meta = json.loads(provenance_path(out).read_text())
    lines = pairs.stdout.splitlines()
    assert lines[0].startswith(f"{meta['rows']} SFT rows, {meta['completion_tokens']} completion tokens, from ")
    assert lines[1].startswith("teacher: model tiny (G=4, seed 3); verifier callable:rewards_for_tests.digits accepted ")
    assert lines[-1] == f"next: posttrain sft --data.task {out} --model STUDENT --output-dir DIR"
    row = json.loads(out.read_text().splitlines()[0])
    assert set(row) == {"id", "prompt", "completion", "metadata"} and isinstance(row["completion"], str)
    sft = subprocess.run([sys.executable, "-m", "posttrain", "sft", "--data.task", str(out), "--data.eval_size", "4", "--max-steps", "2",
                          "--batch_size", "4", "--micro_batch_size", "4", "--acceptance.max_new_tokens", "2",
                          "--output-dir", str(tmp_path / "sft")], capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert sft.returncode == 0, sft.stderr
    card = json.loads((tmp_path / "sft" / "run_card.json").read_text())
    provenance = card["links"]["data"]["provenance"]
    assert (provenance["model"], provenance["keep"], provenance["completion_tokens"]) == ("tiny", "all", meta["completion_tokens"])
    assert provenance["provenance_file_matches"] is True
    assert card["links"]["reward"]["rows_from"].startswith("SFT rows from a teacher's samples: samples of model tiny, --keep all")
    assert card["links"]["data"]["train_rows"] + card["links"]["data"]["heldout_rows"] == meta["rows"]
    # The rows' provenance names the task they were sampled apart from: SFT scores its held-out split too,
    # the same problems and checker an online run from the same task, size and seed scores (`posttrain checklist`).
    acceptance = card["links"]["acceptance"]
    assert acceptance["heldout_task"].startswith(f"arithmetic held-out split ({meta['eval_size']} problems, split seed {meta['seed']}")
    assert acceptance["sets"]["in_distribution"] == {"task": "arithmetic", "size": meta["eval_size"], "checker": acceptance["checker"]}
    assert card["links"]["data"]["removed_heldout_task_overlap"] == 0  # sampled from the training split only
    rows = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["heldout/pass@1"] is not None and rows[-1]["heldout/nll"] is not None


def test_sft_rows_drop_prompts_of_the_heldout_task_and_task_settings_need_rows(tmp_path, capsys):
    from posttrain.cli import main
    from posttrain.data.tasks import load_splits

    _, held_out = load_splits("arithmetic", eval_size=20, seed=0, options={"digits": 2})
    leaked = [{"prompt": example.prompt_input, "completion": "<answer>0</answer>"} for example in held_out.examples[:3]]
    fresh = [{"prompt": f"{a}+{a}=", "completion": f"<answer>{2 * a}</answer>"} for a in range(10, 30)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in leaked + fresh))
    assert main(["sft", "--data.task", str(data), "--data.eval_size", "2", "--max-steps", "1", "--batch_size", "4",
                 "--acceptance.task", "arithmetic", "--acceptance.task_options", '{"digits": 2}', "--acceptance.eval_size", "20",
                 "--acceptance.split_seed", "0", "--acceptance.max_new_tokens", "2", "--output-dir", str(tmp_path / "run")]) == 0
    card = json.loads((tmp_path / "run" / "run_card.json").read_text())
    assert card["links"]["data"]["removed_heldout_task_overlap"] + card["links"]["data"]["train_rows"] == 21  # 23 rows, 2 held out
    assert card["links"]["data"]["removed_heldout_task_overlap"] >= 1
    capsys.readouterr()
    assert main(["sft", "--config", "tiny-sft", "--acceptance.task", "arithmetic", "--max-steps", "1",
                 "--output-dir", str(tmp_path / "gold")]) == 2
    assert "acceptance.task applies to SFT rows" in capsys.readouterr().err
