"""The built-in engine in a worker process (`rollout/worker_engine.py`): the same Rollout as in-process
`generate` for the same weights and seed, the weights synced after an optimizer step (and a skipped
sync caught), LoRA folded, two threads sharing one engine, a killed worker as one line, close(), and
a 2-step GRPO run on `--rollout.engine worker`.

One engine (one worker process) serves the whole module: a spawn start costs seconds."""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import threading

import pytest
import torch

from posttrain.config import build_config, parse_overrides
from posttrain.errors import UserError
from posttrain.models import load_model
from posttrain.models.adapters import LoraSettings, apply_lora
from posttrain.recipes import online, online_config
from posttrain.rollout import engines
from posttrain.rollout.engine import generate
from posttrain.rollout.sampling import SamplingConfig
from posttrain.rollout.vllm_backends import EngineUnavailable
from posttrain.rollout.worker_engine import WorkerEngine
from tests.rewards_for_tests import digits

PROMPTS = ["The cat", "12 + 7 =", "hello there, my"]


@pytest.fixture(scope="module")
def engine():
    made = WorkerEngine(threads=1, timeout_s=120)
    yield made
    made.close()


def assert_same(got, expected):
    """Tokens, texts and flags exactly; log-probs to 1e-6 (the worker runs the same code on the same weights)."""
    assert torch.equal(got.completion_ids, expected.completion_ids)
    assert torch.equal(got.prompt_ids, expected.prompt_ids) and torch.equal(got.mask, expected.mask)
    assert got.texts == expected.texts
    assert torch.equal(got.finished, expected.finished) and torch.equal(got.truncated, expected.truncated)
    assert torch.equal(got.prompt_index, expected.prompt_index) and got.group_size == expected.group_size
    torch.testing.assert_close(got.logprobs, expected.logprobs, atol=1e-6, rtol=0)
    torch.testing.assert_close(got.sampler_logprobs, expected.sampler_logprobs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("sampling, extra", [
    (SamplingConfig(max_new_tokens=8), {}),
    (SamplingConfig(max_new_tokens=8, greedy=True), {}),
    (SamplingConfig(max_new_tokens=10, temperature=0.7, top_k=20, stop_strings=["h", "%"]), {}),
    (SamplingConfig(max_new_tokens=6), {"shard": (2, 7)}),
    (SamplingConfig(max_new_tokens=6), {"draws": ([4, 0, 6], 8)}),
])
def test_the_worker_returns_the_in_process_rollout(engine, sampling, extra):
    model, tokenizer = load_model("tiny")
    got = engine(model, tokenizer, PROMPTS, group_size=3, sampling=sampling, seed=11, **extra)
    assert_same(got, generate(model, tokenizer, PROMPTS, group_size=3, sampling=sampling, seed=11, **extra))
    if sampling.stop_strings:
        assert got.finished.any()  # the stop strings did end rows: the case is exercised


def optimizer_step(model, tokenizer) -> None:
    """One AdamW step on the log-likelihood of a fixed text: every weight moves."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = tokenizer(["the quick brown fox jumps"], return_tensors="pt")
    model(**batch, labels=batch["input_ids"]).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_weights_sync_after_an_optimizer_step_and_a_skipped_sync_is_caught(engine, monkeypatch):
    model, tokenizer = load_model("tiny")
    sampling = SamplingConfig(max_new_tokens=8)
    engine(model, tokenizer, PROMPTS, sampling=sampling, seed=1)  # the worker now holds these weights
    syncs = engine.syncs
    engine(model, tokenizer, PROMPTS, sampling=sampling, seed=1)
    assert engine.syncs == syncs and engine.last_sync_s is None  # unchanged: nothing sent
    optimizer_step(model, tokenizer)
    model.eval()
    expected = generate(model, tokenizer, PROMPTS, group_size=2, sampling=sampling, seed=5)
    assert_same(engine(model, tokenizer, PROMPTS, group_size=2, sampling=sampling, seed=5), expected)
    assert engine.syncs == syncs + 1 and engine.last_sync_s is not None

    optimizer_step(model, tokenizer)  # the counter-test: the same comparison with the push skipped fails
    model.eval()
    monkeypatch.setattr(WorkerEngine, "_push", lambda self, weights: None)
    expected = generate(model, tokenizer, PROMPTS, group_size=2, sampling=sampling, seed=5)
    with pytest.raises(AssertionError):
        assert_same(engine(model, tokenizer, PROMPTS, group_size=2, sampling=sampling, seed=5), expected)


def test_a_lora_policy_samples_as_its_folded_weights(engine):
    torch.manual_seed(0)
    model, tokenizer = load_model("tiny")
    policy = apply_lora(model, LoraSettings(rank=4, alpha=8.0, target_modules=["q_proj", "up_proj"]))
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)  # B = 0 at init: make the adapters change the tokens
    sampling = SamplingConfig(max_new_tokens=8)
    got = engine(policy, tokenizer, PROMPTS, group_size=2, sampling=sampling, seed=2)
    assert_same(got, generate(policy, tokenizer, PROMPTS, group_size=2, sampling=sampling, seed=2))
    base, _ = load_model("tiny")
    base_rollout = generate(base, tokenizer, PROMPTS, group_size=2, sampling=sampling, seed=2)
    assert not torch.equal(got.completion_ids, base_rollout.completion_ids)  # the adapters mattered


def test_two_threads_share_one_engine(engine):
    model, tokenizer = load_model("tiny")
    sampling = SamplingConfig(max_new_tokens=8)
    results: dict[int, object] = {}

    def call(seed: int) -> None:
        results[seed] = engine(model, tokenizer, PROMPTS, group_size=2, sampling=sampling, seed=seed)

    threads = [threading.Thread(target=call, args=(seed,)) for seed in (21, 22, 23, 24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(results) == [21, 22, 23, 24]
    for seed, got in results.items():
        assert_same(got, generate(model, tokenizer, PROMPTS, group_size=2, sampling=sampling, seed=seed))


def test_an_error_in_the_worker_comes_back_as_its_type(engine):
    model, tokenizer = load_model("tiny")
    with pytest.raises(UserError, match="group_size") as caught:
        engine(model, tokenizer, PROMPTS, group_size=0)
    assert "Traceback" not in str(caught.value)
    assert engine.pid is not None  # the worker survives a refused request
    engine(model, tokenizer, PROMPTS, sampling=SamplingConfig(max_new_tokens=2))


def test_a_killed_worker_is_one_line_and_close_ends_the_process():
    model, tokenizer = load_model("tiny")
    engine = WorkerEngine(threads=1, timeout_s=60)
    sampling = SamplingConfig(max_new_tokens=4)
    engine(model, tokenizer, PROMPTS, sampling=sampling)
    os.kill(engine.pid, signal.SIGKILL)
    with pytest.raises(EngineUnavailable, match=r"generation worker \(pid \d+\) was killed by signal SIGKILL") as caught:
        engine(model, tokenizer, PROMPTS, sampling=sampling)
    assert "\n" not in str(caught.value)
    assert engine.pid is None  # forgotten: the next call starts a new worker
    assert_same(engine(model, tokenizer, PROMPTS, sampling=sampling), generate(model, tokenizer, PROMPTS, sampling=sampling))
    process = engine.process
    engine.close()
    assert not process.is_alive() and engine.pid is None
    engine.close()  # idempotent


def test_a_stuck_worker_times_out_and_a_dropped_engine_leaves_no_process():
    model, tokenizer = load_model("tiny")
    engine = WorkerEngine(threads=1, timeout_s=60)
    sampling = SamplingConfig(max_new_tokens=4)
    engine(model, tokenizer, PROMPTS, sampling=sampling)
    engine.timeout_s = 2  # after the start (spawn and load take seconds)
    stuck = engine.process
    os.kill(stuck.pid, signal.SIGSTOP)  # alive, but answers nothing
    with pytest.raises(EngineUnavailable, match=r"generation worker \(pid \d+\) did not answer within 2s and was stopped;"):
        engine(model, tokenizer, PROMPTS, sampling=sampling)
    assert not stuck.is_alive()  # ended, not left behind
    engine.timeout_s = 60
    engine(model, tokenizer, PROMPTS, sampling=sampling)  # a new worker
    process = engine.process
    del engine
    gc.collect()
    process.join(timeout=15)
    assert not process.is_alive()


def grpo_config(tmp_path, *extra):
    args = ["--data.eval_size", "8", "--data.train_size", "200", "--data.prompts_per_step", "2", "--data.group_size", "4",
            "--sampling.max_new_tokens", "6", "--update.micro_batch_size", "8", "--optim.lr", "1e-3",
            "--rollout.engine", "worker", "--acceptance.eval_every", "0", "--acceptance.sets", "[]", *extra]
    config = build_config(online_config.grpo_config, None, parse_overrides(args))
    config.output_dir = str(tmp_path / "run")
    return config


def test_grpo_runs_two_steps_on_the_worker_engine(tmp_path):
    config = grpo_config(tmp_path, "--max-steps", "2")
    run_dir = online.run(config, reward=digits)
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "rollout/sync_s" in row] == [1, 2]
    assert json.loads((run_dir / "run_card.json").read_text())["links"]["data"]["engine"]["name"] == "worker"
    assert engines.ENGINES["worker"].describe(config.rollout)["weight_sync"]


def test_a_worker_dying_mid_run_checkpoints_and_stops_with_one_line(tmp_path, monkeypatch):
    """The worker is killed before the third generation (step 2's sampling: the run generated twice
    before it): the run stops with one line, step 1 checkpointed (checkpoint_every is 10)."""

    class Dying(WorkerEngine):
        calls = 0

        def __call__(self, *args, **kwargs):
            Dying.calls += 1
            if Dying.calls == 3:
                os.kill(self.pid, signal.SIGKILL)
                self.process.join(timeout=10)
            return super().__call__(*args, **kwargs)

    entry = dataclasses.replace(engines.ENGINES["worker"], make=lambda settings: Dying(threads=1))
    monkeypatch.setitem(engines.ENGINES, "worker", entry)
    config = grpo_config(tmp_path, "--max-steps", "4", "--checkpoint-every", "10")
    with pytest.raises(UserError, match=r"generation worker \(pid \d+\) was killed by signal SIGKILL.*while sampling step 2") as caught:
        online.run(config, reward=digits)
    assert "\n" not in str(caught.value) and "--resume" in str(caught.value)
    assert (tmp_path / "run" / "checkpoints" / "step-000001").is_dir()
