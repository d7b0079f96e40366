"""The router core's CPU per request by pool size, in process: the real DisaggregatedClient (admission,
policy, upstream client, NDJSON reading, metrics) against a simulated fleet, without Django, the
ASGI server or the health-check thread, with a cProfile of where the time goes.

The router-process figure (bench/sim/router_scale.py) grows with the pool; this one says which of
the core's functions grow: the same fleet serves a small pool (its first endpoints) and the whole.
"""
from __future__ import annotations

import asyncio
import cProfile
import io
import pstats
import time
from typing import Any

from inference.router import Admission, DisaggregatedClient, DoneEvent, GenerateRequest, WorkerPool
from inference.wire import Sampling


async def _requests(client: DisaggregatedClient, prompts: list[list[int]], count: int, clients: int,
                    max_tokens: int) -> int:
    """`count` requests from `clients` concurrent callers; the number that finished with a done event."""
    done = 0
    next_index = 0

    async def caller() -> None:
        nonlocal done, next_index
        while next_index < count:  # bounded by count
            i = next_index
            next_index += 1
            req = GenerateRequest(sampling=Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                  input_ids=prompts[i % len(prompts)])
            async with asyncio.timeout(60):
                async for event in client.generate(req):
                    if isinstance(event, DoneEvent):
                        done += 1

    await asyncio.gather(*(caller() for _ in range(clients)))
    return done


async def _measure(prefill: list[str], decode: list[str], prompts: list[list[int]], count: int, clients: int,
                   max_tokens: int, profiler: cProfile.Profile | None) -> tuple[float, int]:
    pool = WorkerPool(prefill, decode, health_interval_s=0)
    client = DisaggregatedClient(pool, admission=Admission(pool), stream_credit=16)
    try:
        await pool.check_all()  # the health answers (batch size, credit) as the router has them
        # Warm-up: round-robin over every endpoint twice, so that each has its kept-alive connections
        # (otherwise the run pays a TCP connect per endpoint, 0.5 per request at 256 + 64 endpoints).
        await _requests(client, prompts, 2 * max(clients, len(decode)), clients, max_tokens)
        t0 = time.thread_time()
        if profiler is not None:
            profiler.enable()
        done = await _requests(client, prompts, count, clients, max_tokens)
        if profiler is not None:
            profiler.disable()
        return time.thread_time() - t0, done
    finally:
        await pool.aclose()


def measure(prefill: list[str], decode: list[str], prompts: list[list[int]], count: int, clients: int = 8,
            max_tokens: int = 8, top: int = 15) -> dict[str, Any]:
    """CPU µs per request through the router core with these endpoints, and a profile of a second run."""
    cpu, done = asyncio.run(_measure(prefill, decode, prompts, count, clients, max_tokens, None))
    profiler = cProfile.Profile()
    asyncio.run(_measure(prefill, decode, prompts, count, clients, max_tokens, profiler))
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = []
    for (filename, line, name), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{'/'.join(filename.rsplit('/', 2)[-2:])}:{line}({name})",
                     "calls_per_request": calls / count, "own_us_per_request": tottime * 1e6 / count,
                     "cum_us_per_request": cumtime * 1e6 / count})
    rows.sort(key=lambda r: r["own_us_per_request"], reverse=True)
    return {"decode_endpoints": len(decode), "prefill_endpoints": len(prefill), "requests": count, "ok": done,
            "cpu_us_per_request": cpu * 1e6 / count, "profile_top_own_time": rows[:top]}
