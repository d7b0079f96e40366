"""The test run's reaper: a small process started by the test session (run_guard.py) that waits for the
session's process to end, however it ends (a clean exit, SIGTERM, SIGKILL, a crash), and then stops
every process the run left behind.

The run's processes are recognised by a token in their environment (`INFERENCE_TEST_RUN`): the session
puts it into its own environment before the first test, so every worker, router, agent or helper that a
test starts inherits it (and their own children too), whichever helper started it and from whichever
thread. Each one found is sent SIGTERM, then SIGKILL after a grace period. The reaper runs in its own
session, so a Ctrl-C in the terminal or a signal to the run's process group does not stop it first.

    python -m tests.support.reaper --pid <session pid> --token <token>
"""
from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time

import psutil

ENV_TOKEN = "INFERENCE_TEST_RUN"
GRACE_S = 5.0
# Rounds of find-and-stop: a process being stopped may start another (a supervisor restarting a worker).
ROUNDS = 3


def wait_for_exit(pid: int) -> None:
    """Return once process `pid` has exited (at once when it is already gone)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:  # no pidfd (old kernel): poll
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.5)
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


def leftovers(token: str) -> list[psutil.Process]:
    """The live processes whose environment carries this run's token (not this reaper)."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(ENV_TOKEN) == token:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue  # gone, someone else's, or dead and only waiting to be reaped
    return found


def describe(proc: psutil.Process) -> str:
    """`pid command line` for the report, shortened."""
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:120]}"
    except psutil.Error:
        return str(proc.pid)


def stop(procs: list[psutil.Process], grace_s: float = GRACE_S) -> None:
    """SIGTERM each, then SIGKILL what is still running after `grace_s`."""
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


def report(line: str) -> None:
    """One line on stderr (the run's terminal or log); a closed stderr must not stop the sweep."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def sweep(token: str, grace_s: float = GRACE_S) -> int:
    """Stop every process of the run still running; how many there were."""
    stopped = 0
    for _ in range(ROUNDS):
        procs = leftovers(token)
        if not procs:
            break
        report(f"test-run reaper: stopping {len(procs)} process(es) the test run left: "
               + "; ".join(describe(p) for p in procs))
        stop(procs, grace_s)
        stopped += len(procs)
    return stopped


def main(argv: list[str] | None = None) -> int:
    """Wait for the session's process, then sweep."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pid", type=int, required=True, help="the test session's process")
    parser.add_argument("--token", required=True, help=f"the run's {ENV_TOKEN} value")
    parser.add_argument("--grace", type=float, default=GRACE_S, help="seconds between SIGTERM and SIGKILL")
    args = parser.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only the session's end stops the reaper
    wait_for_exit(args.pid)
    sweep(args.token, args.grace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
