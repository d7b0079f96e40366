"""Router overhead: the real router process against calling the workers' internal API directly.

Both paths run the same request (token ids in, ``max_tokens`` 1, 4 and 64 greedy tokens out on the
tiny model, so the workers are not the bottleneck) against the same prefill and decode worker
processes:

- ``router``: ``POST /generate`` on the router (gunicorn + uvicorn, one worker process);
- ``router_sse``: the same, streamed as Server-Sent Events (the router's extra CPU per token between
  1 and 64 tokens is its cost per streamed token);
- ``direct``: this client does what the router does itself: ``POST /internal/decode`` (read the
  descriptor line), ``POST /internal/prefill`` with that descriptor, read the decode stream to its
  ``done`` line. No retries, no health checks, no policy: the bare protocol.

Measured: latency per request at concurrency 1 (blocks of requests alternating between the paths, so
drift of the shared machine hits both alike), router CPU seconds per request (psutil, router
process and its gunicorn children), and requests/s sustained by closed-loop clients at several
concurrencies.

    .venv/bin/python -m bench.router_overhead            # about 2 minutes
    .venv/bin/python -m bench.router_overhead --quick    # seconds (plus process start)
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    Deadline,
    Platform,
    add_attach_args,
    base_parser,
    fmt,
    log,
    markdown_table,
    median,
    new_figure,
    note_shared_machine,
    parse_args,
    percentile,
    platform_processes,
    print_header,
    process_cpu_seconds,
    ratio,
    save_figure,
    synthetic_prompts,
    tiny_model_dir,
    write_result,
)

MODULE = "bench.router_overhead"
_ids = itertools.count()


async def via_router(client: Any, plat: Platform, ids: list[int], max_tokens: int) -> int:
    """One non-streaming /generate through the router; returns the output token count."""
    async with client.post(plat.router_url + "/generate", json={
            "input_ids": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}) as r:
        r.raise_for_status()
        return len((await r.json())["tokens"])


async def via_router_sse(client: Any, plat: Platform, ids: list[int], max_tokens: int) -> int:
    """One streamed /generate (Server-Sent Events) through the router; returns the output token count."""
    tokens = 0
    async with client.post(plat.router_url + "/generate", json={
            "input_ids": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        r.raise_for_status()
        async for raw in r.content:
            if raw.startswith(b"data: {") and b'"token_ids"' in raw and b'"finish_reason"' not in raw:
                tokens += len(json.loads(raw[6:])["token_ids"])
    return tokens


async def direct(client: Any, plat: Platform, ids: list[int], max_tokens: int) -> int:
    """The same request without the router: decode descriptor, prefill, decode stream to the end."""
    rid = f"bench-direct-{os.getpid()}-{next(_ids)}"
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    tokens = 0
    async with client.post(plat.decode_url + "/internal/decode",
                           json={"request_id": rid, "input_ids": ids, "sampling": sampling}) as resp:
        resp.raise_for_status()
        lines = resp.content.__aiter__()
        first = json.loads(await anext(lines))
        if first.get("type") != "descriptor":
            raise RuntimeError(f"expected a descriptor line, got {first}")
        async with client.post(plat.prefill_url + "/internal/prefill", json={
                "request_id": rid, "prompt_token_ids": first["prompt_token_ids"], "sampling": sampling,
                "descriptor": first["descriptor"]}) as pre:
            pre.raise_for_status()
            await pre.read()
        async for line in lines:
            if not line.strip():
                continue
            obj = json.loads(line)
            if obj["type"] == "token":
                tokens += len(obj["token_ids"])
            elif obj["type"] == "done":
                return tokens
            elif obj["type"] == "error":
                raise RuntimeError(obj.get("message"))
    raise RuntimeError("decode stream ended without a done line")


def _session(concurrency: int = 4) -> Any:
    """The benchmark's HTTP client: aiohttp (a fraction of httpx's CPU, so the shared cores stay with
    the processes under test; bench/http_clients.py measures the difference)."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2 * concurrency + 4), trust_env=False,
                                 timeout=aiohttp.ClientTimeout(total=60))


PATHS = {"router": via_router, "direct": direct}
# Latency also measures the streamed path, whose extra CPU per token is the per-token cost.
LATENCY_PATHS = {**PATHS, "router_sse": via_router_sse}


def _cpu(plat: Platform) -> dict[str, float]:
    out = {}
    for name, pid in (("router", plat.router_pid), ("prefill", plat.prefill_pid), ("decode", plat.decode_pid)):
        if pid is not None:
            out[name] = process_cpu_seconds(pid)
    return out


async def latency(plat: Platform, prompts: list[list[int]], max_tokens: int, rounds: int, block: int,
                  deadline: Deadline) -> dict[str, Any]:
    """Sequential requests, blocks alternating between the paths; latency and CPU per request."""
    lat: dict[str, list[float]] = {name: [] for name in LATENCY_PATHS}
    cpu: dict[str, dict[str, float]] = {name: {} for name in LATENCY_PATHS}
    async with _session() as client:
        for path in LATENCY_PATHS.values():  # warm-up every path (connections, first-call costs)
            for i in range(3):
                await path(client, plat, prompts[i % len(prompts)], max_tokens)
        for r in range(rounds):
            if deadline.expired():
                break
            for name, path in LATENCY_PATHS.items():
                before = _cpu(plat)
                for i in range(block):
                    t = time.perf_counter()
                    await path(client, plat, prompts[(r * block + i) % len(prompts)], max_tokens)
                    lat[name].append(time.perf_counter() - t)
                after = _cpu(plat)
                for proc, value in after.items():
                    cpu[name][proc] = cpu[name].get(proc, 0.0) + value - before.get(proc, 0.0)
    out: dict[str, Any] = {"max_tokens": max_tokens}
    for name in LATENCY_PATHS:
        n = len(lat[name])
        out[name] = {
            "requests": n,
            "p50_ms": _ms(median(lat[name])), "p90_ms": _ms(percentile(lat[name], 90)),
            "p99_ms": _ms(percentile(lat[name], 99)), "mean_ms": _ms(sum(lat[name]) / n) if n else None,
            "cpu_ms_per_request": {k: v * 1000 / n for k, v in cpu[name].items()} if n else {},
        }
    out["added_p50_ms"] = _diff(out["router"]["p50_ms"], out["direct"]["p50_ms"])
    out["added_p99_ms"] = _diff(out["router"]["p99_ms"], out["direct"]["p99_ms"])
    out["p50_ratio"] = ratio(out["router"]["p50_ms"], out["direct"]["p50_ms"])
    return out


async def throughput(plat: Platform, prompts: list[list[int]], max_tokens: int, concurrency: int,
                     seconds: float, name: str) -> dict[str, Any]:
    """Closed loop: `concurrency` clients send requests back to back for `seconds` on one path."""
    import aiohttp

    path = LATENCY_PATHS[name]
    lat: list[float] = []
    errors = 0
    async with _session(concurrency) as client:
        before = _cpu(plat)
        t0 = time.perf_counter()

        async def loop(k: int) -> None:
            nonlocal errors
            i = k
            while time.perf_counter() - t0 < seconds:
                t = time.perf_counter()
                try:
                    await path(client, plat, prompts[i % len(prompts)], max_tokens)
                    lat.append(time.perf_counter() - t)
                except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError):
                    errors += 1
                i += concurrency

        await asyncio.gather(*(loop(k) for k in range(concurrency)))
        wall = time.perf_counter() - t0
        after = _cpu(plat)
    n = len(lat)
    return {
        "path": name, "concurrency": concurrency, "max_tokens": max_tokens, "seconds": wall, "requests": n,
        "errors": errors,
        "requests_per_s": n / wall, "p50_ms": _ms(median(lat)), "p99_ms": _ms(percentile(lat, 99)),
        "cpu_ms_per_request": {k: (after[k] - before.get(k, 0.0)) * 1000 / n for k in after} if n else {},
    }


def _per_token(latencies: list[dict[str, Any]]) -> dict[str, Any]:
    """Router CPU per streamed token: the extra router CPU of a longer streamed request, per extra token."""
    by_tokens = {lat["max_tokens"]: lat for lat in latencies}
    if len(by_tokens) < 2:
        return {}
    short, long = by_tokens[min(by_tokens)], by_tokens[max(by_tokens)]
    out: dict[str, Any] = {"tokens": [min(by_tokens), max(by_tokens)]}
    for name in ("router", "router_sse"):
        a = short[name]["cpu_ms_per_request"].get("router")
        b = long[name]["cpu_ms_per_request"].get("router")
        if a is not None and b is not None:
            out[f"{name}_cpu_us_per_token"] = (b - a) * 1000 / (max(by_tokens) - min(by_tokens))
    return out


def _per_token_streams(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Router CPU per streamed token at 16 concurrent SSE streams (64- vs 1-token requests)."""
    by_tokens = {run["max_tokens"]: run for run in runs}
    if len(by_tokens) < 2:
        return {}
    a = by_tokens[min(by_tokens)]["cpu_ms_per_request"].get("router")
    b = by_tokens[max(by_tokens)]["cpu_ms_per_request"].get("router")
    if a is None or b is None:
        return {}
    return {"router_sse_16_streams_cpu_us_per_token": (b - a) * 1000 / (max(by_tokens) - min(by_tokens))}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _tables(result: dict[str, Any]) -> str:
    lrows = []
    for lat in result["latency"]:
        for name in LATENCY_PATHS:
            d = lat[name]
            cpu = d["cpu_ms_per_request"]
            lrows.append([lat["max_tokens"], name, d["requests"], fmt(d["p50_ms"]), fmt(d["p99_ms"]),
                          fmt(ratio(d["p50_ms"], lat["direct"]["p50_ms"])), fmt(cpu.get("router"), 2),
                          fmt(cpu.get("prefill"), 2), fmt(cpu.get("decode"), 2)])
    trows = []
    by_c: dict[int, dict[str, Any]] = {}
    for t in result["throughput"]:
        by_c.setdefault(t["concurrency"], {})[t["path"]] = t
    for c, paths in sorted(by_c.items()):
        for name in PATHS:
            t = paths.get(name)
            if t is None:
                continue
            base = paths.get("direct", {}).get("requests_per_s")
            trows.append([c, name, t["requests"], fmt(t["requests_per_s"], 1), fmt(ratio(t["requests_per_s"], base)),
                          fmt(t["p50_ms"]), fmt(t["p99_ms"]), fmt(t["cpu_ms_per_request"].get("router"), 2),
                          t["errors"]])
    return (
        markdown_table(["max_tokens", "path", "requests", "p50 ms", "p99 ms", "p50 × direct",
                        "router CPU ms/req", "prefill CPU ms/req", "decode CPU ms/req"], lrows)
        + "\n\n"
        + markdown_table(["clients", "path", "requests", "req/s", "req/s × direct", "p50 ms", "p99 ms",
                          "router CPU ms/req", "errors"], trows)
        + "\n\nrouter CPU per streamed token: "
        + ", ".join(f"{k} {fmt(v, 1)} µs" for k, v in result.get("per_token", {}).items() if k.endswith("_token"))
    )


def _plot(result: dict[str, Any], img_dir: Path, name: str) -> Path:
    fig, (ax_lat, ax_tp) = new_figure(12, 4.5, ncols=2)
    labels = [f"{lat['max_tokens']} tok" for lat in result["latency"]]
    xs = range(len(labels))
    for off, path in ((-0.27, "router"), (0.0, "router_sse"), (0.27, "direct")):
        ax_lat.bar([x + off for x in xs], [lat[path]["p50_ms"] or 0 for lat in result["latency"]], width=0.27,
                   label=f"{path} p50")
        ax_lat.scatter([x + off for x in xs], [lat[path]["p99_ms"] or 0 for lat in result["latency"]], color="k",
                       marker="_", s=200, label=f"{path} p99" if off < 0 else None)
    ax_lat.set_xticks(list(xs), labels)
    ax_lat.set(ylabel="ms per request (concurrency 1)", title="latency: router vs direct worker calls")
    for path, marker in (("router", "o"), ("direct", "s")):
        pts = sorted((t["concurrency"], t["requests_per_s"]) for t in result["throughput"] if t["path"] == path)
        if pts:
            ax_tp.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=path)
    ax_tp.set(xscale="log", xlabel="closed-loop clients", ylabel="requests/s", title="sustained requests/s")
    for ax in (ax_lat, ax_tp):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, img_dir, name)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the tables, write JSON and the plot."""
    p = base_parser(__doc__.splitlines()[0])
    add_attach_args(p)
    p.add_argument("--budget-s", type=float, default=600.0, help="total time budget (later steps are skipped)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    deadline = Deadline(args.budget_s)
    model = args.model_dir or tiny_model_dir()
    if args.quick:
        max_tokens_list, rounds, block, concurrency, seconds = [1], 2, 3, [2], 1.5
    else:
        max_tokens_list, rounds, block, concurrency, seconds = [1, 4, 64], 6, 25, [1, 4, 16], 8.0
    from inference.engine.config import ModelConfig

    prompts = synthetic_prompts(16, 32, ModelConfig.from_pretrained(str(model)).vocab_size, seed=7)
    extra = ["--num-threads", "1"]
    result: dict[str, Any] = {"note": note_shared_machine(), "model": model.name, "prompt_tokens": 32}
    with platform_processes(model, args.log_dir, prefill_extra=[*extra, "--base-cpu-id", "0"],
                            decode_extra=[*extra, "--base-cpu-id", str(1 % (os.cpu_count() or 1))],
                            attach=args) as plat:
        result["latency"] = []
        for m in max_tokens_list:
            result["latency"].append(asyncio.run(latency(plat, prompts, m, rounds, block, deadline)))
            lat = result["latency"][-1]
            log(f"max_tokens={m}: router p50 {fmt(lat['router']['p50_ms'])} ms, "
                f"direct p50 {fmt(lat['direct']['p50_ms'])} ms")
        result["throughput"] = []
        for c in concurrency:
            for name in PATHS:
                if deadline.expired():
                    break
                result["throughput"].append(asyncio.run(throughput(plat, prompts, 2, c, seconds, name)))
                t = result["throughput"][-1]
                log(f"{name} c={c}: {t['requests_per_s']:.1f} req/s")
        result["streams"] = []
        if not args.quick:
            # CPU per streamed token with many streams at once (tokens of different streams share
            # loop wake-ups): 16 closed-loop SSE clients at 1 and at 64 tokens per request.
            for m in (1, 64):
                if not deadline.expired():
                    result["streams"].append(asyncio.run(throughput(plat, prompts, m, 16, seconds, "router_sse")))
    result["throughput_max_tokens"] = 2
    result["per_token"] = _per_token(result["latency"]) | _per_token_streams(result["streams"])
    name = "router_overhead_quick" if args.quick else "router_overhead"
    print_header("router overhead")
    print(_tables(result))
    plot = _plot(result, args.img_dir, name)
    path = write_result(args.out_dir, name, MODULE, argv, result | {"plot": str(plot)})
    print(f"\nresult: {path}\nplot: {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
