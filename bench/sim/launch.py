"""Start simulated fleet processes and the real router in front of them; stop everything on exit.

The fleet is split over `shards` processes (`python -m bench.sim.fleet` each), prefill and decode
workers spread evenly; the router is the real one (`python -m inference.launch_router`, gunicorn +
uvicorn) started by `tests/support/processes.py` with every simulated URL as a static endpoint.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.sim.config import SimConfig
from tests.support.processes import Proc, start_router

READY_TIMEOUT_S = 60.0


@dataclass
class SimFleet:
    """The simulated workers' URLs and the processes serving them."""

    prefill: list[str]
    decode: list[str]
    procs: list[Proc] = field(default_factory=list)
    # One worker URL per fleet process: where its /sim/stats and /sim/workers answer.
    control_urls: list[str] = field(default_factory=list)
    secret: str = ""

    @property
    def pids(self) -> list[int]:
        """Process ids of the fleet processes."""
        return [proc.popen.pid for proc in self.procs]

    def stats(self) -> dict[str, int]:
        """Requests served by path, summed over the fleet processes (`GET /sim/stats` of each)."""
        total: dict[str, int] = {}
        for proc, url in zip(self.procs, self.control_urls, strict=True):
            if not proc.alive():
                continue
            hits = httpx.get(url + "/sim/stats", timeout=10).json()["hits"]
            for key, value in hits.items():
                total[key] = total.get(key, 0) + int(value)
        return total

    def control(self, shard: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """`POST /sim/<path>` to fleet process `shard` (start/stop workers, inject a fault)."""
        response = httpx.post(f"{self.control_urls[shard]}/sim/{path}", json=body, timeout=30,
                              headers={"X-Platform-Secret": self.secret} if self.secret else None)
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        return answer


@dataclass
class SimPlatform:
    """A router in front of a simulated fleet."""

    router_url: str
    router_pid: int
    fleet: SimFleet
    router: Proc


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def _wait_ready(proc: Proc, path: Path, deadline: float) -> dict[str, list[str]]:
    while time.monotonic() < deadline:  # bounded by the deadline
        if path.exists():
            data: dict[str, list[str]] = json.loads(path.read_text())
            return data
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log()[-3000:]}")
        time.sleep(0.05)
    raise TimeoutError(f"{proc.name} not listening after {READY_TIMEOUT_S:g}s:\n{proc.log()[-3000:]}")


@contextlib.contextmanager
def fleet_processes(prefill: int, decode: int, log_dir: Path, config: SimConfig | None = None,
                    shards: int = 1, hosts: Sequence[str] = ()) -> Iterator[SimFleet]:
    """`prefill` + `decode` simulated workers in `shards` processes; all stopped on exit. `hosts`: the
    loopback address of each shard (a simulated node each; default 127.0.0.1 for all)."""
    if shards < 1 or prefill < 0 or decode < 0 or prefill + decode < shards:
        raise ValueError("need shards >= 1 and at least one worker per shard")
    if hosts and len(hosts) != shards:
        raise ValueError(f"{len(hosts)} hosts for {shards} shards")
    config = config or SimConfig()
    log_dir.mkdir(parents=True, exist_ok=True)
    fleet = SimFleet([], [], secret=os.environ.get("PLATFORM_SHARED_SECRET", ""))
    try:
        started: list[tuple[Proc, Path]] = []
        for i, (p, d) in enumerate(zip(_split(prefill, shards), _split(decode, shards), strict=True)):
            ready = log_dir / f"sim-fleet-{i}-{time.monotonic_ns()}.json"
            args = [sys.executable, "-m", "bench.sim.fleet", "--prefill", str(p), "--decode", str(d),
                    "--ready-file", str(ready), "--host", hosts[i] if hosts else "127.0.0.1", *config.to_argv()]
            proc = Proc(f"sim-fleet-{i}", args, log_dir)
            fleet.procs.append(proc)
            started.append((proc, ready))
        deadline = time.monotonic() + READY_TIMEOUT_S
        for proc, ready in started:
            urls = _wait_ready(proc, ready, deadline)
            ready.unlink()
            fleet.prefill += urls["prefill"]
            fleet.decode += urls["decode"]
            fleet.control_urls.append((urls["decode"] or urls["prefill"])[0])
        yield fleet
    finally:
        for proc in fleet.procs:
            proc.stop()


@contextlib.contextmanager
def sim_platform(prefill: int, decode: int, log_dir: Path, config: SimConfig | None = None, *, shards: int = 1,
                 hosts: Sequence[str] = (), policy: str = "round-robin", router_env: dict[str, str] | None = None,
                 router_extra: Sequence[str] = ()) -> Iterator[SimPlatform]:
    """A simulated fleet and the real router with all of its workers as static endpoints."""
    with fleet_processes(prefill, decode, log_dir, config, shards, hosts) as fleet:
        router, url = start_router(fleet.prefill, fleet.decode, log_dir, policy=policy, env=router_env,
                                   extra=list(router_extra))
        try:
            yield SimPlatform(url, router.popen.pid, fleet, router)
        finally:
            router.stop()
