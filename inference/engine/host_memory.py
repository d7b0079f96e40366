"""Host-wide KV pool claims: workers on one host share its memory instead of each sizing its pool alone.

Each worker process records the bytes its CPU KV pool takes in a small JSON file of a host directory
(`claims_dir()`: $INFERENCE_KV_CLAIMS_DIR, else /dev/shm/inference-kv-claims, else the temp directory's),
one file per pool, named `<pid>-<n>.json`. Sizing a default pool and recording its claim happen under
an exclusive `flock` on the directory's lock file, so workers started together size one after the other.

The rule (memory.py `cpu_kv_bytes` takes `CPU_KV_FRACTION` of what `unclaimed()` returns):

    unclaimed = available memory (psutil) - the claims of other live workers whose pools are not resident yet

A pool is zero-filled when it is allocated (kv_cache.py), so once a worker marked its claim resident the
pool is already out of `available`; before that (sized, being allocated) it is subtracted here (while
it is being zero-filled, the part already written counts twice: a later worker errs on the small side).
So the k-th of N workers started together gets FRACTION of what the k-1 before it left: with 40 % each, N pools
together take at most 1 - 0.6^N of the memory that was available (87 % for 4), never more than the host
holds, and a lone worker gets exactly what it got before the registry existed (40 % of available).

A claim goes away with its worker: the file is removed when the pool is garbage-collected or the process
exits normally. A worker ended by a signal (SIGKILL, or SIGTERM: uvicorn re-raises it after its graceful
shutdown, so no exit handler runs) leaves its file behind, but a claim counts only while its process
runs (same pid and start time), and the next worker that takes the lock removes the file.

For tests only, $INFERENCE_KV_HOST_MEMORY (bytes) stands in for the host: unclaimed is then that number
minus every other live claim, resident or not (a fake number does not shrink when pools are allocated).
A registry that cannot be used (a directory this user may not write) is skipped with a warning: the pool
is then sized from available memory alone, as before.
"""
from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from .memory import CPU_KV_FRACTION, cpu_kv_bytes, format_bytes

logger = logging.getLogger(__name__)

CLAIMS_DIR_ENV = "INFERENCE_KV_CLAIMS_DIR"
# Testing only: a made-up host memory in bytes, so that tests can make several real workers share a
# small host without allocating gigabytes (see the module docstring).
HOST_MEMORY_ENV = "INFERENCE_KV_HOST_MEMORY"
LOCK_NAME = ".lock"
# psutil derives a start time from boot time and clock ticks; two readings of one process agree to
# well under this, a reused pid started at least this much later.
START_TIME_TOLERANCE_S = 0.5

_serial = itertools.count()


def claims_dir() -> Path:
    """The host's claims directory: $INFERENCE_KV_CLAIMS_DIR, else /dev/shm's (host-wide, emptied at
    boot), else the temp directory's."""
    if os.environ.get(CLAIMS_DIR_ENV):
        return Path(os.environ[CLAIMS_DIR_ENV])
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / "inference-kv-claims"


def simulated_host_memory() -> int | None:
    """$INFERENCE_KV_HOST_MEMORY as bytes (tests), None when unset; ValueError naming it when malformed."""
    raw = os.environ.get(HOST_MEMORY_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{HOST_MEMORY_ENV} must be a byte count, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{HOST_MEMORY_ENV} must be >= 0, got {value}")
    return value


@dataclass(frozen=True)
class Claim:
    """One pool's claim as recorded on disk."""

    pid: int
    started: float  # the process's start time: a reused pid is not this claim's process
    nbytes: int
    resident: bool  # the pool is allocated (and zero-filled), so it is already out of available memory
    source: str  # the setting that sized it (for people reading the directory)
    path: Path

    def alive(self) -> bool:
        """Whether the process that made the claim still runs (same pid and start time, not a zombie)."""
        try:
            proc = psutil.Process(self.pid)
            return (abs(proc.create_time() - self.started) < START_TIME_TOLERANCE_S
                    and proc.status() != psutil.STATUS_ZOMBIE)
        except psutil.Error:
            return False


def unclaimed_bytes(available: int, others: list[Claim], *, simulated: bool) -> int:
    """The rule: `available` less the other live claims not yet resident (all of them when `available` is
    a simulated host memory, which pools do not shrink). Never negative."""
    pending = sum(c.nbytes for c in others if simulated or not c.resident)
    return max(0, available - pending)


class ClaimHandle:
    """This process's claim of one pool: mark it resident once allocated, release it when freed."""

    def __init__(self, path: Path | None, record: dict[str, object]) -> None:
        self.path = path
        self.record = record

    @property
    def nbytes(self) -> int:
        """The bytes claimed."""
        return int(str(self.record["nbytes"]))

    def mark_resident(self) -> None:
        """The pool is allocated and zero-filled: other workers now see it in available memory."""
        self.record["resident"] = True
        if self.path is not None:
            try:
                _write(self.path, self.record)
            except OSError as exc:  # the claim stays pending: others count it twice, which is safe
                logger.warning("cannot mark the KV claim %s resident: %s", self.path, exc)

    def release(self) -> None:
        """Remove the claim (idempotent; called when the pool is freed or the process exits)."""
        path, self.path = self.path, None
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()


class HostClaims:
    """The claims registry of one host directory (`claims_dir()` by default)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or claims_dir()
        self.usable = True
        try:
            if not self.directory.is_dir():
                self.directory.mkdir(parents=True, exist_ok=True)
                # Shared by every user's workers, like /tmp: each may add files, only the owner removes them.
                with contextlib.suppress(OSError):
                    os.chmod(self.directory, 0o1777)
            self._lock_path = self.directory / LOCK_NAME
            # Read-only is enough for flock, so a lock file another user created serves this one too.
            os.close(os.open(self._lock_path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o666))
        except OSError as exc:
            logger.warning("KV claims registry %s unusable (%s): sizing the KV pool from available memory alone",
                           self.directory, exc)
            self.usable = False

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the registry's exclusive lock (released by the kernel too if this process dies)."""
        if not self.usable:
            yield
            return
        fd = os.open(self._lock_path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the flock

    def live_claims(self) -> list[Claim]:
        """Every live claim; the files of dead processes are removed (call it under `locked()`)."""
        if not self.usable:
            return []
        claims = []
        for path in self.directory.glob("*.json"):
            claim = _read(path)
            if claim is None:
                continue
            if claim.alive():
                claims.append(claim)
            else:
                with contextlib.suppress(OSError):
                    path.unlink()
        return claims

    def unclaimed(self) -> int:
        """What a new default pool may take a share of (the module docstring's rule; under `locked()`)."""
        simulated = simulated_host_memory()
        available = simulated if simulated is not None else int(psutil.virtual_memory().available)
        return unclaimed_bytes(available, self.live_claims(), simulated=simulated is not None)

    def add(self, nbytes: int, source: str) -> ClaimHandle:
        """Record a claim of this process, not resident yet (under `locked()` when the size came from
        `unclaimed()`, so that the next worker sees it)."""
        pid = os.getpid()
        record: dict[str, object] = {
            "pid": pid, "started": psutil.Process(pid).create_time(), "nbytes": int(nbytes), "resident": False,
            "source": source,
        }
        if not self.usable:
            return ClaimHandle(None, record)
        path = self.directory / f"{pid}-{next(_serial)}.json"
        try:
            _write(path, record)
        except OSError as exc:
            logger.warning("cannot record the KV claim in %s: %s", path, exc)
            return ClaimHandle(None, record)
        return ClaimHandle(path, record)


def claim_cpu_pool(
    plan: Callable[[int, str], int],
    block_bytes: int,
    *,
    kv_cache_bytes: int | None,
    num_blocks: int | None = None,
    claims: HostClaims | None = None,
) -> tuple[int, ClaimHandle]:
    """Size a CPU KV pool and record its claim, both under the registry's lock: `num_blocks` when given
    (--num-kv-blocks), else `plan(budget, source)` (plan_pool's blocks; KVPoolTooSmall naming `source`)
    for `kv_cache_bytes` (--kv-cache-memory) or, by default, for CPU_KV_FRACTION of `unclaimed()`.
    Returns the blocks and the claim (not resident yet: mark it once the pool is allocated)."""
    claims = claims or HostClaims()
    with claims.locked():
        if num_blocks is not None:
            blocks, source = num_blocks, "--num-kv-blocks"
        elif kv_cache_bytes is not None:
            source = f"--kv-cache-memory {format_bytes(kv_cache_bytes)}"
            blocks = plan(kv_cache_bytes, source)
        else:
            source = "default"
            blocks = plan(cpu_kv_bytes(None, claims.unclaimed()),
                          f"--kv-cache-memory (default: {CPU_KV_FRACTION:.0%} of the memory available and not "
                          "claimed by other workers on this host)")
        return blocks, claims.add(blocks * block_bytes, source)


def _write(path: Path, record: dict[str, object]) -> None:
    """Write atomically: a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    # Not through a link someone else planted in the shared directory.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(record))
    os.replace(tmp, path)


def _read(path: Path) -> Claim | None:
    """A claim file's content; None for a file that vanished or is not a claim (then it is ignored)."""
    try:
        data = json.loads(path.read_text())
        return Claim(pid=int(data["pid"]), started=float(data["started"]), nbytes=int(data["nbytes"]),
                     resident=bool(data["resident"]), source=str(data.get("source", "")), path=path)
    except (OSError, ValueError, KeyError, TypeError):
        return None
