"""The router's process tree with an acceptor: `python -m inference.launch_router` runs this.

    launch_router (the acceptor: listening socket, /health, hand-over)   <- systemd's main PID
      └─ gunicorn arbiter (same command, ROUTER_ACCEPTOR_SOCKET set)     <- restarts router processes
           └─ router processes (uvicorn workers), each linked to the acceptor

The acceptor binds the public port itself and starts gunicorn as its child on a private Unix socket
(in a 0700 directory, with the control socket), so that only the acceptor accepts from the network.
Signals for gunicorn (HUP reload, TERM/INT/QUIT stop, TTIN/TTOU, USR1/USR2, WINCH) are forwarded
to the arbiter; on a stop the acceptor first closes its listening socket, so new connections are
refused at once while accepted requests finish. The three levels end together: the acceptor exits
when the arbiter does (with its status); the arbiter gets SIGTERM when the acceptor dies (a
parent-death signal) and each router process stops when its link to the acceptor breaks.

Where it may (root or CAP_SYS_NICE), the acceptor runs `ROUTER_ACCEPTOR_PRIORITY` (5) nice levels
ahead of the router processes, so that on busy CPUs a probe waits less for it to be scheduled.

Django-free: the acceptor imports nothing of the platform but the gateway's acceptor modules.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import glob
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence

from inference.gateway.acceptor import Acceptor
from inference.gateway.acceptor_protocol import ACCEPTOR_ENV

logger = logging.getLogger(__name__)

_STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
_FORWARDED = (*_STOPS, signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGUSR1, signal.SIGUSR2,
              signal.SIGWINCH)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_BACKLOG = 2048  # gunicorn's default listen backlog
_DIR_PREFIX = "disagg-router-"


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment; SystemExit naming the variable otherwise."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise SystemExit(f"{name}={text!r} is not a number of seconds") from None
    if not 0 < value <= 3600:
        raise SystemExit(f"{name}={text!r} must be > 0 and <= 3600 seconds")
    return value


def bind_listener(host: str, port: int) -> socket.socket:
    """The public listening socket (IPv4 or IPv6 by the host's form); SystemExit when it cannot bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port} (--host/--listen-port): {exc.strerror}") from None
    if hasattr(socket, "TCP_DEFER_ACCEPT"):
        # Woken only once a connection's first bytes are there (clients send at once; a silent one is
        # accepted after about a second anyway): one wake-up per connection instead of two.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 1)
    sock.listen(_BACKLOG)
    return sock


def remove_dead_dirs(root: str | None = None) -> int:
    """Remove the private directories of acceptors that died without cleaning up (SIGKILL): those of
    this user whose control socket nobody listens on any more, left alone for a minute at least (a
    starting acceptor's is fresh and may not listen yet). Returns how many went."""
    removed = 0
    now = time.time()
    for path in glob.glob(os.path.join(root or tempfile.gettempdir(), _DIR_PREFIX + "*")):
        control = os.path.join(path, "acceptor.sock")
        try:
            info = os.stat(path)
            if info.st_uid != os.getuid() or now - info.st_mtime < 60:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
                probe.connect(control)
            continue  # a live acceptor
        except (ConnectionRefusedError, FileNotFoundError):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
        except OSError:
            continue
    return removed


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop where installed (as uvicorn's "auto" picks), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def raise_priority(steps: int) -> None:
    """Run this process `steps` nice levels ahead of the router's (root or CAP_SYS_NICE only): with
    every CPU busy, a probe then waits less for the acceptor to be scheduled. Called after gunicorn
    started, so that the router processes keep the launcher's priority."""
    if steps <= 0:
        return
    current = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, max(-20, current - steps))
    except PermissionError:
        logger.info("acceptor at the router's priority (nice %d): raising it needs root or CAP_SYS_NICE", current)
        return
    logger.info("acceptor at nice %d, the router processes at %d", os.getpriority(os.PRIO_PROCESS, 0), current)


def _env_steps(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit() or int(text) > 20:
        raise SystemExit(f"{name}={text!r} must be a whole number of nice levels from 0 to 20")
    return int(text)


def _die_with_acceptor() -> None:
    """In gunicorn's process before exec: SIGTERM when the acceptor dies, however it dies."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def serve(host: str, port: int, child_argv: Sequence[str]) -> int:
    """Bind, start gunicorn (`child_argv`, run with ROUTER_ACCEPTOR_SOCKET and a private bind) and
    run the acceptor until gunicorn exits; returns the exit status."""
    listener = bind_listener(host, port)
    remove_dead_dirs()
    private = tempfile.mkdtemp(prefix=_DIR_PREFIX)  # 0700: only this user reaches the sockets
    try:
        control_path = os.path.join(private, "acceptor.sock")
        control = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        control.bind(control_path)
        control.listen(256)
        env = {**os.environ, ACCEPTOR_ENV: control_path, "ROUTER_BIND": f"unix:{private}/gunicorn.sock"}
        priority = _env_steps("ROUTER_ACCEPTOR_PRIORITY", 5)
        child = subprocess.Popen(list(child_argv), env=env, preexec_fn=_die_with_acceptor)
        raise_priority(priority)
        try:
            with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                return runner.run(_run(listener, control, child))
        finally:
            if child.poll() is None:  # the acceptor is ending abnormally: take gunicorn down with it
                child.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=40)  # its graceful stop; past that it goes on its own
    finally:
        listener.close()
        shutil.rmtree(private, ignore_errors=True)


async def _run(listener: socket.socket, control: socket.socket, child: subprocess.Popen[bytes]) -> int:
    loop = asyncio.get_running_loop()
    acceptor = Acceptor(listener, control, head_wait_s=env_seconds("ROUTER_HEAD_WAIT_S", 1.0),
                        stale_s=env_seconds("ROUTER_HEALTH_STALE_S", 2.0),
                        handoff_wait_s=env_seconds("ROUTER_HANDOFF_WAIT_S", 30.0))
    acceptor.start()
    exited = loop.create_future()
    pidfd = os.pidfd_open(child.pid)

    def on_exit() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(pidfd, on_exit)

    def forward(sig: signal.Signals) -> None:
        if sig in _STOPS:
            acceptor.stop_listening()  # refuse new connections now; accepted ones finish in gunicorn
        if child.poll() is None:
            child.send_signal(sig)

    for sig in _FORWARDED:
        loop.add_signal_handler(sig, forward, sig)
    try:
        await exited
    finally:
        for sig in _FORWARDED:
            loop.remove_signal_handler(sig)
        loop.remove_reader(pidfd)
        os.close(pidfd)
        acceptor.close()
    code = child.wait()
    if code:
        logger.warning("gunicorn exited with status %s", code)
    return 128 - code if code < 0 else code


def is_child() -> bool:
    """Whether this process is the acceptor's gunicorn (not the acceptor itself)."""
    return bool(os.environ.get(ACCEPTOR_ENV))
