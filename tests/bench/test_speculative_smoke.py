"""bench/speculative.py runs in its --quick mode (tiny model) and writes a well-formed result whose
greedy tokens were identical with and without speculation (timings are not checked: the shared
machine's load decides them)."""
from __future__ import annotations

import json
from pathlib import Path

from bench import speculative


def test_speculative_quick(tmp_path: Path, tiny_model_dir: Path) -> None:
    argv = ["--quick", "--out-dir", str(tmp_path), "--model-dir", str(tiny_model_dir), "--levels", "1,2"]
    assert speculative.main(argv) == 0  # non-zero when greedy tokens differed
    result = json.loads((tmp_path / "speculative_quick.json").read_text())
    assert result["benchmark"] == "speculative_quick" and result["levels"] == [1, 2]
    for name in ("repetitive_c1", "repetitive_c2", "random_c1", "random_c2"):
        cell = result["results"][name]
        assert cell["greedy_identical"] is True and cell["median_ratio"] > 0
