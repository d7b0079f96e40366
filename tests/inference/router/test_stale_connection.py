"""A pooled connection the worker closed while idle is sent on again, not counted as a failure.

The server below answers the first request of each connection with keep-alive and closes the
connection when the next request arrives on it, as uvicorn does when its keep-alive timeout passes
just as the router reuses the connection: that request fails before the application sees it.
"""
from __future__ import annotations

import asyncio

import aiohttp

from inference.router.health import new_session, stale_connection
from inference.router.pd_client import _post_once_more_if_stale


async def _serve_once_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                     seen: list[bytes]) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length"))
    seen.append(await reader.readexactly(length))
    body = b'{"ok": true}'
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                 b"Connection: keep-alive\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    await reader.read(1)  # the next request on this connection: closed unanswered
    writer.close()


def test_request_on_a_connection_closed_while_idle_is_sent_again() -> None:
    async def scenario() -> list[bytes]:
        seen: list[bytes] = []
        server = await asyncio.start_server(lambda r, w: _serve_once_per_connection(r, w, seen), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        session = new_session()
        try:
            for body in (b'{"n": 1}', b'{"n": 2}', b'{"n": 3}'):
                response = await _post_once_more_if_stale(session, f"http://127.0.0.1:{port}/x", body, 3.0)
                async with response:
                    assert response.status == 200 and (await response.json())["ok"]
        finally:
            await session.close()
            server.close()
            await server.wait_closed()
        return seen

    assert asyncio.run(scenario()) == [b'{"n": 1}', b'{"n": 2}', b'{"n": 3}']


def test_only_a_reused_connection_counts_as_stale() -> None:
    key = aiohttp.client_reqrep.ConnectionKey("h", 1, False, True, None, None, None)
    assert not stale_connection(aiohttp.ClientConnectorError(key, OSError(111, "refused")))
    assert stale_connection(aiohttp.ServerDisconnectedError())
    assert stale_connection(aiohttp.ClientOSError(None, "Can not write request body"))
    assert not stale_connection(ValueError("bad"))
