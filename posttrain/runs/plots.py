"""Curves from metrics.jsonl as PNG files (matplotlib, no display needed)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

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
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
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
