"""`data.async_generation` (issue 42's mode (b)): a generation thread samples ahead while the trainer
trains. The producer's rule on its own (fake batches, a deliberately slow trainer and a deliberately
slow generator, 20 steps: no batch older than k is ever trained, every step gets the batch of its own
step, the producer never samples with weights older than the rule allows, the waits are measured),
a generator that fails stops the trainer with its error, close() ends the thread, the checkpoint
record and the stream position; then whole runs: `online.run` with the generation worker, a run
stopped with batches in flight that resumes (they are sampled again from the prompts of their own
steps, said in the card), a generator process that dies (one line and a checkpoint), and the
settings refused."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from posttrain.config import build_config, parse_overrides
from posttrain.data.async_generation import AsyncBatches, generation_copy
from posttrain.errors import UserError
from posttrain.recipes import online, online_config
from posttrain.runs.faults import RunStopped
from tests.rewards_for_tests import digits


class FakeProducer:
    """A draw for `AsyncBatches`: records which weights version sampled each step's batch, sleeping
    `seconds` per batch; raises `fail` when it reaches step `fail_at`."""

    def __init__(self, seconds: float = 0.0, fail_at: int | None = None, fail: BaseException | None = None):
        self.seconds, self.fail_at, self.fail = seconds, fail_at, fail
        self.sampled: list[tuple[int, int, float]] = []
        self.position = 0

    def __call__(self, serves: int, model, version: int):
        if serves == self.fail_at:
            raise self.fail
        time.sleep(self.seconds)
        self.sampled.append((serves, version, float(model.weight.sum())))
        self.position += 10
        batch = SimpleNamespace(serves=serves, version=version, rollout=SimpleNamespace(mask=torch.ones(2, 3, dtype=torch.bool)))
        return batch, {"generation": self.seconds or 1e-3, "scoring": 0.0}, self.position


class FakeTrainer(torch.nn.Module):
    """The policy: one weight that every update sets to the step number (so a batch's weights are
    readable from the producer's copy)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2))

    def update(self, step: int) -> None:
        with torch.no_grad():
            self.weight.fill_(step / 2)  # sum = step


def drive(k: int, steps: int, producer: FakeProducer, train_seconds: float) -> tuple[list[tuple[int, int]], list[dict], AsyncBatches]:
    """The trainer's loop over `steps` steps: take the batch, 'train' for `train_seconds`, publish."""
    policy = FakeTrainer()
    pending = AsyncBatches(k, producer, generation_copy(policy))
    pending.start(1, steps, version=0, position=0)
    trained, metrics = [], []
    try:
        for step in range(1, steps + 1):
            batch = pending.next(step, steps)
            trained.append((batch.serves, batch.version))
            time.sleep(train_seconds)
            policy.update(step)
            pending.published(step, policy)
            metrics.append(pending.metrics(batch, step))
    finally:
        pending.close()
    return trained, metrics, pending


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("slow", ["trainer", "generator"])
def test_no_batch_older_than_k_is_ever_trained_over_20_steps(k, slow):
    producer = FakeProducer(seconds=0.03 if slow == "generator" else 0.0)
    trained, metrics, pending = drive(k, 20, producer, train_seconds=0.03 if slow == "trainer" else 0.0)
    assert [serves for serves, _ in trained] == list(range(1, 21))  # each step its own step's batch, in order
    assert all(0 <= step - 1 - version <= k for step, (_, version) in enumerate(trained, start=1))
    assert pending.dropped == 0 and all(m["offpolicy/dropped_batches"] == 0 for m in metrics)
    # The producer sampled each batch with the version it recorded (the copy's weight sum is the version)
    # and never with one older than the rule allows.
    assert [(serves, version) for serves, version, _ in producer.sampled] == trained
    assert all(weights == version for _, version, weights in producer.sampled)
    assert all(version >= serves - 1 - k for serves, version, _ in producer.sampled)
    staleness = [m["offpolicy/staleness_max"] for m in metrics]
    if slow == "trainer":
        # The generator is always ahead: after the first k+1 steps every batch is exactly k steps old,
        # the producer waits on training and the trainer never on generation.
        assert staleness[k + 1:] == [k] * (20 - k - 1)
        assert sum(m["offpolicy/wait_training_s"] for m in metrics) > 0.2
        assert max(m["offpolicy/wait_generation_s"] for m in metrics[1:]) < 0.02
    else:
        # The generator is the bottleneck: the trainer waits for it on most steps, and it samples
        # with the newest weights, so batches are fresher than k allows.
        assert sum(m["offpolicy/wait_generation_s"] for m in metrics) > 0.2
        assert sum(staleness) < k * 20


def test_the_producer_runs_at_most_k_steps_ahead():
    """With a trainer that never takes its second batch, the producer stops after the batches version 0
    may sample (steps 1 .. k+1) and waits."""
    k, producer = 2, FakeProducer()
    pending = AsyncBatches(k, producer, generation_copy(FakeTrainer()))
    pending.start(1, 50, version=0, position=0)
    try:
        pending.next(1, 50)
        time.sleep(0.2)
        assert [serves for serves, _, _ in producer.sampled] == [1, 2, 3]
        assert pending.state() == {"dropped": 0, "in_flight": 2, "asynchronous": True}
    finally:
        pending.close()


def test_a_generator_that_fails_stops_the_trainer_with_its_error_and_close_ends_the_thread():
    producer = FakeProducer(fail_at=3, fail=RuntimeError("the reward server went away"))
    with pytest.raises(RuntimeError, match="the reward server went away"):
        drive(1, 10, producer, train_seconds=0.0)
    threads = [thread for thread in threading.enumerate() if thread.name == "posttrain-generation"]
    assert not threads


def test_close_stops_a_producer_waiting_for_weights():
    pending = AsyncBatches(1, FakeProducer(), generation_copy(FakeTrainer()))
    pending.start(1, 10, version=0, position=0)
    pending.next(1, 10)
    time.sleep(0.05)  # the producer has sampled step 2 and waits for version 1
    started = time.perf_counter()
    pending.close()
    assert time.perf_counter() - started < 1.0
    assert not [thread for thread in threading.enumerate() if thread.name == "posttrain-generation"]


def test_the_checkpoint_keeps_the_stream_position_after_the_last_trained_batch_and_counts_those_in_flight():
    producer = FakeProducer()
    policy = FakeTrainer()
    pending = AsyncBatches(2, producer, generation_copy(policy))
    pending.start(1, 10, version=0, position=0)
    try:
        pending.next(1, 10)
        time.sleep(0.1)  # steps 2 and 3 sampled ahead: the stream is at 30
        stream = SimpleNamespace(position=producer.position)
        assert stream.position == 30 and pending.stream_position(stream) == 10
        saved = pending.state()
    finally:
        pending.close()
    resumed = AsyncBatches(2, FakeProducer(), generation_copy(policy))
    resumed.restore(saved)
    assert resumed.regenerated_on_resume == 2 and resumed.dropped == 0
    resumed.restore({"batches": [1, 2, 3], "dropped": 4})  # a mode (a) checkpoint: its batches are sampled again
    assert resumed.regenerated_on_resume == 3 and resumed.dropped == 4


def test_k_zero_is_refused():
    with pytest.raises(ValueError, match="max_staleness >= 1"):
        AsyncBatches(0)


# -- whole runs -----------------------------------------------------------------------------------

SMALL = [
    "--data.eval_size", "4", "--data.train_size", "200", "--data.prompts_per_step", "2", "--data.group_size", "4",
    "--sampling.max_new_tokens", "6", "--update.micro_batch_size", "8", "--optim.lr", "1e-2", "--seed", "3",
    "--acceptance.eval_every", "0", "--checkpoint-every", "1",
]
STEPS = 6


def config_of(directory, *extra) -> online_config.Config:
    config = build_config(online_config.grpo_config, None, parse_overrides(SMALL + ["--max-steps", str(STEPS), *extra]))
    config.output_dir = str(directory)
    return config


def trained_examples(monkeypatch) -> dict[int, list[str]]:
    """Step -> the example ids the step trained on (online.step wrapped)."""
    trained, step = {}, online.step

    def recording(state, batch, timer=None):
        trained[state.step + 1] = [example.id for example in batch.examples]
        return step(state, batch, timer)

    monkeypatch.setattr(online, "step", recording)
    return trained


def rows_of(directory) -> list[dict]:
    return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def on_policy(tmp_path_factory):
    """The on-policy run of the same config: which prompts each step trains on."""
    directory = tmp_path_factory.mktemp("k0") / "run"
    with pytest.MonkeyPatch.context() as monkeypatch:
        trained = trained_examples(monkeypatch)
        online.run(config_of(directory), reward=digits)
    return trained


def test_an_asynchronous_run_trains_each_step_on_its_own_prompts_never_older_than_k(tmp_path, monkeypatch, on_policy):
    trained = trained_examples(monkeypatch)
    directory = online.run(config_of(tmp_path / "run", "--data.max_staleness", "2", "--data.async_generation", "true"), reward=digits)
    assert trained == on_policy  # the prompts and seeds of each step, whatever weights sampled them
    rows = [row for row in rows_of(directory) if row["step"] > 0]
    assert len(rows) == STEPS and all(0 <= row["offpolicy/staleness_max"] <= 2 for row in rows)
    assert all(row["offpolicy/dropped_batches"] == 0 and row["offpolicy/wait_generation_s"] >= 0 for row in rows)
    samples = [json.loads(line) for line in (directory / "samples.jsonl").read_text().splitlines()]
    assert all(0 <= sample["step"] - 1 - sample["version"] <= 2 for sample in samples)
    card = json.loads((directory / "run_card.json").read_text())
    assert card["links"]["data"]["staleness"].startswith("asynchronous (mode b)")
    assert card["links"]["data"]["engine"]["name"] == "worker"  # the built-in engine in its own process
    assert not [thread for thread in threading.enumerate() if thread.name == "posttrain-generation"]


def test_a_run_stopped_with_batches_in_flight_resumes_sampling_them_again(tmp_path, monkeypatch, on_policy):
    config = config_of(tmp_path / "run", "--data.max_staleness", "2", "--data.async_generation", "true")
    trained, step = trained_examples(monkeypatch), online.step

    def stopping(state, batch, timer=None):
        if state.step + 1 == 3:
            time.sleep(0.5)  # the generator samples steps 4 and 5 meanwhile
            os.kill(os.getpid(), signal.SIGTERM)  # the step finishes, is checkpointed, then RunStopped
        return step(state, batch, timer)

    monkeypatch.setattr(online, "step", stopping)
    with pytest.raises(RunStopped):
        online.run(config, reward=digits)
    saved = torch.load(tmp_path / "run" / "checkpoints" / "step-000003" / f"{online.PENDING}.pt", weights_only=False)
    assert saved["in_flight"] == 2 and saved["asynchronous"]
    directory = online.run(config, reward=digits, resume=True)
    assert trained == on_policy  # steps 4-6 sampled again from their own prompts
    card = json.loads((directory / "run_card.json").read_text())
    assert card["run"]["batches_regenerated_on_resume"] == 2
    assert any("2 batch(es) sampled ahead and not trained" in note for note in card["notes"])


def test_a_generation_worker_that_dies_stops_the_run_with_a_checkpoint_and_one_line(tmp_path, monkeypatch):
    """The worker is killed under the generation thread's third batch: the trainer stops at the batch
    it waits for, with one line, its steps checkpointed."""
    import dataclasses

    from posttrain.rollout import engines
    from posttrain.rollout.worker_engine import WorkerEngine

    class Dying(WorkerEngine):
        calls = 0

        def __call__(self, *args, **kwargs):
            Dying.calls += threading.current_thread().name == "posttrain-generation"
            if Dying.calls == 3:
                os.kill(self.pid, signal.SIGKILL)
                self.process.join(timeout=10)
            return super().__call__(*args, **kwargs)

    entry = dataclasses.replace(engines.ENGINES["worker"], make=lambda settings: Dying(threads=1))
    monkeypatch.setitem(engines.ENGINES, "worker", entry)
    config = config_of(tmp_path / "run", "--data.max_staleness", "1", "--data.async_generation", "true")
    with pytest.raises(UserError, match=r"generation worker \(pid \d+\) was killed by signal SIGKILL.*while sampling ahead, "
                                        r"\d steps done; checkpoint step-\d written\); to resume") as caught:
        online.run(config, reward=digits)
    assert "\n" not in str(caught.value) and "--resume" in str(caught.value) and Dying.calls >= 3
    assert list((tmp_path / "run" / "checkpoints").glob("step-*"))
    assert not [thread for thread in threading.enumerate() if thread.name == "posttrain-generation"]


def test_async_generation_without_staleness_or_under_torchrun_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="data.async_generation needs data.max_staleness >= 1"):
        config_of(tmp_path / "a", "--data.async_generation", "true")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="runs in one process; under torchrun"):
        online.run(config_of(tmp_path / "b", "--data.max_staleness", "1", "--data.async_generation", "true"), reward=digits)
    assert not (tmp_path / "b").exists()
