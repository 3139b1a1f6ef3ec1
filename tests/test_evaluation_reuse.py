"""evaluation/reuse.py: an exact repeat of a greedy evaluation reuses its answers, and nothing else does."""

from __future__ import annotations

import json
import logging

import torch

from posttrain.evaluation import reuse
from posttrain.evaluation.acceptance import evaluate_task, heldout_split
from posttrain.models import load_model


def evaluate(model, tokenizer, task, path, **kwargs):
    return evaluate_task(model, tokenizer, task, checker="integer", max_new_tokens=12, seed=0, output_path=path, **kwargs)


def without_seconds(path):
    data = json.loads(path.read_text())
    data["summary"].pop("seconds")
    return data


def test_a_repeat_is_reused_and_writes_what_a_fresh_evaluation_writes(tmp_path, caplog):
    model, tokenizer = load_model("tiny")
    model.eval()
    task = heldout_split("arithmetic", 12, 0, {"digits": 2})
    fresh = evaluate(model, tokenizer, task, tmp_path / "fresh.json")
    with caplog.at_level(logging.INFO, logger="posttrain.evaluation.acceptance"), reuse.reuse_evaluations():
        first = evaluate(model, tokenizer, task, tmp_path / "first.json", label="a")
        assert "reused" not in caplog.text
        again = evaluate(model, tokenizer, task, tmp_path / "again.json", label="b")
        assert "held-out b (arithmetic): the same weights, problems and checker as a (arithmetic): its answers reused" in caplog.text
    assert not reuse.active()
    assert without_seconds(tmp_path / "again.json") == without_seconds(tmp_path / "first.json") == without_seconds(tmp_path / "fresh.json")
    assert again["correct"] == first["correct"] == fresh["correct"]


def test_the_same_weights_loaded_from_disk_are_reused(tmp_path, caplog):
    model, tokenizer = load_model("tiny")
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    loaded, loaded_tokenizer = load_model(str(tmp_path / "model"))
    model.eval(), loaded.eval()
    task = heldout_split("arithmetic", 6, 0, {"digits": 2})
    with caplog.at_level(logging.INFO, logger="posttrain.evaluation.acceptance"), reuse.reuse_evaluations():
        evaluate(model, tokenizer, task, None)
        evaluate(loaded, loaded_tokenizer, task, None)
    assert caplog.text.count("answers reused") == 1


def test_anything_that_changes_the_answers_is_not_reused(tmp_path, caplog):
    model, tokenizer = load_model("tiny")
    model.eval()
    task = heldout_split("arithmetic", 6, 0, {"digits": 2})
    other = heldout_split("arithmetic", 6, 1, {"digits": 2})
    threads = torch.get_num_threads()
    with caplog.at_level(logging.INFO, logger="posttrain.evaluation.acceptance"), reuse.reuse_evaluations():
        evaluate(model, tokenizer, task, None)
        evaluate(model, tokenizer, other, None)  # other problems
        evaluate_task(model, tokenizer, task, checker="exact", max_new_tokens=12, seed=0)  # another checker
        evaluate_task(model, tokenizer, task, checker="integer", max_new_tokens=13, seed=0)  # another budget
        evaluate(model, tokenizer, task, None, batch_size=4)  # other batches
        evaluate(model, tokenizer, task, None, k=2)  # sampled pass@k always generates
        torch.set_num_threads(threads + 1)
        try:
            evaluate(model, tokenizer, task, None)  # other float grouping
        finally:
            torch.set_num_threads(threads)
        with torch.no_grad():
            model.lm_head.weight[0, 0] += 1e-3  # one weight changed
        evaluate(model, tokenizer, task, None)
        assert "answers reused" not in caplog.text
    assert not reuse.active()
    with caplog.at_level(logging.INFO, logger="posttrain.evaluation.acceptance"):
        evaluate(model, tokenizer, task, None)  # outside the block
        evaluate(model, tokenizer, task, None)
    assert "answers reused" not in caplog.text


def test_fingerprint_covers_names_and_bytes():
    model, _ = load_model("tiny")
    before = reuse.weights_fingerprint(model)
    assert before == reuse.weights_fingerprint(model)
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1
    assert reuse.weights_fingerprint(model) != before
