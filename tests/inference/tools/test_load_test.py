"""Tests of the ``load_test`` tool against a small in-process SSE server over real HTTP."""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from inference.tools import load_test
from inference.tools.load_test import LoadTestConfig, RequestRecord, run_load, summarize

TOKENS_PER_REQUEST = 5  # the fake server emits at most this many tokens
TOKEN_DELAY_S = 0.01
PROMPT_TOKENS = 3
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass
class FakeServer:
    """What the tests need from the running fake server."""

    base_url: str
    seen: list[dict[str, Any]] = field(default_factory=list)  # request bodies + headers


def _sse(obj: Any) -> bytes:
    payload = obj if isinstance(obj, str) else json.dumps(obj)
    return f"data: {payload}\n\n".encode()


def _build_app(seen: list[dict[str, Any]]) -> Starlette:
    """Fake router: the documented /generate SSE stream, OpenAI streaming, and failing routes."""
    flaky_counter = itertools.count()

    async def remember(request: Request) -> dict[str, Any]:
        body = await request.json()
        seen.append({"path": request.url.path, "body": body, "headers": dict(request.headers)})
        return body

    async def generate(request: Request) -> Response:
        body = await remember(request)
        n = min(int(body.get("max_tokens", 16)), TOKENS_PER_REQUEST)

        async def events() -> AsyncIterator[bytes]:
            sent = 0
            while sent < n:
                await asyncio.sleep(TOKEN_DELAY_S)
                # The second event carries two tokens, to exercise ITL division.
                k = 2 if sent == 1 and n - sent >= 2 else 1
                ids = list(range(100 + sent, 100 + sent + k))
                yield _sse({"text": "".join(f" t{i}" for i in ids), "token_ids": ids})
                sent += k
            yield _sse(
                {
                    "text": "",
                    "finish_reason": "length",
                    "usage": {
                        "prompt_tokens": PROMPT_TOKENS,
                        "completion_tokens": n,
                        "total_tokens": PROMPT_TOKENS + n,
                    },
                    "timings": {"ttft_s": 0.01, "e2e_s": 0.05, "prefill_s": 0.01, "kv_transfer_s": 0.0},
                }
            )
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    async def completions(request: Request) -> Response:
        body = await remember(request)
        chat = request.url.path.endswith("/chat/completions")
        n = min(int(body.get("max_tokens", 16)), TOKENS_PER_REQUEST)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events() -> AsyncIterator[bytes]:
            if chat:  # OpenAI sends the role first, with empty content: not a token
                yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for i in range(n):
                await asyncio.sleep(TOKEN_DELAY_S)
                piece = f" w{i}"
                choice: dict[str, Any] = {"index": 0, "finish_reason": None}
                if chat:
                    choice["delta"] = {"content": piece}
                else:
                    choice["text"] = piece
                yield _sse({"id": "x", "object": "chunk", "choices": [choice]})
            if include_usage:
                # Usage says one token more than the chunks: the tool must trust usage.
                usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n + 1}
                yield _sse({"id": "x", "choices": [], "usage": usage})
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def broken(request: Request) -> Response:
        await remember(request)
        return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)

    async def flaky(request: Request) -> Response:
        if next(flaky_counter) % 2:
            return JSONResponse({"error": {"message": "busy"}}, status_code=429)
        return await generate(request)

    async def unicode_text(request: Request) -> Response:
        """Tokens whose text holds characters str.splitlines splits at, in raw UTF-8 as orjson writes
        them, each event split across two body chunks, CRLF line ends on the last one."""
        await remember(request)
        texts = ["a\u2028b", "c\x85d", "e\u2029f"]

        async def events() -> AsyncIterator[bytes]:
            for i, text in enumerate(texts):
                raw = b"data: " + json.dumps({"text": text, "token_ids": [i]}, ensure_ascii=False).encode() + b"\n\n"
                yield raw[:9]
                await asyncio.sleep(TOKEN_DELAY_S)
                yield raw[9:]
            done = {"text": "", "finish_reason": "stop", "usage": {"completion_tokens": len(texts)}}
            yield b"data: " + json.dumps(done).encode() + b"\r"
            yield b"\n\r\ndata: [DONE]\r\n\r\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/generate", generate, methods=["POST"]),
            Route("/unicode/generate", unicode_text, methods=["POST"]),
            Route("/api/generate", generate, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/broken/generate", broken, methods=["POST"]),
            Route("/flaky/generate", flaky, methods=["POST"]),
        ]
    )


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    """Serve the fake app with uvicorn on an ephemeral 127.0.0.1 port in a thread."""
    seen: list[dict[str, Any]] = []
    config = uvicorn.Config(_build_app(seen), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        assert thread.is_alive(), "uvicorn thread died"
        time.sleep(0.01)
    port = uv.servers[0].sockets[0].getsockname()[1]
    try:
        yield FakeServer(base_url=f"http://127.0.0.1:{port}", seen=seen)
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


def _free_port() -> int:
    """A port with nothing listening on it, outside the kernel's ephemeral range (tests/support/ports.py)."""
    from tests.support.processes import free_port

    return free_port()


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _assert_ordered(stats: dict[str, float | None]) -> None:
    p50, p90, p99 = stats["p50"], stats["p90"], stats["p99"]
    assert p50 is not None and p90 is not None and p99 is not None
    assert 0 <= p50 <= p90 <= p99


# ------------------------------------------------------------------------------------------
# End to end through main()
# ------------------------------------------------------------------------------------------


def test_generate_csv_summary_and_plot(
    server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = tmp_path / "bench.csv"
    summary_path = tmp_path / "summary.json"
    code = load_test.main(
        [
            "--endpoint",
            f"{server.base_url}/generate",
            "--concurrency",
            "4",
            "--duration",
            "700ms",
            "--max-tokens",
            "8",
            "--metrics-file",
            str(metrics),
            "--summary-json",
            str(summary_path),
            "--header",
            "Authorization: Bearer secret-x",
            "--no-progress",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "TTFT" in out and "ITL" in out and "req/s" in out

    rows = _read_csv(metrics)
    assert list(rows[0].keys()) == list(load_test.CSV_COLUMNS)
    summary = json.loads(summary_path.read_text())
    assert summary["requests"] == len(rows) > 4
    assert summary["ok"] == len(rows) and summary["errors"] == 0
    assert sorted(int(r["index"]) for r in rows) == list(range(len(rows)))
    for row in rows:
        assert row["status"] == "ok" and row["http_status"] == "200" and row["error"] == ""
        assert int(row["output_tokens"]) == TOKENS_PER_REQUEST  # from token_ids
        assert int(row["prompt_tokens"]) == PROMPT_TOKENS
        assert 0 < float(row["ttft_s"]) <= float(row["e2e_s"]) < 5
        assert float(row["itl_mean_s"]) > 0
    # The run stops starting requests at the deadline; in-flight ones finish shortly after.
    assert max(float(r["start_s"]) for r in rows) < 0.7
    assert 0.7 <= summary["duration_s"] < 3

    assert summary["output_tokens_per_s"] > 0 and summary["requests_per_s"] > 0
    assert summary["output_tokens"] == TOKENS_PER_REQUEST * len(rows)
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        _assert_ordered(summary[key])
    assert summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p50"]

    png = metrics.with_suffix(".png")
    assert png.read_bytes()[:8] == PNG_MAGIC

    generate_calls = [s for s in server.seen if s["path"] == "/generate"]
    assert generate_calls
    call = generate_calls[-1]
    assert call["headers"]["authorization"] == "Bearer secret-x"
    assert call["body"]["stream"] is True and call["body"]["max_tokens"] == 8
    assert call["body"]["prompt"] in load_test.DEFAULT_PROMPTS


def test_requests_cap_and_explicit_plot(server: FakeServer, tmp_path: Path) -> None:
    metrics = tmp_path / "m.csv"
    plot = tmp_path / "custom.png"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond prompt\n")
    started = time.monotonic()
    code = load_test.main(
        [
            "--endpoint",
            f"{server.base_url}/api/generate",
            "--concurrency",
            "3",
            "--duration",
            "30s",
            "--requests",
            "7",
            "--prompts-file",
            str(prompts),
            "--metrics-file",
            str(metrics),
            "--plot",
            str(plot),
            "--no-progress",
        ]
    )
    assert code == 0
    assert time.monotonic() - started < 10  # ended by the request cap, not the 30 s duration
    rows = _read_csv(metrics)
    assert len(rows) == 7
    assert all(r["status"] == "ok" for r in rows)
    assert plot.read_bytes()[:8] == PNG_MAGIC
    assert not metrics.with_suffix(".png").exists()
    bodies = [s["body"] for s in server.seen[-7:]]
    assert {b["prompt"] for b in bodies} == {"first prompt", "second prompt"}


def test_http_500_counts_errors_and_exits_1(
    server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = tmp_path / "err.csv"
    summary_path = tmp_path / "s.json"
    code = load_test.main(
        [
            "--endpoint",
            f"{server.base_url}/broken/generate",
            "--concurrency",
            "2",
            "--requests",
            "5",
            "--duration",
            "10s",
            "--metrics-file",
            str(metrics),
            "--summary-json",
            str(summary_path),
            "--no-progress",
        ]
    )
    assert code == 1
    rows = _read_csv(metrics)
    assert len(rows) == 5
    assert {r["status"] for r in rows} == {"error"}
    assert {r["http_status"] for r in rows} == {"500"}
    assert all(r["error"].startswith("http_500: boom") for r in rows)
    summary = json.loads(summary_path.read_text())
    assert summary["error_kinds"] == {"http_500": 5}
    assert summary["ok"] == 0 and summary["ttft_ms"]["p50"] is None
    assert "http_500: 5" in capsys.readouterr().out
    assert metrics.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC  # a plot even with no data


def test_some_errors_exit_0(server: FakeServer, tmp_path: Path) -> None:
    summary_path = tmp_path / "s.json"
    code = load_test.main(
        [
            "--endpoint",
            f"{server.base_url}/flaky/generate",
            "--concurrency",
            "2",
            "--requests",
            "6",
            "--summary-json",
            str(summary_path),
            "--no-progress",
        ]
    )
    assert code == 0
    summary = json.loads(summary_path.read_text())
    assert summary["requests"] == 6
    assert summary["ok"] == 3 and summary["error_kinds"] == {"http_429": 3}


def test_unreachable_endpoint_counts_errors_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = _free_port()
    summary_path = tmp_path / "s.json"
    started = time.monotonic()
    code = load_test.main(
        [
            "--endpoint",
            f"http://127.0.0.1:{port}/generate",
            "--concurrency",
            "3",
            "--duration",
            "500ms",
            "--summary-json",
            str(summary_path),
            "--no-progress",
        ]
    )
    assert code == 1
    assert time.monotonic() - started < 5
    summary = json.loads(summary_path.read_text())
    assert summary["ok"] == 0 and summary["errors"] > 0
    assert set(summary["error_kinds"]) == {"connect"}
    # The connect back-off keeps a refused port from producing a flood of errors.
    assert summary["errors"] < 100
    assert "could not connect" in capsys.readouterr().out


def test_progress_bar_goes_to_stderr(server: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    code = load_test.main(["--endpoint", f"{server.base_url}/generate", "--requests", "2", "--duration", "5s"])
    assert code == 0
    captured = capsys.readouterr()
    assert "done=2" in captured.err and "errors=0" in captured.err
    assert "done=" not in captured.out


# ------------------------------------------------------------------------------------------
# OpenAI endpoints through run_load()
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_openai_streaming(server: FakeServer, path: str) -> None:
    config = LoadTestConfig(
        endpoint=f"{server.base_url}{path}",
        concurrency=2,
        duration_s=10.0,
        max_requests=4,
        max_tokens=16,
        prompts=["hello"],
        progress=False,
    )
    records = asyncio.run(run_load(config))
    assert [r.index for r in records] == [0, 1, 2, 3]
    for record in records:
        assert record.ok, record.error
        assert record.output_tokens == TOKENS_PER_REQUEST + 1  # usage wins over the chunk count
        assert record.prompt_tokens == PROMPT_TOKENS
        assert record.ttft_s is not None and record.e2e_s is not None
        assert 0 < record.ttft_s <= record.e2e_s
        assert len(record.itls_s) == TOKENS_PER_REQUEST - 1  # one ITL per chunk after the first
    bodies = [s["body"] for s in server.seen if s["path"] == path][-4:]
    for body in bodies:
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["model"] == "fake-model"  # discovered from /v1/models
        if "chat" in path:
            assert body["messages"] == [{"role": "user", "content": "hello"}]
        else:
            assert body["prompt"] == "hello"
    summary = summarize(records)
    assert summary["requests"] == 4 and summary["output_tokens_per_s"] > 0


def test_generate_itl_divides_multi_token_events(server: FakeServer) -> None:
    config = LoadTestConfig(
        endpoint=f"{server.base_url}/generate",
        concurrency=1,
        duration_s=10.0,
        max_requests=1,
        max_tokens=16,
        progress=False,
    )
    (record,) = asyncio.run(run_load(config))
    assert record.ok and record.output_tokens == TOKENS_PER_REQUEST
    assert record.finish_reason == "length"
    # Events carry 1, 2, 1, 1 tokens: every token after the first event has one ITL value, and
    # the two tokens of the second event share that event's gap equally.
    assert len(record.itls_s) == TOKENS_PER_REQUEST - 1
    assert record.itls_s[0] == record.itls_s[1]
    # Divided gaps add up to the first-to-last token span, which fits inside e2e - TTFT; an
    # undivided gap would count the second event's gap twice and overshoot by >= 10 ms.
    assert record.ttft_s is not None and record.e2e_s is not None
    assert sum(record.itls_s) <= record.e2e_s - record.ttft_s + 1e-9


def test_text_with_unicode_line_separators_is_one_event(server: FakeServer) -> None:
    """SSE lines end at CR, LF or CRLF only: U+2028, U+2029 and U+0085 inside a token's JSON text do
    not cut its event (httpx's aiter_lines did: "invalid JSON in SSE event")."""
    config = LoadTestConfig(
        endpoint=f"{server.base_url}/unicode/generate", concurrency=1, duration_s=10.0, max_requests=1,
        progress=False,
    )
    (record,) = asyncio.run(run_load(config))
    assert record.ok, record.error
    assert record.output_tokens == 3 and record.finish_reason == "stop"


# ------------------------------------------------------------------------------------------
# Argument errors and pure helpers
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--duration", "abc"], "--duration"),
        (["--duration", "0s"], "--duration"),
        (["--duration", "-5"], "--duration"),
        (["--concurrency", "0"], "--concurrency"),
        (["--requests", "x"], "--requests"),
        (["--header", "no-colon"], "--header"),
        (["--timeout", "soon"], "--timeout"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    args: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc_info:
        load_test.main(["--endpoint", "http://127.0.0.1:1/generate", *args])
    assert exc_info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "endpoint", ["http://127.0.0.1:1/other", "localhost:8000/generate", "ws://127.0.0.1/generate"]
)
def test_bad_endpoint_exit_2(endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        load_test.main(["--endpoint", endpoint])
    assert exc_info.value.code == 2
    assert "argument --endpoint" in capsys.readouterr().err


def test_missing_endpoint_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        load_test.main(["--concurrency", "2"])
    assert exc_info.value.code == 2
    assert "--endpoint" in capsys.readouterr().err


def test_empty_prompts_file_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(SystemExit) as exc_info:
        load_test.main(["--endpoint", "http://127.0.0.1:1/generate", "--prompts-file", str(empty)])
    assert exc_info.value.code == 2
    assert "--prompts-file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("60s", 60.0), ("2m", 120.0), ("90", 90.0), ("500ms", 0.5), ("1.5s", 1.5), ("1h", 3600.0)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert load_test.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("http://h:8000/generate", "generate"),
        ("http://h:8000/api/generate/", "generate"),
        ("https://h/v1/completions", "completions"),
        ("http://h/v1/chat/completions", "chat"),
    ],
)
def test_endpoint_kind(url: str, kind: str) -> None:
    assert load_test.endpoint_kind(url) == kind


def test_summarize_synthetic_records() -> None:
    records = [
        RequestRecord(
            index=i,
            start_s=i * 0.1,
            ok=True,
            http_status=200,
            ttft_s=0.01 * (i + 1),
            e2e_s=0.1 * (i + 1),
            output_tokens=10,
            prompt_tokens=4,
            itls_s=[0.005] * 9,
        )
        for i in range(10)
    ]
    failed = RequestRecord(index=10, start_s=1.0, http_status=429, e2e_s=0.01)
    failed.fail("http_429", "busy")
    summary = summarize([*records, failed], duration_s=2.0)
    assert summary["requests"] == 11 and summary["ok"] == 10 and summary["errors"] == 1
    assert summary["error_kinds"] == {"http_429": 1}
    assert summary["error_examples"] == {"http_429": "busy"}
    assert summary["requests_per_s"] == pytest.approx(5.0)
    assert summary["output_tokens_per_s"] == pytest.approx(50.0)
    assert summary["prompt_tokens"] == 40
    assert summary["ttft_ms"]["mean"] == pytest.approx(55.0)
    assert summary["e2e_ms"]["p50"] == pytest.approx(550.0)
    assert summary["itl_ms"]["p99"] == pytest.approx(5.0)
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        _assert_ordered(summary[key])
    json.dumps(summary)  # JSON-safe (no numpy scalars)
    text = load_test.format_summary(summary)
    assert "http_429: 1" in text and "5.00 req/s" in text

    # Without a duration, the span of the records is used.
    assert summarize(records)["duration_s"] == pytest.approx(0.9 + 1.0)
    assert summarize([])["requests"] == 0
