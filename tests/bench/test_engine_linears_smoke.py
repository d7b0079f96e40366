"""bench.engine_linears' kernel columns (the AMX-tile GEMM beside oneDNN where it runs) and bench.engine_ab's
per-side environment flags, in their quick forms (timings are not checked)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import engine_ab, engine_linears


def _amx_here() -> bool:
    from inference.engine.amx_linear import amx_kernel_available
    from inference.engine.cpu_kernels import load_kernels

    return amx_kernel_available(load_kernels())


def test_engine_linears_times_the_amx_column_where_it_runs(tmp_path: Path) -> None:
    """bf16 with --kernels amx: oneDNN and the AMX GEMM per shape and row count, their ratio per row, on a
    CPU with AMX-BF16; elsewhere bf16 is skipped (nothing to compare) and the result has no run."""
    from inference.engine.cpu_kernels import load_kernels

    if load_kernels() is None:
        pytest.skip("CPU kernels unavailable here")
    args = ["--quick", "--out-dir", str(tmp_path), "--dtypes", "bfloat16", "--kernels", "amx"]
    assert engine_linears.main(args) == 0
    result = json.loads((tmp_path / "engine_linears_quick.json").read_text())
    assert result["amx"] == _amx_here()
    if not result["amx"]:
        assert result["runs"] == []
        return
    (run,) = result["runs"]
    assert run["kernels"] == ["onednn", "amx"]
    shapes = [*run["shapes"], "step"]
    assert [(r["rows"], r["shape"]) for r in run["results"]] == [(n, s) for n in (1, 9) for s in shapes]
    for row in run["results"]:
        assert row["onednn_ms"] > 0 and row["amx_ms"] > 0 and "panel_ms" not in row
        assert row["amx_over_onednn"] == pytest.approx(row["amx_ms"] / row["onednn_ms"])


def test_engine_linears_kernels_follow_the_build() -> None:
    """oneDNN always first; the panels where the build has them for the dtype; AMX only for bf16 with it."""
    assert engine_linears.kernels_for("bfloat16", ["panel", "amx"], ["float32x16", "bfloat16"], True) == [
        "onednn", "panel", "amx"]
    assert engine_linears.kernels_for("bfloat16", ["panel", "amx"], ["float32x16"], False) == ["onednn"]
    assert engine_linears.kernels_for("float32", ["panel", "amx"], ["float32x8"], True) == ["onednn", "panel"]
    assert engine_linears.kernels_for("bfloat16", ["amx"], ["float32x16", "bfloat16"], True) == ["onednn", "amx"]


def test_engine_ab_env_flags() -> None:
    """KEY=VALUE per side (a value may hold '='); anything else is a usage error."""
    p = argparse.ArgumentParser()
    assert engine_ab.env_pairs(p, ["INFERENCE_AMX_GEMM=0", "X=a=b"]) == {"INFERENCE_AMX_GEMM": "0", "X": "a=b"}
    assert engine_ab.env_pairs(p, []) == {}
    for bad in ("NOVALUE", "=1"):
        with pytest.raises(SystemExit):
            engine_ab.env_pairs(p, [bad])
