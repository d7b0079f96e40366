"""The router's policy + admission CPU per request, in process, by pool size and policy.

A request's choices are the calls `DisaggregatedClient` makes before it talks to any worker
(inference/router/pd_client.py): `pool.candidates("prefill")` (is any prefill worker left),
`Admission.acquire` (a decode endpoint with a free slot, chosen by the policy among the free ones),
`pool.endpoints("prefill")` and `pool.choose("prefill")` (the prefill worker), then on the way out
the releases and `record_success` of both. They are timed here on the real WorkerPool and
Admission with `pool_size` decode endpoints (+ a quarter as many prefill endpoints), each holding
the health answer of a simulated worker (so `batch_size` is read as in production) and a random
number of requests in flight (half its slots on average), with CPU time (`time.thread_time`) per
block of requests; the median block is reported. A cProfile of the largest pool shows where the
time goes. The kept state the router reads per request (each endpoint's slots, the pool's list in
rotation) is what makes the cost flat in the pool size; tests/inference/router/test_admission_cache.py
checks it follows every change.

`kv-aware` (the default policy) also reads the KV index: each request carries a 1,000-token prompt as
ids (hashed per request, as the router does), and every worker's index entry holds a random prefix of
it (none to all of its blocks), the most work a choice can meet short of every worker tying.

    .venv/bin/python -m bench.sim.policy_cost [--sizes 4,64,256] [--policies round-robin,...] [--profile]
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import time
from typing import Any

from bench.sim.config import SimConfig
from bench.sim.worker import SimWorker
from inference.router import Admission, WorkerPool
from inference.router.admission import slots_for
from inference.router.kv_index import CURRENT_PROMPT, PromptBlocks
from inference.wire.kv_events import KVSnapshot, block_hashes

PROMPT_TOKENS = 1000


async def _no_delivery(descriptor: dict[str, Any], first_token: int) -> int:
    raise RuntimeError("no KV is delivered in process")


def build_pool(decode: int, prefill: int, policy: str, seed: int = 0) -> tuple[WorkerPool, Admission]:
    """A pool of `decode` + `prefill` endpoints with simulated health answers and in-flight load."""
    pool = WorkerPool([f"http://127.0.0.1:{20000 + i}" for i in range(prefill)],
                      [f"http://127.0.0.1:{30000 + i}" for i in range(decode)], policy, health_interval_s=0)
    config = SimConfig()
    answers = {role: SimWorker(role, 0, config, _no_delivery).health() for role in ("prefill", "decode")}
    rng = random.Random(seed)
    slots = slots_for(config.batch_size)
    for endpoint in pool.all_endpoints():
        endpoint.record_health(True, dict(answers[endpoint.role]), None)
        if endpoint.role == "decode":
            endpoint.inflight = rng.randrange(0, slots)  # half its slots busy on average, never full
    every = block_hashes(prompt_ids(), config.block_size)
    for endpoint in pool.all_endpoints():
        held = every[: rng.randrange(0, len(every) + 1)]
        pool.kv_index.apply_snapshot(endpoint.url, KVSnapshot(role=endpoint.role, block_size=config.block_size,
                                                              epoch="sim", seq=0, hashes=held))
    return pool, Admission(pool)


def prompt_ids() -> list[int]:
    """The prompt every request carries (ids, as a client sends `input_ids`)."""
    rng = random.Random(7)
    return [rng.randrange(3, SimConfig().vocab_size) for _ in range(PROMPT_TOKENS)]


async def _one_request(pool: WorkerPool, admission: Admission, deadline: float, prompt: list[int]) -> None:
    """The policy and admission calls of one request, in pd_client's order."""
    CURRENT_PROMPT.set(PromptBlocks(list(prompt)))  # a new request: its blocks are hashed again
    pool.candidates("prefill", exclude=[])
    decode = await admission.acquire(deadline, exclude=[])
    assert decode is not None
    for _ in range(len(pool.endpoints("prefill"))):
        prefill = pool.choose("prefill", exclude=[])
        assert prefill is not None
        prefill.acquire()
        prefill.release()
        pool.record_success(prefill)
        break
    pool.record_success(decode)
    admission.release(decode)


async def _blocks(pool: WorkerPool, admission: Admission, block: int, blocks: int) -> list[float]:
    """CPU µs per request of each block of `block` requests."""
    deadline = time.monotonic() + 3600
    prompt = prompt_ids()
    for _ in range(block):  # warm-up
        await _one_request(pool, admission, deadline, prompt)
    out = []
    for _ in range(blocks):
        t0 = time.thread_time_ns()
        for _ in range(block):
            await _one_request(pool, admission, deadline, prompt)
        out.append((time.thread_time_ns() - t0) / 1000 / block)
    return out


def measure(decode: int, policy: str, block: int, blocks: int) -> dict[str, Any]:
    """Policy + admission CPU per request with `decode` decode endpoints (and decode // 4 prefill)."""
    prefill = max(1, decode // 4)
    pool, admission = build_pool(decode, prefill, policy)
    per_block = asyncio.run(_blocks(pool, admission, block, blocks))
    return {"decode_endpoints": decode, "prefill_endpoints": prefill, "policy": policy,
            "requests": block * blocks, "cpu_us_per_request_median": statistics.median(per_block),
            "cpu_us_per_request_min": min(per_block), "cpu_us_per_request_max": max(per_block)}


def profile(decode: int, policy: str, requests: int, top: int = 12) -> list[dict[str, Any]]:
    """cProfile of `requests` requests' choices with `decode` endpoints: the functions with the most
    own time (µs per request, own and cumulative)."""
    pool, admission = build_pool(decode, max(1, decode // 4), policy)
    profiler = cProfile.Profile()
    deadline = time.monotonic() + 3600
    prompt = prompt_ids()

    async def run() -> None:
        for _ in range(requests):
            await _one_request(pool, admission, deadline, prompt)

    profiler.enable()
    asyncio.run(run())
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = []
    for (filename, line, name), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{'/'.join(filename.rsplit('/', 2)[-2:])}:{line}({name})",
                     "calls_per_request": calls / requests, "own_us_per_request": tottime * 1e6 / requests,
                     "cum_us_per_request": cumtime * 1e6 / requests})
    rows.sort(key=lambda r: r["own_us_per_request"], reverse=True)
    return rows[:top]


def main(argv: list[str] | None = None) -> int:
    """Measure every policy at each pool size and print one JSON line per measurement."""
    p = argparse.ArgumentParser(prog="python -m bench.sim.policy_cost", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4,64,256", help="decode endpoint counts, comma separated (default 4,64,256)")
    p.add_argument("--policies", default="round-robin,least-connections,power-of-two,kv-aware",
                   help="policies, comma separated (default: all four)")
    p.add_argument("--block", type=int, default=500, help="requests per timed block (default 500)")
    p.add_argument("--blocks", type=int, default=9, help="timed blocks; the median is reported (default 9)")
    p.add_argument("--profile", action="store_true", help="also print a cProfile of the largest size, round-robin")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes: positive integers, comma separated, not {args.sizes!r}")
    if not sizes or min(sizes) < 1:
        p.error("--sizes: positive integers, comma separated")
    if args.block < 1 or args.blocks < 1:
        p.error("--block and --blocks must be >= 1")
    policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    for size in sizes:
        for policy in policies:
            row = measure(size, policy, args.block, args.blocks)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if args.profile:
        for row in profile(max(sizes), "round-robin", 2000):
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
