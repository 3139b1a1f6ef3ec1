"""SFT's loss: the response-only forward against the plain full-logits NLL, micro-batch invariance."""

import copy

import pytest
import torch

from posttrain.data import tokenize_prompt_response
from posttrain.models import LoraSettings, apply_lora, build_tiny_model, lean_mlp
from posttrain.models.forward import TrainingForward, batch_response_sums
from posttrain.losses.sft import sft_loss
from posttrain.losses.sft import SFTSettings
from posttrain.losses.sft import step as sft_step
from posttrain.optim import Trainable

PROMPTS = ["12+30=", "7+5=", "101+99=", "3+4="]
RESPONSES = ["<answer>42</answer>", "<answer>12</answer>", "<answer>200</answer>", "7"]


def naive_loss(model, batch) -> torch.Tensor:
    """Token-mean NLL over response tokens from the model's own full (N, L, V) logits."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    mask = batch.mask[:, 1:]
    return -(logprobs * mask).sum() / mask.sum()


@pytest.mark.parametrize("lora", [False, True])
def test_response_forward_loss_equals_the_full_logits_nll(lora):
    model, tokenizer = build_tiny_model(seed=4)
    if lora:
        model = apply_lora(model, LoraSettings(rank=4, target_modules=["q_proj", "down_proj"]))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.1, generator=torch.Generator().manual_seed(5))
    reference = copy.deepcopy(model)
    lean_mlp(model)  # as the recipe does
    batch = tokenize_prompt_response(tokenizer, PROMPTS, RESPONSES)  # right-padded, unequal lengths
    assert batch.attention_mask.sum(-1).unique().numel() > 1
    loss = sft_loss(TrainingForward(model, batch_response_sums), batch, slice(None), batch.mask[:, 1:].sum())
    expected = naive_loss(reference, batch)
    assert torch.allclose(loss, expected, atol=1e-5)
    loss.backward()
    expected.backward()
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        if a.requires_grad:
            assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), name


def test_micro_batches_add_up_to_the_batch_loss_and_gradient():
    model, tokenizer = build_tiny_model(seed=6)
    batch = tokenize_prompt_response(tokenizer, PROMPTS, RESPONSES)
    tokens = batch.mask[:, 1:].sum()
    forward = TrainingForward(model, batch_response_sums)
    whole = sft_loss(forward, batch, slice(None), tokens)
    (whole_grad,) = torch.autograd.grad(whole, model.lm_head.weight)
    parts = [sft_loss(forward, batch, slice(start, start + 3), tokens) for start in (0, 3)]
    (parts_grad,) = torch.autograd.grad(sum(parts), model.lm_head.weight)
    assert torch.allclose(sum(parts), whole, atol=1e-6)
    assert torch.allclose(parts_grad, whole_grad, atol=1e-6)


def test_loss_step_is_the_same_whatever_the_micro_batch():
    """The public loss step over 4 rows in one micro-batch and in micro-batches of 3 (3 + 1 rows):
    the same token-mean loss (the naive full-logits NLL), the same gradient norm and, after one
    plain SGD step (lr 1: the parameters move by exactly the gradient), the same parameters."""
    batch = tokenize_prompt_response(build_tiny_model(seed=7)[1], PROMPTS, RESPONSES)
    results = []
    for micro_batch_size in (4, 3):
        model, _ = build_tiny_model(seed=7)
        with torch.no_grad():
            naive = naive_loss(model, batch).item()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        models = Trainable(TrainingForward(model, batch_response_sums), optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0))
        metrics = sft_step(models, batch, SFTSettings(micro_batch_size))
        assert metrics["loss"] == pytest.approx(naive, abs=1e-5)
        assert all(p.grad is None for p in model.parameters())  # the step zeroes what it applied
        results.append((metrics, {n: before[n] - p.detach() for n, p in model.named_parameters()}))
    (whole, whole_moves), (split, split_moves) = results
    assert split["loss"] == pytest.approx(whole["loss"], abs=1e-6)
    assert split["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5) and whole["grad_norm"] > 0
    for name, move in whole_moves.items():
        assert torch.allclose(split_moves[name], move, atol=1e-6), name


def test_sft_evaluates_shifted_held_out_sets(tmp_path):
    """A task's SFT run evaluates the default shifted sets beside its own held-out split: one
    heldout/<set>/pass@1 each, their eval files, heldout_sets.png and the card; `sets: []` none; a
    bad entry is one line before anything is written."""
    import json

    from posttrain.config import build_config
    from posttrain.errors import UserError
    from posttrain.recipes import sft

    base = {"model": "tiny", "max_steps": 1, "batch_size": 4, "micro_batch_size": 4, "acceptance": {"max_new_tokens": 4},
            "data": {"train_size": 8, "eval_size": 4}}
    run_dir = sft.run(build_config(sft.Config, None, {**base, "output_dir": str(tmp_path / "sets")}))
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    for name in ("in_distribution", "digits_3", "words"):
        assert 0.0 <= last[f"heldout/{name}/pass@1"] <= 1.0 and f"heldout/{name}/pass@1_high" in last
    assert last["heldout/in_distribution/pass@1"] == last["heldout/pass@1"]
    assert (run_dir / "eval" / "digits_3-step-000001.json").is_file() and (run_dir / "plots" / "heldout_sets.png").is_file()
    words = json.loads((run_dir / "eval" / "words-step-000001.json").read_text())
    assert len(words["rows"]) == 4 and " plus " in words["rows"][0]["prompt"]
    card = json.loads((run_dir / "run_card.json").read_text())["links"]["acceptance"]["sets"]
    assert card["digits_3"]["options"] == {"digits": 3} and card["words"]["checker"] == "integer"
    none = sft.run(build_config(sft.Config, None, {**base, "output_dir": str(tmp_path / "none"), "acceptance": {"sets": []}}))
    last = [json.loads(line) for line in (none / "metrics.jsonl").read_text().splitlines()][-1]
    assert not any(key.startswith("heldout/digits_3") for key in last)
    with pytest.raises(UserError, match=r"^acceptance\.sets\[1\]: unknown key 'tasks'"):
        build_config(sft.Config, None, {**base, "acceptance": {"sets": [{"name": "x", "tasks": "arithmetic"}]}})


def test_sft_resume_with_its_acceptance_section(tmp_path):
    """config.yaml nests the acceptance section: `posttrain sft --resume` continues it (stopped at
    step 2 and resumed, it ends where a straight 3-step run does). The resume check still refuses a
    data change, and lets an acceptance change pass (it touches neither the data order nor the loss)."""
    import json

    from posttrain.cli import main
    from posttrain.config import build_config, load_yaml, to_dict
    from posttrain.errors import UserError
    from posttrain.recipes import sft
    from posttrain.runs.faults import config_changes

    common = ["sft", "--data.train_size", "16", "--data.eval_size", "4", "--batch_size", "4", "--micro_batch_size", "2",
              "--acceptance.max_new_tokens", "4", "--acceptance.eval_every", "2", "--acceptance.sets", "[]"]
    assert main([*common, "--max-steps", "3", "--output-dir", str(tmp_path / "straight")]) == 0
    assert main([*common, "--max-steps", "2", "--checkpoint-every", "1", "--output-dir", str(tmp_path / "run")]) == 0
    saved = load_yaml(tmp_path / "run" / "config.yaml")
    assert saved["acceptance"] == {"eval_every": 2, "max_new_tokens": 4, "checker": None, "sets": [], "task": None, "task_options": None,
                                   "eval_size": None, "split_seed": None}
    assert not {"eval_every", "max_new_tokens", "checker", "sets"} & set(saved)
    assert main(["sft", "--resume", str(tmp_path / "run"), "--max-steps", "3"]) == 0

    def last(name):
        row = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()][-1]
        return {k: v for k, v in row.items() if not k.startswith(("seconds/", "tokens_per_second"))}

    assert last("run") == last("straight") and last("run")["step"] == 3
    saved = load_yaml(tmp_path / "run" / "config.yaml")
    evaluation = build_config(sft.Config, None, {**saved, "acceptance": {**saved["acceptance"], "eval_every": 1, "max_new_tokens": 8}})
    assert config_changes(saved, to_dict(evaluation)) == []
    data = build_config(sft.Config, None, {**saved, "max_steps": 4, "data": {**saved["data"], "train_size": 32}})
    with pytest.raises(UserError, match=r"1 field\(s\) that change its data order or loss: data.train_size: 16 -> 32 "):
        sft.run(data, resume=True)
