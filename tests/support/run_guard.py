"""Pytest hooks (imported by tests/conftest.py) so that an interrupted test run leaves no process behind.

- SIGTERM, SIGHUP and SIGINT end the session like Ctrl-C does (KeyboardInterrupt in the main thread): the
  running test unwinds, fixtures' finalizers stop their workers and pytest reports the run as
  interrupted. SIGINT is handled too because a run started in the background of a non-interactive
  shell inherits SIGINT ignored. A second signal, or cleanup still running after CLEANUP_S, ends the
  process at once (faulthandler prints where it hung); the reaper then stops what is left.
- At the session's end every `Proc` (processes.py) still running is stopped.
- A reaper process (reaper.py) outlives the session's process and stops every process that still
  carries the run's token once it has exited, which covers SIGKILL and crashes. Workers started by
  processes.py also get a parent-death signal. A process a test means to outlive the run must be
  started without `INFERENCE_TEST_RUN` in its environment.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from types import FrameType

import pytest

from tests.support.processes import stop_all
from tests.support.reaper import ENV_TOKEN

ROOT = Path(__file__).resolve().parents[2]
SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
# After the first signal, finalizers get this long before the process ends regardless.
CLEANUP_S = 60.0

_interrupted = False
_reaper: subprocess.Popen[bytes] | None = None  # kept referenced: it runs past this process's end


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """First signal: unwind like Ctrl-C. Second one: leave now (the reaper stops the children)."""
    global _interrupted
    if _interrupted:
        os._exit(128 + signum)
    _interrupted = True
    faulthandler.dump_traceback_later(CLEANUP_S, exit=True)
    raise KeyboardInterrupt(f"{signal.Signals(signum).name} received: stopping the test run")


def install_signal_handlers() -> None:
    """Route SIGTERM/SIGHUP/SIGINT to `_interrupt` (only the main thread may set handlers)."""
    for sig in SIGNALS:
        if signal.getsignal(sig) is not _interrupt:
            signal.signal(sig, _interrupt)


def start_reaper() -> subprocess.Popen[bytes]:
    """Tag this run's future children with a fresh token and start the reaper that watches this process."""
    token = uuid.uuid4().hex
    os.environ[ENV_TOKEN] = token
    env = {key: value for key, value in os.environ.items() if key != ENV_TOKEN}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.reaper", "--pid", str(os.getpid()), "--token", token],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    """Start the reaper and take over the stop signals before any test starts a process."""
    global _reaper
    _reaper = start_reaper()
    install_signal_handlers()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Put the handlers back if an earlier test (an in-process agent, a Celery worker) replaced them."""
    install_signal_handlers()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """After the fixtures' own teardown: stop any started process that a test left running."""
    stop_all()

