"""The run skeleton (posttrain/runs/skeleton.py): the cadence of evaluation and checkpoints, the
epilogue that closes the run directory (and so its trackers) when a run fails, in every recipe."""

from __future__ import annotations

import pytest

from posttrain.config import build_config, parse_overrides
from posttrain.distributed import World
from posttrain.recipes import dpo, dpo_config, online, online_config, sft
from posttrain.runs import skeleton
from posttrain.runs.directory import RunDirectory
from tests.test_dpo import arithmetic_pairs, write_pairs
from tests.test_online_step import SMALL


class Recorded:
    def __init__(self):
        self.logged, self.saved = [], []

    def log_metrics(self, step, metrics):
        self.logged.append(step)

    path = "runs/x"


def test_step_loop_evaluates_and_checkpoints_on_schedule_and_at_the_last_step():
    """eval_every 3 and checkpoint_every 4 over steps 1..10 from step 2 (a resume): evaluations at 3,
    6, 9 and the last (10); checkpoints at 4, 8 and 10; every step logged once."""
    run_dir = Recorded()
    evaluated = []
    with skeleton.StepLoop("sft", run_dir, World(), first_step=2, max_steps=10, checkpoint_every=4, eval_every=3) as loop:
        for done in loop:
            if loop.evaluates(done):
                evaluated.append(done)
            loop.end_step(done, {}, save=lambda: run_dir.saved.append(done))
    assert evaluated == [3, 6, 9, 10]
    assert run_dir.saved == [4, 8, 10]
    assert run_dir.logged == list(range(3, 11))


def test_no_eval_every_still_evaluates_the_last_step():
    loop = skeleton.StepLoop("dpo", Recorded(), World(), 0, 5, checkpoint_every=100, eval_every=0)
    assert [done for done in range(1, 6) if loop.evaluates(done)] == [5]


def failing(*args, **kwargs):
    raise RuntimeError("the step failed")


@pytest.mark.parametrize("recipe", ["sft", "dpo", "grpo"])
def test_a_failing_run_still_closes_its_run_directory(tmp_path, monkeypatch, recipe):
    """Only the online recipe used to close the run directory (and so W&B / MLflow runs) in a
    finally; a failure in SFT or DPO left them open."""
    closed = []
    original = RunDirectory.close
    monkeypatch.setattr(RunDirectory, "close", lambda self: (closed.append(self.path), original(self)))
    out = str(tmp_path / "run")
    if recipe == "sft":
        monkeypatch.setattr(sft, "loss_step", failing)
        config = build_config(sft.Config, None, parse_overrides(["--max-steps", "2", "--data.train_size", "16", "--data.eval_size", "4",
                                                                  "--batch_size", "4", "--micro_batch_size", "2", "--output-dir", out]))
        run = lambda: sft.run(config)  # noqa: E731
    elif recipe == "dpo":
        monkeypatch.setattr(dpo, "loss_step", failing)
        pairs = write_pairs(tmp_path / "pairs.jsonl", arithmetic_pairs())
        config = build_config(dpo_config.Config, None, parse_overrides(["--data.pairs", str(pairs), "--data.heldout_pairs", "2",
                                                                         "--max-steps", "2", "--output-dir", out]))
        run = lambda: dpo.run(config)  # noqa: E731
    else:
        monkeypatch.setattr(online, "step", failing)
        config = build_config(online_config.grpo_config, None, {**SMALL, "max_steps": 2, "output_dir": out})
        run = lambda: online.run(config, reward=lambda completion, example: 1.0)  # noqa: E731
    with pytest.raises(RuntimeError, match="the step failed"):
        run()
    assert [str(path) for path in closed] == [out]


class FakeTime:
    """A clock that moves only when told, so timing metrics have exact expected values."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now


class CudaLike:
    """A placement whose synchronize, peak-memory reset and read are recorded."""
    is_cuda = True

    def __init__(self):
        self.calls = []

    def synchronize(self):
        self.calls.append("sync")

    def reset_peak_memory(self):
        self.calls.append("reset")

    def peak_memory_gib(self):
        return 1.5


def test_step_clock_gives_each_phase_the_wall_time_and_the_rates_of_their_phases(monkeypatch):
    """generation 2 s, update 1.5 s, 0.5 s outside any phase: seconds/step 4, 80 tokens over the step
    = 20/s, 60 generated tokens / 2 s = 30/s, 300 positions / (logprobs 0 + update 1.5) = 200/s; a
    rate whose phases took no time is left out; the peak memory is reset at the step's start."""
    from posttrain.runs import timer as timer_module

    fake = FakeTime()
    monkeypatch.setattr(timer_module.time, "perf_counter", fake.perf_counter)
    placement = CudaLike()
    clock = timer_module.StepClock(placement)
    assert placement.calls == ["reset"]
    with clock("generation"):
        fake.now += 2.0
    fake.now += 0.5
    with clock("update"):
        fake.now += 1.5
    metrics = clock.metrics(80, {"generation": (60, ("generation",)), "training": (300, ("logprobs", "update")),
                                 "scoring": (5, ("scoring",))})
    assert metrics == {"seconds/generation": 2.0, "seconds/update": 1.5, "seconds/step": 4.0, "tokens_per_second": 20.0,
                       "tokens_per_second/generation": 30.0, "tokens_per_second/training": 200.0,
                       "memory/peak_allocated_gib": 1.5}
    assert placement.calls.count("sync") == 4  # each phase synchronises as it starts and ends


def test_step_loop_starts_a_new_clock_for_each_step():
    loop = skeleton.StepLoop("sft", Recorded(), World(), 0, 3, checkpoint_every=100, eval_every=0)
    clocks = []
    with loop:
        for done in loop:
            clocks.append(loop.clock)
            loop.end_step(done, {}, save=lambda: None)
    assert len({id(clock) for clock in clocks}) == 3
