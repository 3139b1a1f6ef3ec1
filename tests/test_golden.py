"""The golden trajectories: every recipe and loss variant, three steps on `tiny` (iterative DPO: two
rounds of two), CPU fp32, one thread, pinned: sft; dpo (live and precomputed reference), kto on
unpaired rows, simpo, orpo; rm; grpo (KL in the loss and in the reward), rloo, reinforce_pp, gspo and
cispo (two mini-batches, so the surrogates act off-policy), grpo with tool episodes; ppo; pairs.

A refactor must keep these bit-identical: each case runs the command line as a user would and
compares its metrics.jsonl (timings, throughput and memory removed), the SHA-256 of every tensor of
the final checkpoint's model (and of the critic, for PPO), and for `posttrain pairs` the SHA-256 of
the pairs file, with what `tests/data/golden/<case>.json` holds. A commit that must change them does
so alone, says why, and rewrites the files:

    POSTTRAIN_GOLDEN_WRITE=1 .venv/bin/python -m pytest tests/test_golden.py

Exact float equality holds for one build of torch and transformers on one kind of processor (oneDNN
and the rollout kernels choose their code by the CPU's instruction sets). Each file records the machine it was
written on; on another (other instruction sets, another torch), the metrics are compared to 1e-4
relative and each tensor's float64 sum, sum of squares and dot with a fixed random vector to 1e-4
relative, and the test says which machine it fell back from.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(os.environ.get("POSTTRAIN_GOLDEN_DIR") or ROOT / "tests" / "data" / "golden")
"""Where the pinned files are; POSTTRAIN_GOLDEN_DIR points elsewhere, e.g. at a baseline written
on this machine (with POSTTRAIN_GOLDEN_WRITE=1 at the commit before a refactor) to check a change
bit-identically where the committed files' machine differs."""
WRITE = os.environ.get("POSTTRAIN_GOLDEN_WRITE") == "1"
UNPINNED = ("seconds/", "tokens_per_second", "memory/")  # timings, throughput, memory: not behaviour

GRPO = ["--data.eval_size", "8", "--data.train_size", "200", "--data.prompts_per_step", "4", "--data.group_size", "4",
        "--sampling.max_new_tokens", "6", "--update.micro_batch_size", "4", "--optim.lr", "1e-3",
        "--reward", "callable:rewards_for_tests.digits", "--seed", "0", "--acceptance.eval_every", "3"]
PAIRWISE = ["--data.heldout_pairs", "4", "--batch_size", "4", "--micro_batch_size", "2", "--optim.lr", "1e-3",
            "--acceptance.eval_every", "3", "--seed", "0"]
CASES = {
    "sft": ["sft", "--data.train_size", "64", "--data.eval_size", "8", "--batch_size", "8", "--micro_batch_size", "4",
            "--acceptance.max_new_tokens", "6", "--acceptance.eval_every", "3", "--seed", "0"],
    "dpo-live": ["dpo", *PAIRWISE, "--loss.reference", "live"],
    "dpo-precomputed": ["dpo", *PAIRWISE, "--loss.reference", "precomputed"],
    "grpo-kl-loss": ["grpo", *GRPO, "--loss.kl.beta", "0.05", "--loss.kl.placement", "loss", "--update.mini_batches", "2",
                     "--update.epochs", "2"],
    "grpo-kl-reward": ["grpo", *GRPO, "--loss.kl.beta", "0.05", "--loss.kl.placement", "reward", "--update.mini_batches", "2",
                       "--update.epochs", "2"],
    "ppo": ["ppo", *GRPO, "--critic.warmup_steps", "1", "--update.mini_batches", "2"],
    "rm": ["rm", *PAIRWISE],
    "kto": ["dpo", "--loss.type", "kto", *PAIRWISE],
    "simpo": ["dpo", "--loss.type", "simpo", *PAIRWISE],
    "orpo": ["dpo", "--loss.type", "orpo", *PAIRWISE],
    "rloo": ["grpo", *GRPO, "--loss.advantage", "rloo", "--loss.kl.beta", "0.05", "--loss.kl.placement", "reward",
             "--loss.kl.estimator", "k1", "--update.mini_batches", "2"],
    "reinforce-pp": ["grpo", *GRPO, "--loss.advantage", "reinforce_pp", "--loss.kl.beta", "0.05", "--loss.kl.placement", "reward",
                     "--update.mini_batches", "2"],
    "gspo": ["grpo", *GRPO, "--loss.surrogate", "gspo", "--loss.aggregation", "seq_mean_token_mean", "--update.mini_batches", "2"],
    "cispo": ["grpo", *GRPO, "--loss.surrogate", "cispo", "--update.mini_batches", "2"],
    "grpo-tools": ["grpo", *GRPO, "--tools.names", "[add]", "--tools.describe", "none", "--tools.max_turns", "2"],
    "iterative-dpo": ["iterative-dpo", "--rounds", "2", "--steps-per-round", "2", "--pairs.data.task", "arithmetic",
                      "--pairs.data.max_prompts", "8", "--pairs.data.eval_size", "8", "--pairs.group_size", "4",
                      "--pairs.verifier", "callable:rewards_for_tests.digits", "--pairs.sampling.max_new_tokens", "6",
                      "--dpo.batch_size", "4", "--dpo.micro_batch_size", "4", "--dpo.data.heldout_pairs", "0",
                      "--dpo.optim.lr", "1e-3", "--dpo.acceptance.max_new_tokens", "6", "--dpo.acceptance.sets", "[]", "--seed", "0"],
    "pairs": ["pairs", "--model", "tiny", "--data.task", "arithmetic", "--group-size", "4", "--data.max_prompts", "8",
              "--data.eval_size", "8", "--max-new-tokens", "6", "--seed", "0", "--verifier", "callable:rewards_for_tests.digits",
              "--pairs-per-prompt", "2"],
}


def machine() -> dict:
    """What exact float results depend on: torch and transformers, the processor's vector
    instruction sets, threads."""
    import transformers

    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    except (OSError, StopIteration):
        flags = []
    vector = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "sse4", "f16c")))
    return {"torch": torch.__version__, "transformers": transformers.__version__, "arch": platform.machine(),
            "vector_flags": vector, "threads": 1}


def tensor_record(tensor: torch.Tensor) -> dict:
    flat = tensor.detach().reshape(-1).to(torch.float64)
    probe = torch.randn(flat.numel(), generator=torch.Generator().manual_seed(flat.numel()), dtype=torch.float64)
    return {"sha256": hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest(),
            "sum": float(flat.sum()), "sum_squares": float((flat * flat).sum()), "probe": float(flat @ probe)}


def state_records(directory: Path) -> dict:
    """{file: {tensor name: record}} for the model weights of the newest checkpoint: every
    safetensors file, and the extra models' state dicts (critic.pt) beside them."""
    checkpoints = sorted((directory / "checkpoints").glob("step-*"))
    assert checkpoints, f"no checkpoint in {directory}"
    newest = checkpoints[-1]
    files = sorted(newest.rglob("*.safetensors"))
    assert files, f"no safetensors in {newest}"
    states = {str(path.relative_to(newest)): load_file(path) for path in files}
    states.update({path.name: torch.load(path, weights_only=True) for path in sorted(newest.glob("*.pt"))
                   if path.name != "trainer_state.pt"})
    return {file: {name: tensor_record(value) for name, value in sorted(state.items())} for file, state in states.items()}


def pinned_metrics(directory: Path) -> list[dict]:
    rows = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(UNPINNED)} for row in rows]


def run_case(name: str, tmp_path: Path) -> dict:
    from tests.test_dpo import arithmetic_pairs, write_pairs
    from tests.test_kto import unpaired_rows

    arguments = list(CASES[name])
    out = tmp_path / "out"
    if name == "pairs":
        arguments += ["--out", str(out / "pairs.jsonl")]
    elif name == "iterative-dpo":  # its length is rounds x steps per round
        arguments += ["--output-dir", str(out)]
    else:
        arguments += ["--max-steps", "3", "--output-dir", str(out)]
    if name == "kto":  # unpaired rows, TRL's layout
        arguments += ["--data.pairs", str(write_pairs(tmp_path / "unpaired.jsonl", unpaired_rows(24)))]
    elif arguments[0] in ("dpo", "rm"):
        arguments += ["--data.pairs", str(write_pairs(tmp_path / "pairs.jsonl", arithmetic_pairs(24)))]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    result = subprocess.run([sys.executable, "-m", "posttrain", *arguments], capture_output=True, text=True, cwd=ROOT,
                            env=environment, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    if name == "pairs":
        content = (out / "pairs.jsonl").read_bytes()
        return {"pairs_sha256": hashlib.sha256(content).hexdigest(), "pairs": [json.loads(line) for line in content.splitlines()]}
    if name == "iterative-dpo":  # each round's pairs and DPO trajectory, the last round's weights
        rounds = sorted((out / "rounds").glob("round-*"))
        return {"metrics": [row for r in rounds for row in pinned_metrics(r / "dpo")], "state": state_records(rounds[-1] / "dpo"),
                "pairs_sha256": [pairs_hash(r / "pairs.jsonl") for r in rounds]}
    return {"metrics": pinned_metrics(out), "state": state_records(out)}


def pairs_hash(path: Path) -> str:
    """SHA-256 of a pairs file's (prompt, chosen, rejected) rows: what a round trains on, without
    the run's own paths (a round's rows name the model they were sampled from)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return hashlib.sha256(json.dumps([(r["prompt"], r["chosen"], r["rejected"]) for r in rows]).encode()).hexdigest()


def close(a, b, tolerance: float = 1e-4) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and abs(a - b) <= tolerance * max(1.0, abs(a), abs(b))
    return a == b


@pytest.mark.parametrize("name", list(CASES))
def test_golden_trajectory(name, tmp_path):
    got = run_case(name, tmp_path)
    path = GOLDEN / f"{name}.json"
    if WRITE:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"machine": machine(), "arguments": CASES[name], **got}, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"wrote {path}")
    expected = json.loads(path.read_text())
    if expected["machine"] == machine():  # the machine the values were written on: bit-identical
        if name == "pairs":
            assert got["pairs_sha256"] == expected["pairs_sha256"], "the pairs file changed"
            return
        for step, (row, pinned) in enumerate(zip(got["metrics"], expected["metrics"], strict=True), start=1):
            assert row == pinned, f"step {step}: " + ", ".join(
                f"{k}: {pinned.get(k)} -> {row.get(k)}" for k in sorted(set(row) | set(pinned)) if row.get(k) != pinned.get(k))
        for file, tensors in expected["state"].items():
            changed = [t for t, record in tensors.items() if got["state"][file][t]["sha256"] != record["sha256"]]
            assert not changed and set(got["state"][file]) == set(tensors), f"{file}: {len(changed)} tensors changed, e.g. {changed[:3]}"
        if "pairs_sha256" in expected:  # iterative DPO: each round's pairs file
            assert got["pairs_sha256"] == expected["pairs_sha256"], "a round's pairs file changed"
        return
    # Another processor or torch: the same computation to float tolerance.
    print(f"golden {name}: written on {expected['machine']}, this is {machine()}: compared to 1e-4 relative")
    if name == "pairs":
        assert [(p["prompt"], p["chosen"], p["rejected"]) for p in got["pairs"]] == \
               [(p["prompt"], p["chosen"], p["rejected"]) for p in expected["pairs"]]
        return
    for step, (row, pinned) in enumerate(zip(got["metrics"], expected["metrics"], strict=True), start=1):
        assert set(row) == set(pinned), f"step {step}: keys differ: {sorted(set(row) ^ set(pinned))}"
        assert all(close(row[k], pinned[k]) for k in row), f"step {step}: " + ", ".join(
            f"{k}: {pinned[k]} -> {row[k]}" for k in row if not close(row[k], pinned[k]))
    for file, tensors in expected["state"].items():
        for tensor, record in tensors.items():
            for key in ("sum", "sum_squares", "probe"):
                assert close(got["state"][file][tensor][key], record[key]), (file, tensor, key)
