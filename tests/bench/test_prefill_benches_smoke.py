"""bench.prefill_cached and bench.mixed_prefill run in their --quick mode (tiny model) and write
well-formed results (timings are not checked: they are measured as ratios within one full run)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from bench import mixed_prefill, prefill_cached


def test_prefill_cached_quick(tmp_path: Path, tiny_model_dir: Path) -> None:
    argv = ["--quick", "--out-dir", str(tmp_path), "--model-dir", str(tiny_model_dir)]
    assert prefill_cached.main(argv) == 0
    result = json.loads((tmp_path / "prefill_cached_quick.json").read_text())
    # bf16 measured with torch's SDPA and with the GEMM attention, fp32 with SDPA.
    assert {"bfloat16 sdpa", "bfloat16 gemm", "float32 sdpa"} <= set(result)
    for key in ("bfloat16 sdpa", "bfloat16 gemm", "float32 sdpa"):
        rows = result[key]
        assert [name for name, *_ in prefill_cached.CASES] == list(rows)
        assert all(math.isfinite(r["forward_ms"]) and r["forward_ms"] > 0 for r in rows.values())
        assert all(r["over_bound"] > 0 for name, r in rows.items() if "cached" in name)


def test_mixed_prefill_quick(tmp_path: Path, tiny_model_dir: Path) -> None:
    argv = ["--quick", "--out-dir", str(tmp_path), "--model-dir", str(tiny_model_dir)]
    assert mixed_prefill.main(argv) == 0
    result = json.loads((tmp_path / "mixed_prefill_quick.json").read_text())
    for name, *_ in mixed_prefill.WORKLOADS:
        assert set(result[name]) == {"alternating", "mixed", "mixed-128"}
        assert all(r["tok_per_s"] > 0 and r["ttft_p50_ms"] > 0 for r in result[name].values())
