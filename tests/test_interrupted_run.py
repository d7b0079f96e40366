"""An interrupted test run stops the processes it started (tests/support/run_guard.py, reaper.py): a
pytest session of its own (tests/support/interrupted_run_probe.py) starts a real worker and a helper
process, and is then killed with SIGTERM, SIGINT or SIGKILL; within a bounded time neither is left."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.support.interrupted_run_probe import MODEL_ENV, PIDS_ENV

ROOT = Path(__file__).resolve().parents[1]
PROBE = "tests/support/interrupted_run_probe.py"
START_S = 180.0  # the probe's worker: interpreter, torch and the model, on a busy host
SESSION_END_S = 60.0
GONE_S = 30.0  # the reaper's SIGTERM grace is 5 s


def _running(pid: int, created: float) -> bool:
    """Whether that process (not a later one with its pid) still runs (a zombie does not)."""
    try:
        proc = psutil.Process(pid)
        return proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _logs(log: Path) -> str:
    """The probe run's output and its processes' logs (the end of each), for a failure message."""
    paths = [log, *sorted((log.parent / "logs").glob("*.log"))]
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in paths if p.exists())


def _wait_for(path: Path, run: subprocess.Popen[bytes], log: Path) -> dict[str, dict[str, float]]:
    deadline = time.monotonic() + START_S
    while not path.exists():
        assert run.poll() is None, f"the probe run ended ({run.returncode}):\n{_logs(log)}"
        assert time.monotonic() < deadline, f"the probe run started nothing in {START_S}s:\n{_logs(log)}"
        time.sleep(0.2)
    time.sleep(0.1)  # written in one call; let it land
    return json.loads(path.read_text())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_a_killed_test_run_leaves_no_process(sig: signal.Signals, tiny_model_dir: Path, tmp_path: Path) -> None:
    pids_file, log = tmp_path / "pids.json", tmp_path / "probe-run.log"
    # Torch ops: the worker need not wait for a kernel build (what is tested is who stops it).
    env = {**os.environ, MODEL_ENV: str(tiny_model_dir), PIDS_ENV: str(pids_file),
           "TEST_ARTIFACTS": str(tmp_path / "logs"), "INFERENCE_CPU_KERNELS": "0"}
    # SIGINT: started as a non-interactive shell starts a background job, with SIGINT ignored (what the
    # run that left its workers had inherited); the session's own handler must still stop it.
    ignore_sigint = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sig == signal.SIGINT else None
    with open(log, "wb") as out:
        run = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", PROBE], cwd=ROOT, env=env,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=ignore_sigint,
        )
    children: dict[str, dict[str, float]] = {}
    try:
        children = _wait_for(pids_file, run, log)
        assert all(_running(int(c["pid"]), c["created"]) for c in children.values()), children
        killed = time.monotonic()
        run.send_signal(sig)
        run.wait(timeout=SESSION_END_S)
        if sig != signal.SIGKILL:  # the session ended as an interrupted run, not killed by the signal
            assert run.returncode == pytest.ExitCode.INTERRUPTED, (run.returncode, _logs(log))
        deadline = killed + SESSION_END_S + GONE_S
        while any(_running(int(c["pid"]), c["created"]) for c in children.values()):
            assert time.monotonic() < deadline, (children, _logs(log))
            time.sleep(0.2)
    finally:
        run.kill()
        run.wait()
        for child in children.values():  # only on failure: never leave them to the next test
            if _running(int(child["pid"]), child["created"]):
                os.killpg(int(child["pid"]), signal.SIGKILL)
