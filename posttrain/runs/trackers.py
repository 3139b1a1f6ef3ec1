"""The experiment trackers a run can also report to (`report_to: [tensorboard, wandb, trackio, mlflow]`).

Every tracker writes into the run directory, offline, without an account or a network:

    runs/<name>/
      tensorboard/   TensorBoard event files             tensorboard --logdir runs/<name>/tensorboard
      wandb/         a W&B offline run (mode="offline")  wandb sync runs/<name>/wandb/offline-run-*
      trackio/       trackio's SQLite project store      TRACKIO_DIR=runs/<name>/trackio trackio show
      mlruns/        an MLflow file store                MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri file:runs/<name>/mlruns

(docs/metrics.md, Trackers: what each one gets, resume, viewing and uploading later.)

metrics.jsonl stays the record; a tracker gets a copy of each line's numbers (None, booleans,
non-finite and non-numeric values left out). Each adapter imports its package only when a run asks
for it, so none of them is a dependency (`pip install 'posttrain[trackers]'`). An adapter has four
calls: `start(run_name, config, card)` once (the resolved config and the run card as the run's
parameters), `log(step, metrics)`, `log_samples(step, rows)` (samples.jsonl's rows, as a table where
the tracker has tables) and `close()`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from posttrain.errors import UserError
from posttrain.runs.card import render_markdown

logger = logging.getLogger(__name__)

PROJECT = "posttrain"  # the W&B / trackio project and the MLflow experiment every run goes to


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics line that a tracker can plot: ints and finite floats, not booleans."""
    return {key: value for key, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}


def _without_config(card: dict[str, Any]) -> dict[str, Any]:
    """The card minus its copy of the config (a tracker gets the config as the run's config already)."""
    return {**card, "run": {k: v for k, v in card.get("run", {}).items() if k != "config"}} if card else {}


class TensorBoardTracker:
    """Scalars in `<run>/tensorboard/` (torch.utils.tensorboard), the config and the run card as text.
    TensorBoard has no table: samples are not sent (they are in samples.jsonl)."""

    def __init__(self, directory: Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.directory, self._writer_class, self.writer = directory / "tensorboard", SummaryWriter, None

    def start(self, run_name: str, config: dict[str, Any], card: dict[str, Any]) -> None:
        self.writer = self._writer_class(log_dir=str(self.directory))
        self.writer.add_text("config", "    " + json.dumps(config, indent=2).replace("\n", "\n    "))  # indented: a code block
        if card:
            self.writer.add_text("run_card", render_markdown(card))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in scalars(metrics).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # for watching a run live

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        pass

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run in offline mode (`mode="offline"`, never online, no API key), its files in
    `<run>/wandb/offline-run-<time>-<id>/`; the config plus the card under `run_card` as the run's
    config; samples as a `wandb.Table` logged under `samples` at each step."""

    def __init__(self, directory: Path):
        import wandb

        self.wandb, self.directory, self.run = wandb, directory, None

    def start(self, run_name: str, config: dict[str, Any], card: dict[str, Any]) -> None:
        # console off: wandb leaves stdout and stderr alone; create_new: a W&B run the caller has open stays open
        settings = self.wandb.Settings(silent=True, console="off", reinit="create_new")
        self.run = self.wandb.init(mode="offline", dir=str(self.directory), project=PROJECT, name=run_name,
                                   config={**config, "run_card": _without_config(card)}, settings=settings)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(scalars(metrics), step=step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
        self.run.log({"samples": self.wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])}, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    """A trackio run in project `posttrain`, its SQLite store in `<run>/trackio/posttrain.db`. trackio
    reads its store's folder from TRACKIO_DIR once, when first imported, into module constants
    (TRACKIO_DIR, MEDIA_DIR, ARTIFACTS_DIR): the variable is set for that import, and the constants of
    trackio's loaded modules are pointed at this run's folder at `start` (trackio imported earlier, a
    second run in one process). The config plus the card under `run_card` as the run's config;
    samples as a `trackio.Table` under `samples`. trackio prints its progress: sent to this module's
    debug log."""

    def __init__(self, directory: Path):
        self.directory = directory / "trackio"
        previous = os.environ.get("TRACKIO_DIR")
        os.environ["TRACKIO_DIR"] = str(self.directory)
        try:
            import trackio
        finally:
            if previous is None:
                del os.environ["TRACKIO_DIR"]
            else:
                os.environ["TRACKIO_DIR"] = previous
        self.trackio, self.run = trackio, None

    def _point_store_here(self) -> None:
        folders = {"TRACKIO_DIR": self.directory, "MEDIA_DIR": self.directory / "media", "ARTIFACTS_DIR": self.directory / "artifacts"}
        for name, module in list(sys.modules.items()):
            if module is not None and name.split(".")[0] == "trackio":
                for constant, folder in folders.items():
                    if isinstance(getattr(module, constant, None), Path):
                        setattr(module, constant, folder)

    @contextlib.contextmanager
    def _quiet(self):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            yield
        for line in printed.getvalue().splitlines():
            if line.strip():
                logger.debug("trackio: %s", re.sub(r"\x1b\[[0-9;]*m", "", line))

    def start(self, run_name: str, config: dict[str, Any], card: dict[str, Any]) -> None:
        self._point_store_here()
        with self._quiet():
            self.run = self.trackio.init(project=PROJECT, name=run_name, config={**config, "run_card": _without_config(card)},
                                         embed=False, auto_log_gpu=False, auto_log_cpu=False)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(scalars(metrics), step=step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
        self.run.log({"samples": self.trackio.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])}, step=step)

    def close(self) -> None:
        with self._quiet():
            self.trackio.finish()  # the current run, ours: the module's finish also forgets it (no second finish at exit)


def mlflow_name(key: str) -> str:
    """A metric or parameter name as MLflow's file store takes it: `@` becomes `_at_` (MLflow refuses
    it), `/` becomes `.` (the store makes a folder of each `/`, so `tokens_per_second` and
    `tokens_per_second/training` could not both exist), any other character outside
    `[A-Za-z0-9_-. :]` becomes `_`: `heldout/pass@1` -> `heldout.pass_at_1`."""
    return re.sub(r"[^\w\-. :]", "_", key.replace("@", "_at_").replace("/", "."))


def _flatten(value: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(value, dict) and value:
        return {k: v for key, item in value.items() for k, v in _flatten(item, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): value if isinstance(value, str) else json.dumps(value)}


class MlflowTracker:
    """An MLflow run in experiment `posttrain` of the file store `<run>/mlruns` (MLflow's client, no
    server; mlflow-skinny is enough). MLflow keeps that store in maintenance mode and refuses it unless
    MLFLOW_ALLOW_FILE_STORE=true, which this sets, as it sets MLFLOW_DISABLE_TELEMETRY=true. The config
    flattened (`optim.lr`) and the card (`card.links.loss.kl.beta`) as parameters, the card also as
    the artifact run_card.json; names through `mlflow_name` (`heldout.pass_at_1`); samples appended to the table
    artifact samples.json (`mlflow.load_table`)."""

    def __init__(self, directory: Path):
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        self.uri = (directory / "mlruns").absolute().as_uri()
        self._client_class, self._metric, self._param, self.client, self.run_id = MlflowClient, Metric, Param, None, None
        self._limits = MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

    def start(self, run_name: str, config: dict[str, Any], card: dict[str, Any]) -> None:
        self.client = self._client_class(tracking_uri=self.uri)  # creates the store: not before the run directory
        experiment = self.client.get_experiment_by_name(PROJECT)
        experiment_id = experiment.experiment_id if experiment is not None else self.client.create_experiment(PROJECT)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        card = _without_config(card)
        longest, per_batch = self._limits
        flat = {**_flatten(config), **(_flatten(card, "card.") if card else {})}
        params = {mlflow_name(k): v[:longest] for k, v in flat.items()}
        items = [self._param(key, value) for key, value in params.items()]
        for first in range(0, len(items), per_batch):
            self.client.log_batch(self.run_id, params=items[first:first + per_batch])
        if card:
            self.client.log_dict(self.run_id, card, "run_card.json")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        now = int(time.time() * 1000)
        values = [self._metric(mlflow_name(k), float(v), now, step) for k, v in scalars(metrics).items()]
        if values:
            self.client.log_batch(self.run_id, metrics=values)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
        self.client.log_table(self.run_id, {c: [row.get(c) for row in rows] for c in columns}, "samples.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


# name -> (adapter, the module it imports, the pip package that brings it)
TRACKERS = {
    "tensorboard": (TensorBoardTracker, "tensorboard", "tensorboard"),
    "wandb": (WandbTracker, "wandb", "wandb"),
    "trackio": (TrackioTracker, "trackio", "trackio"),
    "mlflow": (MlflowTracker, "mlflow", "mlflow-skinny"),
}


def _missing(name: str) -> UserError:
    _, _, package = TRACKERS[name]
    return UserError(f"report_to: {name} needs the {package} package (pip install {package}, or pip install 'posttrain[trackers]')")


def check_trackers(names: Sequence[str]) -> None:
    """One-line errors for a name that is not a tracker and for a tracker whose package is not
    installed (looked up, not imported: cheap enough for config validation)."""
    for name in names:
        if name not in TRACKERS:
            raise UserError(f"report_to: unknown tracker {name!r} (known: {', '.join(TRACKERS)})")
    for name in names:
        try:
            found = importlib.util.find_spec(TRACKERS[name][1]) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise _missing(name)


def make_trackers(names: Sequence[str], directory: str | Path) -> list:
    """The adapters of `names` for the run in `directory`, packages imported, not yet started."""
    check_trackers(names)
    adapters = []
    for name in names:
        adapter, _, _ = TRACKERS[name]
        try:
            adapters.append(adapter(Path(directory)))
        except ImportError:
            raise _missing(name) from None
    return adapters
