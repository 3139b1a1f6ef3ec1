"""`posttrain data check` and `posttrain model info` from the command line (in-process)."""

import json

from posttrain.cli import main


def test_data_check_clean_and_bad(tmp_path, capsys):
    clean = tmp_path / "clean.jsonl"
    clean.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    assert main(["data", "check", str(clean)]) == 0
    assert f"{clean}: 1 rows read, 0 bad" in capsys.readouterr().out

    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([
        json.dumps({"prompt": "Sky?", "chosen": "Blue.", "rejected": "Blue."}),
        json.dumps({"prompt": "Sky?", "chosen": "Blue.", "rejected": "Grey."}),
        "{oops",
    ]) + "\n")
    assert main(["data", "check", "--kind", "preference", str(bad)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == [
        f"{bad}:1: chosen: identical to rejected",
        f"{bad}:3: row: invalid JSON: Expecting property name enclosed in double quotes (column 2)",
        f"{bad}: 3 rows read, 2 bad",
    ]


def test_data_check_prompt_lengths_with_a_model(tmp_path, capsys):
    """"12+34=" is 25 tokens in the tiny chat template: over a limit of 24."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "12+34=", "answer": "46"}) + "\n")
    assert main(["data", "check", "--model", "tiny", "--max-prompt-tokens", "24", str(path)]) == 1
    assert f"{path}:1: prompt: 25 tokens, longer than max_prompt_tokens=24" in capsys.readouterr().out
    assert main(["data", "check", "--model", "tiny", "--max-prompt-tokens", "25", str(path)]) == 0


def test_data_check_missing_file_is_one_line(tmp_path, capsys):
    assert main(["data", "check", str(tmp_path / "nope.jsonl")]) == 2
    assert capsys.readouterr().err.strip() == f"posttrain: error: {tmp_path / 'nope.jsonl'}: no such file"


def test_model_info(capsys):
    assert main(["model", "info", "tiny", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["parameters"] == 3_239_424 and info["vocab_size"] == 101
    assert info["chat_template"] is True
    assert info["special_tokens"]["eos_token"] == "<|im_end|> (id 2)"
    assert info["special_tokens"]["pad_token"] == "<pad> (id 0)"
    assert main(["model", "info", "./missing-dir"]) == 2
    assert "no such directory" in capsys.readouterr().err
