"""Real worker processes started together on one (simulated) host share its memory through the claims
registry (host_memory.py) instead of each taking CPU_KV_FRACTION of what it sees alone; a killed worker's
claim is ignored; a worker that exits removes its claim."""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import httpx

from inference.engine import LLMEngine
from inference.engine.host_memory import CLAIMS_DIR_ENV, HOST_MEMORY_ENV, HostClaims
from inference.engine.memory import CPU_KV_FRACTION
from tests.support.processes import Proc, build_kernels_once, free_port

HOST_BLOCKS = 2000  # the simulated host holds this many KV blocks of the tiny model
FLAGS = ["--max-sequence-length", "64", "--block-size", "16", "--batch-size", "512"]  # cap: 2048 blocks


def _start(name: str, model: Path, log_dir: Path, env: dict[str, str]) -> tuple[Proc, str]:
    port = free_port()
    args = [sys.executable, "-m", "inference.launch_server", "--model-path", str(model), "--service-type", "prefill",
            "--port", str(port), "--host", "127.0.0.1", "--num-threads", "1", *FLAGS]
    return Proc(name, args, log_dir, {"CUDA_VISIBLE_DEVICES": "", **env}), f"http://127.0.0.1:{port}"


def _blocks(url: str) -> int:
    return int(httpx.get(url + "/health", timeout=10).json()["kv_blocks"])


def _expected(block_bytes: int, claimed_blocks: list[int]) -> int:
    """The default pool after `claimed_blocks` (the rule, on the simulated host)."""
    unclaimed = (HOST_BLOCKS - sum(claimed_blocks)) * block_bytes
    return int(unclaimed * CPU_KV_FRACTION) // block_bytes


def test_workers_started_together_share_the_host(tiny_model_dir: Path, log_dir: Path, tmp_path: Path) -> None:
    """Four workers at once: the pools are the rule's sequence (40 %, then 40 % of what is left, ...), so
    together they fit the host; after one is SIGKILLed its claim file stays but a new worker ignores it;
    a worker stopped by SIGTERM removes its own claim."""
    build_kernels_once()
    probe = LLMEngine(str(tiny_model_dir), block_size=16, num_blocks=1, load_tokenizer=False)
    block_bytes = probe.kv_cache.block_nbytes
    claims = tmp_path / "claims"
    env = {CLAIMS_DIR_ENV: str(claims), HOST_MEMORY_ENV: str(HOST_BLOCKS * block_bytes)}
    started = [_start(f"shared-{i}", tiny_model_dir, log_dir, env) for i in range(4)]
    procs = [proc for proc, _ in started]
    try:
        for proc, url in started:
            proc.wait_http(url + "/health", timeout=180)
        pools = [_blocks(url) for _, url in started]
        expected: list[int] = []
        for _ in range(4):
            expected.append(_expected(block_bytes, expected))
        assert expected == [800, 480, 288, 172]
        assert sorted(pools, reverse=True) == expected  # whichever sized first got the largest share
        assert sum(pools) <= HOST_BLOCKS
        records = [json.loads(p.read_text()) for p in claims.glob("*.json")]
        assert sorted(r["nbytes"] for r in records) == sorted(b * block_bytes for b in pools)
        assert all(r["resident"] and r["source"] == "default" for r in records)

        # SIGKILL the largest: no cleanup ran, its file is still there, but the next worker ignores it.
        victim = pools.index(max(pools))
        procs[victim].kill(signal.SIGKILL)
        procs[victim].popen.wait(timeout=30)
        stale = claims / f"{procs[victim].popen.pid}-0.json"
        assert stale.exists()
        survivors = [b for i, b in enumerate(pools) if i != victim]
        late, late_url = _start("shared-late", tiny_model_dir, log_dir, env)
        procs.append(late)
        late.wait_http(late_url + "/health", timeout=180)
        assert _blocks(late_url) == _expected(block_bytes, survivors) == int(
            (HOST_BLOCKS - 940) * block_bytes * CPU_KV_FRACTION) // block_bytes
        assert not stale.exists()  # pruned by the late worker
    finally:
        for proc in procs:
            proc.stop()
    # Stopped by SIGTERM (uvicorn re-raises it after its shutdown; the worker exits 143 through its exit
    # handlers): each removed its own claim, none is left for another worker to prune.
    assert [proc.popen.returncode for i, proc in enumerate(procs) if i != victim] == [143] * (len(procs) - 1)
    assert not list(claims.glob("*.json"))
    with HostClaims(claims).locked():
        assert HostClaims(claims).live_claims() == []
