"""What the router's health checks cost, in process: the real `check_endpoint` on the real
WorkerPool against a running simulated fleet, CPU per check, and a cProfile of where it goes.

The router runs the same code in its health-check thread (inference/router/health.py): every
`health_interval_s` one `GET /health` per endpoint, all at once, on one aiohttp session. Timing a
few rounds here, in a process that does nothing else, isolates that cost from the router's other
work; the router-process figure (bench/sim/router_scale.py) is the one the target is about.
"""
from __future__ import annotations

import asyncio
import cProfile
import io
import pstats
import time
from typing import Any
from urllib.parse import urlsplit

import orjson

from inference.router import WorkerPool
from inference.router.health import check_endpoint, new_session


async def _rounds(pool: WorkerPool, rounds: int, pause_s: float, profiler: cProfile.Profile | None) -> list[float]:
    """CPU seconds of each round after the first (which opens the connections)."""
    session = new_session()
    out = []
    try:
        for i in range(rounds + 1):
            endpoints = pool.all_endpoints()
            t0 = time.thread_time()
            if profiler is not None and i > 0:
                profiler.enable()
            results = await asyncio.gather(*(check_endpoint(pool, session, e) for e in endpoints))
            if profiler is not None:
                profiler.disable()
            if i > 0:
                out.append(time.thread_time() - t0)
            if not all(results):
                raise RuntimeError(f"{results.count(False)} of {len(results)} health checks failed")
            await asyncio.sleep(pause_s)  # as the checker waits between rounds (connections stay alive)
    finally:
        await session.close()
    return out


class _LeanChecker:
    """A prototype of the cheaper check proposed for inference/router/health.py (not used by the
    router): one kept-alive connection per endpoint, the request bytes built once, the answer's
    length from its header and its body parsed by orjson; no URL, request or timer objects."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.request = f"GET /health HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n\r\n".encode()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def check(self) -> bool:
        """One GET /health over the kept connection (reopened if needed); True when healthy."""
        async with asyncio.timeout(5.0):
            return await self._check()

    async def _check(self) -> bool:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        body = orjson.loads(await self.reader.readexactly(length))
        return head.startswith(b"HTTP/1.1 200") and body.get("status") == "healthy"

    def close(self) -> None:
        """Close the connection."""
        if self.writer is not None:
            self.writer.close()


async def _lean_rounds(urls: list[str], rounds: int, pause_s: float) -> list[float]:
    checkers = [_LeanChecker(url) for url in urls]
    out = []
    try:
        for i in range(rounds + 1):
            t0 = time.thread_time()
            results = await asyncio.gather(*(c.check() for c in checkers))
            if i > 0:
                out.append(time.thread_time() - t0)
            if not all(results):
                raise RuntimeError(f"{results.count(False)} of {len(results)} lean health checks failed")
            await asyncio.sleep(pause_s)
    finally:
        for c in checkers:
            c.close()
    return out


def measure(prefill_urls: list[str], decode_urls: list[str], rounds: int, pause_s: float = 2.0,
            top: int = 12) -> dict[str, Any]:
    """CPU per health check over `rounds` rounds of every endpoint, and the profile of those rounds."""
    pool = WorkerPool(prefill_urls, decode_urls, health_interval_s=0)
    n = len(prefill_urls) + len(decode_urls)
    plain = asyncio.run(_rounds(pool, rounds, pause_s, None))
    profiler = cProfile.Profile()
    asyncio.run(_rounds(pool, max(1, rounds // 2), pause_s, profiler))
    stats = pstats.Stats(profiler, stream=io.StringIO())
    checks = n * max(1, rounds // 2)
    rows = []
    for (filename, line, name), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{'/'.join(filename.rsplit('/', 2)[-2:])}:{line}({name})",
                     "calls_per_check": calls / checks, "own_us_per_check": tottime * 1e6 / checks,
                     "cum_us_per_check": cumtime * 1e6 / checks})
    rows.sort(key=lambda r: r["own_us_per_check"], reverse=True)
    cpu_per_check_us = sum(plain) * 1e6 / (n * len(plain))
    lean = asyncio.run(_lean_rounds(prefill_urls + decode_urls, rounds, pause_s))
    return {
        "prototype_lean_cpu_us_per_check": sum(lean) * 1e6 / (n * len(lean)),
        "endpoints": n, "rounds": len(plain), "cpu_us_per_check": cpu_per_check_us,
        "cpu_ms_per_round": sum(plain) * 1000 / len(plain),
        "core_share_at_interval": cpu_per_check_us * n / 1e6 / pause_s,
        "profile_top_own_time": rows[:top],
    }
