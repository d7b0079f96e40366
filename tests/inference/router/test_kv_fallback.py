"""kv-aware (the default policy) over workers that do not serve `/internal/kv-events` or
`/internal/tokenizer`: every request is served (by load), the workers that publish are in the index, the
others are not, and neither missing endpoint is logged more than once or as a warning. Stand-in workers
on real sockets; the router's KV feed and tokenizer fetch run as in a router process."""
from __future__ import annotations

import logging
import time

import pytest

from inference.router import DoneEvent
from tests.inference.router.stand_ins import Cluster
from tests.inference.router.test_pd_client import drain, make_client, request, run


def _wait(what: str, check: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_workers_without_kv_events_or_tokenizer_are_routed_by_load(stand_ins: Cluster,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="inference.router")
    silent = [stand_ins.prefill[0], stand_ins.decode[0]]
    for stand_in in silent:
        stand_in.kv_events = False
    client = make_client(stand_ins.prefill_urls, stand_ins.decode_urls, "kv-aware")
    pool = client.pool
    pool.start_health_checks()  # the KV feed (no health-check thread at interval 0)
    try:
        run(pool.check_all())  # the workers' model, for the tokenizer fetch
        publishing = [s.url for s in stand_ins.all() if s not in silent]
        _wait("the publishing workers' snapshots", lambda: all(pool.kv_index.knows(url) for url in publishing))
        _wait("the silent workers' 404", lambda: all("404" in pool.kv_status()["stream_errors"].get(s.url, "")
                                                     for s in silent))

        async def eight() -> list[object]:
            return [(await drain(client, request(max_tokens=2, prompt=f"prompt number {i} " * 20)))[-1]
                    for i in range(8)]

        dones = run(eight())
        assert all(isinstance(done, DoneEvent) for done in dones), dones
        _wait("the tokenizer fetch's 404", lambda: "404" in str(pool.tokenizers.status()["errors"]))
        assert all(isinstance(done, DoneEvent) for done in run(eight()))  # still served, still as text
        assert not any(pool.kv_index.knows(s.url) for s in silent)
        # The workers tokenized: the router sent text, not ids.
        assert all("prompt" in body and "input_ids" not in body for s in stand_ins.decode for body in s.requests)
    finally:
        feed = pool._kv_feed
        assert feed is not None
        feed.stop()
    records = [r for r in caplog.records if r.name.startswith("inference.router")]
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]
    for stand_in in silent:
        assert len([r for r in records if stand_in.url in r.getMessage() and "kv-events" in r.getMessage()]) == 1
    assert len([r for r in records if "/internal/tokenizer" in r.getMessage()]) == 1
