"""The test port allocator: ports outside the kernel's "any free" range, never handed out twice at once."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.ports import PortAllocator, ephemeral_range, port_range
from tests.support.processes import ROOT, free_port


def test_free_ports_lie_outside_the_kernels_ephemeral_range() -> None:
    """A port-0 bind (a decode worker's --kv-port 0) can never be given a port free_port handed out."""
    low, high = ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert not [p for p in ports if low <= p <= high]
    kernel = []
    for _ in range(20):  # what any-free binds get meanwhile: never one of ours
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            kernel.append(sock.getsockname()[1])
    assert not set(kernel) & set(ports)


def test_a_range_overlapping_the_ephemeral_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    low, _high = ephemeral_range()
    monkeypatch.setenv("TEST_PORT_RANGE", f"{low + 10}-{low + 20}")
    with pytest.raises(ValueError, match="ephemeral"):
        port_range()
    monkeypatch.setenv("TEST_PORT_RANGE", "14000-14099")
    assert port_range() == (14000, 14099)


def _allocate_in_child(low: int, high: int, lock_dir: Path, count: int) -> list[int]:
    """`count` ports allocated by another process over the same range and lock files."""
    code = ("import json, sys; from pathlib import Path; from tests.support.ports import PortAllocator; "
            f"a = PortAllocator({low}, {high}, Path({str(lock_dir)!r})); "
            f"print(json.dumps([a.allocate() for _ in range({count})]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    ports: list[int] = json.loads(out.stdout)
    return ports


def _free_block(size: int) -> int:
    """The first port of `size` consecutive ports nothing listens on, in the allocator's range."""
    low, high = port_range()
    for start in range(low, high - size, size):  # bounded by the range
        free = True
        for port in range(start, start + size):
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    free = False
                    break
        if free:
            return start
    raise AssertionError("no free block")


def test_two_processes_never_hold_the_same_port(tmp_path: Path) -> None:
    """Over a 40-port range, this process takes 20 and another the other 20 (never one of these)."""
    low = _free_block(40)
    here = PortAllocator(low, low + 39, tmp_path)
    mine = [here.allocate() for _ in range(20)]
    theirs = _allocate_in_child(low, low + 39, tmp_path, 20)
    assert len(set(mine)) == 20 and len(set(theirs)) == 20
    assert set(mine) | set(theirs) == set(range(low, low + 40))
    # The other process has exited, and its reservations with it: the rest is this one's now, then none.
    assert {here.allocate() for _ in range(20)} == set(theirs)
    with pytest.raises(OSError, match="no free port"):
        here.allocate()
    here.release(mine[0])  # released: another process may have it now
    assert _allocate_in_child(low, low + 39, tmp_path, 1) == [mine[0]]


def test_a_port_something_listens_on_is_skipped(tmp_path: Path) -> None:
    low = _free_block(2)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", low))
        listener.listen()
        allocator = PortAllocator(low, low + 1, tmp_path)
        assert [allocator.allocate()] == [low + 1]
        with pytest.raises(OSError):
            allocator.allocate()


def test_the_oldest_reservations_go_beyond_max_held(tmp_path: Path) -> None:
    low = _free_block(8)
    allocator = PortAllocator(low, low + 7, tmp_path, max_held=3)
    ports = [allocator.allocate() for _ in range(5)]
    assert allocator.held() == ports[2:]
    # let go of by this process, so another one can take them
    assert sorted(_allocate_in_child(low, low + 7, tmp_path, 5)) == sorted(set(range(low, low + 8)) - set(ports[2:]))
