"""The hardware and memory sections on the CPU: bad settings are one line; every recipe runs 2 steps
under bf16-mixed (CPU autocast) with finite losses, changed weights and the precision in its run
card; gradient checkpointing gives the same loss and gradients (SFT, DPO, GRPO, PPO; with and
without LoRA); the TIS weight and the sampler-trainer mismatch by hand and through the step; a
resumed bf16-mixed run equals an uninterrupted one. tests/test_cuda.py repeats the device checks on
a GPU."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.algorithms import sampler_mismatch, token_logprobs, truncated_importance_weights
from posttrain.config import build_config, parse_overrides
from posttrain.data import tokenize_preference_pairs, tokenize_prompt_response
from posttrain.errors import UserError
from posttrain.hardware import Hardware, Placement, resolve
from posttrain.models import LoraSettings, apply_lora, load_model, make_critic
from posttrain.models.forward import TrainingForward, batch_response_sums, policy_and_critic, policy_scores
from posttrain.models.loading import enable_gradient_checkpointing, load_policy
from posttrain.models.memory import lean_mlp
from posttrain.models.pair_forward import pair_logprobs
from posttrain.models.tiny import build_tiny_model
from posttrain.recipes import dpo, dpo_config, online, online_config, sft
from posttrain.rollout import SamplingConfig, generate
from tests.test_dpo import arithmetic_pairs, pairs_of, write_pairs
from tests.test_online_step import SMALL, fixed_batch

ROOT = Path(__file__).resolve().parent.parent
CPU_BF16 = Placement(torch.device("cpu"), "bf16-mixed")


# -- settings ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("values, message", [
    ({"device": "gpu"}, "hardware.device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    ({"precision": "fp16"}, "hardware.precision 'fp16' is not offered"),
    ({"precision": "bf16_mixed"}, "hardware.precision must be one of auto, fp32, bf16-mixed, bf16"),
])
def test_bad_hardware_settings_are_one_line(values, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_config(sft.Config, None, {"hardware": values})


def test_auto_resolves_to_what_is_there_and_cuda_without_a_gpu_is_refused():
    placement = resolve(Hardware())
    if torch.cuda.is_available():
        assert placement.device.type == "cuda" and placement.precision in ("bf16-mixed", "fp32")
        return
    assert placement == Placement(torch.device("cpu"), "fp32")
    assert resolve(Hardware(precision="bf16-mixed")).precision == "bf16-mixed"
    with pytest.raises(UserError, match="hardware.device cuda: no CUDA GPU is visible"):
        resolve(Hardware(device="cuda"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cli_cuda_without_a_gpu_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "posttrain", "sft", "--hardware.device", "cuda", "--output-dir", str(out)],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"error: hardware.device cuda: no CUDA GPU is visible (torch {torch.__version__} is a CPU build); use --hardware.device cpu"
    ] or "no CUDA GPU is visible" in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr
    assert not out.exists()


def test_placement_dtypes_and_card():
    assert CPU_BF16.param_dtype == torch.float32 and CPU_BF16.compute_dtype == torch.bfloat16
    pure = Placement(torch.device("cpu"), "bf16")
    assert pure.param_dtype == torch.bfloat16 and "AdamW's moments are bfloat16" in pure.describe()["note"]
    with CPU_BF16.autocast():
        assert torch.is_autocast_enabled("cpu")
        assert torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == torch.bfloat16
    with Placement(torch.device("cpu"), "fp32").autocast():
        assert not torch.is_autocast_enabled("cpu")


def test_logprobs_are_float32_under_autocast():
    """The head's matmul runs in bf16 under autocast; token_logprobs and head_logprobs upcast."""
    model, _ = build_tiny_model()
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    with CPU_BF16.autocast():
        logits = model(input_ids=ids).logits
        assert logits.dtype == torch.bfloat16
        assert token_logprobs(logits[:, :-1], ids[:, 1:]).dtype == torch.float32
        sums, _ = batch_sums(model, ids)
    assert sums.dtype == torch.float32 and torch.isfinite(sums).all()


def batch_sums(model, ids):
    from posttrain.models.forward import response_sums

    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, :3] = False
    return response_sums(model, ids, torch.ones_like(ids), mask)


# -- every recipe under bf16-mixed on the CPU -------------------------------------------------------

def parity_reward(completion: str, example) -> float:
    """A reward with signal for an untrained model: 1 for an even-length completion."""
    return float(len(completion) % 2 == 0)


def online_state(kind: str, *extra) -> online.State:
    factory = online_config.grpo_config if kind == "grpo" else online_config.ppo_config
    overrides = copy.deepcopy(SMALL)
    if kind == "ppo":
        overrides["data"]["group_size"] = 2
        overrides["loss"] = {**overrides["loss"], "kl": {"beta": 0.05}}
    else:
        overrides["loss"] = {**overrides["loss"], "kl": {"beta": 0.04}}
    for key, value in (extra[i : i + 2] for i in range(0, len(extra), 2)):
        section, _, leaf = key.partition(".")
        overrides.setdefault(section, {})[leaf] = value
    config = build_config(factory, None, overrides)
    return online.setup(config, reward=parity_reward)


@pytest.mark.parametrize("kind", ["grpo", "ppo"])
def test_online_recipe_two_steps_bf16_mixed(kind):
    state = online_state(kind, "hardware.precision", "bf16-mixed")
    assert state.placement == CPU_BF16
    before = {name: p.detach().clone() for name, p in state.policy.named_parameters()}
    for _ in range(2):
        metrics = online.step(state, online.sample(state))
        assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
        if kind == "ppo":
            assert math.isfinite(metrics["value_loss"])
    # the trainer's bf16 forwards vs the float32 sampler: measured, small, not zero
    assert 0 < metrics["mismatch/logprob_abs_mean"] < 0.05
    assert metrics["mismatch/seq_ratio_max"] >= 1
    changed = [name for name, p in state.policy.named_parameters() if not torch.equal(p, before[name])]
    assert changed, "no parameter changed"
    assert all(p.dtype == torch.float32 for p in state.policy.parameters())  # master weights stay float32
    card = online.make_card(state.config, state, None)
    assert card["run"]["hardware"]["precision"] == "bf16-mixed"
    assert card["run"]["hardware"]["forward_backward"] == "bfloat16 autocast (float32 weights)"


def test_sft_two_steps_bf16_mixed(tmp_path):
    overrides = parse_overrides(["--max-steps", "2", "--batch-size", "4", "--micro-batch-size", "2", "--data.train_size", "40",
                                 "--data.eval_size", "4", "--acceptance.max_new_tokens", "4", "--hardware.precision", "bf16-mixed",
                                 "--output-dir", str(tmp_path / "run")])
    run_dir = sft.run(build_config(sft.Config, None, overrides))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(row["loss"]) for row in rows if "loss" in row)
    card = json.loads((run_dir / "run_card.json").read_text())
    assert card["run"]["hardware"]["precision"] == "bf16-mixed"
    initial = build_tiny_model()[0].state_dict()
    trained = load_file(run_dir / "checkpoints" / "step-000002" / "model" / "model.safetensors")
    assert any(not torch.equal(trained[name], initial[name]) for name in trained if name in initial)


def test_dpo_two_steps_bf16_mixed(tmp_path):
    pairs = write_pairs(tmp_path / "pairs.jsonl", arithmetic_pairs())
    overrides = parse_overrides(["--data.pairs", str(pairs), "--data.heldout_pairs", "2", "--batch_size", "4",
                                 "--micro_batch_size", "2", "--optim.lr", "1e-3", "--max-steps", "2",
                                 "--hardware.precision", "bf16-mixed", "--output-dir", str(tmp_path / "run")])
    run_dir = dpo.run(build_config(dpo_config.Config, None, overrides))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and all(math.isfinite(row["loss"]) for row in rows[1:])
    assert rows[-1]["rewards/margins"] != 0  # the policy moved away from the reference
    card = json.loads((run_dir / "run_card.json").read_text())
    assert card["run"]["hardware"]["precision"] == "bf16-mixed"


def test_resume_of_a_bf16_mixed_run_is_exact(tmp_path):
    def config(name, steps):
        overrides = copy.deepcopy(SMALL)
        overrides.update({"max_steps": steps, "checkpoint_every": 1, "hardware": {"precision": "bf16-mixed"},
                          "output_dir": str(tmp_path / name), "acceptance": {"eval_every": 0}})
        return build_config(online_config.grpo_config, None, overrides)

    straight = online.run(config("straight", 3), reward=parity_reward)
    online.run(config("resumed", 2), reward=parity_reward)
    resumed = online.run(config("resumed", 3), resume=True, reward=parity_reward)

    def comparable(path):
        rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in row.items() if not k.startswith(("seconds/", "tokens_per_second", "heldout/"))} for row in rows
                if row["step"] > 0]

    assert comparable(resumed)[-1] == comparable(straight)[-1]
    a = load_file(straight / "checkpoints" / "step-000003" / "model" / "model.safetensors")
    b = load_file(resumed / "checkpoints" / "step-000003" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- gradient checkpointing -------------------------------------------------------------------------

def policy_pair(lora: bool):
    """Two identical training models (lean MLPs, LoRA or not), the second with checkpointing."""
    model, tokenizer = load_model("tiny")
    lean_mlp(model)
    torch.manual_seed(0)
    if lora:
        model = apply_lora(model, LoraSettings(rank=4, alpha=8))
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(parameter, std=0.02)  # B starts at 0: give the adapters a gradient path
    other = copy.deepcopy(model)
    enable_gradient_checkpointing(other)
    return model.train(), other.train(), tokenizer


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same(loss_a, loss_b, model_a, model_b):
    assert torch.allclose(loss_a, loss_b, rtol=0, atol=1e-5), (loss_a, loss_b)
    grads_a, grads_b = gradients(model_a), gradients(model_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:  # float32 rounding of a different order of operations, relative to the largest entry
        scale = float(grads_a[name].abs().max())
        assert float((grads_a[name] - grads_b[name]).abs().max()) <= 1e-5 * scale + 1e-7, name


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_same_loss_and_gradients_sft(lora):
    plain, checkpointed, tokenizer = policy_pair(lora)
    batch = tokenize_prompt_response(tokenizer, ["12+3=", "7+88="], ["<answer>15</answer>", "<answer>95</answer>"])
    losses = []
    for model in (plain, checkpointed):
        loss = -TrainingForward(model, batch_response_sums)(batch, slice(0, 2)).sum()
        loss.backward()
        losses.append(loss.detach())
    assert_same(*losses, plain, checkpointed)


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_same_loss_and_gradients_dpo(lora):
    plain, checkpointed, tokenizer = policy_pair(lora)
    pairs = pairs_of(arithmetic_pairs(3))
    batch = tokenize_preference_pairs(tokenizer, pairs)
    losses = []
    for model in (plain, checkpointed):
        sums = TrainingForward(model, pair_logprobs)(batch, slice(0, 3))
        loss = -(sums.chosen - sums.rejected).sigmoid().log().sum()
        loss.backward()
        losses.append(loss.detach())
    assert_same(*losses, plain, checkpointed)


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("kind", ["grpo", "ppo"])
def test_gradient_checkpointing_same_loss_and_gradients_online(kind, lora):
    """GRPO's shared-prefix forward (checkpointing turns it into the plain one) and PPO's policy +
    critic pass."""
    plain, checkpointed, tokenizer = policy_pair(lora)
    rollout = generate(plain, tokenizer, ["12+34=", "5+6="], group_size=3, sampling=SamplingConfig(max_new_tokens=5), seed=1)
    inputs, P, T = rollout.forward_inputs(), rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    rows = torch.arange(6)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    losses, models = [], []
    for model in (plain, checkpointed):
        if kind == "grpo":
            trainer = TrainingForward(model, policy_scores)
        else:
            critic = make_critic(model, share_backbone=False)
            torch.manual_seed(1)  # the same value head for both
            torch.nn.init.normal_(critic.value_head.linear.weight, std=0.1)
            trainer = TrainingForward(torch.nn.ModuleDict({"policy": model, "critic": critic}), policy_and_critic)
        scores = trainer(inputs, rows, P, T, rollout.completion_ids, 1.0, score_mask=rollout.mask)
        loss = -(scores.logprobs * advantages[:, None] * rollout.mask).sum()
        if scores.values is not None:
            loss = loss + (scores.values * rollout.mask).pow(2).sum()
        loss.backward()
        losses.append(loss.detach())
        models.append(trainer)
    assert_same(*losses, *models)


def test_gradient_checkpointing_through_the_recipe():
    state = online_state("grpo", "memory.gradient_checkpointing", True)
    assert getattr(state.policy, "is_gradient_checkpointing", False) or state.policy.is_activation_checkpointing
    reference = online_state("grpo")
    batch = fixed_batch(state)
    a, b = online.step(state, batch), online.step(reference, batch)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


# -- the sampler-trainer mismatch and its correction ------------------------------------------------

def test_tis_weight_by_hand():
    old = torch.tensor([[-1.0, -0.2, -3.0]])
    sampler = torch.tensor([[-1.5, -1.5, -2.0]])
    weights = truncated_importance_weights(old, sampler, cap=2.0)
    assert torch.allclose(weights, torch.tensor([[math.exp(0.5), 2.0, math.exp(-1.0)]]))
    assert float(truncated_importance_weights(old, sampler, cap=10.0)[0, 1]) == pytest.approx(math.exp(1.3), rel=1e-6)


def test_mismatch_by_hand():
    trainer = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    sampler = torch.tensor([[-1.1, -2.0], [-0.5, -3.0]])
    mask = torch.tensor([[True, True], [True, False]])
    got = sampler_mismatch(trainer, sampler, mask)
    assert float(got["logprob_abs_mean"]) == pytest.approx(0.1 / 3)
    assert float(got["logprob_abs_max"]) == pytest.approx(0.1)
    assert float(got["seq_ratio_max"]) == pytest.approx(math.exp(0.1))


@pytest.mark.parametrize("epochs", [1, 2])
def test_mismatch_is_zero_on_cpu_fp32(epochs):
    """The engine's and the trainer's log-probs of the same tokens: equal to float32 rounding, both
    with the precomputed old log-probs (2 epochs) and with the first forward's (1 epoch)."""
    state = online_state("grpo", "update.epochs", epochs)
    metrics = online.step(state, fixed_batch(state))
    assert metrics["mismatch/logprob_abs_max"] < 1e-4
    assert metrics["mismatch/seq_ratio_max"] == pytest.approx(1.0, abs=1e-4)


def test_tis_through_the_step():
    """Without truncation the sampler is the trainer's policy: the weights are ~1 and the loss is
    the uncorrected one; with top-k the sampler's log-probs are higher (renormalised over fewer
    tokens), so the weights are < 1 and the loss shrinks."""
    plain, corrected = online_state("grpo"), online_state("grpo", "loss.sampler_correction", "tis")
    batch = fixed_batch(plain)
    a, b = online.step(plain, batch), online.step(corrected, batch)
    assert b["tis/weight_mean"] == pytest.approx(1.0, abs=1e-4) and b["tis/capped_fraction"] == 0
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    truncated = online_state("grpo", "loss.sampler_correction", "tis", "sampling.top_k", 5)
    metrics = online.step(truncated, fixed_batch(truncated))
    assert metrics["tis/weight_mean"] < 1.0


def test_tis_needs_sampled_rollouts():
    with pytest.raises(UserError, match="loss.sampler_correction tis needs sampled rollouts"):
        build_config(online_config.grpo_config, None, {"loss": {"sampler_correction": "tis"}, "sampling": {"greedy": True}})


def test_rollout_on_the_cpu_is_float32_under_bf16_mixed():
    """The C kernels decode in float32 whatever the autocast: bf16-mixed samples what fp32 does."""
    model, tokenizer = load_policy("tiny")
    sampling = SamplingConfig(max_new_tokens=6)
    a = generate(model, tokenizer, ["12+3="], group_size=4, sampling=sampling, seed=2)
    with CPU_BF16.autocast():
        b = generate(model, tokenizer, ["12+3="], group_size=4, sampling=sampling, seed=2)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)


def test_bf16_weights_with_lora_sample_and_train():
    """bf16 parameters with float32 LoRA adapters (PEFT's default): the fast decoder folds the
    adapters in float32 and keeps the base dtype; the step trains the adapters."""
    state = online_state("grpo", "hardware.precision", "bf16")
    assert state.placement.param_dtype == torch.bfloat16
    state = online.setup(dataclasses_replace(state.config, lora_rank=4), reward=parity_reward)
    before = {name: p.detach().clone() for name, p in state.policy.named_parameters() if p.requires_grad}
    metrics = online.step(state, online.sample(state))
    assert math.isfinite(metrics["loss"])
    assert any(not torch.equal(p, before[name]) for name, p in state.policy.named_parameters() if p.requires_grad)


def dataclasses_replace(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_torchrun_bf16_mixed_two_processes_equal_one(tmp_path, strategy):
    """DDP runs the same bf16 forwards as one process: the same steps to 1e-5. FSDP2 takes the
    plain forward instead of the shared-prefix one (see online.setup), which under bf16 rounds
    differently: the first step's sampling and loss agree, the second's loss to bf16 precision."""
    from tests.test_distributed import GRPO, assert_same_run, metrics, run

    args = [*GRPO, "--max-steps", "2", "--hardware.precision", "bf16-mixed"]
    run([*args, "--output-dir", str(tmp_path / "one")], 1)
    run([*args, "--parallel.strategy", strategy, "--output-dir", str(tmp_path / "two")], 2)
    if strategy == "ddp":
        assert_same_run(tmp_path / "one", tmp_path / "two", 2, atol=1e-4)
        return
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two]
    assert one[1]["reward/mean"] == two[1]["reward/mean"] and one[1]["loss"] == pytest.approx(two[1]["loss"], rel=1e-2, abs=1e-4)
    assert one[2]["loss"] == pytest.approx(two[2]["loss"], rel=2e-2, abs=1e-4)
    assert json.loads((tmp_path / "two" / "run_card.json").read_text())["run"]["hardware"]["precision"] == "bf16-mixed"


def test_keep_freed_memory_sets_glibc_thresholds_or_says_it_did_not():
    """On Linux with glibc both mallopt calls succeed (True); elsewhere nothing changes (False). A
    process that keeps its freed memory still allocates and frees as before."""
    import platform

    from posttrain.hardware import keep_freed_memory

    kept = keep_freed_memory()
    assert kept is (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")
    assert torch.ones(1 << 22).sum().item() == float(1 << 22)
