"""bench/structured_cost.py runs in its --quick mode and writes a well-formed result (timings are not
checked: the shared machine's load decides them)."""
from __future__ import annotations

import json
from pathlib import Path

from bench import structured_cost


def test_structured_cost_quick(tmp_path: Path) -> None:
    assert structured_cost.main(["--quick", "--out-dir", str(tmp_path), "--img-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "structured_cost_quick.json").read_text())
    assert result["benchmark"] == "structured_cost_quick"
    decode = result["decode"]
    assert decode["ratio"] > 0 and all(v > 0 for v in decode["tokens_per_cpu_s"].values())
    assert decode["steps_measured"]["unconstrained"] > 0 and decode["steps_measured"]["json_schema"] > 0
    assert result["libraries"]["tiny"]["llguidance"]["mask_us"] > 0
