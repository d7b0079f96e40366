"""The load workers report on their KV event streams and what the router makes of it, without processes:
the `load` line, an endpoint's load (the report plus this router's requests since), the kv-aware choice
over it, the prefill pool's queue a decode worker is told, and the decode worker's local/remote rule."""
from __future__ import annotations

import random

import pytest

from inference.router.endpoint import Endpoint
from inference.router.kv_index import CURRENT_PROMPT, PromptBlocks
from inference.router.policies import KVAware
from inference.router.pool import WorkerPool
from inference.server.errors import WorkerError
from inference.server.load import LoadSignals
from inference.server.local_prefill import RemoteQueue, local_is_sooner, remote_queue
from inference.wire.kv_events import WorkerLoad, decode_line


def _load(running: int = 0, waiting: int = 0, pending: int = 0, rate: float | None = None) -> WorkerLoad:
    return WorkerLoad(running=running, waiting=waiting, prompt_tokens_pending=pending, prefill_tokens_per_s=rate,
                      kv_usage=0.25)


def test_load_lines_round_trip_and_malformed_ones_are_refused() -> None:
    import orjson

    load = _load(3, 2, 640, 1234.5)
    assert decode_line(orjson.loads(load.encode())) == load
    assert decode_line(orjson.loads(_load().encode())) == _load()  # rate not measured yet: null
    for bad in ({"running": -1}, {"kv_usage": 2}, {"prefill_tokens_per_s": 0}, {"waiting": "2"}):
        obj = {**orjson.loads(load.encode()), **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            decode_line(obj)


def test_an_endpoints_load_is_its_report_plus_what_this_router_sent_since() -> None:
    endpoint = Endpoint("http://w:1", "prefill")
    endpoint.acquire()
    endpoint.prefill_sent(100)
    assert (endpoint.load(), endpoint.queued_tokens()) == (1, 100)  # no report: this router's own counts
    endpoint.apply_load(_load(running=1, waiting=4, pending=900, rate=500.0))
    assert (endpoint.load(), endpoint.queued_tokens(), endpoint.prefill_rate()) == (5, 900, 500.0)
    endpoint.acquire()  # sent after the report: counted on top of it until the next one
    endpoint.prefill_sent(60)
    assert (endpoint.load(), endpoint.queued_tokens()) == (6, 960)
    endpoint.release()  # this router's requests that end count at once too (before the next report)
    endpoint.prefill_done(60)
    assert (endpoint.load(), endpoint.queued_tokens()) == (5, 900)
    endpoint.apply_load(_load(running=2))
    assert (endpoint.load(), endpoint.queued_tokens()) == (2, 0)
    endpoint.release()  # one the report counted ended
    endpoint.prefill_done(100)
    assert (endpoint.load(), endpoint.queued_tokens()) == (1, 0)  # never below zero
    endpoint.apply_load(None)  # the stream ended: back to this router's own counts
    assert (endpoint.load(), endpoint.queued_tokens(), endpoint.prefill_rate()) == (0, 0, None)


def test_kv_aware_weighs_the_reported_load_over_this_routers_own() -> None:
    busy, idle = Endpoint("http://w:1", "decode"), Endpoint("http://w:2", "decode")
    idle.inflight = 1  # this router's own count says `idle` is the busier one
    policy = KVAware(random.Random(5))
    assert all(policy.choose([busy, idle]) is busy for _ in range(10))
    busy.apply_load(_load(running=3))  # another router's requests, as the worker reports them
    idle.apply_load(_load())
    assert all(policy.choose([busy, idle]) is idle for _ in range(10))
    token = CURRENT_PROMPT.set(PromptBlocks(list(range(3, 103))))
    try:
        busy.apply_load(_load())
        idle.apply_load(_load(pending=200))  # prompt tokens queued there weigh like tokens to compute
        assert policy.choose([busy, idle]) is busy
    finally:
        CURRENT_PROMPT.reset(token)


def test_the_prefill_queue_told_to_decode_workers_is_the_soonest_workers() -> None:
    pool = WorkerPool(["http://p:1", "http://p:2"], ["http://d:1", "http://d:2"], "kv-aware")
    p1, p2 = pool.endpoints("prefill")
    assert pool.remote_prefill_queue() == {"queue_tokens": 0, "tokens_per_s": None}
    pool.apply_load(p1.url, _load(pending=1000, rate=2000.0))  # 0.5 s ahead
    pool.apply_load(p2.url, _load(pending=600, rate=1000.0))  # 0.6 s ahead: more tokens matter less than rate
    assert pool.remote_prefill_queue() == {"queue_tokens": 1000, "tokens_per_s": 2000.0}
    pool.apply_load(p2.url, _load(pending=300))  # not measured: taken as fast as the measured ones
    assert pool.remote_prefill_queue() == {"queue_tokens": 300, "tokens_per_s": None}
    # Prompts whose decode workers are deciding now: a share for each of the 4 workers that may prefill.
    pool.prefill_deciding_tokens = 800
    assert pool.remote_prefill_queue() == {"queue_tokens": 500, "tokens_per_s": None}
    pool.apply_load("http://gone:1", _load(pending=5))  # a URL no longer in the pool: ignored
    assert WorkerPool([], ["http://d:1"]).remote_prefill_queue() is None


def test_local_prefill_when_it_is_sooner_than_the_prefill_pools_queue() -> None:
    # Neither rate measured: the tokens ahead decide; ties stay remote.
    assert not local_is_sooner(320, 0, 0, None, RemoteQueue(0, None))
    assert local_is_sooner(320, 0, 0, None, RemoteQueue(160, None))
    assert not local_is_sooner(320, 320, 0, None, RemoteQueue(320, None))  # its own queued prefills count
    assert not local_is_sooner(320, 0, 8, None, RemoteQueue(8, None))  # and a row per running decode
    # Rates: a decode worker half as fast as the prefill worker needs twice its queue ahead there.
    assert not local_is_sooner(320, 0, 0, 500.0, RemoteQueue(300, 1000.0))
    assert local_is_sooner(320, 0, 0, 500.0, RemoteQueue(400, 1000.0))
    # One side measured: the other taken as fast.
    assert local_is_sooner(100, 0, 0, None, RemoteQueue(50, 1000.0))
    assert not local_is_sooner(100, 60, 0, 1000.0, RemoteQueue(50, None))


def test_remote_prefill_field_is_checked() -> None:
    assert remote_queue({}) is None
    assert remote_queue({"remote_prefill": {"queue_tokens": 5, "tokens_per_s": None}}) == RemoteQueue(5, None)
    for bad in ([1], {"queue_tokens": -1}, {"queue_tokens": 1, "tokens_per_s": 0}, {"queue_tokens": True}):
        with pytest.raises(WorkerError, match="remote_prefill"):
            remote_queue({"remote_prefill": bad})


def test_load_signals_queue_reading() -> None:
    now = [0.0]
    signals = LoadSignals(clock=lambda: now[0])
    assert signals.prefill_queue() == (0, None)
    signals.prefill_started(300)
    now[0] = 0.5
    assert signals.prefill_queue() == (300, None)
    signals.prefill_finished(300, computed=True)
    assert signals.prefill_queue() == (0, 600.0)


def test_a_decode_body_offering_local_prefill_tells_the_prefill_queue() -> None:
    import orjson

    from inference.router.events import GenerateRequest
    from inference.router.pd_client import DisaggregatedClient
    from inference.wire.sampling import Sampling

    pool = WorkerPool(["http://p:1"], ["http://d:1"], "kv-aware")
    req = GenerateRequest(sampling=Sampling(max_tokens=1), input_ids=[5] * 300)
    client = DisaggregatedClient(pool)
    assert "remote_prefill" not in orjson.loads(client.encode_decode_body(req, "r"))  # not offered
    assert client.deciding_tokens(req) == 0
    client = DisaggregatedClient(pool, local_prefill_tokens=64)
    pool.apply_load("http://p:1", _load(pending=700, rate=900.0))
    body = orjson.loads(client.encode_decode_body(req, "r"))
    assert body["local_prefill_max_tokens"] == 64
    assert body["remote_prefill"] == {"queue_tokens": 700, "tokens_per_s": 900.0}
    assert client.deciding_tokens(req) == 300  # while its decode worker decides, the others count it
