"""Server-Sent Events framing: split a streamed body into lines and events as the SSE spec does."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator

import httpx

from inference.tools.load_test.streams import StreamState

# SSE line terminators (and only these: https://html.spec.whatwg.org/multipage/server-sent-events.html).
_SSE_LINE_BREAK = re.compile(rb"\r\n|\r|\n")


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of an SSE body, split where the SSE spec splits them: CRLF, LF or CR only.

    Not ``httpx.Response.aiter_lines``: it splits like ``str.splitlines``, also at U+2028, U+2029
    and U+0085, which JSON encoders that write UTF-8 (orjson, the router's) leave unescaped inside
    strings; a model that generates one of them would cut its event's JSON in two ("invalid JSON in SSE
    event", seen with the tiny random test model under load).
    """
    pending = b""
    async for chunk in chunks:
        pending += chunk
        parts = _SSE_LINE_BREAK.split(pending)
        pending = parts.pop()
        if pending == b"" and parts and chunk.endswith(b"\r"):
            # A CR at the end of a chunk may be the first half of a CRLF: wait for the next chunk.
            pending = parts.pop() + b"\r"
        for part in parts:
            yield part.decode("utf-8", errors="replace")
    if pending.endswith(b"\r"):
        pending = pending[:-1]
        yield pending.decode("utf-8", errors="replace")
    elif pending:
        yield pending.decode("utf-8", errors="replace")


async def read_sse(response: httpx.Response, state: StreamState) -> None:
    """Read a Server-Sent Events body and feed each event's data to ``state``."""
    data_lines: list[str] = []
    async for line in sse_lines(response.aiter_bytes()):
        if line == "":
            if data_lines:
                state.handle("\n".join(data_lines), time.perf_counter())
                data_lines = []
            continue
        if line.startswith(":"):
            continue  # SSE comment / keep-alive
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            data_lines.append(value)
        # Other fields (event, id, retry) carry nothing we measure.
    if data_lines:  # a last event without the trailing blank line
        state.handle("\n".join(data_lines), time.perf_counter())
