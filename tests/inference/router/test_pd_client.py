"""DisaggregatedClient against stand-in workers: the request path, retries, errors and aborts."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from inference.router import (
    Admission,
    DisaggregatedClient,
    DoneEvent,
    ErrorEvent,
    Event,
    GenerateRequest,
    RouterError,
    TokenEvent,
    WorkerPool,
)
from inference.wire import Sampling
from tests.inference.router.stand_ins import FIRST_TOKEN, Cluster, dead_url

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, 20))


def make_client(
    prefill: list[str], decode: list[str], policy: str = "round-robin", queue_timeout_s: float = 5.0, **timeouts: Any
) -> DisaggregatedClient:
    # Generous timeouts: the stand-ins share this process (and a loaded CI machine) with the test.
    pool = WorkerPool(prefill, decode, policy, health_interval_s=0, connect_timeout_s=3, health_timeout_s=5)
    admission = Admission(pool, queue_timeout_s=queue_timeout_s)
    return DisaggregatedClient(pool, admission=admission, connect_timeout_s=3, abort_timeout_s=5, **timeouts)


def request(max_tokens: int = 3, prompt: str = "hello disaggregated world") -> GenerateRequest:
    return GenerateRequest(sampling=Sampling(max_tokens=max_tokens, temperature=0.0), prompt=prompt)


async def drain(client: DisaggregatedClient, req: GenerateRequest) -> list[Event]:
    return [event async for event in client.generate(req)]


def assert_idle(client: DisaggregatedClient) -> None:
    assert [e.inflight for e in client.pool.all_endpoints()] == [0] * len(client.pool.all_endpoints())


def test_request_path_tokens_done_and_timings(stand_ins: Cluster) -> None:
    client = make_client(stand_ins.prefill_urls[:1], stand_ins.decode_urls[:1])
    req = request(max_tokens=3)
    events = run(drain(client, req))
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    done = events[-1]
    assert isinstance(done, DoneEvent)
    # Lines that arrive together are forwarded as one event: count tokens, not events.
    assert [t for e in tokens for t in e.token_ids][0] == FIRST_TOKEN  # through the prefill's "KV"
    assert len([t for e in tokens for t in e.token_ids]) == 3
    assert "".join(t.text for t in tokens) == " t0 t1 t2"
    assert done.request_id == req.request_id and done.finish_reason == "length"
    assert done.usage == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert done.decode == stand_ins.decode[0].url and done.prefill == stand_ins.prefill[0].url
    timings = done.timings
    assert timings["ttft_s"] is not None and timings["e2e_s"] is not None
    assert 0 < timings["ttft_s"] <= timings["e2e_s"]
    assert timings["prefill_s"] == 0.01 and timings["kv_transfer_s"] == 0.002
    assert done.kv_bytes == 4096 and done.retries == 0
    # The prefill worker got the decode worker's descriptor and prompt tokens.
    (decode_body,) = stand_ins.decode[0].requests
    (prefill_body,) = stand_ins.prefill[0].requests
    assert decode_body["prompt"] == req.prompt and decode_body["sampling"]["max_tokens"] == 3
    assert prefill_body["request_id"] == req.request_id == prefill_body["descriptor"]["request_id"]
    assert prefill_body["prompt_token_ids"] == [0, 1, 2]
    assert not stand_ins.decode[0].aborts and not stand_ins.prefill[0].aborts
    assert_idle(client)


def test_round_robin_alternates_decode_and_prefill(stand_ins: Cluster) -> None:
    client = make_client(stand_ins.prefill_urls, stand_ins.decode_urls, "round-robin")

    async def four() -> list[DoneEvent]:
        results = []
        for _ in range(4):
            events = await drain(client, request(max_tokens=1))
            assert isinstance(events[-1], DoneEvent)
            results.append(events[-1])
        return results

    dones = run(four())
    d0, d1 = stand_ins.decode_urls
    p0, p1 = stand_ins.prefill_urls
    assert [d.decode for d in dones] == [d0, d1, d0, d1]
    assert [d.prefill for d in dones] == [p0, p1, p0, p1]


def test_least_connections_prefers_the_idle_decode(stand_ins: Cluster) -> None:
    stand_ins.decode[0].token_delay_s = stand_ins.decode[1].token_delay_s = 0.05
    client = make_client(stand_ins.prefill_urls, stand_ins.decode_urls, "least-connections")

    async def scenario() -> tuple[str, list[str]]:
        held = client.generate(request(max_tokens=50))
        first = await anext(held)  # one request now streams from one decode worker
        assert isinstance(first, TokenEvent)
        busy = next(e.url for e in client.pool.endpoints("decode") if e.inflight == 1)
        others = []
        for _ in range(2):
            events = await drain(client, request(max_tokens=1))
            assert isinstance(events[-1], DoneEvent)
            others.append(events[-1].decode)
        await held.aclose()
        return busy, others

    busy, others = run(scenario())
    idle = next(url for url in stand_ins.decode_urls if url != busy)
    assert others == [idle, idle]
    assert_idle(client)


def test_dead_decode_endpoint_is_skipped(stand_ins: Cluster) -> None:
    dead = dead_url()
    client = make_client(stand_ins.prefill_urls, [dead, stand_ins.decode[0].url])
    events = run(drain(client, request()))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    assert done.decode == stand_ins.decode[0].url and done.retries == 1
    dead_endpoint = client.pool.endpoints("decode")[0]
    assert dead_endpoint.consecutive_failures == 1 and "Connect" in (dead_endpoint.last_error or "")
    assert_idle(client)


def test_all_decode_dead_is_502_naming_both() -> None:
    dead = [dead_url(), dead_url()]
    client = make_client([dead_url()], dead)
    with pytest.raises(RouterError) as info:
        run(drain(client, request()))
    error = info.value
    assert error.status == 502
    assert error.message.startswith("no backend reachable: ")
    for url in dead:
        assert url in error.message
    assert [b["url"] for b in error.backends] == dead
    assert all(b["role"] == "decode" and b["error"] for b in error.backends)
    body = error.to_dict()["error"]
    assert body["backends"] == error.backends
    assert_idle(client)


def test_decode_5xx_retries_on_the_other(stand_ins: Cluster) -> None:
    stand_ins.decode[0].behavior = "http500"
    client = make_client(stand_ins.prefill_urls, stand_ins.decode_urls)
    events = run(drain(client, request()))
    assert isinstance(events[-1], DoneEvent) and events[-1].decode == stand_ins.decode[1].url
    assert "HTTP 500" in (client.pool.endpoints("decode")[0].last_error or "")


def test_decode_400_is_passed_through(stand_ins: Cluster) -> None:
    for stand_in in stand_ins.decode:
        stand_in.behavior = "http400"
    client = make_client(stand_ins.prefill_urls, stand_ins.decode_urls)
    with pytest.raises(RouterError) as info:
        run(drain(client, request()))
    assert info.value.status == 400
    assert "longer than the context length" in info.value.message
    assert info.value.error_type == "invalid_request_error"
    # The client's error is not retried elsewhere and says nothing about the worker's health.
    assert len(stand_ins.decode[0].requests) + len(stand_ins.decode[1].requests) == 1
    assert all(e.consecutive_failures == 0 for e in client.pool.endpoints("decode"))
    assert not stand_ins.prefill[0].requests
    assert_idle(client)


def test_decode_401_is_a_worker_failure_not_passed_through(stand_ins: Cluster) -> None:
    stand_ins.decode[0].behavior = "http401"  # that worker has another shared secret
    client = make_client(stand_ins.prefill_urls, stand_ins.decode_urls)
    events = run(drain(client, request()))
    assert isinstance(events[-1], DoneEvent) and events[-1].decode == stand_ins.decode[1].url
    assert "HTTP 401" in (client.pool.endpoints("decode")[0].last_error or "")


def test_shared_secret_header_reaches_the_workers(stand_ins: Cluster) -> None:
    pool = WorkerPool(stand_ins.prefill_urls, stand_ins.decode_urls[:1], health_interval_s=0,
                      headers={"X-Platform-Secret": "s3cret"})
    run(drain(DisaggregatedClient(pool), request(max_tokens=1)))
    assert stand_ins.decode[0].secrets == ["s3cret"]


def test_all_busy_is_429_at_the_queue_deadline(stand_ins: Cluster) -> None:
    for stand_in in stand_ins.decode:
        stand_in.behavior = "http429"
    client = make_client(stand_ins.prefill_urls, stand_ins.decode_urls, queue_timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(RouterError) as info:
        run(drain(client, request()))
    # Full workers send the request back to the router's queue, not to the client: 429 comes at the
    # queue deadline, after each worker was asked again once its back-off passed (not hammered).
    assert info.value.status == 429
    assert 1.0 <= time.monotonic() - started < 3.0
    for stand_in in stand_ins.decode:
        assert 1 <= len(stand_in.requests) <= 1.0 / 0.25 + 2
    assert client.admission.queued == 0
    assert_idle(client)


def test_prefill_retry_reuses_the_descriptor(stand_ins: Cluster) -> None:
    stand_ins.prefill[0].behavior = "http500"
    client = make_client(stand_ins.prefill_urls, stand_ins.decode_urls[:1])
    events = run(drain(client, request()))
    assert isinstance(events[-1], DoneEvent) and events[-1].prefill == stand_ins.prefill[1].url
    (failed,) = stand_ins.prefill[0].requests
    (served,) = stand_ins.prefill[1].requests
    assert failed["descriptor"] == served["descriptor"]
    assert len(stand_ins.decode[0].requests) == 1  # the decode side was not restarted


def test_all_prefill_dead_is_502_and_decode_is_aborted(stand_ins: Cluster) -> None:
    dead = [dead_url(), dead_url()]
    decode = stand_ins.decode[0]
    client = make_client(dead, [decode.url])
    req = request()
    with pytest.raises(RouterError) as info:
        run(drain(client, req))
    assert info.value.status == 502
    assert [b["url"] for b in info.value.backends] == dead
    assert all(url in info.value.message for url in dead)
    assert decode.wait_for("aborts", request_id=req.request_id) == [req.request_id]
    assert decode.wait_for("closed_early") == [req.request_id]
    assert_idle(client)


def test_decode_error_before_first_token_restarts_on_another(stand_ins: Cluster) -> None:
    stand_ins.decode[0].behavior = "error_line"
    client = make_client(stand_ins.prefill_urls[:1], stand_ins.decode_urls)
    req = request()
    events = run(drain(client, req))
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.decode == stand_ins.decode[1].url
    assert [r["request_id"] for r in stand_ins.prefill[0].requests] == [req.request_id, f"{req.request_id}-r1"]
    assert done.request_id == req.request_id


def test_decode_without_descriptor_times_out_and_retries(stand_ins: Cluster) -> None:
    stand_ins.decode[0].behavior = "no_descriptor"
    # Not much shorter: a loaded CI machine may need that long for a healthy stand-in's first line.
    client = make_client(stand_ins.prefill_urls, stand_ins.decode_urls, descriptor_timeout_s=1.0)
    started = time.monotonic()
    events = run(drain(client, request()))
    assert isinstance(events[-1], DoneEvent) and events[-1].decode == stand_ins.decode[1].url
    assert time.monotonic() - started < 10  # the hung worker holds its stream for 30 s
    assert "no descriptor" in (client.pool.endpoints("decode")[0].last_error or "")


def test_closing_the_generator_aborts_both_workers(stand_ins: Cluster) -> None:
    decode, prefill = stand_ins.decode[0], stand_ins.prefill[0]
    decode.token_delay_s = 0.05
    client = make_client([prefill.url], [decode.url])
    req = request(max_tokens=100)

    async def scenario() -> None:
        events = client.generate(req)
        assert isinstance(await anext(events), TokenEvent)
        await events.aclose()  # the client went away

    run(scenario())
    # Posted before aclose() returned: no waiting.
    assert decode.wait_for("aborts", timeout=0, request_id=req.request_id) == [req.request_id]
    assert prefill.wait_for("aborts", timeout=0, request_id=req.request_id) == [req.request_id]
    assert decode.wait_for("closed_early") == [req.request_id]
    assert_idle(client)


def test_cancelling_the_consumer_aborts_both_workers(stand_ins: Cluster) -> None:
    decode, prefill = stand_ins.decode[1], stand_ins.prefill[1]
    decode.token_delay_s = 0.05
    client = make_client([prefill.url], [decode.url])
    req = request(max_tokens=100)

    async def scenario() -> None:
        got_token = asyncio.Event()

        async def consume() -> None:
            async for event in client.generate(req):
                if isinstance(event, TokenEvent):
                    got_token.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(got_token.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(scenario())
    assert decode.wait_for("aborts", request_id=req.request_id) == [req.request_id]
    assert prefill.wait_for("aborts", request_id=req.request_id) == [req.request_id]
    assert_idle(client)


def test_cancel_during_prefill_aborts_both_workers(stand_ins: Cluster) -> None:
    decode, prefill = stand_ins.decode[0], stand_ins.prefill[0]
    prefill.behavior = "hang"
    client = make_client([prefill.url], [decode.url])
    req = request()

    async def scenario() -> None:
        task = asyncio.create_task(drain(client, req))
        assert await asyncio.to_thread(prefill.wait_for, "requests")  # the prefill call is in flight
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(scenario())
    assert decode.wait_for("aborts", request_id=req.request_id) == [req.request_id]
    assert prefill.wait_for("aborts", request_id=req.request_id) == [req.request_id]
    assert_idle(client)


def test_lease_lost_to_a_stalled_prefill_retries_with_a_fresh_reservation(stand_ins: Cluster) -> None:
    stalled, healthy, decode = stand_ins.prefill[0], stand_ins.prefill[1], stand_ins.decode[0]
    stalled.behavior = "hang"
    decode.kv_wait_s = 0.5
    client = make_client([stalled.url, healthy.url], [decode.url])
    req = request()
    started = time.monotonic()
    events = run(drain(client, req))
    assert time.monotonic() - started < 10  # not the 30 s of the stalled prefill
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.prefill == healthy.url and done.retries == 1
    assert [r["request_id"] for r in decode.requests] == [req.request_id, f"{req.request_id}-r1"]
    assert stalled.wait_for("aborts", request_id=req.request_id) == [req.request_id]
    assert client.pool.endpoints("prefill")[0].consecutive_failures == 1
    assert_idle(client)


def test_lease_lost_with_the_only_prefill_stalled_is_504_naming_it_at_once(stand_ins: Cluster) -> None:
    stalled, decode = stand_ins.prefill[0], stand_ins.decode[0]
    stalled.behavior = "hang"
    decode.kv_wait_s = 0.5
    client = make_client([stalled.url], stand_ins.decode_urls)
    req = request()
    started = time.monotonic()

    async def scenario() -> None:
        try:
            await drain(client, req)
        finally:
            # The aborts go out in the background: let them finish inside the loop.
            assert await asyncio.to_thread(stalled.wait_for, "aborts", request_id=req.request_id) == [req.request_id]
            assert await asyncio.to_thread(decode.wait_for, "aborts", request_id=req.request_id) == [req.request_id]

    with pytest.raises(RouterError) as info:
        run(scenario())
    assert time.monotonic() - started < 10
    # The workers were reachable: the error says which prefill worker made no progress.
    assert info.value.status == 504 and "no backend reachable" not in info.value.message
    assert f"prefill worker {stalled.url} made no progress" in info.value.message
    assert len(decode.requests) == 1 and not stand_ins.decode[1].requests  # no pointless reservation
    assert_idle(client)


def test_prefill_answering_lease_expired_reserves_again(stand_ins: Cluster) -> None:
    prefill, decode = stand_ins.prefill[0], stand_ins.decode[0]
    prefill.behavior = "lease_expired_once"
    client = make_client([prefill.url], [decode.url])
    req = request()

    async def scenario() -> list[Event]:
        events = await drain(client, req)
        # The first reservation is aborted in the background: let that finish inside the loop.
        assert await asyncio.to_thread(decode.wait_for, "aborts", request_id=req.request_id) == [req.request_id]
        assert await asyncio.to_thread(prefill.wait_for, "aborts", request_id=req.request_id) == [req.request_id]
        return events

    done = run(scenario())[-1]
    assert isinstance(done, DoneEvent) and done.retries == 1 and len(decode.requests) == 2
    assert client.pool.endpoints("prefill")[0].consecutive_failures == 0  # not the prefill's fault


def test_max_inflight_refuses_more_with_429(stand_ins: Cluster) -> None:
    decode = stand_ins.decode[0]
    decode.token_delay_s = 0.05
    pool = WorkerPool(stand_ins.prefill_urls[:1], [decode.url], health_interval_s=0)
    client = DisaggregatedClient(pool, max_inflight=1)

    async def scenario() -> None:
        first = client.generate(request(max_tokens=50))
        assert isinstance(await anext(first), TokenEvent)
        with pytest.raises(RouterError) as info:
            await drain(client, request())
        assert info.value.status == 429 and "ROUTER_MAX_INFLIGHT" in info.value.message
        await first.aclose()
        assert client.inflight == 0
        assert isinstance((await drain(client, request()))[-1], DoneEvent)

    run(scenario())
    assert client.inflight == 0


def test_decode_dying_after_the_first_token_ends_with_an_error(stand_ins: Cluster) -> None:
    stand_ins.decode[0].behavior = "die_after_first_token"
    client = make_client(stand_ins.prefill_urls, stand_ins.decode_urls[:1])
    events = run(drain(client, request(max_tokens=5)))
    assert isinstance(events[0], TokenEvent)
    assert isinstance(events[-1], ErrorEvent) and len(events) == 2
    assert "closed the stream" in events[-1].message
    assert_idle(client)


def test_stalled_decode_stream_ends_with_an_error(stand_ins: Cluster) -> None:
    stand_ins.decode[0].token_delay_s = 10
    client = make_client(stand_ins.prefill_urls, stand_ins.decode_urls[:1], stall_timeout_s=1.0)
    started = time.monotonic()
    events = run(drain(client, request(max_tokens=5)))
    assert time.monotonic() - started < 9  # the stand-in would take 40 s
    assert isinstance(events[-1], ErrorEvent) and events[-1].status == 504
    assert stand_ins.decode[0].wait_for("aborts")


def test_no_endpoints_is_503() -> None:
    client = make_client([], [])
    with pytest.raises(RouterError) as info:
        run(drain(client, request()))
    assert info.value.status == 503
    client = make_client(["http://127.0.0.1:9"], [])
    with pytest.raises(RouterError) as info:
        run(drain(client, request()))
    assert info.value.status == 503 and "decode" in info.value.message


def test_chat_messages_and_token_ids_reach_the_decode_worker(stand_ins: Cluster) -> None:
    client = make_client(stand_ins.prefill_urls[:1], stand_ins.decode_urls[:1])
    messages = [{"role": "user", "content": "hi"}]
    run(drain(client, GenerateRequest(sampling=Sampling(max_tokens=1), messages=messages)))
    run(drain(client, GenerateRequest(sampling=Sampling(max_tokens=1), input_ids=[5, 6, 7])))
    first, second = stand_ins.decode[0].requests
    assert first["messages"] == messages and "prompt" not in first
    assert second["input_ids"] == [5, 6, 7] and "prompt" not in second


def test_decode_dying_after_the_first_token_moves_the_stream(stand_ins: Cluster) -> None:
    dying, other = stand_ins.decode
    dying.behavior = "die_after_first_token"
    client = make_client(stand_ins.prefill_urls, [dying.url, other.url])
    req = request(max_tokens=5)
    events = run(drain(client, req))
    done = events[-1]
    assert isinstance(done, DoneEvent), events
    # One token from the dying worker, four more from the other: the client sees one stream.
    ids = [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]
    assert len(ids) == 5 and ids[0] == FIRST_TOKEN
    assert done.migrations == 1 and done.decode == other.url and done.finish_reason == "length"
    assert done.usage == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    # The other worker was given prompt + the token already sent, and the remaining max_tokens.
    (resumed,) = other.requests
    assert resumed["input_ids"] == [0, 1, 2, FIRST_TOKEN] and resumed["sampling"]["max_tokens"] == 4
    assert resumed["request_id"] == f"{req.request_id}-m1"
    assert dying.wait_for("aborts", request_id=req.request_id) == [req.request_id]
    assert_idle(client)


def test_migrations_are_bounded(stand_ins: Cluster) -> None:
    for stand_in in stand_ins.decode:
        stand_in.behavior = "die_after_first_token"
    client = make_client(stand_ins.prefill_urls, stand_ins.decode_urls)
    client.max_migrations = 1
    events = run(drain(client, request(max_tokens=5)))
    # First worker: 1 token, dies; second: 1 more token, dies; no third try: a clean error event.
    assert [len(e.token_ids) for e in events if isinstance(e, TokenEvent)] == [1, 1]
    assert isinstance(events[-1], ErrorEvent) and "ROUTER_MAX_MIGRATIONS" in events[-1].message
    assert_idle(client)


def test_kv_transfer_failure_blames_the_decode_worker_and_starts_over(stand_ins: Cluster) -> None:
    """A prefill worker that could not write the KV into the decode worker (it died during the send)
    is not at fault: the request starts over on the other decode worker with the same prefill one."""
    (prefill,) = stand_ins.prefill[:1]
    prefill.behavior = "kv_transfer_error_once"
    client = make_client([prefill.url], stand_ins.decode_urls)
    events = run(drain(client, request()))
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.retries == 1 and done.prefill == prefill.url
    first_decode = next(e for e in client.pool.endpoints("decode") if e.url != done.decode)
    assert first_decode.consecutive_failures == 1
    assert client.pool.endpoints("prefill")[0].consecutive_failures == 0
    assert_idle(client)
