"""What the simulated fleet itself costs, for sizing the control-plane simulation (issue 25): memory
per simulated worker, the time to start a batch of workers through the control API (what a sim
agent would do for a scale-out), the size of a /health and a /metrics answer, and the fleet's CPU
per answer (what a collector scrape round costs on the worker side)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.sim.config import SimConfig
from bench.sim.launch import fleet_processes


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def measure(log_dir: Path, batch: int, total: int, answers: int) -> dict[str, Any]:
    """Start a fleet of one worker, add `batch` workers per control call up to `total`, and time
    `answers` GETs of /health and of /metrics on the added workers."""
    with fleet_processes(0, 1, log_dir, SimConfig()) as fleet:
        proc = psutil.Process(fleet.pids[0])
        rss_start = proc.memory_info().rss
        t0 = time.perf_counter()
        added = fleet.control(0, "workers", {"role": "decode", "count": batch})["started"]
        batch_s = time.perf_counter() - t0
        while len(added) + 1 < total:  # bounded: each call adds up to `batch`
            added += fleet.control(0, "workers", {"role": "decode", "count": min(batch, total - 1 - len(added))})[
                "started"]
        rss_end = proc.memory_info().rss
        urls = added[:answers]
        out: dict[str, Any] = {"workers": len(added) + 1, "batch": batch, "start_batch_s": batch_s,
                               "rss_mib": rss_end / 2**20,
                               "rss_kib_per_worker": (rss_end - rss_start) / 1024 / len(added)}
        with httpx.Client(trust_env=False, timeout=30) as client:
            for path in ("/health", "/metrics"):
                sizes = []
                cpu0 = _cpu(proc)
                for url in urls:
                    response = client.get(url + path)
                    response.raise_for_status()
                    sizes.append(len(response.content))
                key = path.strip("/")
                out[f"{key}_bytes"] = sum(sizes) / len(sizes)
                out[f"fleet_cpu_us_per_{key}"] = (_cpu(proc) - cpu0) * 1e6 / len(urls)
    return out
