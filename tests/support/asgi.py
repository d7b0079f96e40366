"""Calling the project's ASGI application in-process, as a protocol server would."""
from __future__ import annotations

from typing import Any

from asgiref.sync import async_to_sync
from asgiref.testing import ApplicationCommunicator


async def _call(method: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    from config.asgi import application

    scope = {"type": "http", "http_version": "1.1", "method": method, "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "scheme": "http", "headers": headers,
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    # channels.testing would do this too, but importing it needs daphne, which the router does not use.
    communicator = ApplicationCommunicator(application, scope)
    await communicator.send_input({"type": "http.request", "body": body})
    start = await communicator.receive_output(10)
    assert start["type"] == "http.response.start", start
    response: dict[str, Any] = {"status": start["status"], "headers": start.get("headers", []), "body": b""}
    while True:  # bounded by the receive timeout
        chunk = await communicator.receive_output(10)
        response["body"] += chunk.get("body", b"")
        if not chunk.get("more_body", False):
            break
    # The connection ends after the response, as uvicorn reports it; the consumer then stops.
    await communicator.send_input({"type": "http.disconnect"})
    await communicator.wait(5)
    return response


def asgi_request(
    method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> dict[str, Any]:
    """`{"status", "headers", "body"}` of one request to config.asgi's application.

    Run with async_to_sync so that database lookups made through sync_to_async (API tokens) run on
    the calling thread, inside a test's transaction.
    """
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    if body:
        raw.append((b"content-length", str(len(body)).encode()))
    return async_to_sync(_call)(method, path, body, raw)


def header(response: dict[str, Any], name: str) -> str | None:
    """A response header's value (case-insensitive name), or None."""
    for key, value in response["headers"]:
        if bytes(key).decode("latin-1").lower() == name.lower():
            return bytes(value).decode("latin-1")
    return None
