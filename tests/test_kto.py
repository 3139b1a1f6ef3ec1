"""KTO in `posttrain dpo --loss.type kto`: unpaired rows (TRL's layout, conversational, a pairs file
unpaired), the mismatched completions of the reference point, the step against a naive whole-batch
computation whatever the micro-batch, the class-balance band, `posttrain pairs --unpaired` and a CLI
run on its rows, and the mistakes a user makes, one line each. The loss itself (hand values, TRL
parity) is tested in tests/test_reference_free_losses.py."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.algorithms import kto_loss
from posttrain.config import build_config, parse_overrides
from posttrain.data import tokenize_preference_pairs
from posttrain.data.preference import prompt_key
from posttrain.data.provenance import provenance_path
from posttrain.data.unpaired import labels, load_unpaired, read_unpaired, with_mismatched, UnpairedRow
from posttrain.errors import UserError
from posttrain.losses import kto
from posttrain.losses.preference import PreferenceModels, PreferenceSettings
from posttrain.losses.preference import step as preference_step
from posttrain.models import load_model, make_reference
from posttrain.models.forward import TrainingForward
from posttrain.recipes import dpo_config
from tests.gradients import KeptGradients

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


def unpaired_rows(count: int = 12) -> list[dict]:
    """Arithmetic rows in TRL's unpaired layout: even rows a right sum (desirable), odd rows a wrong one."""
    rows = []
    for index in range(count):
        a, b = 10 + 7 * index, 21 + 5 * index
        right = index % 2 == 0
        rows.append({"prompt": f"{a}+{b}=", "completion": f"<answer>{a + b + (0 if right else 1 + index % 3)}</answer>",
                     "label": right})
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_trl_unpaired_rows_standard_and_conversational(tmp_path):
    """Labels true / false or 1 / 0; a conversational row's completion is its one assistant message;
    fields beyond the layout land in metadata."""
    rows = unpaired_rows(4)
    rows[1]["label"] = 0
    rows[2] = {"prompt": [{"role": "user", "content": "2+2="}], "completion": [{"role": "assistant", "content": "4"}],
               "label": 1, "source_note": "hand"}
    loaded, bad, layout = read_unpaired(write_rows(tmp_path / "rows.jsonl", rows))
    assert (bad, layout) == ({"rows_bad": 0, "rows_bad_reasons": {}}, "unpaired")
    assert [row.label for row in loaded] == [True, False, True, False]
    assert loaded[2].completion == "4" and loaded[2].prompt == [{"role": "user", "content": "2+2="}]
    assert loaded[2].metadata["source_note"] == "hand" and loaded[2].id == "rows.jsonl:3"


@pytest.mark.parametrize(
    "change, field",
    [
        ({"label": "yes"}, "label"),
        ({"label": 2}, "label"),
        ({"completion": [{"role": "user", "content": "x"}]}, "completion"),
        ({"completion": 7}, "completion"),
    ],
)
def test_a_bad_row_names_file_line_and_field(tmp_path, change, field):
    rows = unpaired_rows(4)
    rows[2].update(change)
    with pytest.raises(UserError) as error:
        read_unpaired(write_rows(tmp_path / "rows.jsonl", rows))
    assert "rows.jsonl:3" in str(error.value) and field in str(error.value)


def test_a_missing_label_column_is_read_as_pairs_and_says_so(tmp_path):
    """A file without `completion` and `label` is a pairs file; one with neither layout names the pairs fields."""
    path = write_rows(tmp_path / "rows.jsonl", [{"prompt": "1+1=", "completion": "2"}])
    with pytest.raises(UserError) as error:
        read_unpaired(path)
    assert "chosen" in str(error.value)


def test_a_pairs_file_is_two_rows_per_pair(tmp_path):
    """TRL's unpair_preference_dataset: chosen desirable, rejected undesirable, ids <pair>/chosen and <pair>/rejected."""
    pairs = [{"id": f"p{i}", "prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(3)]
    rows, bad, layout = read_unpaired(write_rows(tmp_path / "pairs.jsonl", pairs))
    assert layout == "pairs" and bad == {"rows_bad": 0, "rows_bad_reasons": {}}
    assert [(row.id, row.completion, row.label) for row in rows[:2]] == [("p0/chosen", "1", True), ("p0/rejected", "2", False)]
    assert len(rows) == 6


def test_each_row_gets_another_prompts_completion_fixed_by_the_seed():
    """The reference point's mismatched completion: never the row's own prompt, the same for the same
    seed (so a precomputed reference covers it), recorded in metadata."""
    rows = [UnpairedRow(f"r{i}", f"q{i // 2}", f"a{i}", i % 2 == 0) for i in range(10)]  # 5 prompts, 2 rows each
    first, again, other = with_mismatched(rows, 0, "x"), with_mismatched(rows, 0, "x"), with_mismatched(rows, 1, "x")
    by_completion = {row.completion: row for row in rows}
    for row, pair in zip(rows, first):
        source = by_completion[pair.rejected]
        assert prompt_key(source.prompt) != prompt_key(row.prompt) and pair.metadata["mismatched_from"] == source.id
        assert pair.chosen == row.completion and pair.metadata["label"] == row.label
    assert [p.rejected for p in first] == [p.rejected for p in again]
    assert [p.rejected for p in first] != [p.rejected for p in other]
    assert labels(first).tolist() == [i % 2 == 0 for i in range(10)]
    with pytest.raises(UserError, match="at least two different prompts"):
        with_mismatched([UnpairedRow("a", "q", "x", True), UnpairedRow("b", "q", "y", False)], 0, "rows.jsonl")


def test_heldout_rows_are_whole_prompts_and_counted(tmp_path):
    _, tokenizer = load_model("tiny")
    rows = unpaired_rows(12)
    rows += [{**row, "completion": "no idea", "label": False} for row in rows[:4]]  # a second row for 4 prompts
    splits = load_unpaired(write_rows(tmp_path / "rows.jsonl", rows), tokenizer, heldout_pairs=4, split_seed=0)
    train_prompts = {prompt_key(p.prompt) for p in splits.train}
    assert not train_prompts & {prompt_key(p.prompt) for p in splits.heldout}
    assert len(splits.train) + len(splits.heldout) == 16
    for name, kept in (("train", splits.train), ("heldout", splits.heldout)):
        assert splits.stats[name]["desirable"] == int(labels(kept).sum())
        assert splits.stats[name]["desirable"] + splits.stats[name]["undesirable"] == len(kept)
    assert splits.stats["layout"] == "unpaired"


def test_heldout_rows_of_one_prompt_borrow_mismatched_completions(tmp_path):
    """A held-out split that is one prompt's rows (6 sampled answers to it) still has a reference point:
    its rows' mismatched completions come from the other rows of the file, never from their own prompt."""
    _, tokenizer = load_model("tiny")
    rows = [{"prompt": "1+1=", "completion": f"answer {k}", "label": k % 2 == 0} for k in range(6)]
    rows += [{"prompt": f"{a}+2=", "completion": str(a + 2), "label": True} for a in range(2, 8)]
    splits = load_unpaired(write_rows(tmp_path / "rows.jsonl", rows), tokenizer, heldout_pairs=4, split_seed=2)
    assert {prompt_key(p.prompt) for p in splits.heldout} == {"1+1="}, "seed 2's split holds out the 6-row prompt"
    own = {r["completion"] for r in rows if r["prompt"] == "1+1="}
    assert len(splits.heldout) == 6 and all(p.rejected not in own for p in splits.heldout)


def naive_sum(model, batch, row: int, side: str) -> torch.Tensor:
    """One row's summed response log-probs, unpadded, full log-softmax (with gradient)."""
    tokens = getattr(batch, side)
    keep = tokens.attention_mask[row].bool()
    ids, mask = tokens.input_ids[row][keep], tokens.mask[row][keep]
    logprobs = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), dim=-1)[:-1]
    return (logprobs.gather(1, ids[1:, None])[:, 0] * mask[1:]).sum()


@pytest.mark.parametrize("micro_batch_size", [6, 4, 1])
def test_step_equals_the_naive_whole_batch_loss_whatever_the_micro_batch(micro_batch_size):
    """z0 from the whole batch's mismatched rows (not per micro-batch, as TRL), then the batch mean of
    kto_loss: the step's loss, z0 and gradient equal a naive per-row full-softmax computation of the
    same objective, for 1, 2 (4 + 2) and 6 micro-batches."""
    policy, tokenizer = load_model("tiny")
    moved = load_model("tiny")[0]
    torch.manual_seed(2)
    with torch.no_grad():  # a reference off the policy: these rows' log-ratios are then ~ +12 (z0 > 0)
        for param in moved.parameters():
            param.add_(0.05 * torch.randn_like(param))
    reference = make_reference(moved)
    rows = [UnpairedRow(f"r{i}", row["prompt"], row["completion"], row["label"]) for i, row in enumerate(unpaired_rows(6))]
    pairs = with_mismatched(rows, 0, "test")
    batch = tokenize_preference_pairs(tokenizer, pairs)
    desirable = labels(pairs)
    loss = dpo_config.Config().loss
    loss.type, loss.beta, loss.undesirable_weight = "kto", 0.5, 1.3
    # Naive: every sum on its own, the loss on the whole batch.
    own = torch.stack([naive_sum(policy, batch, i, "chosen") for i in range(6)])
    with torch.no_grad():
        mismatched = torch.stack([naive_sum(policy, batch, i, "rejected") - naive_sum(reference.model, batch, i, "rejected") for i in range(6)])
        ref_own = torch.stack([naive_sum(reference.model, batch, i, "chosen") for i in range(6)])
    losses, _, point = kto_loss(own - ref_own, mismatched, desirable, beta=0.5, undesirable_weight=1.3)
    losses.mean().backward()
    naive = {name: p.grad.clone() for name, p in policy.named_parameters()}
    policy.zero_grad(set_to_none=True)
    assert float(point) > 0, "the test must exercise z0 > 0"
    kept = KeptGradients(policy)
    models = PreferenceModels(kept.trainable(TrainingForward(policy, kto.side_sums)), reference)
    metrics = preference_step(models, dataclasses.replace(batch, desirable=desirable), PreferenceSettings(loss, micro_batch_size))
    # float32 sums of ~-50 nats by two code paths (shared-prompt batch vs one unpadded row) agree to ~1e-6 relative
    assert metrics["loss"] == pytest.approx(float(losses.detach().mean()), abs=1e-5)
    assert metrics["kl"] == pytest.approx(float(point), rel=1e-5)
    for name, grad in naive.items():
        assert torch.allclose(kept.grads[name], grad, rtol=1e-4, atol=1e-6), name


def test_precomputed_reference_equals_live():
    policy, tokenizer = load_model("tiny")
    reference = make_reference(policy)
    rows = [UnpairedRow(f"r{i}", row["prompt"], row["completion"], row["label"]) for i, row in enumerate(unpaired_rows(4))]
    pairs = with_mismatched(rows, 0, "test")
    batch = tokenize_preference_pairs(tokenizer, pairs)
    loss = dpo_config.Config().loss
    loss.type = "kto"
    from posttrain.models import pair_forward

    cached = pair_forward.reference_logprobs(policy, [batch])
    kept = KeptGradients(policy)
    settings, batch = PreferenceSettings(loss, 2), dataclasses.replace(batch, desirable=labels(pairs))
    live = preference_step(PreferenceModels(kept.trainable(TrainingForward(policy, kto.side_sums)), reference), batch, settings)
    live_grads = kept.grads
    cached_metrics = preference_step(PreferenceModels(kept.trainable(TrainingForward(policy, kto.side_sums))),
                                     dataclasses.replace(batch, reference=cached), settings)
    # policy == reference: every log-ratio 0, z0 0, loss 1 - sigmoid(0) = 0.5 for each row.
    assert live["loss"] == pytest.approx(0.5, abs=1e-6) == cached_metrics["loss"]
    for name, grad in live_grads.items():
        assert torch.allclose(kept.grads[name], grad, atol=1e-6), name


def test_kto_metrics_count_rows_at_the_reference_point_apart():
    """Log-ratios [1.0, -0.2, 0.1], labels [desirable, undesirable, desirable], z0 0.1: the first two
    are on their label's side (1.0 > 0.1, -0.2 < 0.1), the third is at z0: accuracy 2/3, ties 1/3."""
    logratios, desirable = torch.tensor([1.0, -0.2, 0.1]), torch.tensor([True, False, True])
    zeros = torch.zeros(3)
    metrics = kto.kto_metrics(kto.kto_columns(zeros, zeros, logratios, zeros, zeros, desirable), 0.1)
    assert metrics["rewards/accuracy"] == pytest.approx(2 / 3) and metrics["rewards/ties"] == pytest.approx(1 / 3)


def test_heldout_rows_at_step_0_are_ties_not_wrong_and_not_a_preference_accuracy():
    """Policy == reference: every held-out row's log-ratio is 0 and z0 = max(0, 0) = 0, so no row is
    on its label's side: label-side accuracy 0 of 8 with all 8 counted as ties, and the Wilson interval
    of 0 / 8, [0, 0.324]. The metric is named for what it is (rows against z0), not preference
    accuracy; the card's acceptance link says so. After the policy moves, no row sits exactly at z0."""
    from posttrain.evaluation.preference import HeldoutPairs, evaluate_unpaired, preference_acceptance_card
    from posttrain.evaluation.stats import wilson_interval

    policy, tokenizer = load_model("tiny")
    reference = make_reference(policy)
    rows = [UnpairedRow(f"r{i}", row["prompt"], row["completion"], row["label"]) for i, row in enumerate(unpaired_rows(8))]
    pairs = with_mismatched(rows, 0, "test")
    loss = dpo_config.Config().loss
    loss.type = "kto"
    held = HeldoutPairs(pairs, lambda chunk: tokenize_preference_pairs(tokenizer, chunk), loss, 3, reference)
    metrics = evaluate_unpaired(policy, held)
    assert "heldout/preference_accuracy" not in metrics and "heldout/rewards/accuracy" not in metrics
    assert metrics["heldout/label_side_accuracy"] == 0.0 and metrics["heldout/label_side_accuracy_ties"] == 8
    assert (metrics["heldout/label_side_accuracy_low"], metrics["heldout/label_side_accuracy_high"]) == pytest.approx(wilson_interval(0, 8))
    assert metrics["heldout/label_side_accuracy_high"] == pytest.approx(0.3244, abs=1e-4)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(0.05 * torch.randn_like(param))
    moved = evaluate_unpaired(policy, held)
    assert moved["heldout/label_side_accuracy_ties"] == 0
    correct = round(moved["heldout/label_side_accuracy"] * 8)
    assert (moved["heldout/label_side_accuracy_low"], moved["heldout/label_side_accuracy_high"]) == pytest.approx(wilson_interval(correct, 8))
    acceptance = dpo_config.Config().acceptance
    link = preference_acceptance_card(acceptance, 8, None, None, None, unpaired=True)
    assert link["heldout_pairs"].startswith("8 unpaired rows: label-side accuracy") and "reference point z0" in link["heldout_pairs"]


def test_class_balance_band_and_the_weights_that_bring_it_in():
    """19 desirable, 21 undesirable at weights 1, 1: 19/21 = 0.905 < 1, outside TRL's [1, 4/3]; the
    warning names undesirable_weight in [19/(4/3 x 21), 19/21] = [0.679, 0.905], and 0.8 is inside."""
    loss = dpo_config.Config().loss
    loss.type = "kto"
    entry = kto.class_balance(19, 21, loss)
    assert entry["ratio"] == pytest.approx(19 / 21) and entry["in_band"] is False
    assert "loss.undesirable_weight in [0.679, 0.905]" in entry["warning"]
    loss.undesirable_weight = 0.8
    assert kto.class_balance(19, 21, loss)["in_band"] is True and "warning" not in kto.class_balance(19, 21, loss)
    assert "no undesirable completion" in kto.class_balance(5, 0, loss)["warning"]


def pairs_command(out, *extra):
    return [sys.executable, "-m", "posttrain", "pairs", "--model", "tiny", "--data.task", "arithmetic", "--group-size", "4",
            "--data.max_prompts", "12", "--data.eval_size", "8", "--max-new-tokens", "6", "--seed", "3",
            "--verifier", "callable:rewards_for_tests.digits", "--temperature", "0.9", "--out", str(out), *extra]


def test_pairs_unpaired_keeps_every_group_then_kto_trains_on_it(tmp_path):
    """`posttrain pairs --unpaired` on random tiny-model samples scored by a digit detector: every
    distinct scored answer is a row, labelled by its reward, the all-correct and all-incorrect groups
    that pairing skips included and counted; `posttrain dpo --loss.type kto` then trains on the file,
    its card naming the rows, where they came from, the class balance and the reference point."""
    out = tmp_path / "rows.jsonl"
    result = subprocess.run(pairs_command(out, "--unpaired"), capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert result.returncode == 0, result.stderr
    meta = json.loads(provenance_path(out).read_text())
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert meta["kind"] == "unpaired rows from verified samples" and meta["rows"] == len(rows) > 0
    assert meta["desirable"] == sum(row["label"] for row in rows) and meta["undesirable"] == len(rows) - meta["desirable"]
    for group in ("mixed", "all_correct", "all_incorrect"):
        expected = sum(row["metadata"]["group"] == ("paired" if group == "mixed" else group) for row in rows)
        assert meta[f"rows_from_{group}_groups"] == expected
    assert meta["prompts_mixed"] + meta["prompts_all_correct"] + meta["prompts_all_incorrect"] + meta["prompts_unscored"] == 12
    for row in rows:
        assert row["label"] == any(c.isdigit() for c in row["completion"]) and row["metadata"]["reward"] == float(row["label"])
    per_prompt = {}
    for row in rows:
        per_prompt.setdefault(row["metadata"]["example"], []).append(row["completion"])
    assert all(len(texts) == len(set(texts)) <= 4 for texts in per_prompt.values()), "distinct answers, at most G per prompt"
    assert f"{meta['rows']} unpaired rows ({meta['desirable']} desirable" in result.stdout
    # Pairing the same samples keeps fewer rows: only the mixed groups.
    paired = subprocess.run(pairs_command(tmp_path / "pairs.jsonl"), capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert paired.returncode == 0, paired.stderr
    pairs_meta = json.loads(provenance_path(tmp_path / "pairs.jsonl").read_text())
    assert pairs_meta["prompts_paired"] == meta["prompts_mixed"]
    assert pairs_meta["prompts_skipped_all_correct"] == meta["prompts_all_correct"]

    run = subprocess.run([sys.executable, "-m", "posttrain", "dpo", "--model", "tiny", "--data.pairs", str(out), "--loss.type", "kto",
                          "--data.heldout_pairs", "8", "--batch_size", "8", "--micro_batch_size", "4", "--max-steps", "2",
                          "--optim.lr", "1e-3", "--acceptance.max_new_tokens", "8", "--output-dir", str(tmp_path / "kto")],
                         capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert run.returncode == 0, run.stderr
    card = json.loads((tmp_path / "kto" / "run_card.json").read_text())
    data, loss_link = card["links"]["data"], card["links"]["loss"]
    assert data["source"].startswith("offline: unpaired rows") and data["layout"] == "unpaired"
    assert data["rows_from_groups"] == {"mixed": meta["rows_from_mixed_groups"], "all_correct": meta["rows_from_all_correct_groups"],
                                        "all_incorrect": meta["rows_from_all_incorrect_groups"]}
    assert data["train"]["desirable"] + data["train"]["undesirable"] == data["train_pairs"]
    assert data["class_balance"]["desirable"] == data["train"]["desirable"]
    assert loss_link["type"] == "kto" and "z0" in loss_link["reference_point"]
    assert "KTOTrainer" in loss_link["as_peers_spell_it"]["trl"]
    assert card["links"]["reward"]["verifier"] == "callable:rewards_for_tests.digits"
    metrics = [json.loads(line) for line in (tmp_path / "kto" / "metrics.jsonl").read_text().splitlines()]
    step = [m for m in metrics if "loss" in m][-1]
    assert {"kl", "rewards/accuracy", "rewards/ties", "rows/desirable", "grad_norm"} <= set(step)
    assert metrics[0]["heldout/label_side_accuracy"] == 0.0 and metrics[0]["heldout/label_side_accuracy_ties"] == data["heldout_pairs"]
    assert not any("heldout/preference_accuracy" in m for m in metrics)
    assert "label-side accuracy (KTO rows vs z0) 0.000 [0.000, " in run.stdout and f"(step 0, {data['heldout_pairs']} ties)" in run.stdout
    assert (tmp_path / "kto" / "plots" / "kl.png").is_file()


@pytest.mark.parametrize(
    "command, extra, message",
    [
        ("pairs", ["--unpaired", "--pairs-per-prompt", "2"], "--pairs-per-prompt does not apply with --unpaired"),
        ("dpo", ["--loss.type", "kto", "--loss.nll_weight", "0.5"], "loss.nll_weight does not apply to loss.type kto"),
        ("dpo", ["--loss.desirable_weight", "2"], "apply to loss.type kto only"),
        ("dpo", ["--loss.type", "kto", "--loss.undesirable_weight", "0"], "must be > 0"),
        # DPO's pairwise loss on unpaired rows: the file's layout and the loss that reads it, not a missing `chosen` per row
        ("dpo", [], "unpaired rows (KTO's layout: prompt, completion, label), not preference pairs (prompt, chosen, rejected); "
                    "DPO's pairwise losses train on pairs: train KTO on these rows with --loss.type kto"),
    ],
)
def test_mistakes_are_one_line(tmp_path, command, extra, message):
    rows = write_rows(tmp_path / "rows.jsonl", unpaired_rows(12))
    args = (pairs_command(tmp_path / "out.jsonl", *extra) if command == "pairs" else
            [sys.executable, "-m", "posttrain", "dpo", "--data.pairs", str(rows), "--data.heldout_pairs", "2",
             "--output-dir", str(tmp_path / "run"), *extra])
    result = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "out.jsonl").exists()


def test_build_config_accepts_kto_settings():
    config = build_config(dpo_config.Config, None, parse_overrides(["--data.pairs", "x.jsonl", "--loss.type", "kto",
                                                                    "--loss.undesirable_weight", "0.8"]))
    assert config.loss.nll_weight == 0.0 and config.loss.undesirable_weight == 0.8
