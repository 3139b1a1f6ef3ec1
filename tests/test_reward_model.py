"""Reward models: Bradley-Terry by hand, pair metrics, the stored scale, the length-bias probes,
pooling at the last attended token (pad = EOS included), padding invariance, the export that
transformers loads with the same scores, `rm:DIR` as a reward (its own tokenizer's rendering,
batched = row by row, normalisation, independence by weights), and `posttrain rm` from the command
line (card, export, resume, one-line mistakes)."""

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.algorithms.reward_model import bradley_terry_loss, length_bias, pearson, reward_pair_metrics, reward_scale
from posttrain.data import encode_prompt, encode_response
from posttrain.evaluation.acceptance import independence
from posttrain.models import load_model
from posttrain.models.reward_model import RewardModel, export, last_attended_index, load_reward_model
from posttrain.rewards import RewardOptions, as_verifier, get_verifier
from posttrain.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "options, expected",
    [
        ({}, 0.313262),  # -log sigmoid(1)
        ({"margin": torch.tensor([0.5])}, 0.474077),  # -log sigmoid(1 - 0.5)
        ({"centering": 0.01}, 0.323262),  # 0.313262 + 0.01 x (1 + 0)^2
        # label smoothing 0.1: 0.9 x 0.313262 + 0.1 x -log sigmoid(-1) = 0.281936 + 0.131326
        ({"label_smoothing": 0.1}, 0.9 * 0.313262 + 0.1 * 1.313262),
    ],
)
def test_bradley_terry_by_hand(options, expected):
    loss = bradley_terry_loss(torch.tensor([1.0]), torch.tensor([0.0]), **options)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_bradley_terry_gradient_is_sigmoid_of_minus_the_difference():
    """d/dr_c of -log sigmoid(r_c - r_r) = -sigmoid(-(r_c - r_r)) = -(1 - sigmoid(1)) = -0.268941."""
    chosen, rejected = torch.tensor([1.0], requires_grad=True), torch.tensor([0.0], requires_grad=True)
    bradley_terry_loss(chosen, rejected).sum().backward()
    assert chosen.grad.item() == pytest.approx(-0.268941, abs=1e-6) and rejected.grad.item() == pytest.approx(0.268941, abs=1e-6)


def test_pair_metrics_scale_and_length_bias_by_hand():
    """Pairs (1.0, 0.0) and (0.2, 0.5): accuracy 0.5, margin (1 - 0.3) / 2 = 0.35; a tie is wrong.
    Rewards [1, 2, 3, 4]: mean 2.5, population std sqrt(1.25) = 1.118034, sample std 1.290994."""
    metrics = reward_pair_metrics(torch.tensor([1.0, 0.2]), torch.tensor([0.0, 0.5]))
    assert metrics["accuracy"].item() == 0.5 and metrics["margin"].item() == pytest.approx(0.35)
    assert reward_pair_metrics(torch.tensor([1.0]), torch.tensor([1.0]))["accuracy"].item() == 0.0
    scale = reward_scale(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert (scale["mean"].item(), scale["std_population"].item(), scale["std_sample"].item()) == pytest.approx((2.5, 1.118034, 1.290994), abs=1e-6)
    assert pearson(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 7.0])).item() == pytest.approx(0.993399, abs=1e-6)
    # Rewards grow with length exactly: correlation 1; of the 2 pairs whose chosen is shorter, 0 are right.
    probes = length_bias(torch.tensor([1.0, 2.0, 5.0]), torch.tensor([3.0, 4.0, 0.0]), torch.tensor([1, 2, 5]), torch.tensor([3, 4, 0]))
    assert probes["reward_length_correlation"].item() == pytest.approx(1.0)
    assert probes["shorter_chosen_pairs"].item() == 2 and probes["accuracy_shorter_chosen"].item() == 0.0


def test_pooling_reads_the_attention_mask_not_the_ids():
    """Row [p, p, x, y, EOS, PAD, PAD] with the pad id equal to the EOS id pools index 4; a
    left-padded row pools its last position."""
    eos = 2
    ids = torch.tensor([[7, 7, 9, 10, eos, eos, eos]])
    assert last_attended_index(torch.tensor([[1, 1, 1, 1, 1, 0, 0]])).tolist() == [4]
    assert (ids[0, last_attended_index(torch.tensor([[1, 1, 1, 1, 1, 0, 0]]))] == eos).all()
    assert last_attended_index(torch.tensor([[0, 0, 1, 1, 1, 1, 1]])).tolist() == [6]


@pytest.fixture(scope="module")
def tiny_reward_model():
    policy, tokenizer = load_model("tiny")
    return RewardModel.from_policy(policy, seed=0).eval(), tokenizer


def test_a_row_scores_the_same_right_padded_left_padded_and_alone(tiny_reward_model):
    model, tokenizer = tiny_reward_model
    short, long = tokenizer("1+2=3<|im_end|>")["input_ids"], tokenizer("12+345=357<|im_end|>")["input_ids"]
    width = len(long)
    with torch.no_grad():
        alone = model(torch.tensor([short]), torch.ones(1, len(short), dtype=torch.long))
        for side in ("right", "left"):
            pad = [0] * (width - len(short))
            ids = short + pad if side == "right" else pad + short
            mask = [1] * len(short) + [0] * len(pad) if side == "right" else [0] * len(pad) + [1] * len(short)
            both = model(torch.tensor([ids, long]), torch.tensor([mask, [1] * width]))
            assert both[0].item() == pytest.approx(alone.item(), abs=1e-5), side
    assert model.score.weight.std().item() == pytest.approx(1 / math.sqrt(257), rel=0.2), "N(0, 1/sqrt(H+1)), not zero"


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_export_loads_in_transformers_with_the_same_scores(tiny_reward_model, tmp_path, pad_is_eos):
    """AutoModelForSequenceClassification(num_labels 1) scores right-padded rows as we do; with a
    tokenizer whose pad is its EOS (SmolLM2's case) the export adds a pad of its own, or transformers
    would pool the token before the final EOS."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model, tokenizer = tiny_reward_model
    tokenizer = copy.deepcopy(tokenizer)
    if pad_is_eos:
        tokenizer.pad_token = tokenizer.eos_token
    export(model, tokenizer, tmp_path / "rm", {"reward_mean": 0.0, "reward_std_population": 1.0})
    meta = json.loads((tmp_path / "rm" / "reward_model.json").read_text())
    assert meta["pad_token_added"] is pad_is_eos and meta["pad_token_id"] != meta["eos_token_id"]
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "rm")
    texts = ["1+2=3<|im_end|>", "12+345=357<|im_end|>", "7<|im_end|>"]
    batch = hf_tokenizer(texts, padding=True, return_tensors="pt")
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    with torch.no_grad():
        theirs = hf(**batch).logits.squeeze(-1)
        ours = model(batch["input_ids"].clamp(max=model.config.vocab_size - 1), batch["attention_mask"])
        loaded = load_reward_model(tmp_path / "rm")[0](batch["input_ids"], batch["attention_mask"])
    assert torch.allclose(theirs, ours, atol=1e-5) and torch.allclose(loaded, ours, atol=1e-5)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_reward_model):
    model, tokenizer = tiny_reward_model
    directory = tmp_path_factory.mktemp("rm") / "final"
    export(model, tokenizer, directory, {"reward_mean": 0.5, "reward_std_population": 2.0, "system_prompt": None})
    return directory


def test_rm_reward_renders_the_conversation_with_its_own_tokenizer(exported, tiny_reward_model):
    """The row carries the policy's own rendering (`rendered_prompt`, another template); the reward
    model re-renders `messages` with its ChatML template, then the completion and ONE EOS, and its
    verdict is (r - 0.5) / 2 of that sequence's reward."""
    model, tokenizer = tiny_reward_model
    verifier = get_verifier(f"rm:{exported}")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    row = {"messages": messages, "prompt": None, "rendered_prompt": "### System: Be brief.\n### User: 2+2=\n### Assistant:"}
    ids, cut = verifier.render("4", row)
    expected = encode_prompt(tokenizer, messages) + encode_response(tokenizer, "4")
    assert ids == expected and ids.count(tokenizer.eos_token_id) == 3 and cut == {"prompt": 0, "response": 0}  # 2 turn ends + 1 EOS
    assert verifier.render("4<|im_end|>", row)[0] == expected, "an EOS already there is not doubled"
    verdict = verifier("4", row)
    with torch.no_grad():
        raw = model(torch.tensor([expected]), torch.ones(1, len(expected), dtype=torch.long)).item()
    assert verdict.status == "ok" and verdict.details["raw"] == pytest.approx(raw, abs=1e-5)
    assert verdict.reward == pytest.approx((raw - 0.5) / 2.0, abs=1e-5)
    assert verifier("4", {"prompt": None}).status == "data_error"


def test_rm_batched_equals_row_by_row_and_normalisations(exported):
    rows = [{"prompt": f"{a}+{b}="} for a, b in ((1, 2), (12, 345), (7, 0), (99, 99), (3, 3))]
    completions = ["3", "<answer>357</answer>", "7", "no idea at all, sorry", ""]
    verifier = get_verifier(f"rm:{exported}")
    verifier.batch_size = 2
    batched = [v.details["raw"] for v in verifier.batch(completions, rows)]
    single = [verifier(c, r).details["raw"] for c, r in zip(completions, rows)]
    assert batched == pytest.approx(single, abs=1e-5)
    options = RewardOptions(normalisation="batch", clip=0.5)
    normalised = [v.reward for v in as_verifier(None, f"rm:{exported}", options).batch(completions, rows)]
    raw = torch.tensor(batched)
    assert normalised == pytest.approx(((raw - raw.mean()) / raw.std(correction=0)).clamp(-0.5, 0.5).tolist(), abs=1e-4)
    plain = as_verifier(None, f"rm:{exported}", RewardOptions(normalisation="none")).batch(completions, rows)
    assert [v.reward for v in plain] == pytest.approx(batched, abs=1e-6)


def test_rm_scores_a_group_sharing_its_prompt_once_and_as_the_plain_forward(exported, monkeypatch):
    """GRPO's rows come in groups sharing a prompt: the scoring forward computes each prompt once
    (the shared path ran, with fewer prompt rows than rows) and gives the plain forward's rewards."""
    import posttrain.rewards.reward_model as scoring

    rows = [{"prompt": prompt} for prompt in ("12+34=", "7+8=", "500+500=") for _ in range(4)]
    completions = ["<answer>46</answer>", "46", "<answer>45</answer>", "", "15", "<answer>15</answer>", "x" * 30, "16",
                   "1000", "<answer>1000</answer>", "<answer>100</answer>", "ok"]
    verifier = get_verifier(f"rm:{exported}")
    verifier.batch_size = 8  # two chunks, the second across a group's boundary
    calls = []
    shared = scoring.shared_prompt_rewards

    def spy(model, input_ids, attention, mask):
        rewards = shared(model, input_ids, attention, mask)
        calls.append((input_ids.shape[0], rewards is not None))
        return rewards

    monkeypatch.setattr(scoring, "shared_prompt_rewards", spy)
    batched = [v.details["raw"] for v in verifier.batch(completions, rows)]
    assert calls == [(8, True), (4, True)]
    sequences = [verifier.render(c, r)[0] for c, r in zip(completions, rows)]
    width = max(map(len, sequences))
    plain = verifier.model(torch.tensor([ids + [0] * (width - len(ids)) for ids in sequences]),
                           torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in sequences]))
    assert batched == pytest.approx(plain.tolist(), abs=1e-5)


def test_rm_identity_is_its_weights(exported, tmp_path, tiny_reward_model):
    """The same reward model as reward and checker is not independent; against the integer checker it is;
    another export of the same weights is the same model."""
    model, tokenizer = tiny_reward_model
    same = get_verifier(f"rm:{exported}")
    independent, _ = independence(same, get_verifier("integer"))
    assert independent
    copy_dir = export(model, tokenizer, tmp_path / "again", {"reward_mean": 0.0, "reward_std_population": 1.0})
    independent, why = independence(same, get_verifier(f"rm:{copy_dir}"))
    assert not independent and "weights sha256" in why


def test_rm_mistakes_are_one_line(tmp_path):
    with pytest.raises(UserError, match="not a reward model directory"):
        as_verifier(None, f"rm:{tmp_path}")
    with pytest.raises(UserError, match="name the reward model's directory"):
        as_verifier(None, "rm:")
    with pytest.raises(UserError, match="reward_options.normalisation"):
        RewardOptions(normalisation="zscore")


def pairs_file(path: Path, count: int = 40) -> Path:
    rows = []
    for index in range(count):
        a, b = 10 + 7 * index, 21 + 5 * index
        rows.append({"id": f"p{index}", "prompt": f"{a}+{b}=", "chosen": f"<answer>{a + b}</answer>", "margin": 1.0 + index % 2,
                     "rejected": f"<answer>{a + b + 1 + index % 3}</answer>" if index % 2 else "I do not know"})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def rm_command(pairs: Path, out: Path, *extra) -> list[str]:
    return [sys.executable, "-m", "posttrain", "rm", "--data.pairs", str(pairs), "--data.heldout_pairs", "8", "--batch_size", "8",
            "--micro_batch_size", "4", "--max-steps", "4", "--checkpoint-every", "2", "--output-dir", str(out), *extra]


def test_cli_run_card_export_and_resume(tmp_path):
    """4 steps with margins and centering: the card's four links, the held-out metrics at step 0 and 4,
    an export that `rm:` loads, whose stored scale is the held-out rewards'; a resume past the end
    trains 2 more steps from the checkpoint."""
    pairs = pairs_file(tmp_path / "pairs.jsonl")
    run = tmp_path / "run"
    result = subprocess.run(rm_command(pairs, run, "--loss.margin", "true", "--loss.centering", "0.01"),
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    card = json.loads((run / "run_card.json").read_text())
    assert card["run"]["recipe"] == "rm" and set(card["links"]) == {"data", "reward", "loss", "acceptance"}
    assert card["links"]["data"]["train_pairs"] == 32 and card["links"]["data"]["margins"] == "each pair's `margin` column"
    assert "Bradley-Terry" in card["links"]["loss"]["objective"] and "margin" in card["links"]["loss"]["objective"]
    assert card["links"]["acceptance"]["heldout_pairs"] == 8
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "heldout/preference_accuracy" in m] == [0, 4]
    last = metrics[-1]
    assert last["heldout/preference_accuracy_low"] <= last["heldout/preference_accuracy"] <= last["heldout/preference_accuracy_high"]
    assert {"heldout/reward_length_correlation", "heldout/accuracy_shorter_chosen", "loss", "accuracy", "margin", "grad_norm"} <= set(last)
    meta = json.loads((run / "final" / "reward_model.json").read_text())
    assert meta["heldout_accuracy"] == last["heldout/preference_accuracy"] and meta["steps"] == 4
    assert meta["reward_std_population"] > 0 and "8 held-out pairs" in meta["scale_from"]
    assert card["export"]["use_as"] == f"--reward rm:{run / 'final'}"
    assert "results: " in result.stdout and "preference accuracy" in result.stdout
    assert (run / "plots" / "loss.png").is_file()
    resumed = subprocess.run([sys.executable, "-m", "posttrain", "rm", "--resume", str(run), "--max-steps", "6"],
                             capture_output=True, text=True, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4, 5, 6]
    assert json.loads((run / "final" / "reward_model.json").read_text())["steps"] == 6


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--loss.label_smoothing", "0.6"], "loss.label_smoothing must be in [0, 0.5)"),
        (["--loss.centering", "-1"], "loss.centering must be >= 0"),
        (["--parallel.strategy", "fsdp2"], "not yet fsdp2"),
        (["--data.pairs", "missing.jsonl"], "missing.jsonl"),
    ],
)
def test_bad_config_is_one_line_and_writes_nothing(tmp_path, extra, message):
    pairs = pairs_file(tmp_path / "pairs.jsonl")
    result = subprocess.run(rm_command(pairs, tmp_path / "run", *extra), capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "run").exists()


def test_rm_on_an_unpaired_file_is_one_line(tmp_path):
    """`posttrain rm` given KTO's unpaired rows: one line, a reward model needs pairs and this file is
    unpaired (KTO's layout), what to run instead; not a "chosen: missing field" per row. Nothing written."""
    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1) if i % 2 else "no", "label": bool(i % 2)} for i in range(40)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = subprocess.run(rm_command(tmp_path / "rows.jsonl", tmp_path / "run"), capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "unpaired rows (KTO's layout: prompt, completion, label)" in result.stderr, result.stderr
    assert "a reward model is trained on pairs" in result.stderr and "missing field" not in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_margin_without_the_column_names_the_pair(tmp_path):
    rows = [json.loads(line) for line in pairs_file(tmp_path / "pairs.jsonl").read_text().splitlines()]
    del rows[3]["margin"]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = subprocess.run(rm_command(tmp_path / "pairs.jsonl", tmp_path / "run", "--loss.margin", "true"),
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2 and "pair p3" in result.stderr and "margin" in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_truncated_completions_follow_the_policy():
    """reward_options.truncated: penalty:1 turns a truncated 0.7 into -0.3 (TRL's missing_eos_penalty
    subtracts); exclude makes it a counted data_error; an untruncated row and a row that is not ok stay."""
    from posttrain.rewards import Verdict
    from posttrain.rewards.scores import truncation_policy

    verdicts = [Verdict.ok(0.7, "r"), Verdict.ok(0.7, "r"), Verdict.infra_error("down")]
    penalised = truncation_policy(verdicts, [True, False, True], "penalty:1")
    assert penalised[0].reward == pytest.approx(-0.3) and penalised[0].details["unpenalised"] == 0.7
    assert penalised[1] is verdicts[1] and penalised[2] is verdicts[2]
    excluded = truncation_policy(verdicts, [True, False, True], "exclude")
    assert excluded[0].status == "data_error" and excluded[0].details["unexcluded"] == 0.7 and excluded[1].reward == 0.7
    with pytest.raises(UserError, match="reward_options.truncated"):
        RewardOptions(truncated="penalty:x")
    with pytest.raises(UserError, match="reward_options.offload"):
        RewardOptions(offload="disk")


def test_offload_keeps_the_model_on_the_cpu_between_calls(exported):
    verifier = as_verifier(None, f"rm:{exported}", RewardOptions(offload="cpu"))
    moves = []
    original = verifier.model.to
    verifier.model.to = lambda device: (moves.append(str(device)), original(device))[1]
    verdict = verifier("4", {"prompt": "2+2="})
    assert verdict.status == "ok" and moves == ["cpu", "cpu"]  # to the run's device (the CPU here), then back
    assert next(verifier.model.parameters()).device.type == "cpu"


def test_grpo_on_a_reward_model_with_a_truncation_penalty(tmp_path, exported):
    """`posttrain grpo --reward rm:DIR`: the reward link is the reward model (its card entry), the
    held-out checker `integer` is independent of it, the divergence alarm's threshold is relative to
    the reward's spread (an RM's rewards are not on [0, 1]), and truncated completions pay the penalty."""
    run = tmp_path / "grpo"
    result = subprocess.run([sys.executable, "-m", "posttrain", "grpo", "--reward", f"rm:{exported}", "--max-steps", "2",
                             "--data.prompts_per_step", "4", "--data.group_size", "4", "--data.eval_size", "8",
                             "--sampling.max_new_tokens", "4", "--acceptance.max_new_tokens", "4", "--acceptance.sets", "[]",
                             "--reward_options.truncated", "penalty:5", "--output-dir", str(run)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    card = json.loads((run / "run_card.json").read_text())
    assert card["links"]["reward"]["verifier"] == f"rm:{exported}" and card["links"]["reward"]["kind"] == "learned reward model"
    assert card["links"]["acceptance"]["independent"] is True
    assert card["links"]["acceptance"]["divergence_alarm_threshold"].startswith("relative")
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    truncated = [row for row in samples if row["truncated"]]
    assert truncated and all("truncated: -5" in row["reason"] for row in truncated)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_reward_model_on_verifier_labelled_pairs_beats_chance(tmp_path):
    """The whole chain for real: SFT the tiny model (400 steps of presets/tiny-sft.yaml), label its
    samples of 2-digit sums with `exact` (posttrain pairs), train a reward model on the pairs: its
    held-out pair accuracy has a Wilson lower bound above 0.5 (measured 2026-12-03 from a 400-step start:
    768 prompts, presets/tiny-rm.yaml's 50 steps, 0.688 [0.566, 0.788] on 64 held-out pairs, as this test
    holds out (the preset itself holds out 12, a quarter of what its own 256-prompt chain gives); with 256
    prompts and 60 steps the bound was 0.487: the model overfits its few pairs)."""
    sft = subprocess.run([sys.executable, "-m", "posttrain", "sft", "--config", "tiny-sft", "--max-steps", "400", "--checkpoint-every", "400",
                          "--output-dir", str(tmp_path / "sft")], capture_output=True, text=True, cwd=ROOT)
    assert sft.returncode == 0, sft.stderr[-2000:]
    model = str(tmp_path / "sft" / "checkpoints" / "step-000400" / "model")
    pairs = subprocess.run([sys.executable, "-m", "posttrain", "pairs", "--model", model, "--data.task", "arithmetic",
                            "--data.task_options", '{"digits": 2}', "--group-size", "8", "--data.max_prompts", "768", "--data.eval_size", "500",
                            "--max-new-tokens", "24", "--out", str(tmp_path / "pairs.jsonl")], capture_output=True, text=True, cwd=ROOT)
    assert pairs.returncode == 0, pairs.stderr[-2000:]
    run = subprocess.run([sys.executable, "-m", "posttrain", "rm", "--config", "tiny-rm", "--model", model, "--data.pairs",
                          str(tmp_path / "pairs.jsonl"), "--data.heldout_pairs", "64", "--output-dir", str(tmp_path / "rm")],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    last = [json.loads(line) for line in (tmp_path / "rm" / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["heldout/preference_accuracy_low"] > 0.5, last


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_shared_prompt_rewards_equal_the_plain_forward_in_value_and_gradient(padding_side):
    """Pairs sharing their prompt (and one pair with another prompt): rewards and every parameter's
    gradient through the shared-prompt path equal the plain (2n, L) forward's."""
    from posttrain.data import PreferencePair, tokenize_preference_pairs
    from posttrain.models.reward_model import batch_rewards

    policy, tokenizer = load_model("tiny")
    tokenizer.padding_side = padding_side
    torch.manual_seed(0)
    model = RewardModel.from_policy(policy, seed=1)
    pairs = [PreferencePair("a", "12+34=", "<answer>46</answer>", "I do not know"),
             PreferencePair("b", "7+5=", "<answer>12</answer>", "<answer>13</answer>"),
             PreferencePair("c", "123+4=", "127", "<answer>128 or so</answer>")]
    batch = tokenize_preference_pairs(tokenizer, pairs)
    results = []
    for shared in (True, False):
        model.zero_grad(set_to_none=True)
        chosen, rejected = batch_rewards(model, batch, shared_prompt=shared)
        (chosen.sum() - 2 * rejected.sum()).backward()
        results.append((torch.cat([chosen, rejected]).detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (shared_rewards, shared_grads), (plain_rewards, plain_grads) = results
    from posttrain.models.reward_model import shared_prompt_rewards

    rows = torch.cat([batch.chosen.input_ids, batch.rejected.input_ids]), torch.cat([batch.chosen.attention_mask, batch.rejected.attention_mask])
    assert shared_prompt_rewards(model, *rows, torch.cat([batch.chosen.mask, batch.rejected.mask])) is not None, "the shared path ran"
    assert torch.allclose(shared_rewards, plain_rewards, atol=1e-5)
    assert set(shared_grads) == set(plain_grads)
    for name, grad in plain_grads.items():
        assert torch.allclose(shared_grads[name], grad, atol=1e-5), name


def test_common_prefix_lengths_by_hand():
    """Row pairs (padding 0, either side): [5, 5, 7, 8, 2] / [5, 5, 7, 9, 4, 2] share 5 5 7 -> 3;
    [5, 2] / [5, 2, 6, 2]: the first row is all prefix, capped at its length - 1 -> 1 (its EOS
    stays its own); [3, 2] / [4, 2] -> 0; the same rows left-padded give the same lengths."""
    from posttrain.models.packing import common_prefix_lengths

    first = [[5, 5, 7, 8, 2], [5, 2], [3, 2]]
    second = [[5, 5, 7, 9, 4, 2], [5, 2, 6, 2], [4, 2]]

    def padded(rows, side):
        width = max(map(len, rows))
        ids = torch.tensor([row + [0] * (width - len(row)) if side == "right" else [0] * (width - len(row)) + row for row in rows])
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) if side == "right" else [0] * (width - len(row)) + [1] * len(row)
                             for row in rows])
        return ids, mask

    for side in ("right", "left"):
        assert common_prefix_lengths(*padded(first, side), *padded(second, side)).tolist() == [3, 1, 0], side


@pytest.mark.parametrize("padding_side,attention,checkpointing", [("right", "sdpa", False), ("left", "sdpa", False),
                                                                    ("right", "eager", False), ("left", "eager", False),
                                                                    ("right", "sdpa", True)])
def test_pairs_sharing_response_tokens_equal_the_plain_forward(padding_side, attention, checkpointing):
    """Chosen and rejected answers that begin alike ("<answer>4" in both; "12" a prefix of "12, I
    think"), and a pair sharing only its prompt: computed once a pair (SDPA: the pairs packed in one
    row, `packed_pair_rewards`, also with gradient checkpointing, whose recomputation in backward
    looks the attention up again; eager attention: the shared KV cache), the rewards and every
    parameter's gradient equal the plain (2n, L) forward's."""
    from posttrain.data import PreferencePair, tokenize_preference_pairs
    from posttrain.models.loading import enable_gradient_checkpointing
    from posttrain.models.reward_model import batch_rewards, packed_pair_rewards

    policy, tokenizer = load_model("tiny")
    policy.config._attn_implementation = attention
    if checkpointing:
        enable_gradient_checkpointing(policy)
        policy.train()
    tokenizer.padding_side = padding_side
    model = RewardModel.from_policy(policy, seed=2)
    pairs = [PreferencePair("a", "12+34=", "<answer>46</answer>", "<answer>47</answer> or so"),
             PreferencePair("b", "7+5=", "12", "12, I think"),
             PreferencePair("c", "1+1=", "two", "three")]
    batch = tokenize_preference_pairs(tokenizer, pairs)
    packed = packed_pair_rewards(model, batch.chosen.input_ids, batch.chosen.attention_mask, batch.rejected.input_ids,
                                 batch.rejected.attention_mask)
    assert (packed is not None) == (attention == "sdpa"), "the packed row runs under SDPA only"
    results = []
    for shared in (True, False):
        model.zero_grad(set_to_none=True)
        chosen, rejected = batch_rewards(model, batch, shared_prompt=shared)
        (3 * chosen.sum() - rejected.sum()).backward()
        results.append((torch.cat([chosen, rejected]).detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (shared_rewards, shared_grads), (plain_rewards, plain_grads) = results
    assert torch.allclose(shared_rewards, plain_rewards, atol=1e-5)
    assert set(shared_grads) == set(plain_grads)
    for name, grad in plain_grads.items():
        assert torch.allclose(shared_grads[name], grad, rtol=1e-4, atol=1e-5), name


def test_out_of_memory_while_scoring_names_the_scoring_knobs(exported, monkeypatch):
    verifier = get_verifier(f"rm:{exported}")

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(verifier, "_raw_rewards", no_memory)
    with pytest.raises(UserError) as error:
        verifier("4", {"prompt": "2+2="})
    message = str(error.value)
    assert "out of memory while scoring 1 completions" in message and "reward_options.batch_size" in message
    assert "reward_options.offload cpu" in message and "\n" not in message


def test_rm_composes_with_a_program_in_a_weighted_sum(exported):
    """`0.8*rm:DIR+0.2*format`: the sum of the weighted parts, each kept in the verdict's components."""
    verifier = get_verifier(f"0.8*rm:{exported}+0.2*format")
    row = {"prompt": "2+2=", "answer": "4"}
    verdict = verifier("<answer>4</answer>", row)
    parts = verdict.details["components"]
    assert verdict.status == "ok" and verdict.reward == pytest.approx(0.8 * parts[f"rm:{exported}"] + 0.2 * parts["format"], abs=1e-6)
    assert parts[f"rm:{exported}"] == pytest.approx(get_verifier(f"rm:{exported}")("<answer>4</answer>", row).reward, abs=1e-6)


def test_lora_reward_model_trains_and_exports_merged(tmp_path):
    """--lora_rank 4: only the adapters and the head train; the checkpoint keeps the adapter; the export
    is a plain sequence-classification directory (adapters merged) that rm: loads."""
    pairs = pairs_file(tmp_path / "pairs.jsonl", 24)
    run = tmp_path / "run"
    result = subprocess.run(rm_command(pairs, run, "--lora_rank", "4"), capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    checkpoint = run / "checkpoints" / "step-000004"
    assert (checkpoint / "model" / "adapter_config.json").is_file() and (checkpoint / "score.pt").is_file()
    assert not list((run / "final").glob("adapter_*")) and (run / "final" / "model.safetensors").is_file()
    verdict = get_verifier(f"rm:{run / 'final'}")("<answer>46</answer>", {"prompt": "12+34="})
    assert verdict.status == "ok" and math.isfinite(verdict.reward)
