"""Ports for the processes tests and benchmarks start, which no other process's "any free" bind can take.

A port found by binding port 0 and closing the socket comes from the kernel's ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default), the range every later port-0 bind
also draws from: a decode worker's KV listener (`--kv-port 0`), another harness's probe, a gunicorn or
uvicorn started on port 0. A worker binds the HTTP port it was given only after loading its model
(seconds), so in between another worker's KV listener could land on it, and one of the two failed to
start. So ports are handed out from a range the kernel never assigns on its own (below the ephemeral
range, and apart from the blocks other harnesses use by number: bench/sim's workers from 11000, the
managed platform's worker blocks 20000-29999, a node's default 30000-30999), and each is reserved
across processes by an flock on a file named after it (several test runs share one machine): a port
another process holds is skipped, and the lock goes when this process releases it, exits or dies.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

DEFAULT_RANGE = (14000, 19999)  # inclusive; TEST_PORT_RANGE="LOW-HIGH" overrides it
# Reservations this process keeps at once: a port matters only until its process has bound it (seconds
# after it was handed out), so the oldest are let go beyond this many.
MAX_HELD = 1024
LOCK_DIR = Path(tempfile.gettempdir()) / "platform-test-ports"


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for port-0 binds and outgoing connections (inclusive)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def port_range() -> tuple[int, int]:
    """The range ports are handed out from (inclusive): TEST_PORT_RANGE or DEFAULT_RANGE, refused where it
    overlaps the kernel's ephemeral range (a port there could be taken by any port-0 bind)."""
    spec = os.environ.get("TEST_PORT_RANGE", "")
    low, high = (int(part) for part in spec.split("-", 1)) if spec else DEFAULT_RANGE
    eph_low, eph_high = ephemeral_range()
    if not 1024 <= low <= high <= 65535 or (low <= eph_high and eph_low <= high):
        raise ValueError(f"test port range {low}-{high} must lie in 1024-65535 outside the kernel's ephemeral "
                         f"range {eph_low}-{eph_high} (net.ipv4.ip_local_port_range); set TEST_PORT_RANGE")
    return low, high


class PortAllocator:
    """Hands out ports of `port_range()` that nothing listens on and no other allocator holds.

    Thread-safe (workers are started side by side from threads). Walks the range from a random start,
    so that allocators of different processes rarely even try the same port."""

    def __init__(self, low: int, high: int, lock_dir: Path = LOCK_DIR, max_held: int = MAX_HELD) -> None:
        """Allocate from `low`-`high` (inclusive) with reservation files in `lock_dir`."""
        self.low, self.high = low, high
        self.lock_dir = lock_dir
        self.max_held = max_held
        self._held: OrderedDict[int, int] = OrderedDict()  # port -> fd of its locked file, oldest first
        self._next = random.randrange(low, high + 1)
        self._lock = threading.Lock()

    def allocate(self) -> int:
        """A port reserved for this process, on which nothing listens on 127.0.0.1 right now.
        Raises OSError when every port of the range is taken (bounded: one pass over the range)."""
        with self._lock:
            if not self.lock_dir.is_dir():
                self.lock_dir.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(OSError):  # shared by every user's runs, as /tmp is
                    self.lock_dir.chmod(0o1777)
            size = self.high - self.low + 1
            for _ in range(size):  # bounded: one pass
                port = self._next
                self._next = self.low + (port - self.low + 1) % size
                if port in self._held:
                    continue
                fd = self._reserve(port)
                if fd is None:
                    continue
                if not _bindable(port):
                    os.close(fd)  # something listens there (not one of ours): leave the file unlocked
                    continue
                self._held[port] = fd
                while len(self._held) > self.max_held:
                    _, old = self._held.popitem(last=False)
                    os.close(old)
                return port
        raise OSError(f"no free port in {self.low}-{self.high}")

    def release(self, port: int) -> None:
        """Let other processes have `port` again (its process has stopped); a port not held is ignored."""
        with self._lock:
            fd = self._held.pop(port, None)
            if fd is not None:
                os.close(fd)

    def held(self) -> list[int]:
        """The ports this allocator holds now."""
        with self._lock:
            return list(self._held)

    def _reserve(self, port: int) -> int | None:
        """The fd of `port`'s lock file, locked; None when another allocator holds it."""
        path = self.lock_dir / str(port)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except PermissionError:  # made by another user's run: a read-only descriptor locks it as well
            fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        return fd


def _bindable(port: int) -> bool:
    """Whether a listener could bind 127.0.0.1:`port` now (no SO_REUSEADDR: a port whose old connections
    linger in TIME_WAIT is skipped too)."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_allocator: PortAllocator | None = None
_allocator_lock = threading.Lock()


def allocator() -> PortAllocator:
    """This process's allocator (made on first use, over `port_range()`)."""
    global _allocator
    with _allocator_lock:
        if _allocator is None:
            _allocator = PortAllocator(*port_range())
        return _allocator
