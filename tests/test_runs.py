"""Run directory and checkpoints: atomic writes, corruption fallback, rotation, log truncation."""

import json
import logging

import pytest
import torch

from posttrain.errors import UserError
from posttrain.runs import (
    RunDirectory,
    latest_checkpoint,
    load_trainer_state,
    new_card,
    plot_metrics,
    rng_state,
    set_rng_state,
    write_run_card,
    write_step_checkpoint,
)


def write_weights(value):
    def write(directory):
        (directory / "model").mkdir()
        torch.save({"w": torch.full((1000,), float(value))}, directory / "model" / "weights.pt")

    return write


def test_save_and_load_newest(tmp_path):
    for step in (1, 2, 3):
        write_step_checkpoint(tmp_path, step, write_weights(step), {"data_position": step * 10}, keep=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-000002", "step-000003"]  # rotated, no temp dirs left
    newest = latest_checkpoint(tmp_path)
    assert newest.name == "step-000003"
    state = load_trainer_state(newest)
    assert state["step"] == 3 and state["data_position"] == 30


def test_truncated_newest_falls_back_with_warning(tmp_path, caplog):
    write_step_checkpoint(tmp_path, 1, write_weights(1), {}, keep=3)
    newest = write_step_checkpoint(tmp_path, 2, write_weights(2), {}, keep=3)
    weights = newest / "model" / "weights.pt"
    weights.write_bytes(weights.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(tmp_path).name == "step-000001"
    assert "truncated or corrupted" in caplog.text


def test_write_interrupted_before_manifest_is_ignored(tmp_path):
    write_step_checkpoint(tmp_path, 1, write_weights(1), {})
    # A crash after the rename target was created but before the manifest: no MANIFEST.json.
    partial = tmp_path / "step-000002"
    partial.mkdir()
    (partial / "trainer_state.pt").write_bytes(b"partial")
    (tmp_path / ".tmp-step-000003-1").mkdir()
    assert latest_checkpoint(tmp_path).name == "step-000001"


def test_rng_state_round_trip():
    state = rng_state()
    first = (torch.rand(3), __import__("random").random())
    set_rng_state(state)
    assert torch.equal(torch.rand(3), first[0]) and __import__("random").random() == first[1]


def test_run_directory_refuses_existing_run_and_truncates_on_resume(tmp_path):
    run = RunDirectory(tmp_path / "run")
    (run.path / "config.yaml").write_text("a: 1\n")
    for step in (1, 2, 3):
        run.log_metrics(step, {"loss": 1.0 / step, "bad": float("nan")})
    run.log_samples(3, [{"prompt": "p", "completion": "c"}])
    with pytest.raises(UserError, match="already holds a run"):
        RunDirectory(tmp_path / "run")
    with pytest.raises(UserError, match="nothing to resume"):
        RunDirectory(tmp_path / "other", resume=True)
    resumed = RunDirectory(tmp_path / "run", resume=True)
    resumed.truncate_logs(2)
    rows = resumed.read_metrics()
    assert [row["step"] for row in rows] == [1, 2] and rows[0]["bad"] is None
    assert (run.path / "samples.jsonl").read_text() == ""


def test_run_card_and_plots(tmp_path):
    card = new_card("grpo", seed=7)
    card["links"]["loss"].update({"advantage_scale": "group", "kl_estimator": "k3"})
    card["alarms"].append("divergence")
    write_run_card(tmp_path, card)
    assert json.loads((tmp_path / "run_card.json").read_text())["links"]["loss"]["kl_estimator"] == "k3"
    markdown = (tmp_path / "run_card.md").read_text()
    assert "### loss: How does a score become a gradient?" in markdown and "| kl_estimator | k3 |" in markdown
    rows = [{"step": s, "reward/mean": s / 10} for s in range(5)]
    written = plot_metrics(rows, ["reward/mean", "absent"], tmp_path / "plots")
    assert [p.name for p in written] == ["reward_mean.png"]
    assert written[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_rewritten_run_card_keeps_the_human_review(tmp_path):
    """A resumed run rewrites its card from scratch: the person's review score already in it stays."""
    import json

    from posttrain.runs import new_card, write_run_card

    card = new_card("grpo", 0)
    card["links"]["acceptance"] = {"checker": "integer"}
    write_run_card(tmp_path, card)
    saved = json.loads((tmp_path / "run_card.json").read_text())
    saved["links"]["acceptance"]["human_review"] = {"agreement": 0.9, "n": 10}
    (tmp_path / "run_card.json").write_text(json.dumps(saved))
    fresh = new_card("grpo", 0)
    fresh["links"]["acceptance"] = {"checker": "integer", "eval_every": 5}
    write_run_card(tmp_path, fresh)
    written = json.loads((tmp_path / "run_card.json").read_text())["links"]["acceptance"]
    assert written == {"checker": "integer", "eval_every": 5, "human_review": {"agreement": 0.9, "n": 10}}
    assert "human_review" in (tmp_path / "run_card.md").read_text()
    assert not list(tmp_path.glob(".*tmp"))


def test_results_show_a_held_out_rate_with_its_interval_and_ties(tmp_path):
    """DPO's held-out preference accuracy at step 0 is 0 of 8 because all 8 pairs tie (policy =
    reference): the summary shows the Wilson interval of each end and the ties, so 0.000 -> 1.000 on
    8 pairs does not read as a measured gain; the card's results table shows the same."""
    import json

    from posttrain.evaluation.stats import wilson_interval
    from posttrain.runs.card import results_markdown
    from posttrain.runs.results import results, summary_lines

    start, end = wilson_interval(0, 8), wilson_interval(8, 8)
    rows = [{"step": 0, "heldout/preference_accuracy": 0.0, "heldout/preference_accuracy_low": start[0],
             "heldout/preference_accuracy_high": start[1], "heldout/preference_accuracy_ties": 8},
            {"step": 10, "heldout/preference_accuracy": 1.0, "heldout/preference_accuracy_low": end[0],
             "heldout/preference_accuracy_high": end[1], "heldout/preference_accuracy_ties": 0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    expected = "preference accuracy 0.000 [0.000, 0.324] (step 0, 8 ties) -> 1.000 [0.676, 1.000] (step 10)"
    assert summary_lines(tmp_path)[0] == f"held-out: {expected}"
    assert "| preference accuracy | 0.000 [0.000, 0.324] (step 0, 8 ties) | 1.000 [0.676, 1.000] (step 10) | - |" in results_markdown(results(tmp_path))
