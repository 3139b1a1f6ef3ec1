"""torchrun on CPU (gloo), tiny model: 2 processes give the steps of 1 process with the same global
batch and seed (losses and parameters), for DDP and FSDP2; a 2-process run resumes (with 2 or 1
processes); a rank that dies ends the job instead of hanging it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.flags import with_flags

ROOT = Path(__file__).resolve().parent.parent
LR = 1e-3  # every run here trains at this learning rate (assert_same_run's bounds are fractions of it)
GRPO = [
    "grpo", "--data.eval_size", "8", "--data.train_size", "200", "--data.prompts_per_step", "4", "--data.group_size", "4",
    "--sampling.max_new_tokens", "6", "--update.micro_batch_size", "8", "--optim.lr", str(LR), "--loss.kl.beta", "0.05",
    "--reward", "callable:rewards_for_tests.digits", "--seed", "5", "--acceptance.eval_every", "2",
    "--parallel.timeout_seconds", "120",  # a test that deadlocks fails in minutes, not in half an hour
]
# Uneven shares: refilled groups land on whichever rank sampled them, mini-batches mix ranks' rows.
GRPO_UNEVEN = ["--data.dynamic_sampling", "true", "--loss.group.scale", "batch", "--update.mini_batches", "2",
               "--update.micro_batch_size", "3"]
TIMINGS = ("seconds/", "tokens_per_second")


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


def launch(args: list[str], processes: int) -> list[str]:
    if processes == 1:
        return [sys.executable, "-m", "posttrain", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
            "-m", "posttrain", *args]


def run(args: list[str], processes: int, timeout: int = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(launch(args, processes), env=env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(TIMINGS)} for row in rows]


def final_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step-{step:06d}" / "model" / "model.safetensors")


def assert_same_run(a: Path, b: Path, step: int, atol: float = 5e-5, strays: int = 0) -> None:
    """Per-step loss to 1e-5 and the same rewards; parameters after `step` steps to `atol` (Adam
    turns float-rounding differences of near-zero gradients into steps up to lr in size, so the
    parameter tolerance is a small fraction of lr = 1e-3, not 1e-7). `strays`: how many elements
    of a tensor may lie past `atol`, each still within one Adam step either way per step (2·lr·step):
    a gradient within rounding of zero can take either sign when the sum runs in another order."""
    rows_a, rows_b = metrics(a), metrics(b)
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b], "rank 0 alone writes: one line per step"
    for row_a, row_b in zip(rows_a, rows_b):
        for key in ("loss", "reward/mean", "heldout/pass@1", "groups/trained", "groups/dropped", "length/mean"):
            if row_a.get(key) is None:
                assert row_b.get(key) is None, key
            else:
                assert row_b[key] == pytest.approx(row_a[key], abs=1e-5), (row_a["step"], key)
    weights_a, weights_b = final_weights(a, step), final_weights(b, step)
    assert set(weights_a) == set(weights_b)
    for name, value in weights_a.items():
        difference = (weights_b[name] - value).abs()
        far = int((difference > atol).sum())
        assert far <= strays and float(difference.max()) <= 2 * LR * step, (name, far, float(difference.max()))


@pytest.mark.parametrize("strategy, extra", [("ddp", GRPO_UNEVEN), ("fsdp2", [])], ids=["ddp-uneven", "fsdp2"])
def test_grpo_two_processes_equal_one(tmp_path, strategy, extra):
    args = [*with_flags(GRPO, *extra), "--max-steps", "3"]
    run([*args, "--output-dir", str(tmp_path / "one")], 1)
    result = run([*args, "--parallel.strategy", strategy, "--output-dir", str(tmp_path / "two")], 2)
    assert result.stdout.count("results:") == 1, "only rank 0 prints"
    assert_same_run(tmp_path / "one", tmp_path / "two", 3)
    samples = lambda d: (d / "samples.jsonl").read_text()  # noqa: E731
    assert samples(tmp_path / "one") == samples(tmp_path / "two")
    card = json.loads((tmp_path / "two" / "run_card.json").read_text())
    assert card["run"]["world_size"] == 2


def test_two_process_run_resumes_with_two_or_one(tmp_path):
    """Stopped after step 2 of 4, resumed: the same steps as an uninterrupted 2-process run; the
    2-process checkpoint also resumes in one process (a step does not depend on the world size)."""
    args = [*GRPO, "--checkpoint-every", "1"]
    run([*args, "--max-steps", "4", "--output-dir", str(tmp_path / "straight")], 2)
    run([*args, "--max-steps", "2", "--output-dir", str(tmp_path / "stopped")], 2)
    subprocess.run(["cp", "-r", str(tmp_path / "stopped"), str(tmp_path / "stopped-1")], check=True)
    run(["grpo", "--resume", str(tmp_path / "stopped"), "--max-steps", "4"], 2)
    assert_same_run(tmp_path / "straight", tmp_path / "stopped", 4, atol=1e-6)
    result = run(["grpo", "--resume", str(tmp_path / "stopped-1"), "--max-steps", "4"], 1)
    assert "saved by 2 process(es), resumed by 1" in result.stderr
    assert_same_run(tmp_path / "straight", tmp_path / "stopped-1", 4)

    # SIGTERM to rank 1 alone: the ranks agree on the step, rank 0 checkpoints it, the resume is exact.
    term = tmp_path / "term"
    process = subprocess.Popen(launch(with_flags(args, "--checkpoint-every", "100", "--max-steps", "4", "--output-dir", str(term)), 2), env=env(),
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while process.poll() is None and time.time() < deadline and len(
            (term / "metrics.jsonl").read_text().splitlines() if (term / "metrics.jsonl").exists() else []) < 2:
        time.sleep(0.1)
    assert process.poll() is None, f"the run ended (exit {process.returncode}) before it could be stopped: {process.stderr.read()[-3000:]}"
    os.kill(rank_pid(term, 1), signal.SIGTERM)
    _, stderr = process.communicate(timeout=300)
    step = len((term / "metrics.jsonl").read_text().splitlines()) - 1
    assert 1 <= step < 4 and f"stopped by SIGTERM at step {step}; resume with: posttrain grpo --resume {term}" in stderr, stderr[-3000:]
    assert [p.name for p in (term / "checkpoints").glob("step-*")] == [f"step-{step:06d}"]
    run(["grpo", "--resume", str(term)], 2)
    assert_same_run(tmp_path / "straight", term, 4, atol=1e-6)


def rank_pid(run_dir: Path, rank: int, seconds: float = 30) -> int:
    """The process id of torchrun worker `rank` of the run writing `run_dir` (looked for again
    until `seconds` pass: a loaded machine may list a process late)."""
    deadline = time.time() + seconds
    while True:
        for pid in os.listdir("/proc"):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except (OSError, ValueError):
                continue
            if f"RANK={rank}".encode() in environ and str(run_dir).encode() in cmdline:
                return int(pid)
        if time.time() > deadline:
            raise AssertionError(f"rank {rank} of {run_dir} not found among the running processes")
        time.sleep(0.2)


def test_a_dead_rank_ends_the_job(tmp_path):
    """SIGKILL one worker mid-run: torchrun stops the other and exits non-zero naming the failure."""
    out = tmp_path / "run"
    process = subprocess.Popen(launch([*GRPO, "--max-steps", "500", "--output-dir", str(out)], 2), env=env(), cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and len((out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []) < 2:
        time.sleep(0.2)
    os.kill(rank_pid(out, 1), signal.SIGKILL)
    try:
        _, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("the job hung after a rank died")
    assert process.returncode != 0
    assert "Signal 9 (SIGKILL)" in stderr or "exitcode" in stderr, stderr[-2000:]


SFT = ["sft", "--data.train_size", "200", "--data.eval_size", "8", "--acceptance.max_new_tokens", "6", "--seed", "3", "--acceptance.eval_every", "2",
       "--optim.warmup_steps", "0", "--parallel.timeout_seconds", "120"]


@pytest.mark.parametrize("strategy, extra", [
    ("ddp", ["--batch_size", "3", "--micro_batch_size", "1"]),  # blocks of 2 and 1 rows: rank 1 runs a zero-weight micro-batch
    pytest.param("fsdp2", ["--batch_size", "8", "--micro_batch_size", "4"], marks=pytest.mark.slow),
], ids=["ddp-uneven", "fsdp2"])
def test_sft_two_processes_equal_one(tmp_path, strategy, extra):
    args = [*SFT, *extra, "--max-steps", "3"]
    run([*args, "--output-dir", str(tmp_path / "one")], 1)
    run([*args, "--parallel.strategy", strategy, "--output-dir", str(tmp_path / "two")], 2)
    assert_same_run(tmp_path / "one", tmp_path / "two", 3)


def dpo_args(tmp_path) -> list[str]:
    from tests.test_dpo import arithmetic_pairs, write_pairs

    pairs = write_pairs(tmp_path / "pairs.jsonl", arithmetic_pairs(24))
    return ["dpo", "--data.pairs", str(pairs), "--data.heldout_pairs", "4", "--optim.lr", str(LR), "--seed", "2",
            "--acceptance.eval_every", "2", "--parallel.timeout_seconds", "120"]


@pytest.mark.parametrize("strategy, extra", [
    ("ddp", ["--batch_size", "5", "--micro_batch_size", "1"]),  # blocks of 3 and 2 pairs: a zero-weight micro-batch
    pytest.param("ddp", ["--batch_size", "4", "--micro_batch_size", "2", "--loss.reference", "precomputed"], marks=pytest.mark.slow),
    ("fsdp2", ["--batch_size", "4", "--micro_batch_size", "2", "--loss.nll_weight", "0.5"]),
], ids=["ddp-uneven", "ddp-precomputed", "fsdp2"])
def test_dpo_two_processes_equal_one(tmp_path, strategy, extra):
    args = [*dpo_args(tmp_path), *extra, "--max-steps", "3"]
    run([*args, "--output-dir", str(tmp_path / "one")], 1)
    run([*args, "--parallel.strategy", strategy, "--output-dir", str(tmp_path / "two")], 2)
    # FSDP2 reduce-scatters in another order: 1 of 65,536 v_proj elements past 5e-5 here (5.1e-5, Intel
    # VM), up to 9.1e-5 on AMD ones, the median difference 4e-9.
    assert_same_run(tmp_path / "one", tmp_path / "two", 3, strays=4 if strategy == "fsdp2" else 0)
    for key in ("rewards/accuracy", "rewards/margins", "logratio/chosen", "heldout/preference_accuracy"):
        for row_a, row_b in zip(metrics(tmp_path / "one"), metrics(tmp_path / "two")):
            if row_a.get(key) is None or (key == "rewards/accuracy" and row_a["step"] == 1):
                continue  # step 1: policy == reference, every margin is 0 and a tie's accuracy is rounding
            # rel: a summed log-ratio of 26.7 nats carries float32 rounding of a few 1e-6 (1.3e-5 seen, fsdp2)
            assert row_b[key] == pytest.approx(row_a[key], rel=1e-6, abs=1e-5), (row_a["step"], key)


def test_kto_two_processes_equal_one(tmp_path):
    """KTO under DDP: the reference point z0 is all-reduced over the ranks' mismatched rows, so blocks of
    3 and 2 rows give the one-process step."""
    args = [*dpo_args(tmp_path), "--loss.type", "kto", "--loss.nll_weight", "0", "--batch_size", "5", "--micro_batch_size", "2",
            "--max-steps", "3"]
    run([*args, "--output-dir", str(tmp_path / "one")], 1)
    run([*args, "--output-dir", str(tmp_path / "two")], 2)
    assert_same_run(tmp_path / "one", tmp_path / "two", 3)
    for row_a, row_b in zip(metrics(tmp_path / "one"), metrics(tmp_path / "two")):
        for key in ("kl", "rewards/accuracy"):
            if row_a.get(key) is not None:
                assert row_b[key] == pytest.approx(row_a[key], rel=1e-6, abs=1e-5), (row_a["step"], key)


def test_reward_model_two_processes_equal_one(tmp_path):
    """`posttrain rm` under DDP, blocks of 3 and 2 pairs with micro-batches of 2: the same losses, held-out
    accuracy, backbone and head (score.pt) as one process; one export, by rank 0."""
    from tests.test_reward_model import pairs_file

    pairs = pairs_file(tmp_path / "pairs.jsonl", 24)
    args = ["rm", "--data.pairs", str(pairs), "--data.heldout_pairs", "4", "--optim.lr", str(LR), "--seed", "2", "--batch_size", "5",
            "--micro_batch_size", "2", "--acceptance.eval_every", "2", "--max-steps", "3", "--parallel.timeout_seconds", "120"]
    run([*args, "--output-dir", str(tmp_path / "one")], 1)
    run([*args, "--output-dir", str(tmp_path / "two")], 2)
    assert_same_run(tmp_path / "one", tmp_path / "two", 3)
    heads = [torch.load(tmp_path / name / "checkpoints" / "step-000003" / "score.pt") for name in ("one", "two")]
    assert torch.allclose(heads[0]["weight"], heads[1]["weight"], atol=5e-5)
    for row_a, row_b in zip(metrics(tmp_path / "one"), metrics(tmp_path / "two")):
        for key in ("accuracy", "margin", "heldout/preference_accuracy", "heldout/margin"):
            if row_a.get(key) is not None:
                assert row_b[key] == pytest.approx(row_a[key], rel=1e-5, abs=1e-5), (row_a["step"], key)
    assert (tmp_path / "two" / "final" / "reward_model.json").is_file()


PPO = ["ppo", *GRPO[1:], "--critic.warmup_steps", "1"]


@pytest.mark.parametrize("share", ["true", pytest.param("false", marks=pytest.mark.slow)])
def test_ppo_two_processes_equal_one(tmp_path, share):
    """Critic warm-up at step 1, then policy and critic; uneven micro-batches (3 rows of 8 per rank)."""
    args = [*with_flags(PPO, "--critic.share_backbone", share, "--update.micro_batch_size", "3"), "--max-steps", "3"]
    run([*args, "--output-dir", str(tmp_path / "one")], 1)
    run([*args, "--output-dir", str(tmp_path / "two")], 2)
    assert_same_run(tmp_path / "one", tmp_path / "two", 3)
    for row_a, row_b in zip(metrics(tmp_path / "one"), metrics(tmp_path / "two")):
        for key in ("value_loss", "values/mean", "returns/mean"):
            if row_a.get(key) is not None:
                assert row_b[key] == pytest.approx(row_a[key], abs=1e-5), (row_a["step"], key)


def test_ppo_with_fsdp2_is_refused_in_one_line(tmp_path):
    result = subprocess.run(launch(["ppo", "--parallel.strategy", "fsdp2", "--output-dir", str(tmp_path / "run")], 2),
                            env=env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "ppo under torchrun supports parallel.strategy ddp only" in result.stderr
    assert not (tmp_path / "run").exists()


def test_fsdp2_code_reads_no_private_fsdp_state():
    """torch 2.11 and 2.12 keep FSDP2's parameter group in `_fsdp_param_group` (one, Optional), torch
    2.13 in `_fsdp_param_groups` (a list): code reading either breaks on the other torch. posttrain
    calls FSDP2's public methods only (the 2-process tests above run them), plus `_lazy_init`, the
    same in both (no public call settles the root)."""
    import re

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    private = re.compile(r"\._(fsdp\w*|comm_ctx|post_forward\w*|states_to\w*|get_fsdp_state\(\)\.(?!_lazy_init\(\))\w*)")
    found = [(path.name, match.group(0)) for path in (ROOT / "posttrain").rglob("*.py")
             for match in private.finditer(path.read_text())]
    assert found == []
    for method in ("set_modules_to_backward_prefetch", "set_reshard_after_forward", "unshard", "reshard", "_get_fsdp_state"):
        assert callable(getattr(FSDPModule, method)), method
    assert callable(FSDPState._lazy_init)


def test_grpo_with_tool_episodes_two_processes_equal_one(tmp_path):
    """The episode sampler under torchrun: each rank runs its prompts' episodes (turn 2 onwards drawn
    by each row's place in the whole batch), the gather carries the episode records; the same steps
    and samples (with their transcripts) as one process."""
    args = [*with_flags(GRPO, "--sampling.max_new_tokens", "12"), "--tools.names", "[add]", "--tools.max_turns", "2",
            "--max-steps", "2"]
    run([*args, "--output-dir", str(tmp_path / "one")], 1)
    run([*args, "--output-dir", str(tmp_path / "two")], 2)
    assert_same_run(tmp_path / "one", tmp_path / "two", 2)
    samples = lambda d: (d / "samples.jsonl").read_text()  # noqa: E731
    assert samples(tmp_path / "one") == samples(tmp_path / "two") and '"transcript": "[model] ' in samples(tmp_path / "one")
    assert any("turns/mean" in row for row in metrics(tmp_path / "two"))


def test_distillation_two_processes_equal_one(tmp_path):
    """A teacher's per-token reward under torchrun: each rank scores its own rows with the teacher and the
    pieces are summed, so 2 processes train the steps of 1 (losses, weights, the reverse KL)."""
    from posttrain.models.tiny import build_tiny_model

    torch.manual_seed(1)
    model, tokenizer = build_tiny_model()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.5 * torch.randn_like(parameter))
    model.save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "teacher")
    args = [*with_flags(GRPO, "--reward", f"teacher:{tmp_path / 'teacher'}", "--loss.kl.beta", "0"), "--loss.advantage", "distill",
            "--max-steps", "2"]
    run([*args, "--output-dir", str(tmp_path / "one")], 1)
    run([*args, "--output-dir", str(tmp_path / "two")], 2)
    assert_same_run(tmp_path / "one", tmp_path / "two", 2)
    for row_one, row_two in zip(metrics(tmp_path / "one"), metrics(tmp_path / "two")):
        if "distill/reverse_kl" in row_one:
            assert row_one["distill/reverse_kl"] > 0
            assert row_two["distill/reverse_kl"] == pytest.approx(row_one["distill/reverse_kl"], abs=1e-5)
