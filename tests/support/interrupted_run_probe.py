"""Run by tests/test_interrupted_run.py as a test session of its own, which that test then kills: starts a
real worker from the main thread (as the fixtures do) and a process from another thread (as the agent's
supervisor does), writes their pids and holds them until the session is killed. Not collected by a plain
`pytest` run (its name does not start with test_)."""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import psutil

from tests.support.processes import Proc, start_worker

MODEL_ENV = "RUN_GUARD_PROBE_MODEL"
PIDS_ENV = "RUN_GUARD_PROBE_PIDS"
HOLD_S = 300.0


def test_hold_processes_until_the_run_is_killed(log_dir: Path) -> None:
    """Both children run; the pids file is the killer's cue."""
    worker, _ = start_worker("decode", Path(os.environ[MODEL_ENV]), log_dir)
    started: list[Proc] = []
    thread = threading.Thread(target=lambda: started.append(
        Proc("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"], log_dir)))
    thread.start()
    thread.join()
    time.sleep(0.5)
    # Started from a thread that has ended: no parent-death signal (it would have fired by now).
    assert started[0].alive(), started[0].log()
    pids = {name: proc.popen.pid for name, proc in (("worker", worker), ("sleeper", started[0]))}
    record = {name: {"pid": pid, "created": psutil.Process(pid).create_time()} for name, pid in pids.items()}
    Path(os.environ[PIDS_ENV]).write_text(json.dumps(record))
    try:
        time.sleep(HOLD_S)
    finally:
        worker.stop()  # the sleeper is left to the session's end and the reaper
