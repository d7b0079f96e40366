"""The host-wide KV claims registry (host_memory.py): the rule, live and dead claims, sizing under the lock,
and a claim's life with its engine's pool."""
from __future__ import annotations

import gc
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from inference.engine import LLMEngine, host_memory
from inference.engine.host_memory import (
    CLAIMS_DIR_ENV,
    HOST_MEMORY_ENV,
    Claim,
    HostClaims,
    claim_cpu_pool,
    simulated_host_memory,
    unclaimed_bytes,
)
from inference.engine.memory import CPU_KV_FRACTION, KVPoolTooSmall

from .conftest import TinyModel

BLOCK = 16


def _claim(nbytes: int, *, resident: bool) -> Claim:
    return Claim(pid=1, started=0.0, nbytes=nbytes, resident=resident, source="x", path=Path("x.json"))


@pytest.fixture
def sleeper() -> Iterator[psutil.Process]:
    """A live process other than this one (stands for another worker on the host)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield psutil.Process(proc.pid)
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _write_claim(directory: Path, pid: int, started: float, nbytes: int, *, resident: bool) -> Path:
    path = directory / f"{pid}-0.json"
    path.write_text(json.dumps({"pid": pid, "started": started, "nbytes": nbytes, "resident": resident,
                                "source": "default"}))
    return path


def test_rule_subtracts_pending_claims_only() -> None:
    """Real memory: a resident pool is already out of `available`, a pending one is not; a simulated host
    does not shrink, so every claim counts. Never negative."""
    claims = [_claim(100, resident=True), _claim(30, resident=False)]
    assert unclaimed_bytes(1000, claims, simulated=False) == 970
    assert unclaimed_bytes(1000, claims, simulated=True) == 870
    assert unclaimed_bytes(50, claims, simulated=True) == 0
    assert unclaimed_bytes(1000, [], simulated=False) == 1000


def test_simulated_host_memory_parses_or_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset: None; a byte count; anything else a ValueError naming the variable."""
    monkeypatch.delenv(HOST_MEMORY_ENV, raising=False)
    assert simulated_host_memory() is None
    monkeypatch.setenv(HOST_MEMORY_ENV, "4096")
    assert simulated_host_memory() == 4096
    monkeypatch.setenv(HOST_MEMORY_ENV, "lots")
    with pytest.raises(ValueError, match=HOST_MEMORY_ENV):
        simulated_host_memory()


def test_lone_worker_sees_the_available_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No other claim on the host: unclaimed is psutil's available memory, so the default pool is what it
    was before the registry (CPU_KV_FRACTION of available)."""
    monkeypatch.delenv(HOST_MEMORY_ENV, raising=False)
    claims = HostClaims(tmp_path)
    before = psutil.virtual_memory().available
    with claims.locked():
        got = claims.unclaimed()
    after = psutil.virtual_memory().available
    low, high = sorted((before, after))
    assert int(low * 0.95) <= got <= int(high * 1.05)


def test_live_claims_ignore_and_prune_dead_and_reused_pids(
    tmp_path: Path, sleeper: psutil.Process, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim counts while its process runs; a dead pid's claim, or one whose pid now names a process
    with another start time (reused), is ignored and removed; a garbled file is ignored."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    live = _write_claim(tmp_path, sleeper.pid, sleeper.create_time(), 300, resident=False)
    stale = _write_claim(tmp_path, dead.pid, 1.0, 5000, resident=False)
    reused = _write_claim(tmp_path, os.getpid(), psutil.Process().create_time() - 100, 7000, resident=False)
    (tmp_path / "garbled.json").write_text("{not json")
    claims = HostClaims(tmp_path)
    with claims.locked():
        found = claims.live_claims()
    assert [(c.pid, c.nbytes) for c in found] == [(sleeper.pid, 300)]
    assert live.exists() and not stale.exists() and not reused.exists()
    monkeypatch.setenv(HOST_MEMORY_ENV, "1000")
    with claims.locked():
        assert claims.unclaimed() == 700


def test_claim_cpu_pool_shares_and_records(
    tmp_path: Path, sleeper: psutil.Process, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Default: CPU_KV_FRACTION of what other claims leave, recorded (pending) under this pid; explicit
    sizes are recorded as given; a refused pool records nothing."""
    monkeypatch.setenv(HOST_MEMORY_ENV, "10000")
    _write_claim(tmp_path, sleeper.pid, sleeper.create_time(), 2000, resident=True)
    claims = HostClaims(tmp_path)
    budgets: list[tuple[int, str]] = []

    def plan(budget: int, source: str) -> int:
        budgets.append((budget, source))
        return budget // 10

    blocks, handle = claim_cpu_pool(plan, 10, kv_cache_bytes=None, claims=claims)
    assert budgets[0][0] == int(8000 * CPU_KV_FRACTION) and "not claimed by other workers" in budgets[0][1]
    assert blocks == 320 and handle.nbytes == 3200 and handle.path is not None
    assert json.loads(handle.path.read_text())["resident"] is False and handle.path.name.startswith(f"{os.getpid()}-")
    handle.mark_resident()
    assert json.loads(handle.path.read_text())["resident"] is True
    # A second pool of this process: the first one's claim counts (the simulated host does not shrink).
    _, second = claim_cpu_pool(plan, 10, kv_cache_bytes=None, claims=claims)
    assert budgets[1][0] == int((8000 - 3200) * CPU_KV_FRACTION)
    explicit_blocks, explicit = claim_cpu_pool(plan, 10, kv_cache_bytes=50_000, claims=claims)
    assert explicit_blocks == 5000 and explicit.nbytes == 50_000 and budgets[2][1] == "--kv-cache-memory 48.8 KiB"
    exact_blocks, exact = claim_cpu_pool(plan, 10, kv_cache_bytes=None, num_blocks=7, claims=claims)
    assert exact_blocks == 7 and exact.nbytes == 70 and len(budgets) == 3

    def refuse(budget: int, source: str) -> int:
        raise KVPoolTooSmall(source)

    files = sorted(p.name for p in tmp_path.glob("*.json"))
    with pytest.raises(KVPoolTooSmall):
        claim_cpu_pool(refuse, 10, kv_cache_bytes=None, claims=claims)
    assert sorted(p.name for p in tmp_path.glob("*.json")) == files
    for h in (handle, second, explicit, exact):
        h.release()
        h.release()  # idempotent
    assert [p.name for p in tmp_path.glob("*.json")] == [f"{sleeper.pid}-0.json"]


def test_unusable_directory_falls_back_to_available_memory(tmp_path: Path) -> None:
    """A registry path that cannot be a directory: a warning, no lock, no files, available memory alone."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    claims = HostClaims(blocker / "claims")
    assert not claims.usable
    with claims.locked():
        assert claims.unclaimed() > 0
        handle = claims.add(123, "default")
    assert handle.path is None and handle.nbytes == 123
    handle.mark_resident()
    handle.release()


def test_engine_claim_lives_with_its_pool(
    llama: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine's CPU pool is claimed (resident once allocated) and the claim goes when the pool is
    freed; with a simulated host the default pool is exactly CPU_KV_FRACTION of it, a second engine's
    CPU_KV_FRACTION of what the first leaves."""
    monkeypatch.setenv(CLAIMS_DIR_ENV, str(tmp_path))
    probe = LLMEngine(llama.path, block_size=BLOCK, num_blocks=2, load_tokenizer=False)
    block_bytes = probe.kv_cache.block_nbytes
    (claim_path,) = tmp_path.glob("*.json")
    assert json.loads(claim_path.read_text())["nbytes"] == 2 * block_bytes
    del probe
    gc.collect()
    assert not list(tmp_path.glob("*.json"))
    host = 1000 * block_bytes
    monkeypatch.setenv(HOST_MEMORY_ENV, str(host))
    kwargs = dict(block_size=BLOCK, max_model_len=64, max_num_seqs=256, load_tokenizer=False)
    first = LLMEngine(llama.path, **kwargs)  # type: ignore[arg-type]
    assert first.kv_cache.num_blocks == int(host * CPU_KV_FRACTION) // block_bytes == 400
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert record["resident"] is True and record["nbytes"] == first.kv_cache.nbytes
    second = LLMEngine(llama.path, **kwargs)  # type: ignore[arg-type]
    assert second.kv_cache.num_blocks == int(600 * block_bytes * CPU_KV_FRACTION) // block_bytes == 240
    del first, second
    gc.collect()
    assert not list(tmp_path.glob("*.json"))


def test_a_planted_link_is_not_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory is shared: a link planted where a claim is written is refused (the claim goes
    unrecorded, with a warning), and the file it points to is left alone."""
    monkeypatch.setattr(host_memory, "_serial", itertools.count(1000))
    victim = tmp_path / "victim"
    victim.write_text("keep")
    claims_path = tmp_path / "claims"
    claims = HostClaims(claims_path)
    (claims_path / f".{os.getpid()}-1000.json.tmp").symlink_to(victim)
    with claims.locked():
        handle = claims.add(10, "default")
    assert handle.path is None and victim.read_text() == "keep"
