"""The router at 4 to 256 decode endpoints (issue 25): CPU per request and health-check CPU, measured
on the real router process in front of a simulated fleet.

For each pool size (decode endpoints N, prefill endpoints N / 4) a simulated fleet
(bench/sim/fleet.py) and the real router (`python -m inference.launch_router`, one gunicorn worker,
the default 2 s health interval) are started, then:

- idle: no requests for `--idle-s` seconds; the router's CPU seconds (its process and children,
  from /proc) ÷ the interval is its share of one core for health checks and, with `kv-aware` (the
  default `--router-policy`), for following every worker's KV event stream (the simulated workers
  serve the real stream over a simulated prefix cache: bench/sim/prefix_cache.py); the fleet counts
  the checks;
- requests: a fixed number of non-streaming `/generate` requests (32 prompt tokens, 8 output
  tokens, 8 clients); the router's CPU ÷ requests, raw and net of the idle (health) rate.

Beside them, in process: policy + admission CPU per request on the real WorkerPool and Admission
(bench/sim/policy_cost.py), the health checks' CPU per
check with a cProfile (bench/sim/health_cost.py; the lean check and aiohttp's), and the router
core's CPU per request with a cProfile (bench/sim/request_cost.py), at the smallest and the largest
pool, against the largest fleet; and the fleet's own footprint (bench/sim/footprint.py: memory per
simulated worker, time to start 100 more, bytes and fleet CPU per /health and /metrics answer).

    .venv/bin/python -m bench.sim.router_scale            # about 4 minutes
    .venv/bin/python -m bench.sim.router_scale --quick    # seconds
"""
from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

from bench.common import (
    Deadline,
    base_parser,
    fmt,
    log,
    markdown_table,
    note_shared_machine,
    parse_args,
    print_header,
    process_cpu_seconds,
    synthetic_prompts,
    write_result,
)
from bench.sim import footprint, health_cost, policy_cost, request_cost
from bench.sim.config import SimConfig
from bench.sim.launch import SimPlatform, sim_platform

MODULE = "bench.sim.router_scale"
POLICIES = ("round-robin", "least-connections", "power-of-two", "kv-aware")
PROMPT_TOKENS = 32
MAX_TOKENS = 8
CLIENTS = 8
HEALTH_INTERVAL_S = 2.0
# Targets of issue 25 for one router process with 256 decode endpoints.
TARGET_POLICY_US = 200.0
TARGET_HEALTH_SHARE = 0.05


async def _requests(url: str, prompts: list[list[int]], count: int, clients: int) -> dict[str, Any]:
    """`count` non-streaming /generate requests from `clients` closed-loop clients; checks every answer."""
    import aiohttp

    errors: list[str] = []
    done = 0
    next_index = 0
    async with aiohttp.ClientSession(trust_env=False, timeout=aiohttp.ClientTimeout(total=60),
                                     connector=aiohttp.TCPConnector(limit=clients + 2)) as session:

        async def client() -> None:
            nonlocal done, next_index
            while next_index < count:  # bounded by count
                i = next_index
                next_index += 1
                body = {"input_ids": prompts[i % len(prompts)], "max_tokens": MAX_TOKENS, "temperature": 0,
                        "ignore_eos": True}
                try:
                    async with session.post(url + "/generate", json=body) as response:
                        answer = await response.json()
                    if response.status != 200 or len(answer.get("tokens", [])) != MAX_TOKENS:
                        errors.append(f"HTTP {response.status}: {str(answer)[:200]}")
                    else:
                        done += 1
                except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"requests": count, "ok": done, "errors": len(errors), "first_errors": errors[:3], "wall_s": wall}


def measure_router(plat: SimPlatform, decode: int, prefill: int, idle_s: float, count: int,
                   prompts: list[list[int]]) -> dict[str, Any]:
    """CPU per request, then the idle (health-check) CPU share, of the router process in front of `plat`."""
    # Warm-up: round-robin over every endpoint twice, so that the router holds kept-alive connections
    # to each (else the measured run pays a TCP connect per endpoint: 0.5 per request at 256 + 64).
    asyncio.run(_requests(plat.router_url, prompts, 2 * max(CLIENTS, decode), CLIENTS))
    # The measured run follows at once (kept-alive connections expire after 3 s idle).
    cpu_start = process_cpu_seconds(plat.router_pid)
    run = asyncio.run(_requests(plat.router_url, prompts, count, CLIENTS))
    cpu_end = process_cpu_seconds(plat.router_pid)
    time.sleep(HEALTH_INTERVAL_S)  # requests in flight are done; only health checks from here on
    hits0 = plat.fleet.stats().get("health", 0)
    fleet0 = sum(process_cpu_seconds(pid) for pid in plat.fleet.pids)
    cpu0, t0 = process_cpu_seconds(plat.router_pid), time.monotonic()
    time.sleep(idle_s)
    cpu1, t1 = process_cpu_seconds(plat.router_pid), time.monotonic()
    fleet1 = sum(process_cpu_seconds(pid) for pid in plat.fleet.pids)
    hits1 = plat.fleet.stats().get("health", 0)
    idle_share = (cpu1 - cpu0) / (t1 - t0)
    raw_ms = (cpu_end - cpu_start) * 1000 / count
    net_ms = (cpu_end - cpu_start - idle_share * run["wall_s"]) * 1000 / count
    return {
        "decode_endpoints": decode, "prefill_endpoints": prefill,
        "idle_s": t1 - t0, "health_checks_per_s": (hits1 - hits0) / (t1 - t0),
        "router_idle_cpu_share": idle_share,
        "router_cpu_us_per_health_check": (cpu1 - cpu0) * 1e6 / max(1, hits1 - hits0),
        "fleet_idle_cpu_share": (fleet1 - fleet0) / (t1 - t0),
        "kv_event_subscriptions": plat.fleet.stats().get("kv_events", 0),
        **run, "requests_per_s": count / run["wall_s"],
        "router_cpu_ms_per_request": raw_ms, "router_cpu_ms_per_request_net_of_health": net_ms,
    }


def _tables(result: dict[str, Any]) -> str:
    rows = [[r["decode_endpoints"], r["prefill_endpoints"], fmt(r["health_checks_per_s"], 1),
             fmt(100 * r["router_idle_cpu_share"], 2), fmt(r["router_cpu_us_per_health_check"], 0),
             r["ok"], r["errors"], fmt(r["requests_per_s"], 1), fmt(r["router_cpu_ms_per_request"], 3),
             fmt(r["router_cpu_ms_per_request_net_of_health"], 3)] for r in result["router"]]
    prows = [[r["policy"], r["decode_endpoints"], fmt(r["cpu_us_per_request_median"], 1)]
             for r in result["policy_admission"]]
    hp = result.get("health_profile")
    health = "" if hp is None else (
        f"\n\nhealth checks in process, {hp['endpoints']} endpoints: {fmt(hp['cpu_us_per_check'], 0)} µs CPU per check "
        f"({fmt(100 * hp['core_share_at_interval'], 2)} % of a core at {HEALTH_INTERVAL_S:g} s); through aiohttp "
        f"{fmt(hp['aiohttp_cpu_us_per_check'], 0)} µs per check")
    core = "".join(f"\nrouter core in process, {c['decode_endpoints']} decode endpoints: "
                   f"{fmt(c['cpu_us_per_request'], 0)} µs CPU per request" for c in result.get("core_request_cost", []))
    health += core
    fp = result.get("fleet_footprint")
    if fp is not None:
        health += (f"\nfleet: {fp['workers']} simulated workers in one process, {fmt(fp['rss_mib'], 0)} MiB; "
                   f"+{fp['batch']} workers in {fmt(fp['start_batch_s'], 2)} s; /health {fmt(fp['health_bytes'], 0)} B "
                   f"({fmt(fp['fleet_cpu_us_per_health'], 0)} µs fleet CPU), /metrics {fmt(fp['metrics_bytes'], 0)} B "
                   f"({fmt(fp['fleet_cpu_us_per_metrics'], 0)} µs)")
    idle = "router idle CPU % (health + KV feed)" if result.get("router_policy") == "kv-aware" else "router idle CPU %"
    return (markdown_table(["decode", "prefill", "health checks/s", idle, "µs/check",
                            "ok", "errors", "req/s", "router CPU ms/req", "net of health"], rows)
            + "\n\n" + markdown_table(["policy", "decode endpoints", "policy+admission CPU µs/request"], prows)
            + health)


def main(argv: list[str] | None = None) -> int:
    """Run the measurements, print the tables, write the JSON."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", default=None, help="decode endpoint counts, comma separated (default 4,16,64,256)")
    p.add_argument("--idle-s", type=float, default=None, help="idle interval per size (default 30, quick 2.5)")
    p.add_argument("--requests", type=int, default=None, help="requests per size (default 600, quick 12)")
    p.add_argument("--budget-s", type=float, default=900.0, help="total time budget (later sizes are skipped)")
    p.add_argument("--router-policy", default="kv-aware", choices=POLICIES,
                   help="the router process's policy (default kv-aware, the product's default: it follows "
                        "every worker's KV event stream)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    deadline = Deadline(args.budget_s)
    quick = args.quick
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else ([4, 16] if quick else [4, 16, 64, 256])
    if not sizes or min(sizes) < 1:
        p.error("--sizes: positive integers, comma separated")
    idle_s = args.idle_s if args.idle_s is not None else (2.5 if quick else 30.0)
    count = args.requests if args.requests is not None else (12 if quick else 600)
    if idle_s <= 0 or count < 1:
        p.error("--idle-s must be > 0 and --requests >= 1")
    config = SimConfig(decode_tokens_per_s=200.0)
    prompts = synthetic_prompts(32, PROMPT_TOKENS, config.vocab_size, seed=25)
    result: dict[str, Any] = {
        "note": note_shared_machine(), "sim_config": config.to_dict(), "health_interval_s": HEALTH_INTERVAL_S,
        "clients": CLIENTS, "prompt_tokens": PROMPT_TOKENS, "max_tokens": MAX_TOKENS,
        "targets": {"policy_admission_us_per_request": TARGET_POLICY_US, "health_core_share": TARGET_HEALTH_SHARE},
        "router": [], "policy_admission": [], "router_policy": args.router_policy,
    }
    block, blocks = (50, 3) if quick else (500, 9)
    for size in sorted(set(sizes) | {4}):
        for policy in POLICIES:
            result["policy_admission"].append(policy_cost.measure(size, policy, block, blocks))
    largest = max(sizes)
    result["policy_profile"] = {"decode_endpoints": largest, "policy": "round-robin",
                                "top_own_time": policy_cost.profile(largest, "round-robin", 200 if quick else 2000)}
    env = {"ROUTER_HEALTH_INTERVAL_S": str(HEALTH_INTERVAL_S)}
    for size in sizes:
        if deadline.expired():
            log(f"budget spent: {size} endpoints skipped")
            break
        prefill = max(1, size // 4)
        log(f"{size} decode + {prefill} prefill simulated endpoints")
        with sim_platform(prefill, size, args.log_dir, config, router_env=env, policy=args.router_policy) as plat:
            row = measure_router(plat, size, prefill, idle_s, count, prompts)
            result["router"].append(row)
            log(f"  idle CPU {100 * row['router_idle_cpu_share']:.2f} %, "
                f"{row['router_cpu_ms_per_request']:.3f} ms/request, {row['errors']} errors")
            if size == largest:
                fleet = plat.fleet
                result["health_profile"] = health_cost.measure(fleet.prefill, fleet.decode,
                                                               rounds=2 if quick else 6, pause_s=HEALTH_INTERVAL_S)
                # The router core alone, in process, on a small pool and on the whole (same fleet).
                pools = sorted({min(sizes), size})
                result["core_request_cost"] = [
                    request_cost.measure(fleet.prefill[:max(1, n // 4)], fleet.decode[:n], prompts, count,
                                         CLIENTS, MAX_TOKENS) for n in pools]
    if not deadline.expired():
        result["fleet_footprint"] = footprint.measure(args.log_dir, batch=10 if quick else 100,
                                                      total=30 if quick else 1000, answers=10 if quick else 200)
    result["verdict"] = _verdict(result, largest)
    name = "sim_router_scale" + ("_quick" if quick else "")
    print_header(name)
    print(_tables(result))
    print(result["verdict"])
    path = write_result(args.out_dir, name, MODULE, argv, result)
    log(f"wrote {path}")
    return 0


def _verdict(result: dict[str, Any], largest: int) -> dict[str, Any]:
    """The issue's two targets at the largest pool measured, met or not."""
    policy = max((r["cpu_us_per_request_median"] for r in result["policy_admission"]
                  if r["decode_endpoints"] == largest), default=None)
    share = next((r["router_idle_cpu_share"] for r in result["router"] if r["decode_endpoints"] == largest), None)
    return {
        "decode_endpoints": largest,
        "policy_admission_us_per_request_worst_policy": policy,
        "policy_admission_target_met": policy is not None and policy <= TARGET_POLICY_US,
        "health_core_share": share,
        "health_target_met": share is not None and share <= TARGET_HEALTH_SHARE,
    }


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
