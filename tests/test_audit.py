"""`posttrain audit --verifier NAME` passes for every shipped verifier; `posttrain verify` works."""

from __future__ import annotations

import json

import pytest

from posttrain.cli import main
from posttrain.rewards import SandboxUnavailable, check_isolation
from posttrain.rewards.audit import SUITES, Case, Outcome
from posttrain.rewards.verdict import Verdict

pytestmark = pytest.mark.timeout(300)
CODE = {"humaneval", "io", "stdio"}


@pytest.mark.parametrize("name", sorted(SUITES))
def test_audit_passes(name, capsys):
    if name in CODE:
        try:
            check_isolation()
        except SandboxUnavailable as error:
            pytest.skip(str(error))
    code = main(["audit", "--verifier", name, "--workers", "2"])
    output = capsys.readouterr().out
    assert code == 0, output
    assert "FAIL" not in output and f"audit {name}:" in output


def test_audit_suites_cover_the_issue_list():
    names = {case.name for case in SUITES["humaneval"]()}
    for required in ("sys.exit(0) at import", "os._exit(0) in the function", "raise SystemExit(0) at import",
                     "printed fake pass lines", "always-true __eq__ object", "int subclass with __eq__",
                     "str subclass with __eq__", "list subclass with __eq__", "NaN",
                     "stack-frame walking for expected values", "monkeypatching builtins, json and print",
                     "skip exception (unittest.SkipTest)", "re-exec the interpreter with -O",
                     "hard-coded visible test", "catch-all except BaseException loop", "correct but too slow",
                     "correct but floods output"):
        assert required in names
    math_names = {case.name for case in SUITES["math"]()}
    assert {"several boxed answers", "hedge: or", "answer only in the reasoning", "enormous expression"} <= math_names


def test_audit_outcome_rules():
    exploit, honest = Case("x", "exploit", "", {}), Case("y", "honest", "", {})
    assert Outcome(exploit, Verdict.ok(0.0, "wrong")).passed
    assert not Outcome(exploit, Verdict.ok(0.5, "partly")).passed
    assert not Outcome(exploit, Verdict.infra_error("crashed the judge")).passed
    assert Outcome(honest, Verdict.ok(1.0, "right")).passed
    assert not Outcome(honest, Verdict.ok(0.0, "false negative")).passed


def test_audit_rejects_unknown_suite(capsys):
    assert main(["audit", "--verifier", "callable:os.getcwd"]) == 2
    assert "no built-in audit suite" in capsys.readouterr().err


def test_every_registered_reward_kind_has_a_suite():
    """Issue 40 item 12: the held-out checkers math_equal and rg_answer had none."""
    from posttrain.rewards.registry import REWARD_KINDS

    assert set(SUITES) == set(REWARD_KINDS)


def test_audit_help_lists_every_suite(capsys):
    """Issue 40 item 12: --help names every verifier with a suite, from the suites' table (it named
    10 of 15: integer, letter, text_match, math_equal and rg_answer were missing)."""
    with pytest.raises(SystemExit):
        main(["audit", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    assert "--verifier VERIFIER the verifier whose suite runs: " + ", ".join(SUITES) + " --data DATA" in text


def test_verify_command_rows_in_order(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in [
        {"completion": r"\boxed{4}", "answer": "4"},
        {"completion": r"\boxed{4} or \boxed{5}", "answer": "4"},
        {"completion": r"\boxed{4}", "answer": ""},
    ]) + "\n")
    output = tmp_path / "out" / "verdicts.jsonl"
    assert main(["verify", "--verifier", "exact", "--input", str(rows), "--output", str(output)]) == 0
    verdicts = [json.loads(line) for line in output.read_text().splitlines()]
    assert [(v["reward"], v["status"]) for v in verdicts] == [(1.0, "ok"), (0.0, "ok"), (None, "data_error")]
    assert set(verdicts[0]) == {"reward", "status", "reason"}
    assert "ok=2, infra_error=0, data_error=1" in capsys.readouterr().err


def test_verify_command_bad_row_is_one_line_error(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"completion": "x", "answer": "1"}\n{"completion": 5}\n')
    output = tmp_path / "verdicts.jsonl"
    assert main(["verify", "--verifier", "exact", "--input", str(rows), "--output", str(output)]) == 2
    error = capsys.readouterr().err.strip()
    assert error == f"posttrain: error: {rows} line 2: field 'completion' must be a string"
    assert not output.exists()


def test_verify_command_code_rows(tmp_path, capsys):
    try:
        check_isolation()
    except SandboxUnavailable as error:
        pytest.skip(str(error))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in [
        {"completion": "def f(a):\n    return (a, a)\n", "entry_point": "f",
         "cases": [{"args": [1], "expected": {"tuple": [1, 1]}}]},
        {"completion": "def f(a):\n    return [a, a]\n", "entry_point": "f",
         "cases": [{"args": [1], "expected": {"tuple": [1, 1]}}]},
    ]) + "\n")
    assert main(["verify", "--verifier", "io", "--input", str(rows), "--workers", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["reward"] for line in lines] == [1.0, 0.0]
