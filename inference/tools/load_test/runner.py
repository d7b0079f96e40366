"""The closed loop: ``concurrency`` clients each send one request at a time until the budget ends."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time

import httpx

from inference.tools.load_test.client import discover_model, send_one
from inference.tools.load_test.config import LoadTestConfig
from inference.tools.load_test.records import RequestRecord

# Connection failures come back in microseconds; without a pause a refused port would make each
# worker spin and log millions of identical errors. The pause doubles up to this cap.
_CONNECT_BACKOFF_START_S = 0.05
_CONNECT_BACKOFF_MAX_S = 1.0


class _RunState:
    """Shared by the workers: the request counter, the deadline and the results."""

    def __init__(self, config: LoadTestConfig, stop: asyncio.Event) -> None:
        self.config = config
        self.stop = stop
        self.start = time.perf_counter()
        self.deadline = self.start + config.duration_s
        self.next_index = 0
        self.records: list[RequestRecord] = []
        self.ok = 0
        self.errors = 0

    def claim(self) -> int | None:
        """Next request index, or ``None`` once the time or request budget is spent.

        Safe without a lock: all workers run on one event loop and this does not await.
        """
        if self.stop.is_set() or time.perf_counter() >= self.deadline:
            return None
        if self.config.max_requests is not None and self.next_index >= self.config.max_requests:
            return None
        index = self.next_index
        self.next_index += 1
        return index

    def add(self, record: RequestRecord) -> None:
        """Store a finished request."""
        self.records.append(record)
        if record.ok:
            self.ok += 1
        else:
            self.errors += 1


async def _worker(client: httpx.AsyncClient, run: _RunState, model: str | None) -> None:
    """One closed-loop client: a request, wait for it, the next one, until the budget ends."""
    backoff = 0.0
    while (index := run.claim()) is not None:
        record = await send_one(client, run.config, index, run.start, model)
        run.add(record)
        if record.error_kind == "connect":
            backoff = min(_CONNECT_BACKOFF_MAX_S, backoff * 2 or _CONNECT_BACKOFF_START_S)
            # Never sleep past the deadline: the run should end on time.
            pause = min(backoff, run.deadline - time.perf_counter())
            if pause > 0:
                try:
                    await asyncio.wait_for(run.stop.wait(), timeout=pause)
                except TimeoutError:
                    pass
        else:
            backoff = 0.0


async def _progress(run: _RunState) -> None:
    """Time-based tqdm bar on stderr showing requests done and errors; cancelled at the end."""
    from tqdm import tqdm

    total = run.config.duration_s
    bar = tqdm(
        total=total,
        file=sys.stderr,
        unit="s",
        dynamic_ncols=True,
        bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s [{elapsed}] {postfix}",
        desc="load_test",
    )
    try:
        while True:
            elapsed = time.perf_counter() - run.start
            bar.n = min(elapsed, total)
            inflight = run.next_index - len(run.records)
            phase = " draining" if elapsed >= total or run.stop.is_set() else ""
            bar.set_postfix_str(f"done={run.ok} errors={run.errors} in_flight={inflight}{phase}")
            await asyncio.sleep(0.25)
    finally:
        bar.n = min(time.perf_counter() - run.start, total)
        bar.set_postfix_str(f"done={run.ok} errors={run.errors}")
        bar.close()


async def run_load(config: LoadTestConfig, stop: asyncio.Event | None = None) -> list[RequestRecord]:
    """Run the load test described by ``config`` and return one record per request (by index).

    Exactly ``config.concurrency`` worker tasks run, each with its own keep-alive connection, so
    at most ``concurrency`` connections are open. Setting ``stop`` ends the run early: no new
    requests are started, requests in flight finish.
    """
    stop = stop or asyncio.Event()
    timeout = httpx.Timeout(config.timeout_s)
    # One single-connection AsyncClient per worker instead of one shared client with
    # max_connections=concurrency: httpcore 1.0.x rescans the whole pool (quadratically) on every
    # request start and end, which at concurrency 100 cost ~25 ms of client CPU per request and
    # made the load generator, not the server, the bottleneck. The total connection limit is
    # the same. One SSL context is shared because building one costs ~60 ms.
    ssl_context = httpx.create_ssl_context(trust_env=True)
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(
                    limits=limits,
                    timeout=timeout,
                    headers=config.headers,
                    verify=ssl_context,
                    # A proxy taken from the environment would be measured instead of the router.
                    trust_env=False,
                )
            )
            for _ in range(config.concurrency)
        ]
        model = config.model
        if model is None and config.api_kind != "generate":
            model = await discover_model(clients[0], config.endpoint)
        run = _RunState(config, stop)
        progress = asyncio.create_task(_progress(run)) if config.progress else None
        try:
            workers = [asyncio.create_task(_worker(client, run, model)) for client in clients]
            await asyncio.gather(*workers)
        finally:
            if progress is not None:
                progress.cancel()
                try:
                    await progress
                except asyncio.CancelledError:
                    pass
    return sorted(run.records, key=lambda r: r.index)
