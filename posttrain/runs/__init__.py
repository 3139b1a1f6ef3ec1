"""The run directory: resolved config, run card, metrics, samples, checkpoints, plots."""

from posttrain.runs.card import new_card, write_run_card
from posttrain.runs.checkpoint import (
    latest_checkpoint,
    load_trainer_state,
    rng_state,
    set_rng_state,
    verify_checkpoint,
    write_step_checkpoint,
)
from posttrain.runs.directory import RunDirectory, read_jsonl
from posttrain.runs.plots import plot_metrics

__all__ = [
    "RunDirectory",
    "latest_checkpoint",
    "load_trainer_state",
    "new_card",
    "plot_metrics",
    "read_jsonl",
    "rng_state",
    "set_rng_state",
    "verify_checkpoint",
    "write_run_card",
    "write_step_checkpoint",
]
