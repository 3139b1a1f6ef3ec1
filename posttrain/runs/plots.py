"""Curves from metrics.jsonl as PNG files (matplotlib, no display needed)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from posttrain.atomic import write_atomically  # noqa: E402

logger = logging.getLogger(__name__)


def plot_metric(rows: Sequence[dict[str, Any]], key: str, path: str | Path, title: str | None = None) -> bool:
    """Plot `key` against `step` over the rows that have it; returns False if none do."""
    points = [(row["step"], row[key]) for row in rows if row.get(key) is not None and "step" in row]
    if not points:
        return False
    steps, values = zip(*points)
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.plot(steps, values, marker="o" if len(points) < 30 else None, linewidth=1.5)
    axis.set_xlabel("step")
    axis.set_ylabel(key)
    axis.set_title(title or key)
    axis.grid(alpha=0.3)
    save_figure(figure, path)
    return True


def plot_metrics(rows: Sequence[dict[str, Any]], keys: Sequence[str], plots_dir: str | Path) -> list[Path]:
    """One PNG per metric key present in `rows`, named after the key ('/' becomes '_')."""
    plots_dir = Path(plots_dir)
    plots_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key in keys:
        path = plots_dir / f"{key.replace('/', '_')}.png"
        if plot_metric(rows, key, path):
            written.append(path)
    return written


def plot_sets(rows: Sequence[dict[str, Any]], names: Sequence[str], path: str | Path) -> bool:
    """Every held-out set's `heldout/<name>/pass@1` against `step` in one figure, with its 95%
    interval as a band; returns False if no row has any of them."""
    figure, axis = plt.subplots(figsize=(6, 3.5))
    drawn = False
    for name in names:
        key = f"heldout/{name}/pass@1"
        points = [(row["step"], row[key], row.get(f"{key}_low"), row.get(f"{key}_high")) for row in rows
                  if row.get(key) is not None and "step" in row]
        if not points:
            continue
        steps, values, lows, highs = zip(*points)
        axis.plot(steps, values, marker="o" if len(points) < 30 else None, linewidth=1.5, label=name)
        if all(v is not None for v in lows + highs):
            axis.fill_between(steps, lows, highs, alpha=0.15)
        drawn = True
    if drawn:
        axis.set_xlabel("step")
        axis.set_ylabel("held-out pass@1")
        axis.set_title("held-out sets (95% intervals)")
        axis.set_ylim(-0.02, 1.02)
        axis.grid(alpha=0.3)
        axis.legend()
        save_figure(figure, path)
    else:
        plt.close(figure)
    return drawn


def save_figure(figure, path: str | Path) -> None:
    """Lay out, write (PNG, `atomic.write_atomically`: a failed write leaves the previous PNG as it
    was, no partial one, and is a one-line error) and close `figure`."""
    try:
        figure.tight_layout()
        write_atomically(path, lambda stream: figure.savefig(stream, format="png", dpi=100))
    finally:
        plt.close(figure)
