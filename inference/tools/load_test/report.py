"""Aggregating request records: the summary dict, its text table and the per-request CSV."""

from __future__ import annotations

import csv
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from inference.tools.load_test.records import RequestRecord

#: CSV columns written by :func:`write_metrics_csv`, one row per request.
CSV_COLUMNS: tuple[str, ...] = (
    "index",
    "start_s",
    "status",
    "http_status",
    "ttft_s",
    "e2e_s",
    "output_tokens",
    "prompt_tokens",
    "itl_mean_s",
    "error",
)


def _stats_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean/p50/p90/p99/min/max in milliseconds (``None`` values when there is no data)."""
    if not values_s:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "min": None, "max": None}
    arr = np.asarray(values_s, dtype=float) * 1000.0
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {
        "mean": float(arr.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "min": float(arr.min()),
        "max": float(arr.max()),
    }


def summarize(records: Sequence[RequestRecord], duration_s: float | None = None) -> dict[str, Any]:
    """Aggregate request records into a JSON-safe summary dict.

    ``duration_s`` is the wall time of the run; when omitted it is the span from the first
    request start to the last request end. Throughputs count successful requests only.
    Latencies (``ttft_ms``, ``itl_ms``, ``e2e_ms``) are dicts with ``mean``, ``p50``, ``p90``,
    ``p99``, ``min``, ``max`` in milliseconds, over successful requests (ITL over all tokens).
    """
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    if duration_s is None:
        if records:
            first = min(r.start_s for r in records)
            last = max(r.start_s + (r.e2e_s or 0.0) for r in records)
            duration_s = last - first
        else:
            duration_s = 0.0
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_counts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    kinds = Counter(r.error_kind or "unknown" for r in failed)
    examples: dict[str, str] = {}
    for r in failed:
        examples.setdefault(r.error_kind or "unknown", r.error or "")
    per_s = (lambda n: n / duration_s) if duration_s and duration_s > 0 else (lambda n: 0.0)
    return {
        "duration_s": duration_s,
        "requests": len(records),
        "ok": len(ok),
        "errors": len(failed),
        "error_kinds": dict(kinds.most_common()),
        "error_examples": examples,
        "requests_per_s": per_s(len(ok)),
        "output_tokens": output_tokens,
        "output_tokens_per_s": per_s(output_tokens),
        "prompt_tokens": sum(prompt_counts) if prompt_counts else None,
        "mean_output_tokens": output_tokens / len(ok) if ok else None,
        "ttft_ms": _stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": _stats_ms([itl for r in ok for itl in r.itls_s]),
        "e2e_ms": _stats_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
    }


def _fmt(value: float | None, digits: int = 1) -> str:
    """A number for the table, or "-" when there is no data."""
    return "-" if value is None else f"{value:.{digits}f}"


def format_summary(summary: dict[str, Any], title: str | None = None) -> str:
    """Render a :func:`summarize` dict as a readable text table."""
    lines: list[str] = []
    if title:
        lines.append(title)
    lines.append(f"  {'Duration':<22}{summary['duration_s']:.2f} s")
    lines.append(
        f"  {'Requests':<22}{summary['requests']} total, {summary['ok']} ok, {summary['errors']} errors"
    )
    for kind, count in summary["error_kinds"].items():
        example = summary["error_examples"].get(kind, "")
        lines.append(f"  {'':<24}{kind}: {count}  (e.g. {example})")
    lines.append(f"  {'Request throughput':<22}{summary['requests_per_s']:.2f} req/s")
    lines.append(f"  {'Output throughput':<22}{summary['output_tokens_per_s']:.1f} tok/s")
    lines.append(
        f"  {'Output tokens':<22}{summary['output_tokens']} total, "
        f"{_fmt(summary['mean_output_tokens'])} per request"
    )
    if summary["prompt_tokens"] is not None:
        lines.append(f"  {'Prompt tokens':<22}{summary['prompt_tokens']} total")
    lines.append("")
    lines.append(f"  {'Latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for label, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("End-to-end", "e2e_ms")):
        s = summary[key]
        lines.append(
            f"  {label:<14}{_fmt(s['mean']):>10}{_fmt(s['p50']):>10}{_fmt(s['p90']):>10}{_fmt(s['p99']):>10}"
        )
    return "\n".join(lines)


def _csv_float(value: float | None) -> str:
    """A CSV cell: microsecond precision, empty when unknown."""
    return "" if value is None else f"{value:.6f}"


def write_metrics_csv(records: Sequence[RequestRecord], path: str | Path) -> None:
    """Write one CSV row per request with the columns in :data:`CSV_COLUMNS`."""
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(CSV_COLUMNS)
        for r in records:
            error = f"{r.error_kind}: {r.error}" if r.error_kind else ""
            writer.writerow(
                [
                    r.index,
                    _csv_float(r.start_s),
                    r.status,
                    "" if r.http_status is None else r.http_status,
                    _csv_float(r.ttft_s),
                    _csv_float(r.e2e_s),
                    r.output_tokens,
                    "" if r.prompt_tokens is None else r.prompt_tokens,
                    _csv_float(r.itl_mean_s),
                    error,
                ]
            )


def summary_line(summary: dict[str, Any]) -> str:
    """Two lines with the headline numbers (the plot's caption)."""
    return (
        f"{summary['ok']} ok / {summary['errors']} errors in {summary['duration_s']:.1f} s, "
        f"{summary['requests_per_s']:.2f} req/s, {summary['output_tokens_per_s']:.1f} tok/s\n"
        f"TTFT p50 {_fmt(summary['ttft_ms']['p50'])} ms, "
        f"ITL p50 {_fmt(summary['itl_ms']['p50'], 2)} ms, "
        f"E2E p50 {_fmt(summary['e2e_ms']['p50'])} / p99 {_fmt(summary['e2e_ms']['p99'])} ms"
    )
