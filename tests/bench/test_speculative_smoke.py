"""bench/speculative.py and bench/verify_cost.py run in their --quick modes (tiny model) and write
well-formed results: greedy tokens identical with and without speculation, for the learned row
budget and the fixed tile alike, and a step cost for every row count (timings are not checked: the
shared machine's load decides them)."""
from __future__ import annotations

import json
from pathlib import Path

from bench import speculative, verify_cost


def test_speculative_quick(tmp_path: Path, tiny_model_dir: Path) -> None:
    argv = ["--quick", "--out-dir", str(tmp_path), "--model-dir", str(tiny_model_dir), "--levels", "1,2",
            "--ab-tile", "8"]
    assert speculative.main(argv) == 0  # non-zero when greedy tokens differed
    result = json.loads((tmp_path / "speculative_quick.json").read_text())
    assert result["benchmark"] == "speculative_quick" and result["levels"] == [1, 2]
    for name in ("repetitive", "story", "random"):
        for level in ("1", "2"):
            cell = result["results"][name][level]
            assert cell["identical"] is True
            assert len(cell["plain"]) == len(cell["spec"]) == len(cell["tile"]) == 1
            assert cell["ratio_spec"][0] > 0 and cell["ratio_tile"][0] > 0
    assert result["learned_step_ms"]  # the speculative engine timed its steps


def test_verify_cost_quick(tmp_path: Path, tiny_model_dir: Path) -> None:
    argv = ["--quick", "--out-dir", str(tmp_path), "--model-dir", str(tiny_model_dir), "--dtypes", "float32",
            "--seqs", "3", "--k", "2"]
    assert verify_cost.main(argv) == 0
    result = json.loads((tmp_path / "verify_cost_quick.json").read_text())
    (res,) = result["results"]
    assert sorted(int(r) for r in res["verify"]) == list(range(3, 10))  # 3 plain rows up to 3 * (1 + 2)
    assert res["plain_median_ms"] > 0 and all(c["min_ms"] > 0 for c in res["verify"].values())


def test_spread_adds_rows_round_robin() -> None:
    assert verify_cost.spread(5, 3, 2) == [2, 2, 1]
    assert verify_cost.spread(0, 2, 4) == [0, 0]
