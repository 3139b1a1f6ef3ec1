"""The recipes on an NVIDIA GPU (marker `cuda`; skipped without one; `make test-cuda`, and
`make gpu-check` on a lent GPU machine):

* each recipe, 2 steps, on CUDA at fp32 equals the CPU (losses to ~1e-4, the same sampled tokens);
* bf16-mixed runs with finite losses and a measured (non-zero) sampler-trainer mismatch, and the
  peak-memory counter;
* our generation on CUDA equals `model.generate` (greedy) and the CPU's draws (seeded);
* a checkpoint saved on the GPU resumes on the CPU and the reverse;
* with 2+ GPUs, torchrun DDP and FSDP2 equal 1 GPU.

`POSTTRAIN_TEST_CUDA_AS=cpu` runs the same file with "cuda" replaced by the CPU (then every
comparison is CPU against CPU): a dry run of the tests' own code on a machine without a GPU.
"""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch

from posttrain.config import build_config, parse_overrides
from posttrain.models import load_model
from posttrain.recipes import dpo, dpo_config, online, online_config, sft
from posttrain.rollout import SamplingConfig, decoder_weights, generate
from tests.test_distributed import GRPO, assert_same_run, run
from tests.test_dpo import arithmetic_pairs, write_pairs
from tests.test_hardware import parity_reward
from tests.test_online_step import SMALL

DEVICE = os.environ.get("POSTTRAIN_TEST_CUDA_AS", "cuda")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]
GPUS = torch.cuda.device_count() if DEVICE == "cuda" else 0


def online_config_for(kind: str, device: str, precision: str = "fp32", **top) -> online_config.Config:
    factory = online_config.grpo_config if kind == "grpo" else online_config.ppo_config
    overrides = copy.deepcopy(SMALL)
    overrides["loss"] = {**overrides["loss"], "kl": {"beta": 0.04}}
    if kind == "ppo":
        overrides["data"]["group_size"] = 2
    overrides["hardware"] = {"device": device, "precision": precision}
    overrides.update(top)
    return build_config(factory, None, overrides)


def online_steps(kind: str, device: str, precision: str = "fp32", steps: int = 2):
    state = online.setup(online_config_for(kind, device, precision), reward=parity_reward)
    rows = []
    for _ in range(steps):
        batch = online.sample(state)
        rows.append((batch.rollout.completion_ids.cpu(), online.step(state, batch)))
    return state, rows


@pytest.mark.parametrize("kind", ["grpo", "ppo"])
def test_online_recipe_on_cuda_fp32_equals_cpu(kind):
    """Step 1 samples from the same weights on both devices: the same seeded tokens and the same
    losses. After an optimizer step the weights differ by float rounding (other kernels), which can
    legitimately flip a draw near a tie, so later steps are compared only where their tokens agree."""
    _, on_device = online_steps(kind, DEVICE)
    _, on_cpu = online_steps(kind, "cpu")
    for step, ((tokens_a, metrics_a), (tokens_b, metrics_b)) in enumerate(zip(on_device, on_cpu), start=1):
        if step == 1:
            assert torch.equal(tokens_a, tokens_b), "seeded draws of the same weights differ between the devices"
        elif not torch.equal(tokens_a, tokens_b):
            assert math.isfinite(metrics_a["loss"])
            continue
        for key in ("loss", "kl/estimate", "value_loss", "ratio/mean"):
            if key in metrics_b:
                assert metrics_a[key] == pytest.approx(metrics_b[key], abs=1e-4, rel=1e-3), (step, key)
        assert metrics_a["mismatch/logprob_abs_max"] < 1e-3


def test_online_bf16_mixed_on_cuda_finite_with_a_measured_mismatch():
    state, rows = online_steps("grpo", DEVICE, "bf16-mixed")
    for _, metrics in rows:
        assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
        assert metrics["mismatch/logprob_abs_mean"] > 0  # the bf16 trainer vs the sampler
    assert all(p.dtype == torch.float32 for p in state.policy.parameters())
    assert state.placement.describe()["precision"] == "bf16-mixed"


def test_online_run_on_cuda_logs_peak_memory_and_throughput(tmp_path):
    config = online_config_for("grpo", DEVICE, "bf16-mixed", max_steps=2, output_dir=str(tmp_path / "run"))
    run_dir = online.run(config, reward=parity_reward)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["tokens_per_second/generation"] > 0 and last["tokens_per_second/training"] > 0
    if DEVICE == "cuda":
        assert last["memory/peak_allocated_gib"] > 0
        card = json.loads((run_dir / "run_card.json").read_text())
        assert card["run"]["hardware"]["device"].startswith("cuda") and card["run"]["hardware"]["device_name"]


def sft_overrides(device: str, out, steps: int = 2, precision: str = "fp32") -> list[str]:
    return ["--max-steps", str(steps), "--batch-size", "4", "--micro-batch-size", "2", "--data.train_size", "40", "--data.eval_size", "4",
            "--acceptance.max_new_tokens", "4", "--checkpoint-every", "1", "--hardware.device", device, "--hardware.precision", precision,
            "--output-dir", str(out)]


def losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def assert_same_losses(on_device: list[float], on_cpu: list[float]) -> None:
    """fp32 on the GPU against the CPU: the first step's loss (the same weights, other kernels'
    summation order) to 1e-4 (seen on an H200: SimPO's 0.720356 against 0.720390, its beta 2
    scaling the log-probs' rounding); later steps to 1e-4 absolute or 1e-3 relative, as the online
    test: Adam's first update moves each weight by about lr x sign(its gradient), so a gradient near
    0 whose rounding differs between the devices moves that weight by up to 2 x lr (seen: KTO's
    second loss 0.396519 against 0.396410)."""
    assert len(on_device) == len(on_cpu) and on_device
    assert on_device[0] == pytest.approx(on_cpu[0], abs=1e-4)
    assert on_device[1:] == pytest.approx(on_cpu[1:], abs=1e-4, rel=1e-3)


def test_sft_on_cuda_fp32_equals_cpu(tmp_path):
    a = sft.run(build_config(sft.Config, None, parse_overrides(sft_overrides(DEVICE, tmp_path / "gpu"))))
    b = sft.run(build_config(sft.Config, None, parse_overrides(sft_overrides("cpu", tmp_path / "cpu"))))
    assert_same_losses(losses(a), losses(b))


@pytest.mark.parametrize("reference", ["live", "precomputed"])
def test_dpo_on_cuda_fp32_equals_cpu(tmp_path, reference):
    pairs = write_pairs(tmp_path / "pairs.jsonl", arithmetic_pairs())

    def go(device, name, precision="fp32"):
        overrides = ["--data.pairs", str(pairs), "--data.heldout_pairs", "2", "--batch_size", "4", "--micro_batch_size", "2",
                     "--optim.lr", "1e-3", "--max-steps", "2", "--loss.reference", reference, "--hardware.device", device,
                     "--hardware.precision", precision, "--output-dir", str(tmp_path / name)]
        return dpo.run(build_config(dpo_config.Config, None, parse_overrides(overrides)))

    assert_same_losses(losses(go(DEVICE, "gpu")), losses(go("cpu", "cpu")))
    assert all(math.isfinite(x) for x in losses(go(DEVICE, "bf16", "bf16-mixed")))


@pytest.mark.parametrize("loss_type", ["kto", "simpo"])
def test_kto_and_reference_free_on_cuda_fp32_equal_cpu(tmp_path, loss_type):
    pairs = write_pairs(tmp_path / "pairs.jsonl", arithmetic_pairs())

    def go(device, name):
        overrides = ["--data.pairs", str(pairs), "--data.heldout_pairs", "4", "--batch_size", "4", "--micro_batch_size", "2",
                     "--optim.lr", "1e-3", "--max-steps", "2", "--loss.type", loss_type, "--hardware.device", device, "--output-dir",
                     str(tmp_path / name)]
        return dpo.run(build_config(dpo_config.Config, None, parse_overrides(overrides)))

    assert_same_losses(losses(go(DEVICE, "gpu")), losses(go("cpu", "cpu")))


def test_reward_model_on_cuda_fp32_equals_cpu_and_scores_there(tmp_path):
    """`posttrain rm` trains on the GPU as on the CPU; `rm:` scores on the GPU (and with offload cpu)
    what it scores on the CPU."""
    from posttrain.hardware import Hardware, resolve
    from posttrain.recipes import rm
    from posttrain.rewards import RewardOptions, as_verifier

    pairs = write_pairs(tmp_path / "pairs.jsonl", arithmetic_pairs(16))

    def go(device, name, precision="fp32"):
        overrides = ["--data.pairs", str(pairs), "--data.heldout_pairs", "4", "--batch_size", "4", "--micro_batch_size", "2",
                     "--max-steps", "2", "--hardware.device", device, "--hardware.precision", precision, "--output-dir", str(tmp_path / name)]
        return rm.run(build_config(rm.Config, None, parse_overrides(overrides)))

    gpu, cpu = go(DEVICE, "gpu"), go("cpu", "cpu")
    assert_same_losses(losses(gpu), losses(cpu))
    assert all(math.isfinite(x) for x in losses(go(DEVICE, "bf16", "bf16-mixed")))
    rows = [{"prompt": f"{a}+{b}="} for a, b in ((1, 2), (12, 34), (50, 7))]
    completions = ["<answer>3</answer>", "46", "no"]
    on_cpu = [v.details["raw"] for v in as_verifier(None, f"rm:{cpu / 'final'}").batch(completions, rows)]
    placement = resolve(Hardware(device=DEVICE, precision="fp32"))
    for options in (RewardOptions(), RewardOptions(offload="cpu")):
        on_gpu = [v.details["raw"] for v in as_verifier(None, f"rm:{cpu / 'final'}", options, placement=placement).batch(completions, rows)]
        assert on_gpu == pytest.approx(on_cpu, abs=1e-4)


def test_generation_on_cuda_equals_model_generate_greedy_and_the_cpu_seeded():
    model, tokenizer = load_model("tiny", device=DEVICE)
    prompts = ["12+34=", "7+8=", "99+1="]
    greedy = SamplingConfig(max_new_tokens=8, greedy=True)
    ours = generate(model, tokenizer, prompts, sampling=greedy)
    assert ours.completion_ids.device.type == torch.device(DEVICE).type
    for row, prompt in enumerate(prompts):
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(DEVICE)
        reference = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:]
        length = int(ours.lengths[row])
        assert ours.completion_ids[row, :length].tolist() == reference[:length].tolist()
    sampled = SamplingConfig(max_new_tokens=8, temperature=1.0)
    cpu_model, _ = load_model("tiny")
    a = generate(model, tokenizer, prompts, group_size=4, sampling=sampled, seed=7)
    b = generate(cpu_model, tokenizer, prompts, group_size=4, sampling=sampled, seed=7)
    assert torch.equal(a.completion_ids.cpu(), b.completion_ids)
    assert torch.allclose(a.logprobs.cpu(), b.logprobs, atol=1e-4)


def test_generation_on_cuda_frees_the_decoder_weight_copy():
    """On a GPU, generate drops the fast decoder's fused bf16 copy of the weights when it returns (it
    would otherwise stay allocated through the update that follows); on the CPU it is kept for the
    next call with the same weights."""
    model, tokenizer = load_model("tiny", device=DEVICE)
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0)
    on_gpu = torch.device(DEVICE).type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16, enabled=on_gpu):
        rollout = generate(model, tokenizer, ["12+34=", "7+8="], group_size=4, sampling=sampling, seed=3)
    assert (decoder_weights.PACKED.get(model) is None) == on_gpu
    if on_gpu:
        del rollout
        torch.cuda.synchronize()
        parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert torch.cuda.memory_allocated() - before < parameter_bytes / 10  # the copy is half of them (bf16)


@pytest.mark.parametrize("first, then", [(DEVICE, "cpu"), ("cpu", DEVICE)], ids=["gpu-then-cpu", "cpu-then-gpu"])
def test_checkpoint_resumes_across_a_change_of_device(tmp_path, first, then):
    out = tmp_path / "run"
    sft.run(build_config(sft.Config, None, parse_overrides(sft_overrides(first, out, steps=2))))
    resumed = sft.run(build_config(sft.Config, None, parse_overrides(sft_overrides(then, out, steps=3))), resume=True)
    straight = sft.run(build_config(sft.Config, None, parse_overrides(sft_overrides("cpu", tmp_path / "straight", steps=3))))
    assert losses(resumed) == pytest.approx(losses(straight), abs=1e-4)


@pytest.mark.skipif(GPUS < 2, reason="needs 2 or more GPUs")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_torchrun_two_gpus_equal_one(tmp_path, strategy):
    args = [*GRPO, "--max-steps", "3", "--hardware.device", "cuda", "--hardware.precision", "fp32"]
    run([*args, "--output-dir", str(tmp_path / "one")], 1)
    run([*args, "--parallel.strategy", strategy, "--output-dir", str(tmp_path / "two")], 2)
    assert_same_run(tmp_path / "one", tmp_path / "two", 3, atol=1e-4)
