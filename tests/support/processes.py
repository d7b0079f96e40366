"""Start real worker and router processes for end-to-end tests, and stop them whatever happens.

Each `Proc` leads its own process group (a worker's or router's children are stopped with it), is
stopped when the session ends if a test did not (`stop_all`, run_guard.py), and, when started from the
main thread, gets SIGTERM from the kernel the moment the process that started it dies (a parent-death
signal; SIGKILL of pytest or of a benchmark script included). The signal fires when the *thread* that
forked the child exits, so a child started from another thread goes without it; the run's reaper
(reaper.py) stops those after the run.
"""
from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

from tests.support.ports import allocator

ROOT = Path(__file__).resolve().parents[2]
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_libc = ctypes.CDLL(None, use_errno=True)
_running: set[Proc] = set()


def _die_with(parent: int) -> None:
    """In the child before exec: ask for SIGTERM when the parent dies; if it died already, go now."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen`: the child gets SIGTERM when this process dies, however it
    dies. Only from the main thread, whose exit is the process's (from another thread the child would be
    stopped when that thread ends): None there."""
    if threading.current_thread() is threading.main_thread():
        return functools.partial(_die_with, os.getpid())
    return None


def stop_all() -> None:
    """Stop every `Proc` still running (the session's end: a test that forgot, or was interrupted)."""
    for proc in list(_running):
        proc.stop()


def free_port() -> int:
    """A TCP port nothing listens on right now, reserved for this process: outside the kernel's range for
    "any free" binds (a decode worker's `--kv-port 0` cannot take it before its process binds it) and
    held against other test runs' allocations (tests/support/ports.py)."""
    return allocator().allocate()


class Proc:
    """A child process with its log file; `stop()` terminates it (then kills it) and closes the log."""

    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115  closed in stop()
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = subprocess.Popen(
            args, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
            preexec_fn=die_with_parent(),  # a prctl through ctypes: takes no lock between fork and exec
        )
        _running.add(self)

    def log(self) -> str:
        """Everything the process printed so far."""
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.popen.poll() is None

    def wait_http(self, url: str, timeout: float = 120.0) -> None:
        """Wait until `url` answers 200; fail with the process log if it dies or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready at {url} after {timeout}s:\n{self.log()[-3000:]}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the whole process group (gunicorn has children)."""
        if self.alive():
            os.killpg(self.popen.pid, sig)

    def stop(self) -> None:
        """Terminate, wait a little, then kill."""
        if self.alive():
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=10)
        _running.discard(self)
        self._log.close()


def build_kernels_once() -> None:
    """Build the engine's C++ CPU kernels here before a worker starts: a worker that builds them
    itself (about a minute on a busy machine, while others wait on the build's lock) would not be
    healthy within the wait below. `make test` and `make up` build them first; benchmarks and a
    checkout whose kernels changed land here."""
    from inference.engine.cpu_kernels import load_kernels

    load_kernels()  # cached per process; None (torch ops) where they cannot be built


def start_worker(
    role: str,
    model_dir: Path,
    log_dir: Path,
    *,
    port: int | None = None,
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
    name: str | None = None,
) -> tuple[Proc, str]:
    """Start `python -m inference.launch_server` and wait for /health; returns (process, base URL)."""
    port = port or free_port()
    args = [
        sys.executable, "-m", "inference.launch_server",
        "--model-path", str(model_dir), "--service-type", role, "--port", str(port),
        "--host", "127.0.0.1", "--num-threads", "1", *(extra or []),
    ]
    worker_env = {"CUDA_VISIBLE_DEVICES": "", **(env or {})}
    build_kernels_once()
    proc = Proc(name or f"{role}-{port}", args, log_dir, worker_env)
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + "/health")
    except BaseException:
        proc.stop()
        raise
    return proc, url


def start_parallel(starters: Mapping[str, Callable[[], tuple[Proc, str]]]) -> dict[str, tuple[Proc, str]]:
    """Run every starter (e.g. a `start_worker` call) in a thread of its own, so that the processes load
    their models side by side instead of one after the other; their (process, URL) by name. If any fails
    to start, the others are stopped and the first failure is raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(starters)) as pool:
        futures = {name: pool.submit(start) for name, start in starters.items()}
    started = {name: future.result() for name, future in futures.items() if future.exception() is None}
    if len(started) < len(starters):
        for proc, _url in started.values():
            proc.stop()
        for future in futures.values():
            future.result()  # raises the first failure
    return started


def start_workers(roles: dict[str, str], model_dir: Path, log_dir: Path, *, extra: list[str] | None = None,
                  prefix: str = "w") -> dict[str, tuple[Proc, str]]:
    """Start one worker per `roles` entry (name -> role) in parallel (each takes seconds to load the
    model); their (process, URL) by name. If any fails to start, the others are stopped and it raises."""
    return start_parallel({
        name: functools.partial(start_worker, role, model_dir, log_dir, extra=extra, name=f"{prefix}-{name}")
        for name, role in roles.items()
    })


def start_prefill_and_decode(model_dir: Path, log_dir: Path, common: list[str], max_sequence_length: int,
                             decode_extra: list[str] | None = None) -> tuple[tuple[Proc, str], tuple[Proc, str]]:
    """A prefill and a decode worker started side by side with the `common` flags (the decode worker also
    with `--max-sequence-length` and `decode_extra`): their (process, URL) pairs."""
    started = start_parallel({
        "prefill": functools.partial(start_worker, "prefill", model_dir, log_dir, extra=common),
        "decode": functools.partial(start_worker, "decode", model_dir, log_dir,
                                    extra=[*common, "--max-sequence-length", str(max_sequence_length),
                                           *(decode_extra or [])]),
    })
    return started["prefill"], started["decode"]


def post_json(url: str, body: dict[str, Any], timeout: httpx.Timeout | float = 60.0) -> dict[str, Any]:
    """POST `body` as JSON; the JSON answer, asserting a 200 (the answer's text shown otherwise)."""
    response = httpx.post(url, json=body, timeout=timeout)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def start_router(
    prefill: list[str],
    decode: list[str],
    log_dir: Path,
    *,
    policy: str = "round-robin",
    env: dict[str, str] | None = None,
    port: int | None = None,
    extra: list[str] | None = None,
) -> tuple[Proc, str]:
    """Start `python -m inference.launch_router` (gunicorn + uvicorn) and wait for /health."""
    port = port or free_port()
    args = [sys.executable, "-m", "inference.launch_router", "--listen-port", str(port), "--host", "127.0.0.1",
            "--load-balance-strategy", policy, *(extra or [])]
    for url in prefill:
        args += ["--prefill-endpoint", url]
    for url in decode:
        args += ["--decode-endpoint", url]
    proc = Proc(f"router-{port}", args, log_dir, env)
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + "/health", timeout=60)
    except BaseException:
        proc.stop()
        raise
    return proc, url


class NotReady(RuntimeError):
    """A condition the processes did not reach in time (the message names it and quotes the logs)."""


def wait_until(what: str, check: Callable[[], object], timeout: float, watch: list[Proc],
               logs_of: list[Proc] | None = None, interval: float = 0.5) -> object:
    """Poll `check()` until it returns something truthy and return that; NotReady as soon as a process of
    `watch` exits, or at `timeout`, with the logs of `logs_of` (default: `watch`). HTTP errors and
    missing keys count as "not yet". Bounded by `timeout`."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            last = exc
        else:
            if last:
                return last
        for proc in watch:
            if not proc.alive():
                raise NotReady(f"{proc.name} exited ({proc.popen.returncode}) while waiting for {what}:\n"
                               f"{proc.log()[-4000:]}")
        time.sleep(interval)
    logs = "\n".join(f"--- {p.name} ---\n{p.log()[-2500:]}" for p in (logs_of if logs_of is not None else watch))
    raise NotReady(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})\n{logs}")
