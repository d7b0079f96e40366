"""Real processes: a credited decode stream (X-Stream-Credit, inference/server/credit.py) sends at
most its credit past the router's acknowledgements, resumes when acknowledged, ends with the same
greedy tokens as an uncredited stream, and leaves its keep-alive connection reusable.

Driven with the router's own upstream client (decode → descriptor → prefill → stream)."""
from __future__ import annotations

import asyncio
import json
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from inference.router.ndjson import NdjsonReader
from inference.router.upstream import UpstreamClient
from tests.support.processes import start_parallel, start_worker

pytestmark = pytest.mark.django_db(transaction=False, databases=[])

CREDIT = 8
MAX_TOKENS = 120
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, log_dir: Path):
    """Prefill + decode, flow control at its defaults (the engine's window is off)."""
    procs = []
    try:
        common = ["--context-length", "512", "--block-size", "8"]
        started = start_parallel({
            "prefill": partial(start_worker, "prefill", tiny_model_dir, log_dir, extra=common, name="credit-prefill"),
            "decode": partial(start_worker, "decode", tiny_model_dir, log_dir, extra=common, name="credit-decode"),
        })
        (prefill, prefill_url), (decode, decode_url) = started["prefill"], started["decode"]
        procs += [prefill, decode]
        yield {"prefill": prefill_url, "decode": decode_url}
    finally:
        for p in reversed(procs):
            p.stop()


def _body(request_id: str) -> bytes:
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return json.dumps({"request_id": request_id, "prompt": PROMPT, "sampling": sampling}).encode()


async def _prefill(cluster: dict[str, str], request_id: str, descriptor: dict[str, Any]) -> None:
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as client:
        answer = await client.post(cluster["prefill"] + "/internal/prefill", json={
            "request_id": request_id, "prompt_token_ids": descriptor["prompt_token_ids"],
            "sampling": sampling, "descriptor": descriptor["descriptor"],
        })
    assert answer.status_code == 200, answer.text


async def _read_tokens(reader: NdjsonReader, tokens: list[int], quiet_s: float) -> dict[str, Any] | None:
    """Read token lines until the stream is quiet for `quiet_s` (None) or ends (its last line)."""
    while True:  # bounded: the stream ends after MAX_TOKENS, or goes quiet
        try:
            line = await asyncio.wait_for(reader.next(), quiet_s)
        except TimeoutError:
            return None
        assert line is not None, "stream ended without a done line"
        if line["type"] == "token":
            tokens += line["token_ids"]
        else:
            return line


def test_credited_stream_stops_at_its_credit_and_resumes_to_the_greedy_answer(cluster: dict[str, str]) -> None:
    async def run(client: UpstreamClient, request_id: str, credit: int) -> tuple[list[int], int | None]:
        response = await client.post(cluster["decode"] + "/internal/decode", _body(request_id),
                                     connect_timeout_s=5, credit=credit)
        assert response.status == 200
        reader: NdjsonReader[dict[str, Any]] = NdjsonReader(response.content)
        descriptor = await reader.next()
        assert descriptor is not None and descriptor["type"] == "descriptor"
        await _prefill(cluster, request_id, descriptor)
        tokens: list[int] = []
        held = None
        if credit:
            # No acknowledgement yet: the worker sends its credit and then nothing.
            assert await _read_tokens(reader, tokens, quiet_s=1.0) is None
            held = len(tokens)
        while True:  # bounded: MAX_TOKENS, then the done line; a stall fails the 10 s wait
            response.ack(len(tokens))  # everything read so far, as the router does after relaying it
            line = await asyncio.wait_for(reader.next(), 10.0)
            assert line is not None, "stream ended without a done line"
            if line["type"] != "token":
                break
            tokens += line["token_ids"]
        assert line["type"] == "done", line
        assert await asyncio.wait_for(response.read(), 10.0) == b""  # the body's end: reusable
        response.close()
        return tokens, held

    async def main() -> None:
        client = UpstreamClient()
        reference, _ = await run(client, "plain-1", 0)
        tokens, held = await run(client, "credit-1", CREDIT)
        assert held is not None and CREDIT <= held <= CREDIT + 1
        assert tokens == reference and len(tokens) == MAX_TOKENS
        assert sum(client.stats().values()) == 1  # the credited request's connection went back to the pool
        again, _ = await run(client, "credit-2", CREDIT)  # ...and serves the next credited stream
        assert again == reference
        client.close()

    asyncio.run(main())


def test_a_bad_credit_header_is_a_400_naming_it(cluster: dict[str, str]) -> None:
    answer = httpx.post(cluster["decode"] + "/internal/decode", content=_body("bad-credit") + b"\n",
                        headers={"X-Stream-Credit": "1", "Content-Type": "application/json"}, timeout=30)
    assert answer.status_code == 400
    assert "x-stream-credit" in answer.json()["error"]["message"]


def test_health_says_the_decode_worker_takes_credit(cluster: dict[str, str]) -> None:
    assert httpx.get(cluster["decode"] + "/health", timeout=10).json()["stream_credit"] is True
    assert "stream_credit" not in httpx.get(cluster["prefill"] + "/health", timeout=10).json()
