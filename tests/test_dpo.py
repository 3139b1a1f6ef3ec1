"""DPO recipe: the seed's pair through the recipe's code, ln 2 at the start, masked sums with left
and right padding, precomputed = live reference, LoRA reference = base model, every loss type by
hand, micro-batch invariance (of the step and of the held-out pair metrics), the displacement
alarm, smoke runs, bad configs, SIGKILL resume."""

import copy
import dataclasses
import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from posttrain.config import build_config, parse_overrides
from posttrain.data import (
    PreferencePair, TruncationPolicy, collate_token_ids, encode_prompt, encode_response, tokenize_preference_pairs,
)
from posttrain.data.pair_batch import PreferenceBatch
from posttrain.data.provenance import write_with_provenance
from posttrain.evaluation.alarms import DisplacementAlarm
from posttrain.evaluation.preference import HeldoutPairs, evaluate_pairs
from posttrain.models import LoraSettings, apply_lora, load_model, make_reference
from posttrain.models import forward as model_forward
from posttrain.models import pair_forward
from posttrain.losses.objectives import PREFERENCE_OBJECTIVES
from posttrain.losses.preference import REFERENCE_CACHE, Loss, PreferenceModels, PreferenceSettings, preference_losses
from posttrain.losses.preference import step as preference_step
from posttrain.models.forward import TrainingForward
from posttrain.recipes import dpo, dpo_config
from tests.gradients import KeptGradients

ROOT = Path(__file__).resolve().parent.parent


def arithmetic_pairs(count: int = 12) -> list[dict]:
    rows = []
    for index in range(count):
        a, b = 10 + 7 * index, 21 + 5 * index
        rows.append({"id": f"p{index}", "prompt": f"{a}+{b}=", "chosen": f"<answer>{a + b}</answer>",
                     "rejected": f"<answer>{a + b + 1 + index % 3}</answer>" if index % 2 else "I do not know"})
    return rows


def write_pairs(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def pairs_file(tmp_path) -> Path:
    return write_pairs(tmp_path / "pairs.jsonl", arithmetic_pairs())


def small_config(tmp_path, pairs_file, *extra) -> dpo_config.Config:
    overrides = ["--data.pairs", str(pairs_file), "--data.heldout_pairs", "2", "--batch_size", "4",
                 "--micro_batch_size", "2", "--optim.lr", "1e-3", "--max-steps", "2", *extra]
    config = build_config(dpo_config.Config, None, parse_overrides(overrides))
    config.output_dir = str(tmp_path / "run")
    return config


def pairs_of(rows) -> list[PreferencePair]:
    return [PreferencePair(r["id"], r["prompt"], r["chosen"], r["rejected"]) for r in rows]


def sums(chosen, rejected, chosen_lengths=(1,), rejected_lengths=(1,)) -> pair_forward.PairLogprobs:
    return pair_forward.PairLogprobs(torch.tensor(chosen), torch.tensor(rejected), torch.tensor(chosen_lengths), torch.tensor(rejected_lengths))


def test_seed_pair_through_the_recipe_loss():
    """The seed: policy chosen -2, rejected -4; reference -3, -3; beta 0.2.
    h = (-2 - -3) - (-4 - -3) = 2, logit 0.4, loss = log(1 + e^-0.4) = 0.51302; rewards +0.2 / -0.2."""
    losses, chosen_rewards, rejected_rewards = preference_losses(
        Loss(type="sigmoid", beta=0.2), sums([-2.0], [-4.0]), torch.tensor([-3.0]), torch.tensor([-3.0]))
    assert losses.item() == pytest.approx(math.log(1 + math.exp(-0.4)), abs=1e-6)
    assert losses.item() == pytest.approx(0.5130, abs=5e-5)
    assert chosen_rewards.item() == pytest.approx(0.2) and rejected_rewards.item() == pytest.approx(-0.2)


@pytest.mark.parametrize(
    "loss, expected",
    [
        # h = 2, beta = 0.2, beta h = 0.4; softplus(-0.4) = 0.513015, softplus(0.4) = 0.913015.
        (Loss(type="sigmoid", beta=0.2), 0.513015),
        # cDPO, e = 0.1: 0.9 * 0.513015 + 0.1 * 0.913015 = 0.553015
        (Loss(type="conservative", beta=0.2, label_smoothing=0.1), 0.553015),
        # robust, e = 0.1: (0.9 * 0.513015 - 0.1 * 0.913015) / 0.8 = 0.463015
        (Loss(type="robust", beta=0.2, label_smoothing=0.1), 0.463015),
        # IPO: (h - 1 / (2 beta))^2 = (2 - 2.5)^2 = 0.25
        (Loss(type="ipo", beta=0.2), 0.25),
        # hinge: max(0, 1 - beta h) = 0.6
        (Loss(type="hinge", beta=0.2), 0.6),
        # length-normalised, lengths 2 (chosen) and 4 (rejected): chosen -2/2 - -3/2 = 0.5,
        # rejected -4/4 - -3/4 = -0.25, h = 0.75, beta h = 0.15, softplus(-0.15) = 0.620957
        (Loss(type="length_normalized", beta=0.2), 0.620957),
    ],
)
def test_each_loss_type_by_hand(loss, expected):
    losses, _, _ = preference_losses(loss, sums([-2.0], [-4.0], [2], [4]), torch.tensor([-3.0]), torch.tensor([-3.0]))
    assert losses.item() == pytest.approx(expected, abs=1e-5)


def test_every_loss_type_is_a_row_of_the_one_table():
    """The config's choices (`--loss kto` hints), the losses with a reference and without, KTO (its
    own step, on unpaired rows) and the run card's descriptions are the rows of one table."""
    assert Loss.PRIMARY["type"] is PREFERENCE_OBJECTIVES
    with_reference = {name for name, entry in PREFERENCE_OBJECTIVES.items() if entry.pair_loss is not None}
    reference_free = {name for name, entry in PREFERENCE_OBJECTIVES.items() if not entry.needs_reference}
    assert with_reference == {"sigmoid", "conservative", "robust", "ipo", "hinge", "length_normalized", "length_normalized_ipo"}
    assert reference_free == {"simpo", "cpo", "orpo"}
    assert set(PREFERENCE_OBJECTIVES) >= with_reference | reference_free | {"kto"}
    assert all(entry.card for entry in PREFERENCE_OBJECTIVES.values())


def naive_response_sum(model, prompt_ids, response_ids) -> float:
    """One unpadded sequence, full log-softmax, sum of the response tokens' log-probs."""
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    return sum(float(logprobs[t - 1, ids[0, t]]) for t in range(len(prompt_ids), ids.shape[1]))


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_masked_sums_equal_unpadded_sums_with_left_and_right_padding(padding_side):
    """Hand-built batch: prompts and responses of different lengths padded on either side. Each
    sum must equal the unpadded sequence's response log-probs (prompt and padding excluded, the
    ending EOS included)."""
    model, tokenizer = load_model("tiny")
    prompts, chosen, rejected = ["1+2=", "12+345="], ["<answer>3</answer>", "357"], ["4", "<answer>356</answer>"]
    prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]
    chosen_ids = [encode_response(tokenizer, r) for r in chosen]
    rejected_ids = [encode_response(tokenizer, r) for r in rejected]
    assert all(ids[-1] == tokenizer.eos_token_id for ids in chosen_ids + rejected_ids)
    both = collate_token_ids(prompt_ids * 2, chosen_ids + rejected_ids, pad_token_id=tokenizer.pad_token_id, padding_side=padding_side)
    halves = [type(both)(both.input_ids[s], both.attention_mask[s], both.mask[s], both.prompt_lengths[s], both.response_lengths[s])
              for s in (slice(0, 2), slice(2, 4))]
    batch = PreferenceBatch(chosen=halves[0], rejected=halves[1], kept=[0, 1], counts=None)
    assert (both.attention_mask == 0).any(), "the batch must contain padding"
    with torch.no_grad():
        result = pair_forward.pair_logprobs(model, batch)
    for i in range(2):
        assert result.chosen[i].item() == pytest.approx(naive_response_sum(model, prompt_ids[i], chosen_ids[i]), abs=1e-4)
        assert result.rejected[i].item() == pytest.approx(naive_response_sum(model, prompt_ids[i], rejected_ids[i]), abs=1e-4)
    assert result.chosen_lengths.tolist() == [len(ids) for ids in chosen_ids]
    assert result.rejected_lengths.tolist() == [len(ids) for ids in rejected_ids]


def test_policy_equal_to_reference_gives_ln2_and_precomputed_equals_live(tmp_path, pairs_file):
    """At step 0 the policy is the reference: every h is 0 and the loss is ln 2 whatever the
    log-probs. Cached reference log-probs give the same loss and the same gradient as a live
    reference, and the live reference does not move when the policy does."""
    config = small_config(tmp_path, pairs_file)
    policy, tokenizer = load_model("tiny")
    pairs = pairs_of(arithmetic_pairs(4))
    batch = tokenize_preference_pairs(tokenizer, pairs)
    reference = make_reference(policy)
    kept = KeptGradients(policy)
    models = PreferenceModels(kept.trainable(TrainingForward(policy, pair_forward.pair_logprobs)), reference)
    settings = PreferenceSettings(config.loss, config.micro_batch_size)
    live = preference_step(models, batch, settings)
    live_grads = kept.grads
    assert all(p.grad is None for p in policy.parameters())  # the step zeroes what it applied
    cached = pair_forward.reference_logprobs(policy, (tokenize_preference_pairs(tokenizer, pairs[start : start + 3]) for start in (0, 3)))
    assert cached.shape == (4, 2)
    precomputed = preference_step(PreferenceModels(models.policy), dataclasses.replace(batch, reference=cached), settings)
    assert live["loss"] == pytest.approx(math.log(2), abs=1e-6) and precomputed["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert live["logps/chosen"] < -5 and live["rewards/accuracy"] == 0.0 and live["logratio/chosen"] == 0.0
    assert live["grad_norm"] == pytest.approx(precomputed["grad_norm"], rel=1e-5) and live["grad_norm"] > 0
    for name, grad in kept.grads.items():
        assert torch.allclose(grad, live_grads[name], atol=1e-6), name
    # After an optimizer step the live reference still gives the cached values.
    torch.optim.SGD(policy.parameters(), lr=0.1).step()
    again = pair_forward.pair_logprobs(reference, batch)
    assert torch.allclose(torch.stack([again.chosen, again.rejected], 1), cached, atol=1e-4)


def test_heldout_pairs_live_equals_cached_whatever_the_micro_batch(tmp_path, pairs_file):
    """`evaluation.preference.evaluate_pairs` with the policy as its own reference: every h is 0, so
    heldout/loss = ln 2 and margins 0 (live: accuracy exactly 0, a tie counts as wrong). The columns
    of the micro-batches are concatenated before the means, so micro-batches of 1, 2 or 5 pairs and
    a cached reference give the same numbers; heldout/nll = -(sum of chosen log-probs) / chosen tokens."""
    config = small_config(tmp_path, pairs_file)
    policy, tokenizer = load_model("tiny")
    policy.eval()
    pairs = pairs_of(arithmetic_pairs(5))

    def encode(chunk):
        return tokenize_preference_pairs(tokenizer, chunk)

    with torch.no_grad():
        whole = pair_forward.pair_logprobs(policy, encode(pairs))
    cached = torch.stack([whole.chosen, whole.rejected], 1)  # (M, 2)
    nll = -float(whole.chosen.sum()) / int(whole.chosen_lengths.sum())
    live = [evaluate_pairs(policy, HeldoutPairs(pairs, encode, config.loss, micro, reference=make_reference(policy))) for micro in (1, 2, 5)]
    precomputed = evaluate_pairs(policy, HeldoutPairs(pairs, encode, config.loss, 2, cached=cached))
    for result in live + [precomputed]:
        assert result["heldout/loss"] == pytest.approx(math.log(2), abs=1e-5)
        assert result["heldout/margins"] == pytest.approx(0.0, abs=1e-5) and result["heldout/logratio/chosen"] == pytest.approx(0.0, abs=1e-4)
        assert result["heldout/nll"] == pytest.approx(nll, rel=1e-5)
    assert all(result["heldout/preference_accuracy"] == 0.0 for result in live)
    # TRL's convention counts the 5 ties as wrong; they are counted apart, and the interval is 0 of 5's.
    from posttrain.evaluation.stats import wilson_interval

    for result in live:
        assert result["heldout/preference_accuracy_ties"] == 5
        assert (result["heldout/preference_accuracy_low"], result["heldout/preference_accuracy_high"]) == pytest.approx(wilson_interval(0, 5))
    assert evaluate_pairs(policy, HeldoutPairs([], encode, config.loss, 2)) == {}


def test_lora_reference_is_the_base_model():
    """A LoRA policy's reference is the policy with adapters disabled: after the adapters are
    changed (so the policy differs), its log-probs equal a fresh base model's."""
    base, tokenizer = load_model("tiny")
    policy = apply_lora(load_model("tiny")[0], LoraSettings(rank=4))
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    batch = tokenize_preference_pairs(tokenizer, pairs_of(arithmetic_pairs(3)))
    reference = make_reference(policy)
    assert reference.adapter_disabled
    with torch.no_grad():
        ours, expected, adapted = pair_forward.pair_logprobs(reference, batch), pair_forward.pair_logprobs(base, batch), pair_forward.pair_logprobs(policy, batch)
    assert torch.allclose(ours.chosen, expected.chosen, atol=1e-5) and torch.allclose(ours.rejected, expected.rejected, atol=1e-5)
    assert not torch.allclose(adapted.chosen, expected.chosen, atol=1e-2), "the adapters should change the policy"


def shared_prompt_batch(tokenizer, padding_side: str) -> PreferenceBatch:
    """5 pairs over 4 distinct prompts (pairs 1 and 3 share one) of 3 lengths, the longest prompt cut
    on the left and some responses cut on the right (no EOS) by the truncation policy."""
    rows = arithmetic_pairs(4) + [{"id": "long", "prompt": "Question: what is 1234 plus 98765, step by step?",
                                   "chosen": "1234 + 98765 = 99999, so the answer is 99999.", "rejected": "?"}]
    rows[0]["prompt"], rows[3]["prompt"] = f"Add them: {rows[0]['prompt']}", rows[1]["prompt"]  # 35, 25, 25, 25, 67 -> 40 tokens
    policy = TruncationPolicy(max_prompt_tokens=40, max_response_tokens=16, prompt="left")
    batch = tokenize_preference_pairs(tokenizer, pairs_of(rows), truncation=policy, padding_side=padding_side)
    assert batch.counts.prompts_truncated and batch.counts.responses_truncated and not batch.counts.dropped
    return batch


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_shared_prompt_forward_equals_the_concatenated_forward(padding_side, lora):
    """Each pair's prompt computed once (KV cache shared by its chosen and rejected rows), and the
    pairs packed in one row (each pair's common prefix once), give the per-row forward's sums,
    lengths and parameter gradients, for the policy and a live reference.
    Sums of ~16 log-probs reach ~75, where one float32 ulp is 7.6e-6: hence rtol 1e-6 next to atol 1e-5."""
    torch.manual_seed(0)  # the LoRA A matrices
    model, tokenizer = load_model("tiny")
    if lora:
        model = apply_lora(model, LoraSettings(rank=4))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    model.train()
    batch = shared_prompt_batch(tokenizer, padding_side)
    input_ids, attention_mask, mask = (torch.cat([getattr(batch.chosen, key), getattr(batch.rejected, key)])
                                       for key in ("input_ids", "attention_mask", "mask"))
    weights = torch.linspace(-1.0, 2.0, input_ids.shape[0])  # a different gradient per row
    results = []
    n = input_ids.shape[0] // 2
    halves = [tensor[:n] for tensor in (input_ids, attention_mask, mask)] + [tensor[n:] for tensor in (input_ids, attention_mask, mask)]
    for forward in (model_forward.response_sums, pair_forward.shared_prompt_sums, lambda model, *_: pair_forward.packed_pair_sums(model, *halves)):
        model.zero_grad(set_to_none=True)
        sums, lengths = forward(model, input_ids, attention_mask, mask)
        (sums * weights).sum().backward()
        results.append((sums.detach(), lengths, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    (plain, plain_lengths, plain_grads), *others = results
    for shared, shared_lengths, shared_grads in others:  # the prompt through a KV cache; the pairs packed in one row
        torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-6)
        assert shared_lengths.tolist() == plain_lengths.tolist() == (mask.sum(-1)).tolist()
        for name, grad in plain_grads.items():
            torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    reference = make_reference(model)  # for LoRA the base model: the adapters go off in both calls
    shared, plain = pair_forward.pair_logprobs(reference, batch), pair_forward.pair_logprobs(reference, batch, full_forward=True)
    torch.testing.assert_close(shared.chosen, plain.chosen, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(shared.rejected, plain.rejected, atol=1e-5, rtol=1e-6)


def test_packed_pairs_under_gradient_checkpointing_equal_the_per_row_forward():
    """With gradient checkpointing (each layer recomputed in backward, where transformers looks the
    attention function up again) the packed pairs give the per-row forward's sums and gradients."""
    from posttrain.models.loading import enable_gradient_checkpointing

    model, tokenizer = load_model("tiny")
    enable_gradient_checkpointing(model)
    model.train()
    batch = shared_prompt_batch(tokenizer, "left")
    chosen, rejected = batch.chosen, batch.rejected
    results = []
    for packed in (True, False):
        model.zero_grad(set_to_none=True)
        if packed:
            sums, _ = pair_forward.packed_pair_sums(model, chosen.input_ids, chosen.attention_mask, chosen.mask,
                                                    rejected.input_ids, rejected.attention_mask, rejected.mask)
        else:
            sums, _ = model_forward.response_sums(model, *(torch.cat([getattr(chosen, key), getattr(rejected, key)])
                                                           for key in ("input_ids", "attention_mask", "mask")))
        (sums * torch.linspace(-1.0, 2.0, sums.shape[0])).sum().backward()
        results.append((sums.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (packed_sums, packed_grads), (plain_sums, plain_grads) = results
    torch.testing.assert_close(packed_sums, plain_sums, atol=1e-5, rtol=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_shared_prompt_forward_embeds_each_prompt_once_and_falls_back(monkeypatch):
    """5 pairs over 4 distinct prompts: under SDPA one packed row of each pair's distinct tokens
    (its common prefix once); under eager attention 4 prompt rows of width P, then 10 response
    rows of width T - 1 (the shared KV cache); `full_forward` is one (10, L) call; an unsupported
    architecture takes the per-row path. All give the same sums."""
    from posttrain.models.packing import common_prefix_lengths

    model, tokenizer = load_model("tiny")
    batch = shared_prompt_batch(tokenizer, "right")
    shapes = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, output: shapes.append(tuple(args[0].shape)))
    chosen, rejected = batch.chosen, batch.rejected
    distinct = int((chosen.attention_mask.sum() + rejected.attention_mask.sum()
                    - common_prefix_lengths(chosen.input_ids, chosen.attention_mask, rejected.input_ids, rejected.attention_mask).sum()))
    with torch.no_grad():
        packed = pair_forward.pair_logprobs(model, batch)
        assert shapes == [(1, distinct)]
        shapes.clear()
        model.config._attn_implementation = "eager"
        shared = pair_forward.pair_logprobs(model, batch)
        model.config._attn_implementation = "sdpa"
        P = int((batch.chosen.attention_mask.bool() & ~batch.chosen.mask).sum(-1).max())
        T = int(torch.cat([batch.chosen.mask, batch.rejected.mask]).sum(-1).max())
        assert shapes == [(4, P), (10, T - 1)]
        shapes.clear()
        full = pair_forward.pair_logprobs(model, batch, full_forward=True)
        assert shapes == [(10, batch.chosen.input_ids.shape[1])]
        monkeypatch.setattr(model_forward, "SUPPORTED_MODEL_TYPES", ())
        assert pair_forward.shared_prompt_sums(model, batch.chosen.input_ids, batch.chosen.attention_mask, batch.chosen.mask) is None
        fallback = pair_forward.pair_logprobs(model, batch)
    for result in (full, fallback, packed):
        torch.testing.assert_close(result.chosen, shared.chosen, atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(result.rejected, shared.rejected, atol=1e-5, rtol=1e-6)


def test_micro_batch_split_gives_the_same_gradient(tmp_path, pairs_file):
    """1 micro-batch of 4 pairs vs 4 of 1, with the RPO term on: the per-pair mean and the
    batch-wide chosen-token normaliser make the gradient identical."""
    policy, tokenizer = load_model("tiny")
    torch.manual_seed(0)
    with torch.no_grad():  # move the policy off the reference so h != 0
        for param in policy.parameters():
            param.add_(0.02 * torch.randn_like(param))
    reference = make_reference(load_model("tiny")[0])
    batch = tokenize_preference_pairs(tokenizer, pairs_of(arithmetic_pairs(4)))
    results, kept = [], KeptGradients(policy)
    models = PreferenceModels(kept.trainable(TrainingForward(policy, pair_forward.pair_logprobs)), reference)
    for micro in (4, 1):
        config = small_config(tmp_path, pairs_file, "--loss.nll_weight", "0.5", "--micro_batch_size", str(micro))
        metrics = preference_step(models, batch, PreferenceSettings(config.loss, config.micro_batch_size))
        results.append((metrics, kept.grads))
    (first, grads), (second, other) = results
    assert first["loss"] != pytest.approx(math.log(2), abs=1e-3)
    for key in ("loss", "loss/nll", "rewards/margins", "rewards/accuracy"):
        assert second[key] == pytest.approx(first[key], abs=1e-5), key
    for name, grad in grads.items():
        assert torch.allclose(other[name], grad, atol=1e-6), name


def test_displacement_alarm_rings_once_when_chosen_falls_while_accuracy_rises():
    alarm = DisplacementAlarm(threshold=1.0, window=2)
    assert alarm.observe(1, 0.0, 0.0) is None
    assert alarm.observe(2, -0.5, 0.5) is None  # mean over the last 2 steps -0.25: above -1
    # steps 2-3: mean chosen log-ratio -1.75 < -1, accuracy 0.5 > 0.25 (steps 1-2): rings
    message = alarm.observe(3, -3.0, 0.5)
    assert message is not None and "step 3" in message and alarm.rings == [message]
    assert alarm.observe(4, -9.0, 1.0) is None, "rings once"
    calm = DisplacementAlarm(threshold=1.0, window=2)
    for step, (ratio, accuracy) in enumerate([(0.0, 0.5), (-4.0, 0.5), (-5.0, 0.25)], start=1):
        assert calm.observe(step, ratio, accuracy) is None, "accuracy did not rise: no alarm"


LOSS_VARIANTS = [
    ["--loss.type", "sigmoid", "--loss.reference_refresh_every", "2"],
    ["--loss.type", "conservative", "--loss.label_smoothing", "0.1", "--loss.reference", "precomputed"],
    ["--loss.type", "robust", "--loss.label_smoothing", "0.2", "--lora_rank", "4", "--optim.lr", "1e-2"],
    ["--loss.type", "ipo", "--loss.nll_weight", "0.2"],
    ["--loss.type", "hinge", "--lora_rank", "4", "--loss.reference", "precomputed", "--optim.lr", "1e-2"],
    ["--loss.type", "length_normalized", "--loss.beta", "1.0", "--acceptance.displacement_threshold", "-1e9", "--acceptance.alarm_window", "1"],
]


@pytest.mark.parametrize("variant", LOSS_VARIANTS, ids=lambda v: v[1])
def test_smoke_each_loss(tmp_path, pairs_file, variant):
    config = small_config(tmp_path, pairs_file, *variant)
    before = copy.deepcopy(config)
    run_dir = dpo.run(config)
    assert config == before, "run() does not change its config"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert rows[0]["heldout/preference_accuracy"] == 0.0 and rows[0]["heldout/margins"] == 0.0
    card_heldout = json.loads((run_dir / "run_card.json").read_text())["links"]["acceptance"]["heldout_pairs"]
    assert rows[0]["heldout/preference_accuracy_ties"] == int(card_heldout.split()[0]), "policy == reference: every held-out pair a tie"
    assert "a tie counts as wrong" in card_heldout and "Wilson 95% interval" in card_heldout
    assert rows[1]["rewards/ties"] == 1.0 and rows[2]["rewards/ties"] == 0.0
    assert rows[1]["logratio/chosen"] == pytest.approx(0.0, abs=1e-5), "step 1: policy == reference"
    assert all(math.isfinite(row["loss"]) for row in rows[1:])
    assert rows[2]["logratio/chosen"] != 0.0, "the policy moved"
    assert "heldout/preference_accuracy" in rows[2] and "heldout/pass@1" not in rows[2]
    card = json.loads((run_dir / "run_card.json").read_text())
    loss = card["links"]["loss"]
    assert loss["type"] == config.loss.type and loss["forward"].startswith("chosen and rejected concatenated")
    assert "not recorded" in card["links"]["reward"]["labels"]
    if config.loss.reference == "precomputed":
        assert "no reference model in memory" in loss["reference"] and (run_dir / REFERENCE_CACHE).is_file()
    elif config.lora_rank:
        assert loss["reference"].startswith("LoRA base")
    if config.loss.reference_refresh_every:
        assert card["run"]["reference_refreshed_at"] == [2]
    if config.acceptance.displacement_threshold < 0:  # any drop counts: rings once accuracy rises
        assert card["alarms"] and "likelihood displacement" in card["alarms"][0]
    assert (run_dir / "plots" / "loss.png").is_file() and (run_dir / "checkpoints" / "step-000002").is_dir()


def test_cli_smoke_and_provenance_in_the_card(tmp_path, pairs_file):
    """Through the CLI, on a file with a `posttrain pairs` sidecar: the card says who labelled the
    pairs, the held-out task accuracy is measured, and the pairs' prompts in the held-out split are
    removed from training."""
    rows = arithmetic_pairs()
    provenance = {"model": "tiny", "verifier": "exact", "task": "arithmetic", "task_options": {}, "eval_size": 4, "seed": 0,
                  "group_size": 4, "sampling": {"temperature": 1.0}, "system_prompt": "Answer in tags."}
    write_with_provenance(tmp_path / "verified.jsonl", rows, provenance)
    result = subprocess.run(
        [sys.executable, "-m", "posttrain", "dpo", "--data.pairs", str(tmp_path / "verified.jsonl"), "--max-steps", "1",
         "--batch_size", "2", "--data.heldout_pairs", "0", "--acceptance.max_new_tokens", "4", "--output-dir", str(tmp_path / "run")],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert f"results: {tmp_path / 'run'}" in result.stdout
    card = json.loads((tmp_path / "run" / "run_card.json").read_text())
    assert card["links"]["reward"]["labels"] == "labels came from verifier exact on samples of model tiny"
    assert card["links"]["reward"]["provenance_file_matches"] is True
    # The default checker of a number task is `integer`, written apart from the `exact` labeller.
    acceptance = card["links"]["acceptance"]
    assert acceptance["checker"] == "integer" and acceptance["checker_is_labeller"] is False
    assert acceptance["independent"] is True and "shares no part with the training reward exact" in acceptance["independence_reason"]
    assert not any("not independent" in note for note in card["notes"])
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "heldout/pass@1" in metrics[0] and "heldout/pass@1" in metrics[-1]
    # The task's shifted held-out sets beside it (arithmetic's defaults), as in grpo.
    assert metrics[-1]["heldout/in_distribution/pass@1"] == metrics[-1]["heldout/pass@1"]
    assert "heldout/digits_3/pass@1" in metrics[-1] and "heldout/words/pass@1_high" in metrics[-1]
    assert set(acceptance["sets"]) == {"digits_3", "words"} and acceptance["sets"]["words"]["size"] == 4
    assert (tmp_path / "run" / "plots" / "heldout_sets.png").is_file()
    assert list((tmp_path / "run" / "eval").glob("task-step-*.json"))
    # No data.system_prompt given: the pairs are rendered with the one they were sampled with.
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["data"]["system_prompt"] == "Answer in tags."


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([], "data.pairs: give the preference JSONL"),
        (["--data.pairs", "missing.jsonl"], "missing.jsonl"),
        (["--loss.type", "slic"], "loss.type: must be one of"),
        (["--loss.type", "ipo", "--loss.label_smoothing", "0.1"], "label_smoothing applies to"),
        (["--loss.type", "conservative"], "label_smoothing must be in (0, 0.5)"),
        (["--loss.reference", "precomputed", "--loss.reference_refresh_every", "5"], "needs a live reference"),
        (["--loss.beta", "0"], "loss.beta must be > 0"),
        (["--los.beta", "1"], "unknown key 'los'"),
    ],
)
def test_bad_config_one_line(tmp_path, pairs_file, overrides, message):
    pairs = [] if overrides and overrides[0] == "--data.pairs" or not overrides else ["--data.pairs", str(pairs_file)]
    result = subprocess.run(
        [sys.executable, "-m", "posttrain", "dpo", "--output-dir", str(tmp_path / "run"), *pairs, *overrides],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "run").exists(), "nothing may be written for a bad config"


def test_bad_pair_row_names_file_line_and_field(tmp_path):
    rows = arithmetic_pairs(4)
    rows[2]["chosen"] = 7
    path = write_pairs(tmp_path / "bad.jsonl", rows)
    result = subprocess.run(
        [sys.executable, "-m", "posttrain", "dpo", "--data.pairs", str(path), "--output-dir", str(tmp_path / "run")],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert result.returncode != 0 and "bad.jsonl:3" in result.stderr and "chosen" in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path, pairs_file):
    """Kill -9 after the second checkpoint, tear the newest checkpoint as a crash mid-write would,
    resume: per-step metrics (except timings) and final weights equal an uninterrupted run. The
    reference is refreshed every 3 steps, so it is part of the state that must survive."""

    def command(output):
        return [sys.executable, "-m", "posttrain", "dpo", "--data.pairs", str(pairs_file), "--data.heldout_pairs", "2",
                "--batch_size", "4", "--micro_batch_size", "2", "--optim.lr", "1e-3", "--checkpoint-every", "1",
                "--loss.reference_refresh_every", "3", "--seed", "5", "--max-steps", "5", "--output-dir", str(output)]

    subprocess.run(command(tmp_path / "straight"), check=True, capture_output=True, cwd=ROOT)
    interrupted = tmp_path / "interrupted"
    process = subprocess.Popen(command(interrupted), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and not (interrupted / "checkpoints" / "step-000004").exists():
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    newest = sorted((interrupted / "checkpoints").glob("step-*"))[-1]
    torn = newest / "model" / "model.safetensors"
    if torn.exists():
        torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    result = subprocess.run([sys.executable, "-m", "posttrain", "dpo", "--resume", str(interrupted)],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr

    def comparable(path):
        rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in row.items() if not k.startswith(("seconds/", "tokens_per_second"))} for row in rows]

    assert comparable(interrupted) == comparable(tmp_path / "straight")
    card = json.loads((interrupted / "run_card.json").read_text())
    assert card["run"]["reference_refreshed_at"] == [3]
    final_a = load_model(str(tmp_path / "straight" / "checkpoints" / "step-000005" / "model"))[0]
    final_b = load_model(str(interrupted / "checkpoints" / "step-000005" / "model"))[0]
    for (name, a), (_, b) in zip(final_a.named_parameters(), final_b.named_parameters()):
        assert torch.equal(a, b), name
