"""`data.max_staleness` (mode (a): simulated, synchronous, deterministic staleness in the online
recipe): k = 0 is the on-policy run and logs nothing new; with k = 2 the batch trained at step t was
sampled by the weights step max(t-2, 1) started from (weight hashes recorded at each sampling and at
each step), with the on-policy run's step-t prompts; the staleness metrics; a run stopped with
batches pending resumes exactly; the pending queue's drop rule; a negative k is one line."""

import hashlib
import json
import os
import signal
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from posttrain.config import build_config, parse_overrides
from posttrain.data.staleness import PendingBatches
from posttrain.errors import UserError
from posttrain.models import load_model
from posttrain.recipes import online
from posttrain.recipes import online_config
from posttrain.runs.faults import RunStopped
from tests.rewards_for_tests import digits

SMALL = [
    "--data.eval_size", "4", "--data.train_size", "200", "--data.prompts_per_step", "2", "--data.group_size", "4",
    "--sampling.max_new_tokens", "6", "--update.micro_batch_size", "8", "--optim.lr", "1e-2", "--seed", "3",
    "--acceptance.eval_every", "0", "--checkpoint-every", "1",
]
STEPS = 5
TIMINGS = ("seconds/", "tokens_per_second")


def config_of(directory, *extra) -> online_config.Config:
    config = build_config(online_config.grpo_config, None, parse_overrides(SMALL + ["--max-steps", str(STEPS), *extra]))
    config.output_dir = str(directory)
    return config


def weights_hash(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@dataclass
class Record:
    """What the wrapped `online.sample` and `online.step` saw."""

    sampled: list[dict] = field(default_factory=list)
    """One per sampled batch: the step in progress, the step it serves, its version, the policy's hash."""
    trained: dict[int, dict] = field(default_factory=dict)
    """Step -> the batch it trained (serves, version, example ids) and the policy's hash at the step's start."""


def recorded_run(monkeypatch, config, stop_after: int | None = None, resume: bool = False) -> Record:
    """`online.run` with `sample` and `step` wrapped to record the weights' hashes; with
    `stop_after`, SIGTERM during that step (the run checkpoints it and raises `RunStopped`)."""
    record, sample, step = Record(), online.sample, online.step

    def recording_sample(state, timer=None, serves=None):
        batch = sample(state, timer, serves)
        record.sampled.append({"during": state.step + 1, "serves": batch.serves, "version": batch.version,
                               "hash": weights_hash(state.policy)})
        return batch

    def recording_step(state, batch, timer=None):
        record.trained[state.step + 1] = {"serves": batch.serves, "version": batch.version, "hash": weights_hash(state.policy),
                                          "examples": [example.id for example in batch.examples]}
        if state.step + 1 == stop_after:
            os.kill(os.getpid(), signal.SIGTERM)  # StepLoop's handler: the step finishes, is checkpointed, then RunStopped
        return step(state, batch, timer)

    monkeypatch.setattr(online, "sample", recording_sample)
    monkeypatch.setattr(online, "step", recording_step)
    online.run(config, reward=digits, resume=resume)
    return record


def metric_rows(directory) -> list[dict]:
    rows = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(TIMINGS)} for row in rows]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An on-policy run (k = 0) and a k = 2 run of the same config, each recorded: 5 steps."""
    out = {}
    for k in (0, 2):
        directory = tmp_path_factory.mktemp(f"k{k}") / "run"
        with pytest.MonkeyPatch.context() as monkeypatch:  # each run wraps the recipe's own functions
            out[k] = (directory, recorded_run(monkeypatch, config_of(directory, "--data.max_staleness", str(k))))
    return out


def test_k0_is_the_on_policy_run_and_logs_nothing_new(runs):
    """k = 0: every batch sampled during the step it serves, by the weights that train on it (the
    goldens pin the numbers bit for bit); no offpolicy/* key, no version in samples.jsonl, no
    pending batches in the checkpoints, no staleness in the card."""
    directory, record = runs[0]
    assert [(s["during"], s["serves"], s["version"]) for s in record.sampled] == [(t, t, t - 1) for t in range(1, STEPS + 1)]
    assert all(record.trained[t]["hash"] == record.sampled[t - 1]["hash"] for t in range(1, STEPS + 1))
    assert not [key for row in metric_rows(directory) for key in row if key.startswith("offpolicy/")]
    assert all("version" not in json.loads(line) for line in (directory / "samples.jsonl").read_text().splitlines())
    assert not list((directory / "checkpoints").glob("*/pending_batches.pt"))
    data = json.loads((directory / "run_card.json").read_text())["links"]["data"]
    assert data["source"] == "online: the policy's own samples" and "max_staleness" not in data


def test_batch_of_step_t_was_sampled_by_the_weights_of_step_t_minus_k(runs):
    """k = 2, 5 steps: step 1 samples the batches of steps 1, 2, 3 (version 0), step 2 that of step
    4 (version 1), step 3 that of step 5 (version 2), steps 4 and 5 nothing (no step 6 or 7). The
    batch trained at step t serves t, and its sampling hash is the hash the weights had at the start
    of step max(t-2, 1): versions 0, 0, 0, 1, 2."""
    _, record = runs[2]
    assert [(s["during"], s["serves"], s["version"]) for s in record.sampled] == [(1, 1, 0), (1, 2, 0), (1, 3, 0), (2, 4, 1), (3, 5, 2)]
    sampled_hash = {s["serves"]: s["hash"] for s in record.sampled}
    for t in range(1, STEPS + 1):
        trained = record.trained[t]
        assert (trained["serves"], trained["version"]) == (t, max(t - 3, 0))
        assert sampled_hash[t] == record.trained[max(t - 2, 1)]["hash"], t
    assert len({trained["hash"] for trained in record.trained.values()}) == STEPS, "every step changed the weights"


def test_step_t_trains_on_the_on_policy_runs_step_t_prompts(runs):
    """The prompts (and sampling seeds) of a batch are those of the step it serves: only the
    weights that drew the completions differ."""
    on_policy, stale = runs[0][1], runs[2][1]
    assert [stale.trained[t]["examples"] for t in range(1, STEPS + 1)] == [on_policy.trained[t]["examples"] for t in range(1, STEPS + 1)]


def test_staleness_metrics_samples_and_card(runs):
    """Staleness t - 1 - version: 0, 1, 2, 2, 2 (mean = max: one version per batch); nothing
    dropped; samples.jsonl rows carry the version; the card's data link says how old and how."""
    directory, _ = runs[2]
    rows = [row for row in metric_rows(directory) if row["step"] > 0]
    assert [row["offpolicy/staleness_mean"] for row in rows] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert [row["offpolicy/staleness_max"] for row in rows] == [0, 1, 2, 2, 2]
    assert [row["offpolicy/dropped_batches"] for row in rows] == [0] * STEPS
    versions = {}
    for line in (directory / "samples.jsonl").read_text().splitlines():
        versions.setdefault(json.loads(line)["step"], set()).add(json.loads(line)["version"])
    assert versions == {1: {0}, 2: {0}, 3: {0}, 4: {1}, 5: {2}}
    data = json.loads((directory / "run_card.json").read_text())["links"]["data"]
    assert data["source"] == "online: the policy's own samples, up to 2 steps old" and data["max_staleness"] == 2
    assert data["staleness"].startswith("simulated, synchronous and deterministic")
    assert data["staleness_correction"].startswith("decoupled: decoupled PPO")  # what loss.off_policy auto resolved to


def test_changing_max_staleness_alone_is_a_data_link_change(runs):
    """The loss link states the setting (auto, the same rule at k = 0 and k = 2), so `posttrain
    checklist` on the two runs finds the data link changed and nothing else."""
    from posttrain.evaluation.run_comparison import link_rows
    from posttrain.evaluation.run_record import read_run

    changed = [row.link for row in link_rows(read_run(runs[0][0]), read_run(runs[2][0])) if row.changes]
    assert changed == ["data"]


def test_a_run_stopped_with_batches_pending_resumes_exactly(runs, tmp_path, monkeypatch):
    """k = 2: SIGTERM during step 3 of 5: checkpoint 3 holds the batches of steps 4 and 5 (sampled
    by versions 1 and 2, weights the restart loses); a resume with k changed is refused naming the
    key; the resume trains them, samples nothing, and ends with the uninterrupted run's metrics
    (timings aside) and weights."""
    straight, _ = runs[2]
    directory = tmp_path / "run"
    with pytest.raises(RunStopped):
        recorded_run(monkeypatch, config_of(directory, "--data.max_staleness", "2"), stop_after=3)
    monkeypatch.undo()
    pending = torch.load(directory / "checkpoints" / "step-000003" / "pending_batches.pt", weights_only=False)
    assert [(batch.serves, batch.version) for batch in pending["batches"]] == [(4, 1), (5, 2)]
    with pytest.raises(UserError, match="data.max_staleness: 2 -> 1"):
        online.run(config_of(directory, "--data.max_staleness", "1"), reward=digits, resume=True)
    record = recorded_run(monkeypatch, config_of(directory, "--data.max_staleness", "2"), resume=True)
    assert record.sampled == [] and sorted(record.trained) == [4, 5]
    assert metric_rows(directory) == metric_rows(straight)
    final = lambda run: load_model(str(run / "checkpoints" / f"step-{STEPS:06d}" / "model"))[0]  # noqa: E731
    for (name, a), (_, b) in zip(final(straight).named_parameters(), final(directory).named_parameters()):
        assert torch.equal(a, b), name


def test_a_batch_older_than_k_is_dropped_and_counted():
    """The drop rule (a generator of its own can fall behind; the synchronous pipeline never does):
    k = 1, step 4, pending batches of version 1 (staleness 2: dropped) and version 2 (staleness 1:
    kept and trained); `draw` tops the queue up to step 4 + 1 with the current weights."""
    pending = PendingBatches(1, [SimpleNamespace(serves=4, version=1), SimpleNamespace(serves=5, version=2)])
    drawn = []
    batch = pending.next(4, 10, lambda serves: drawn.append(serves) or SimpleNamespace(serves=serves, version=3))
    assert (batch.serves, batch.version, pending.dropped, drawn) == (5, 2, 1, [])
    assert pending.metrics(batch, 4) == {"offpolicy/staleness_mean": 1.0, "offpolicy/staleness_max": 1, "offpolicy/dropped_batches": 1}
    batch = pending.next(5, 10, lambda serves: drawn.append(serves) or SimpleNamespace(serves=serves, version=4))
    assert (batch.serves, batch.version, drawn) == (5, 4, [5, 6])
    assert PendingBatches(0).metrics(batch, 5) == {}


def test_negative_max_staleness_is_one_line(tmp_path, capsys):
    from posttrain.cli import main

    assert main(["grpo", "--output-dir", str(tmp_path / "run"), "--data.max_staleness", "-1"]) == 2
    err = capsys.readouterr().err
    assert "data.max_staleness must be 0 (on-policy) or more, got -1" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_stale_batches_on_greedy_rollouts_are_refused_before_any_work(tmp_path, capsys):
    """auto resolves to decoupled at k >= 1, which reads the behaviour distribution: greedy has none."""
    from posttrain.cli import main

    assert main(["grpo", "--output-dir", str(tmp_path / "run"), "--data.max_staleness", "1", "--sampling.greedy", "true"]) == 2
    err = capsys.readouterr().err
    assert "loss.off_policy.objective decoupled needs sampled rollouts" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_two_processes_equal_one(tmp_path):
    """Under torchrun (DDP, gloo) with k = 1: every rank holds the same pending batches (each
    sampled as one global batch), so 2 processes train the steps of 1, staleness included."""
    from tests.flags import with_flags
    from tests.test_distributed import GRPO, assert_same_run, metrics
    from tests.test_distributed import run as launch_run

    args = [*with_flags(GRPO, "--data.max_staleness", "1"), "--max-steps", "3"]
    launch_run([*args, "--output-dir", str(tmp_path / "one")], 1)
    launch_run([*args, "--parallel.strategy", "ddp", "--output-dir", str(tmp_path / "two")], 2)
    assert_same_run(tmp_path / "one", tmp_path / "two", 3)
    staleness = lambda run: [row.get("offpolicy/staleness_max") for row in metrics(run)]  # noqa: E731
    assert staleness(tmp_path / "one") == staleness(tmp_path / "two") == [None, 0, 1, 1]
    assert (tmp_path / "one" / "samples.jsonl").read_text() == (tmp_path / "two" / "samples.jsonl").read_text()
