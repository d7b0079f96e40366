"""bench.serve_layouts.step_summary's `top_gaps`: which steps make the slowest 1 % of the inter-token
gaps, per rule of the step log (a step gives each of its decode rows a gap of about its time)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.serve_layouts import step_summary, top_gaps


def _step(ms: float, tokens: int, rows: int, rule: str, waiting: int | None = 0) -> dict[str, Any]:
    return {"ms": ms, "tokens": tokens, "rows": rows, "rule": rule, "waiting": waiting}


def test_the_slowest_steps_weighted_by_their_rows() -> None:
    """1,000 gaps: the 1 % is 10 of them: a 1.3 s burst beside 1 row, then two 150 ms steps of 6 rows
    (12 gaps, the share's edge inside the second), not the 90 ms decode steps."""
    steps = [_step(50.0, 0, 8, "decode")] * 110 + [_step(90.0, 0, 8, "decode")] * 8 + [
        _step(1300.0, 896, 1, "burst", 7), _step(150.0, 64, 6, "fixed", 2), _step(148.0, 64, 6, "fixed", 1)]
    total = sum(s["rows"] for s in steps)
    got = top_gaps(steps)
    assert got["gaps"] == total == 8 * 118 + 13
    assert got["gap_ms"] == 148.0
    assert got["by_rule"] == {
        "burst": {"steps": 1, "gaps": 1, "ms": [1300.0, 1300.0], "tokens": [896, 896], "rows": [1, 1],
                  "waiting": [7, 7]},
        "fixed": {"steps": 2, "gaps": 12, "ms": [148.0, 150.0], "tokens": [64, 64], "rows": [6, 6],
                  "waiting": [1, 2]},
    }


def test_the_summary_reads_old_and_new_step_logs(tmp_path: Path) -> None:
    """Lines of five columns (before the rule was logged) and of seven; lines before `since` left out;
    a prompt step without rows (no gap) is no gap's step."""
    (tmp_path / "steps-1.tsv").write_text(
        "5.0\t999.0\t0\t0\t4\n"  # before since
        "10.0\t40.0\t0\t0\t4\n"
        "10.1\t120.0\t64\t1\t4\tcost\t1\n"
        "10.3\t300.0\t512\t4\t0\tburst\t4\n"
        "10.7\t200.0\t32\t1\t3\n")
    summary = step_summary(tmp_path, since=9.0)
    assert summary["decode_steps"] == 1 and summary["prefill_steps"] == 3
    gaps = summary["top_gaps"]
    assert gaps["gaps"] == 11 and gaps["gap_ms"] == 200.0
    assert gaps["by_rule"]["?"]["gaps"] == 3 and gaps["by_rule"]["?"]["waiting"] is None
