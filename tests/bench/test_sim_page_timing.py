"""bench/sim/page_timing.py alone on a kept run's rows (what bench/sim/page_ab.py runs in each tree): the
pages named answer 200 and are timed, with the full collections during the timed requests."""
from __future__ import annotations

import json

import pytest

from bench.sim import page_timing
from tests.support.control_plane import make_deployment, make_node, make_worker

pytestmark = pytest.mark.django_db


def test_pages_of_a_kept_prefix_are_timed(capsys: pytest.CaptureFixture[str]) -> None:
    deployment = make_deployment(name="cpab12-dep")
    make_worker(deployment, make_node(), role="decode")
    page_timing.add_history(deployment)
    names = "admin deployment page,admin workers of the deployment"
    assert page_timing.main(["--prefix", "cpab12", "--repeats", "2", "--pages", names]) == 0
    result = json.loads(capsys.readouterr().out)
    assert sorted(result) == sorted(names.split(","))
    for page in result.values():
        assert page["status"] == 200 and len(page["wall_ms"]) == len(page["cpu_ms"]) == 2
        assert page["p95_ms"] >= page["p50_ms"] > 0 and isinstance(page["full_gc_ms"], list)


def test_unknown_prefix_or_page_is_refused() -> None:
    with pytest.raises(SystemExit):
        page_timing.main(["--prefix", "cpffff"])
    make_deployment(name="cpab13-dep")
    with pytest.raises(SystemExit):
        page_timing.main(["--prefix", "cpab13", "--pages", "no such page"])
