"""The web process's garbage collection settings (config/web_gc.py), in a fresh process as the entry points
set them: what Django's setup left is frozen, the young threshold raised, and what the first requests left
frozen too, once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import gc, json, os
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
import django
django.setup()
from django.core.signals import request_finished
from config import web_gc
before = gc.get_freeze_count()
web_gc.tune_web_gc()
after_setup = gc.get_freeze_count()
threshold = gc.get_threshold()
kept = [[k] for k in range(5000)]  # what a first request leaves alive (compiled templates, caches)
counts = []
for _ in range(web_gc.WARM_UP_REQUESTS + 2):
    request_finished.send(sender=None)
    counts.append(gc.get_freeze_count())
print(json.dumps({"before": before, "after_setup": after_setup, "threshold": threshold, "counts": counts,
                  "warm_up": web_gc.WARM_UP_REQUESTS, "gen0": web_gc.GEN0_THRESHOLD}))
"""


def test_setup_and_warm_up_are_frozen_once() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["before"] == 0 and out["after_setup"] > 50_000  # Django's setup: tens of thousands of objects
    assert out["threshold"][0] == out["gen0"] > 700
    counts, warm_up = out["counts"], out["warm_up"]
    assert all(c == out["after_setup"] for c in counts[: warm_up - 1])  # not before the warm-up ends
    assert counts[warm_up - 1] >= out["after_setup"] + 5000  # the objects the requests left, frozen
    assert counts[warm_up:] == [counts[warm_up - 1]] * (len(counts) - warm_up)  # once only
