"""The control-plane harness (bench/sim/control_plane.py) in its --quick mode: simulated agents register
nodes and run the workers the real controller places, the collector scrapes them, the sample history
is rolled up and sized, and the admin and REST pages answer; the result is well formed (timings are
not checked: they are measured by the full mode, as ratios and figures under a recorded load)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

from tests.support.processes import ROOT

HARNESS_TIMEOUT_S = 300


def _database_url() -> str:
    """The test database (migrated by pytest-django) as a URL the harness's processes can use."""
    cfg = connection.settings_dict
    auth = cfg["USER"] + (f":{cfg['PASSWORD']}" if cfg.get("PASSWORD") else "")
    return f"postgres://{auth}@{cfg['HOST'] or '127.0.0.1'}:{cfg['PORT'] or 5432}/{cfg['NAME']}"


@pytest.mark.django_db(transaction=True)
def test_quick_harness_writes_a_well_formed_result(tmp_path: Path, log_dir: Path) -> None:
    if connection.vendor != "postgresql" or not os.environ.get("REDIS_URL"):
        pytest.skip("the harness needs PostgreSQL and Redis (DATABASE_URL, REDIS_URL)")
    env = {**os.environ, "DATABASE_URL": _database_url(), "PYTHONUNBUFFERED": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "bench.sim.control_plane", "--quick", "--out-dir", str(tmp_path),
         "--log-dir", str(log_dir / "sim-control-plane")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=HARNESS_TIMEOUT_S,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    result = json.loads((tmp_path / "sim_control_plane.json").read_text())
    (size,) = result["sizes"]
    assert (size["nodes"], size["workers"], size["step"]) == (3, 12, 4)
    scale = size["scale"]
    # The new workers were placed after the decision and all ran (their event's time to run is filled).
    assert 0 < scale["decision_to_all_placed_s"] and scale["decision_to_all_running_s"] > 0
    rounds = size["collector"]["rounds"]
    assert len(rounds) == 2 and all(r["statements"] > 0 for r in rounds)
    assert all(r["db_s"] >= r["write_s"] > 0 for r in rounds)  # each round wrote its samples
    ab = size["collector"]["client_ab"]
    assert ab["client_per_scrape_failed"] == 0 and ab["shared_client_failed"] == 0  # every simulated worker answered
    queue = size["queue_latency"]
    for phase in ("idle", "loaded"):  # every probe went through the controller's queue and was done
        assert queue[phase]["probes"] > 0 and queue[phase]["not_done"] == 0 and queue[phase]["p95_s"] > 0
    assert queue["loaded"]["periodic_sent"]["inference.tasks.collect_metrics"] >= 1
    assert not queue["idle"]["periodic_sent"]
    db = size["database"]
    assert db["workers"] == 12 and db["loaded"]["raw_rows"] > 0 and db["downsample"]["minute_rollups"] > 0
    assert db["bytes_per_row"]["raw"] > 0 and db["bytes_per_row"]["rollup"] > 0
    # A day kept as rollups is smaller than a day kept raw: 1,464 rows a worker instead of 17,280.
    assert db["per_day"]["default_gb"] < db["per_day"]["raw_only_gb"]
    assert {name: page["status"] for name, page in size["pages"].items()} == dict.fromkeys(size["pages"], 200)
