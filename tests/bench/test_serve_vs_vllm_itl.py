"""bench.serve_vs_vllm's client counts inter-token gaps two ways: between events with text (the benchmark's
ITL since the fifth session) and between every event with choices, as `vllm bench serve` does. A token that
completes no character (the first byte of a two-byte character) comes as an event with empty text: the
first way skips it, so the next text event's gap spans both tokens (issue 19's shared-prefix ITL p99)."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from bench import serve_vs_vllm

STEP_S = 0.04


def _event(text: str, ids: list[int], finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}
    return b"data: " + json.dumps({"id": "cmpl-t", "choices": [choice]}).encode() + b"\n\n"


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One chunked SSE answer: "a", a token without text, "b" (completing its character), the finish."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length"))
    await reader.readexactly(length)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                 b"connection: close\r\n\r\n")
    usage = b'data: {"id":"cmpl-t","choices":[],"usage":{"completion_tokens":3}}\n\n'
    for body in (_event("a", [64]), _event("", [162]), _event("\u05e2", [112]), _event("", [], "length"), usage,
                 b"data: [DONE]\n\n"):
        writer.write(b"%x\r\n" % len(body) + body + b"\r\n")
        await writer.drain()
        await asyncio.sleep(STEP_S)
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    writer.close()


async def _stream_once() -> tuple[dict[str, Any], list[tuple[float, str]]]:
    server = await asyncio.start_server(_serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    trace: list[tuple[float, str]] = []
    try:
        async with aiohttp.ClientSession() as session:
            result = await serve_vs_vllm._one(session, f"http://127.0.0.1:{port}", "m", [1, 2], 3, trace)
    finally:
        server.close()
        await server.wait_closed()
    return result, trace


def test_a_token_without_text_is_a_gap_as_vllm_bench_serve_counts_it() -> None:
    """Text events: one gap over two steps; every chunk: three gaps of about a step (the finish chunk's
    too); the blank event is counted; the delivery trace's client rows are the text events."""
    result, trace = asyncio.run(_stream_once())
    assert result["ok"] and result["tokens"] == 3
    assert len(result["gaps"]) == 1 and result["gaps"][0] >= 1.8 * STEP_S
    assert len(result["chunk_gaps"]) == 3 and all(0.5 * STEP_S <= g < 1.8 * STEP_S for g in result["chunk_gaps"])
    assert result["blank"] == 1
    assert [rid for _, rid in trace] == ["cmpl-t", "cmpl-t"]
