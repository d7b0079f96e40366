"""The router's upstream HTTP client against real sockets: keep-alive reuse, stale connections sent
again, streamed bodies, broken streams and refused connects."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from inference.router.ndjson import NdjsonReader, TornLine
from inference.router.upstream import UpstreamClient
from tests.support.processes import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return head, await reader.readexactly(length)


async def _with_server(handler: Handler, scenario: Callable[[str], Awaitable[None]]) -> None:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        await scenario(f"http://127.0.0.1:{port}")
    finally:
        server.close()
        await server.wait_closed()


def test_keep_alive_reuse_headers_and_json_body() -> None:
    heads: list[bytes] = []
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:  # bounded: the client sends three requests
            try:
                head, body = await _read_request(reader)
            except asyncio.IncompleteReadError:
                break
            heads.append(head)
            answer = b'{"echo": %s}' % body
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(answer), answer))
            await writer.drain()
        writer.close()

    async def scenario(base: str) -> None:
        client = UpstreamClient({"X-Platform-Secret": "s3"})
        for n in range(3):
            async with await client.post(f"{base}/internal/prefill", b'{"n": %d}' % n, connect_timeout_s=3) as r:
                assert r.status == 200
                assert r.headers["content-type"] == "application/json"
                assert await r.read() == b'{"echo": {"n": %d}}' % n
        assert list(client.stats().values()) == [1]
        client.close()

    asyncio.run(_with_server(handler, scenario))
    assert connections == 1
    assert all(h.startswith(b"POST /internal/prefill HTTP/1.1\r\n") and b"X-Platform-Secret: s3\r\n" in h
               for h in heads)


def test_request_on_a_connection_closed_while_idle_is_sent_again() -> None:
    """uvicorn closes an idle keep-alive connection just as the router reuses it: the request
    never reached the application, so it goes out again on a fresh connection."""
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, body = await _read_request(reader)
        seen.append(body)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\n{}")
        await writer.drain()
        await reader.read(1)  # the next request on this connection: closed unanswered
        writer.close()

    async def scenario(base: str) -> None:
        client = UpstreamClient()
        for n in range(3):
            response = await client.post(f"{base}/x", b'{"n": %d}' % n, connect_timeout_s=3)
            assert response.status == 200 and await response.read() == b"{}"
        client.close()

    asyncio.run(_with_server(handler, scenario))
    assert seen == [b'{"n": 0}', b'{"n": 1}', b'{"n": 2}']


def test_chunked_ndjson_stream_arrives_line_by_line() -> None:
    async def main() -> None:
        gate = asyncio.Event()  # made inside the loop that waits on it
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n")
            for i in range(3):
                line = b'{"type": "token", "token_ids": [%d]}\n' % i
                writer.write(b"%x\r\n%s\r\n" % (len(line), line))
                await writer.drain()
                if i == 0:
                    await gate.wait()  # the client must see the first line before the rest is sent
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            writer.close()

        async def scenario(base: str) -> None:
            client = UpstreamClient()
            response = await client.post(f"{base}/internal/decode", b"{}", connect_timeout_s=3)
            reader: NdjsonReader[dict[str, Any]] = NdjsonReader(response.content)
            assert await asyncio.wait_for(reader.next(), 5) == {"type": "token", "token_ids": [0]}
            gate.set()
            assert [await reader.next() for _ in range(3)] == [
                {"type": "token", "token_ids": [1]}, {"type": "token", "token_ids": [2]}, None]
            response.close()
            client.close()

        await _with_server(handler, scenario)

    asyncio.run(main())


def test_stream_cut_mid_body_raises_and_connection_is_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        writer.close()  # dies mid-stream

    async def scenario(base: str) -> None:
        client = UpstreamClient()
        response = await client.post(f"{base}/x", b"{}", connect_timeout_s=3)
        assert await response.content.readany() == b"hello"
        with pytest.raises(aiohttp.ClientConnectionError):
            await asyncio.wait_for(response.read(), 5)
        response.close()
        assert list(client.stats().values()) == [0]
        client.close()

    asyncio.run(_with_server(handler, scenario))


def test_refused_connect_is_a_connector_error() -> None:
    async def scenario() -> None:
        client = UpstreamClient()
        with pytest.raises(aiohttp.ClientConnectorError):
            await client.post(f"http://127.0.0.1:{free_port()}/x", b"{}", connect_timeout_s=3)

    asyncio.run(scenario())


def test_non_http_url_is_refused() -> None:
    async def scenario() -> None:
        with pytest.raises(ValueError, match="http://host:port"):
            await UpstreamClient().post("https://127.0.0.1:1/x", b"{}", connect_timeout_s=1)

    asyncio.run(scenario())


def test_concurrent_short_requests_all_answered() -> None:
    """A short answer completes within one read and its connection goes back to the pool before
    the caller resumes; the next request taking that connection must still get its own answer."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:  # bounded: the client's requests
            try:
                _, body = await _read_request(reader)
            except asyncio.IncompleteReadError:
                break
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
        writer.close()

    async def scenario(base: str) -> None:
        client = UpstreamClient()

        async def one(n: int) -> bytes:
            async with await client.post(f"{base}/x", b"%d" % n, connect_timeout_s=3) as r:
                return await r.read()

        async def closed_loop(k: int) -> list[bytes]:
            return [await one(k * 100 + i) for i in range(20)]

        answers = await asyncio.wait_for(asyncio.gather(*(closed_loop(k) for k in range(16))), 20)
        assert answers == [[b"%d" % (k * 100 + i) for i in range(20)] for k in range(16)]
        client.close()

    asyncio.run(_with_server(handler, scenario))


@pytest.mark.parametrize("clean_end", [True, False])
def test_a_line_torn_at_the_end_of_the_stream_is_never_a_line(clean_end: bool) -> None:
    """Issue 26: a worker that dies inside a line. Its complete lines come through; the torn rest is
    `TornLine` (a broken body), whether the body then ends cleanly or the connection drops."""
    torn = b'{"type": "token", "token_ids": [7], "text": "ca'

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        whole = b'{"type": "token", "token_ids": [6], "text": "x"}\n'
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(whole), whole))
        if clean_end:
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(torn), torn))
        else:
            writer.write(b"%x\r\n%s" % (len(torn) + 20, torn))  # the chunk promised more
        await writer.drain()
        writer.close()

    async def scenario(base: str) -> None:
        client = UpstreamClient()
        response = await client.post(f"{base}/internal/decode", b"{}", connect_timeout_s=3)
        reader: NdjsonReader[dict[str, Any]] = NdjsonReader(response.content)
        assert await asyncio.wait_for(reader.next(), 5) == {"type": "token", "token_ids": [6], "text": "x"}
        with pytest.raises(aiohttp.ClientError) as caught:
            await asyncio.wait_for(reader.next(), 5)
        assert isinstance(caught.value, TornLine) == clean_end
        assert reader.ready() is None
        response.close()
        client.close()

    asyncio.run(_with_server(handler, scenario))
