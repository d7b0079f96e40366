"""The run's picture: latency over time on top, TTFT and inter-token latency histograms below."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from inference.tools.load_test.records import RequestRecord
from inference.tools.load_test.report import summarize, summary_line


def _histogram(ax: Any, values: list[float], name: str) -> None:
    """A latency histogram (ms) with its p50 and p99 marked, or "no data"."""
    if values:
        ax.hist(values, bins=min(50, max(5, len(values) // 5)), color="tab:blue", alpha=0.8)
        p50, p99 = np.percentile(values, [50, 99])
        ax.axvline(float(p50), color="black", linestyle="--", label=f"p50 {p50:.1f} ms")
        ax.axvline(float(p99), color="red", linestyle=":", label=f"p99 {p99:.1f} ms")
        ax.legend(loc="upper right")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(name)
    ax.set_xlabel("ms")
    ax.set_ylabel("count")


def plot_metrics(
    records: Sequence[RequestRecord],
    path: str | Path,
    summary: dict[str, Any] | None = None,
    title: str | None = None,
) -> None:
    """Save a PNG: latency over time (scatter) on top, TTFT and ITL histograms below."""
    # The object-oriented API with an explicit Agg canvas: no pyplot global state, no display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    summary = summary or summarize(records)
    fig = Figure(figsize=(12, 8), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 2)
    ax_time = fig.add_subplot(grid[0, :])
    ax_ttft = fig.add_subplot(grid[1, 0])
    ax_itl = fig.add_subplot(grid[1, 1])

    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    ax_time.scatter(
        [r.start_s for r in ok], [(r.e2e_s or 0.0) * 1000 for r in ok], s=8, alpha=0.6, label="end-to-end"
    )
    with_ttft = [r for r in ok if r.ttft_s is not None]
    ax_time.scatter(
        [r.start_s for r in with_ttft],
        [(r.ttft_s or 0.0) * 1000 for r in with_ttft],
        s=8,
        alpha=0.6,
        label="TTFT",
    )
    if failed:
        ax_time.scatter(
            [r.start_s for r in failed],
            [(r.e2e_s or 0.0) * 1000 for r in failed],
            s=14,
            marker="x",
            color="red",
            label="error",
        )
    ax_time.set_xlabel("request start (s since run start)")
    ax_time.set_ylabel("latency (ms)")
    ax_time.set_title("Latency over time")
    ax_time.grid(True, alpha=0.3)
    if records:
        ax_time.legend(loc="upper right")

    _histogram(ax_ttft, [r.ttft_s * 1000 for r in with_ttft if r.ttft_s is not None], "TTFT")
    _histogram(ax_itl, [itl * 1000 for r in ok for itl in r.itls_s], "Inter-token latency")

    heading = f"{title}\n" if title else ""
    fig.suptitle(heading + summary_line(summary), fontsize=11)
    fig.savefig(str(path), dpi=100)
