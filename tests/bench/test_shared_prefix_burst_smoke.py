"""bench.shared_prefix_burst runs in its --quick mode (tiny model): the scheduler's shared-prefix wait
serves every prompt of the burst but the first from the prefix cache, and without it none."""
from __future__ import annotations

import json
from pathlib import Path

from bench import shared_prefix_burst


def test_shared_prefix_burst_quick(tmp_path: Path, tiny_model_dir: Path) -> None:
    argv = ["--quick", "--out-dir", str(tmp_path), "--model-dir", str(tiny_model_dir)]
    assert shared_prefix_burst.main(argv) == 0
    result = json.loads((tmp_path / "shared_prefix_burst_quick.json").read_text())
    burst, prefix = result["burst"], result["prefix"]
    (wait,) = result["rounds"]["wait"]
    (no_wait,) = result["rounds"]["no-wait"]
    assert wait["prefix_hit_tokens"] == (burst - 1) * prefix and wait["shared_prefix_waits"] >= 1
    assert no_wait["prefix_hit_tokens"] == 0 and no_wait["shared_prefix_waits"] == 0
    assert wait["tok_per_s"] > 0 and no_wait["ttft_p50_ms"] > 0
