"""bench.soak --quick: the managed platform under mixed traffic while its seeded schedule injects faults;
the run loses no request, leaks no KV block, leaves no process and writes a well-formed result."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_soak_quick(tmp_path: Path, tiny_model_dir: Path) -> None:
    from bench import soak

    assert soak.main(["--quick", "--model-dir", str(tiny_model_dir), "--out-dir", str(tmp_path),
                      "--log-dir", str(tmp_path / "logs")]) == 0
    result = json.loads((tmp_path / "soak_quick.json").read_text())
    assert result["command"].startswith("python -m bench.soak") or "bench.soak" in result["command"]
    assert result["machine"]["cpus"] >= 1 and "load_avg_at_end" in result["machine"]
    assert result["requests"] >= 10, result
    assert set(result["requests_by_kind"]) <= set(soak.KINDS)
    # The schedule injected at least one fault, and the platform was whole again after each.
    assert result["faults"], result
    assert result["faults_not_repaired"] == 0, result["faults"]
    assert result["lost"] == 0, result["error_samples"]
    assert result["ok"] + sum(result["errors_by_kind"].values()) == result["requests"]
    assert result["leaked_kv_blocks"] == 0, result["kv_blocks_held_when_idle"]
    assert result["kv_blocks_held_when_idle"], "no worker's /health was read"
    assert result["leftover_processes"] == 0
    assert result["ttft_p99_ms_outside_faults"] is not None
