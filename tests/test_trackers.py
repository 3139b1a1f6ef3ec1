"""Trackers (`report_to`): a 2-step sft run reports to all four, and each tracker's own local files,
read back with its own reader, hold exactly the numbers of metrics.jsonl, the config and the card;
a 2-step grpo run's samples tables hold samples.jsonl's rows; bad names and missing packages are one
line before anything is written; `tensorboard: true` is still the tensorboard tracker."""

import json
import sqlite3
import struct
import sys

import pytest

from posttrain.cli import main
from posttrain.config import build_config, parse_overrides
from posttrain.errors import UserError
from posttrain.recipes import online, online_config, sft
from posttrain.runs import RunDirectory, read_jsonl
from posttrain.runs.trackers import mlflow_name, scalars
from tests.rewards_for_tests import digits

SFT = ["--max-steps", "2", "--batch-size", "4", "--micro-batch-size", "2", "--data.train_size", "40",
       "--data.eval_size", "4", "--acceptance.max_new_tokens", "4"]
GRPO = ["--max-steps", "2", "--data.eval_size", "4", "--data.train_size", "40", "--data.prompts_per_step", "2",
        "--data.group_size", "2", "--sampling.max_new_tokens", "4", "--samples_per_step", "3"]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """One `posttrain sft` run reporting to every tracker: (run directory, {(step, key): value} of metrics.jsonl)."""
    for name in ("tensorboard", "wandb", "trackio", "mlflow"):
        pytest.importorskip(name)
    run = tmp_path_factory.mktemp("sft") / "run"
    assert main(["sft", "--output-dir", str(run), *SFT, "--report_to", "[tensorboard, wandb, trackio, mlflow]"]) == 0
    expected = {(row["step"], key): value for row in read_jsonl(run / "metrics.jsonl") for key, value in scalars(row).items() if key != "step"}
    assert {key for _, key in expected} >= {"loss", "grad_norm", "heldout/pass@1", "heldout/nll"}
    return run, expected


def wandb_records(run_dir):
    """The records of a W&B offline run's .wandb file, decoded with wandb's own protobuf. The file is
    a LevelDB-style log: a 7-byte W&B header, then 32 KiB blocks of chunks, each with a 7-byte header
    (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, position, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a header is padding
            position += 32768 - position % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def wandb_history(run_dir) -> dict[int, dict]:
    """{step: {key: value}} of the run's history records (W&B's own keys `_step`, `_runtime`... left out)."""
    history = {}
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(items.pop("_step"), {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return history


def mlflow_run(run_dir):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").absolute().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("posttrain").experiment_id])
    return client, run


def test_tensorboard_event_file_holds_metrics_jsonl(sft_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # the fixture skips without it

    run, expected = sft_run
    board = EventAccumulator(str(run / "tensorboard"))
    board.Reload()
    logged = {(event.step, key): event.value for key in board.Tags()["scalars"] for event in board.Scalars(key)}
    assert logged == {key: pytest.approx(value, rel=1e-6) for key, value in expected.items()}  # float32 in the file
    assert {"config/text_summary", "run_card/text_summary"} <= set(board.Tags()["tensors"])


def test_wandb_offline_run_holds_metrics_config_and_card(sft_run):
    run, expected = sft_run
    history = wandb_history(run)
    assert {(step, key): value for step, row in history.items() for key, value in row.items()} == expected
    (config,) = [{item.key: json.loads(item.value_json) for item in r.run.config.update}
                 for r in wandb_records(run) if r.WhichOneof("record_type") == "run"]
    assert config["max_steps"] == 2 and config["optim"]["lr"] == sft.Config().optim.lr
    assert config["run_card"]["links"]["loss"]["objective"] == "masked NLL"
    assert config["run_card"]["run"]["recipe"] == "sft" and "config" not in config["run_card"]["run"]


def test_trackio_store_holds_metrics_config_and_card(sft_run):
    run, expected = sft_run
    with sqlite3.connect(run / "trackio" / "posttrain.db") as db:
        rows = db.execute("SELECT step, metrics FROM metrics WHERE run_name = ?", (run.name,)).fetchall()
        (config,) = db.execute("SELECT config FROM configs WHERE run_name = ?", (run.name,)).fetchone()
    assert {(step, key): value for step, text in rows for key, value in json.loads(text).items()} == expected
    config = json.loads(config)
    assert config["max_steps"] == 2 and config["run_card"]["links"]["loss"]["objective"] == "masked NLL"


def test_mlflow_file_store_holds_metrics_params_and_card(sft_run):
    run, expected = sft_run
    client, logged = mlflow_run(run)
    history = {(m.step, key): m.value for key in logged.data.metrics for m in client.get_metric_history(logged.info.run_id, key)}
    assert history == {(step, mlflow_name(key)): pytest.approx(value) for (step, key), value in expected.items()}
    assert "heldout.pass_at_1" == mlflow_name("heldout/pass@1")
    params = logged.data.params
    assert params["max_steps"] == "2" and params["optim.lr"] == str(sft.Config().optim.lr)
    assert params["card.links.loss.objective"] == "masked NLL" and params["card.run.recipe"] == "sft"
    assert logged.info.run_name == run.name and logged.info.status == "FINISHED"
    card = json.loads((run / "mlruns" / logged.info.experiment_id / logged.info.run_id / "artifacts" / "run_card.json").read_text())
    assert card["links"] == json.loads((run / "run_card.json").read_text())["links"]


def test_grpo_samples_are_tables_in_wandb_and_mlflow(tmp_path):
    """samples.jsonl's rows, step by step, are W&B's `samples` tables and MLflow's samples.json."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    config = build_config(online_config.grpo_config, None, parse_overrides(GRPO + ["--report_to", "[wandb, mlflow]"]))
    config.output_dir = str(tmp_path / "run")
    run = online.run(config, reward=digits)
    samples = read_jsonl(run / "samples.jsonl")
    columns = list(samples[0])
    assert len(samples) == 2 * 3 and columns[0] == "step"

    history = wandb_history(run)
    (files,) = run.glob("wandb/offline-run-*/files")
    tables = []
    for step in (1, 2):
        assert history[step]["samples/_type"] == "table-file" and history[step]["samples/nrows"] == 3
        table = json.loads((files / history[step]["samples/path"]).read_text())
        assert table["columns"] == columns
        tables += [dict(zip(table["columns"], row)) for row in table["data"]]
    assert tables == samples
    assert history[2]["reward/mean"] == read_jsonl(run / "metrics.jsonl")[2]["reward/mean"]

    client, logged = mlflow_run(run)
    table = json.loads((run / "mlruns" / logged.info.experiment_id / logged.info.run_id / "artifacts" / "samples.json").read_text())
    assert table["columns"] == columns
    assert [dict(zip(table["columns"], row)) for row in table["data"]] == samples


def test_trackio_samples_table_in_a_second_run_of_the_process(tmp_path, sft_run):
    """After the sft run's trackio (imported, pointed at that run), another run still gets its own
    store, and samples are a trackio table."""
    run = RunDirectory(tmp_path / "run", trackers=["trackio"])
    run.log_metrics(1, {"loss": 1.5})
    run.log_samples(1, [{"prompt": "p", "reward": 1.0}, {"prompt": "q", "reward": None}])
    run.close()
    with sqlite3.connect(tmp_path / "run" / "trackio" / "posttrain.db") as db:
        rows = [(step, json.loads(text)) for step, text in db.execute("SELECT step, metrics FROM metrics ORDER BY id")]
    assert rows[0] == (1, {"loss": 1.5})
    assert rows[1] == (1, {"samples": {"_type": "trackio.table", "_value": [{"step": 1, "prompt": "p", "reward": 1.0},
                                                                            {"step": 1, "prompt": "q", "reward": None}]}})
    with sqlite3.connect(sft_run[0] / "trackio" / "posttrain.db") as db:
        assert db.execute("SELECT COUNT(*) FROM metrics WHERE run_name = 'run' AND step = 1 AND metrics LIKE '%samples%'").fetchone() == (0,)


def test_unknown_tracker_is_one_line_listing_the_known(tmp_path, capsys):
    assert main(["sft", "--output-dir", str(tmp_path / "run"), *SFT, "--report_to", "[wandb, neptune]"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert "unknown tracker 'neptune'" in error and "tensorboard, wandb, trackio, mlflow" in error
    assert not (tmp_path / "run").exists()


def test_missing_package_is_one_line_naming_it_before_anything_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` now fails as if it were not installed
    assert main(["sft", "--output-dir", str(tmp_path / "run"), *SFT, "--report_to", "[mlflow]"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "pip install mlflow-skinny" in error
    assert not (tmp_path / "run").exists()
    with pytest.raises(UserError, match="pip install mlflow-skinny"):  # the run directory checks again
        RunDirectory(tmp_path / "run", trackers=["mlflow"])
    assert not (tmp_path / "run").exists()


def test_tensorboard_true_is_the_tensorboard_tracker(tmp_path):
    EventAccumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator").EventAccumulator

    assert build_config(sft.Config, None, {"tensorboard": True}).trackers() == ["tensorboard"]
    assert build_config(sft.Config, None, {"tensorboard": True, "report_to": ["tensorboard"]}).trackers() == ["tensorboard"]  # once
    run = RunDirectory(tmp_path / "run", trackers=build_config(sft.Config, None, {"tensorboard": True}).trackers())
    run.log_metrics(1, {"loss": 2.5, "heldout/pass@1": None, "flag": True})
    run.close()
    board = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    board.Reload()
    assert board.Tags()["scalars"] == ["loss"] and [(e.step, e.value) for e in board.Scalars("loss")] == [(1, 2.5)]


def test_other_ranks_make_no_tracker(tmp_path):
    run = RunDirectory(tmp_path / "run", writer=False, trackers=["tensorboard"])
    run.log_metrics(1, {"loss": 1.0})
    run.close()
    assert not (tmp_path / "run").exists()
