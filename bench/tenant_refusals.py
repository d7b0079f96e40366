"""The cost of refusing a request from a key over its limit, in process (issue 21, part of bench/tenants.py).

The router's real ASGI application (config/asgi.py) is called in this process with a request of a key
whose window's budget is spent, through the early refusal (its middleware in front of the routes) and,
as the baseline, through the same routes without it (Channels routing, the consumer, body read, JSON
parsing, key lookup, the quotas' memory, the 429). Measured: the event loop thread's CPU per refusal
(`time.thread_time`, so the router's health-check and usage threads do not count) and the wall time of
each call, no network in between; alternating blocks, medians.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from bench.common import log, median, percentile, ratio

_BODY = b'{"prompt": "flood", "max_tokens": 8}'


async def _one(app: Any, scope: dict[str, Any]) -> int:
    """One request through `app`; its status."""
    done = asyncio.Event()
    status = 0
    sent_request = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_request
        if not sent_request:
            sent_request = True
            return {"type": "http.request", "body": _BODY, "more_body": False}
        await done.wait()  # what a server says once the response is sent and the client goes
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    await app(dict(scope), receive, send)
    return status


async def _measure(secret: str, rounds: int, per_block: int) -> dict[str, Any]:
    from channels.routing import ProtocolTypeRouter

    from config.asgi import application
    from inference.gateway.api_keys import key_cache
    from inference.gateway.quotas import quotas
    from inference.gateway.service import get_router

    get_router()  # built, as in a router that served a request already
    tenant = await key_cache().lookup(secret)
    assert tenant is not None and tenant.requests_per_minute == 1
    while await quotas().admit(tenant) is None:  # spend the window's budget: now known in process
        pass
    early = application
    consumer_only = ProtocolTypeRouter({"http": application.application_mapping["http"].app})
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"authorization", f"Bearer {secret}".encode()),
                         (b"content-length", str(len(_BODY)).encode())],
             "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000)}
    cpu: dict[str, list[float]] = {"early refusal": [], "through the consumer": []}
    wall: dict[str, list[float]] = {"early refusal": [], "through the consumer": []}
    for name, app in (("early refusal", early), ("through the consumer", consumer_only)):
        assert await _one(app, scope) == 429, name  # warm, and both really refuse
    for _ in range(rounds):
        for name, app in (("early refusal", early), ("through the consumer", consumer_only)):
            started = time.thread_time()
            for _ in range(per_block):
                t0 = time.perf_counter()
                await _one(app, scope)
                wall[name].append(time.perf_counter() - t0)
            cpu[name].append(1e6 * (time.thread_time() - started) / per_block)
            log(f"in process, {name}: {cpu[name][-1]:.1f} us CPU per refusal")
    cpu_us = {name: median(values) for name, values in cpu.items()}
    return {
        "cpu_us_per_refusal": cpu_us, "cpu_rounds_us": cpu,
        "consumer_over_early": ratio(cpu_us["through the consumer"], cpu_us["early refusal"]),
        "wall_us": {name: {"p50": 1e6 * (percentile(v, 50) or 0), "p99": 1e6 * (percentile(v, 99) or 0)}
                    for name, v in wall.items()},
    }


def measure_in_process(prefill_url: str, decode_url: str, secret: str, rounds: int = 3,
                       per_block: int = 2000) -> dict[str, Any]:
    """CPU and wall time per refusal of a spent key, early refusal against the consumer path (this
    process plays a router of the given workers; Django is set up by the caller)."""
    from django.conf import settings

    from inference.gateway.service import set_router

    settings.ROUTER_PREFILL_ENDPOINTS = [prefill_url]
    settings.ROUTER_DECODE_ENDPOINTS = [decode_url]
    settings.ROUTER_REQUIRE_AUTH = True
    set_router(None)
    try:
        return asyncio.run(_measure(secret, rounds, per_block))
    finally:
        set_router(None)
