"""A Redis server and a PostgreSQL cluster of one's own, for tests and benchmarks that restart them.

The machine's shared Redis (6379) and PostgreSQL (5432) serve every other test run, so a fault drill
never touches them: `PrivateRedis` runs `redis-server` on a free port (no persistence, like a broker
that lost its data on restart), `PrivatePostgres` an `initdb` cluster in a temporary folder, run as
the `postgres` user when this process is root (PostgreSQL refuses root). Both are `Proc`s (process
group, parent-death signal, stopped at the session's end if the caller did not), and `restart()`
stops and starts the same server on the same port, which is the fault the drills inject.
"""
from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support.processes import Proc, free_port

PG_BIN_ROOT = Path("/usr/lib/postgresql")


class ServiceUnavailable(RuntimeError):
    """The server binary is missing on this machine (the caller skips)."""


def _wait_port(port: int, proc: Proc, timeout: float) -> None:
    """Wait until 127.0.0.1:`port` accepts connections; RuntimeError with the log otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.log()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{proc.name} not listening on {port} after {timeout}s:\n{proc.log()[-2000:]}")


class PrivateRedis:
    """`redis-server` on a free port of 127.0.0.1, without persistence (a restart loses its queues)."""

    def __init__(self, log_dir: Path, name: str = "redis") -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ServiceUnavailable("redis-server is not installed")
        self.binary = binary
        self.log_dir = log_dir
        self.name = name
        self.port = free_port()
        self.starts = 0
        self.proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.starts += 1
        self.proc = Proc(f"{self.name}-{self.starts}", [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--daemonize", "no"], self.log_dir)
        _wait_port(self.port, self.proc, 20)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the server (SIGKILL: as if it crashed); waits until it is gone."""
        if self.proc is not None:
            if sig != signal.SIGTERM:
                self.proc.kill(sig)
            self.proc.stop()

    def restart(self, down_s: float = 0.0, sig: int = signal.SIGTERM) -> None:
        """Stop, stay down `down_s` seconds, start again on the same port (empty: no persistence)."""
        self.stop(sig)
        time.sleep(down_s)
        self.start()


def _pg_bin() -> Path:
    versions = sorted(PG_BIN_ROOT.glob("*/bin/postgres"), key=lambda p: int(p.parent.parent.name)
                      if p.parent.parent.name.isdigit() else 0)
    if not versions:
        raise ServiceUnavailable(f"no PostgreSQL server under {PG_BIN_ROOT}")
    return versions[-1].parent


class PrivatePostgres:
    """A throw-away PostgreSQL cluster (trust authentication, fsync off) on a free port of 127.0.0.1."""

    def __init__(self, log_dir: Path, name: str = "postgres") -> None:
        self.bin = _pg_bin()
        self.log_dir = log_dir
        self.name = name
        self.port = free_port()
        self.starts = 0
        self.proc: Proc | None = None
        # Outside pytest's tmp_path: that folder is private to root, and the server runs as postgres.
        self.dir = Path(tempfile.mkdtemp(prefix="private-pg-"))
        self._as_postgres: list[str] = []
        if os.geteuid() == 0:
            account = pwd.getpwnam("postgres")
            os.chown(self.dir, account.pw_uid, account.pw_gid)
            self._as_postgres = ["setpriv", "--reuid", "postgres", "--regid", "postgres", "--init-groups", "--"]
        subprocess.run([*self._as_postgres, str(self.bin / "initdb"), "-D", str(self.dir / "data"), "-A", "trust",
                        "-U", "postgres", "--no-sync", "-E", "UTF8"], check=True, capture_output=True, timeout=120)

    def url(self, database: str = "postgres") -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        self.starts += 1
        # The server leads its process group, so Proc's killpg reaches its backends too.
        self.proc = Proc(f"{self.name}-{self.starts}", [
            *self._as_postgres, str(self.bin / "postgres"), "-D", str(self.dir / "data"), "-p", str(self.port),
            "-k", str(self.dir), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=200",
        ], self.log_dir)
        _wait_port(self.port, self.proc, 60)
        self._wait_accepting(60)

    def _wait_accepting(self, timeout: float) -> None:
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.url(), connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self, sig: int = signal.SIGINT) -> None:
        """Stop the server: SIGINT is PostgreSQL's fast shutdown (clients are disconnected), SIGKILL a crash."""
        proc = self.proc
        if proc is None or not proc.alive():
            return
        os.kill(proc.popen.pid, sig) if sig != signal.SIGKILL else proc.kill(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=30)
        proc.stop()  # whatever is left of the group, and the log

    def restart(self, down_s: float = 0.0, sig: int = signal.SIGINT) -> None:
        """Stop (fast shutdown by default), stay down `down_s` seconds, start again on the same port."""
        self.stop(sig)
        time.sleep(down_s)
        self.start()

    def remove(self) -> None:
        """Stop the server and delete its cluster."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
