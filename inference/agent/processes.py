"""The worker processes as the operating system and HTTP see them: /health probes, idleness, free ports,
process start times (a pid is a worker's only with its port and start time), signals and log tails.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import psutil

logger = logging.getLogger(__name__)

# Bytes of a worker's log quoted in last_error when it crashes: enough for a Python traceback.
LOG_TAIL_BYTES = 2000
# After SIGKILL a process normally disappears at once; one stuck in the kernel is given up on after this.
KILL_GRACE_S = 5.0
# Slack when comparing a process's start time with the one recorded at launch.
START_TIME_TOLERANCE_S = 0.5


def probe_json(url: str, timeout: float) -> dict[str, Any] | None:
    """GET a worker endpoint; its JSON object, or None on any error or non-200 answer."""
    try:
        response = httpx.get(url, timeout=timeout)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def is_idle(health: Mapping[str, Any]) -> bool:
    """Whether a worker has nothing in flight: no running sequence, nothing queued, no KV block held.

    running == 0 and queue_depth == 0 is the drain condition; kv_usage == 0 is checked too because a
    decode worker's requests that reserved blocks and wait for their prompt KV from a prefill worker
    appear in neither count (the engine's `num_reserved`), yet stopping the worker would fail them.
    """
    try:
        return (
            int(health.get("running", 0)) == 0
            and int(health.get("queue_depth", 0)) == 0
            and float(health.get("kv_usage", 0.0) or 0.0) == 0.0
        )
    except (TypeError, ValueError):
        return False


def port_free(host: str, port: int) -> bool:
    """Whether a worker could bind host:port now (SO_REUSEADDR, as uvicorn binds)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def process_start_time(pid: int) -> float | None:
    """The process's start time in epoch seconds as the OS reports it (None when it is gone)."""
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, OSError):
        return None


def worker_process_matches(pid: int, port: int, started_at: float | None = None) -> bool:
    """Whether `pid` is a live launch_server process serving `port`, started at `started_at` when known.

    All three are checked because a pid alone may have been reused by an unrelated process since the
    worker ran (after a reboot, say); the start time also tells apart a later launch_server on that port.
    """
    return process_mismatch(pid, port, started_at) is None


def process_mismatch(pid: int, port: int, started_at: float | None = None) -> str | None:
    """Why `pid` is not the worker's process (see `worker_process_matches`), or None when it is."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return "the process is a zombie"
        cmdline = proc.cmdline()
        created = proc.create_time()
    except (psutil.Error, OSError) as exc:
        return f"no such process ({type(exc).__name__})"
    # create_time is derived from boot time and clock ticks: equal for one process, to well under this.
    if started_at is not None and abs(created - started_at) > START_TIME_TOLERANCE_S:
        return f"started at {created:.3f}, not {started_at:.3f}"
    if "inference.launch_server" not in cmdline:
        return "not a launch_server process"
    try:
        if cmdline[cmdline.index("--port") + 1] == str(port):
            return None
    except (ValueError, IndexError):
        return "no --port on its command line"
    return f"it serves another port than {port}"


def signal_process(pid: int, sig: int) -> None:
    """Send `sig` to the worker's process group (it leads its own session), else to the process itself."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        logger.warning("no permission to signal pid %s", pid)


def log_tail(path: Path, limit: int = LOG_TAIL_BYTES) -> str:
    """The last `limit` bytes of a log file as text ("" when missing)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def is_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def marked_worker_processes(env_name: str) -> list[tuple[str, psutil.Process]]:
    """Every live launch_server process whose environment holds `env_name`: (its value, the process).

    Processes of other users (their environment is not readable) and zombies are left out.
    """
    found: list[tuple[str, psutil.Process]] = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "inference.launch_server" not in (proc.info.get("cmdline") or []):
                continue
            value = proc.environ().get(env_name)
            if value and proc.status() != psutil.STATUS_ZOMBIE:
                found.append((value, proc))
        except (psutil.Error, OSError):
            continue
    return found


def terminate(proc: psutil.Process, timeout_s: float) -> bool:
    """SIGTERM the process (its group when it leads one), SIGKILL after `timeout_s`; True once it is gone."""
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, KILL_GRACE_S)):
        try:
            if not proc.is_running():  # compares the start time too: a reused pid is not signalled
                return True
            signal_process(proc.pid, sig)
            proc.wait(timeout=wait_s)
            return True
        except psutil.TimeoutExpired:
            continue
        except psutil.Error:
            return True
    return False
