"""Per-pair DPO losses equal TRL's DPOTrainer on the same tiny model and the same pairs (TRL is a
test/bench-only dependency; skipped when it is not installed).

TRL computes one loss per batch (a mean), so each pair is its own TRL batch; ours are computed in
one padded batch, which also checks that padding does not leak into the sums. TRL's configs default
to bf16=True, which runs its reference forward under bfloat16 autocast even on CPU; we turn it off
so both sides compute in float32.
"""

import copy

import pytest
import torch

from posttrain.data import PreferencePair, tokenize_preference_pairs
from posttrain.models import load_model
from posttrain.models.pair_forward import pair_logprobs
from posttrain.losses.preference import Loss, preference_losses
from tests.test_dpo import arithmetic_pairs

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def models():
    reference, tokenizer = load_model("tiny")
    policy = copy.deepcopy(reference)
    torch.manual_seed(0)
    with torch.no_grad():  # a policy away from the reference, so the losses are not all ln 2
        for param in policy.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return policy, reference, tokenizer


@pytest.mark.parametrize(
    "ours, theirs, label_smoothing",
    [("sigmoid", "sigmoid", 0.0), ("hinge", "hinge", 0.0), ("robust", "robust", 0.1), ("length_normalized", "sigmoid_norm", 0.0)],
)
def test_per_pair_losses_equal_trl(tmp_path, models, ours, theirs, label_smoothing):
    policy, reference, tokenizer = models
    rows = arithmetic_pairs(6)
    beta = 0.2
    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"), beta=beta, loss_type=[theirs], label_smoothing=label_smoothing, bf16=False,
        use_cpu=True, per_device_train_batch_size=1, max_length=None, report_to=[], logging_strategy="no", save_strategy="no",
    )
    dataset = datasets.Dataset.from_list([{key: row[key] for key in ("prompt", "chosen", "rejected")} for row in rows])
    trainer = trl.DPOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), args=args,
                             train_dataset=dataset, processing_class=tokenizer)
    trainer.model.eval()
    expected = []
    with torch.no_grad():
        for index in range(len(rows)):
            batch = trainer.data_collator([trainer.train_dataset[index]])
            expected.append(float(trainer._compute_loss(trainer.model, batch, return_outputs=False)))

    # Ours: the plain (non-chat) rendering TRL uses for string prompts, all pairs in one padded batch.
    pairs = [PreferencePair(row["id"], row["prompt"], row["chosen"], row["rejected"]) for row in rows]
    batch = tokenize_preference_pairs(tokenizer, pairs, use_chat_template=False)
    assert batch.chosen.input_ids[0].tolist() == trainer.train_dataset[0]["prompt_ids"] + trainer.train_dataset[0]["chosen_ids"]
    with torch.no_grad():
        policy_sums, reference_sums = pair_logprobs(policy, batch), pair_logprobs(reference, batch)
    losses, _, _ = preference_losses(Loss(type=ours, beta=beta, label_smoothing=label_smoothing),
                                         policy_sums, reference_sums.chosen, reference_sums.rejected)
    assert len(set(round(x, 3) for x in expected)) == len(expected), "pairs should differ"
    assert losses.tolist() == pytest.approx(expected, abs=1e-5)
