"""Closed-loop HTTP load generator for the router (the ``load_test`` console script).

``concurrency`` client tasks each loop "send one streaming request, wait for its end" until the
duration or the request budget is spent, so the offered load is exactly ``concurrency`` requests
in flight. Every request is timed from the client side (TTFT, inter-token latency, end-to-end) by
reading the Server-Sent Events stream of either our JSON API (``/generate``, ``/api/generate``) or
the OpenAI API (``/v1/completions``, ``/v1/chat/completions``).

Example::

    load_test --endpoint http://localhost:8000/generate --concurrency 100 --duration 60s \\
        --metrics-file benchmark.csv

Reusable pieces: :class:`LoadTestConfig`, :func:`run_load`, :class:`RequestRecord`,
:func:`summarize`, :func:`write_metrics_csv`, :func:`plot_metrics`, :func:`format_summary`.
This module must stay Django-free: it is a plain client of the public HTTP API.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import math
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import httpx
import numpy as np

ApiKind = Literal["generate", "completions", "chat"]

#: Built-in prompts: varied lengths and topics so that prefill cost is not one constant.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "Hello, my name is",
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain in simple terms how a transformer neural network processes a sentence.",
    "List three tips for staying productive when working from home.",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    "Translate to French: The weather is nice today and I would like to go for a walk.",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "What are the main differences between TCP and UDP? Answer briefly.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "The three primary colors are",
    "Q: If a train travels 120 km in 1.5 hours, what is its average speed?\nA:",
)

#: CSV columns written by :func:`write_metrics_csv`, one row per request.
CSV_COLUMNS: tuple[str, ...] = (
    "index",
    "start_s",
    "status",
    "http_status",
    "ttft_s",
    "e2e_s",
    "output_tokens",
    "prompt_tokens",
    "itl_mean_s",
    "error",
)

# Connection failures come back in microseconds; without a pause a refused port would make each
# worker spin and log millions of identical errors. The pause doubles up to this cap.
_CONNECT_BACKOFF_START_S = 0.05
_CONNECT_BACKOFF_MAX_S = 1.0
# Error bodies can be large HTML pages; the summary only needs the gist.
_ERROR_MESSAGE_MAX_CHARS = 300
# SSE line terminators (and only these: https://html.spec.whatwg.org/multipage/server-sent-events.html).
_SSE_LINE_BREAK = re.compile(rb"\r\n|\r|\n")


# --------------------------------------------------------------------------------------------
# Configuration and records
# --------------------------------------------------------------------------------------------


@dataclass
class LoadTestConfig:
    """Everything :func:`run_load` needs; built from the command line by :func:`main`.

    ``duration_s`` bounds the time during which new requests are started; requests still in
    flight at the deadline are allowed to finish (each bounded by ``timeout_s``).
    ``max_requests`` optionally caps the total number of requests; whichever limit is reached
    first ends the run.
    """

    endpoint: str
    concurrency: int = 1
    duration_s: float = 60.0
    max_requests: int | None = None
    max_tokens: int = 64
    prompts: Sequence[str] = DEFAULT_PROMPTS
    model: str | None = None
    temperature: float | None = None
    timeout_s: float = 120.0
    headers: dict[str, str] = field(default_factory=dict)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.concurrency <= 0:
            raise ValueError("concurrency must be > 0")
        if not self.duration_s > 0:
            raise ValueError("duration_s must be > 0")
        if self.max_requests is not None and self.max_requests <= 0:
            raise ValueError("max_requests must be > 0")
        if self.max_tokens <= 0:
            raise ValueError("max_tokens must be > 0")
        if not self.timeout_s > 0:
            raise ValueError("timeout_s must be > 0")
        if not self.prompts:
            raise ValueError("prompts must not be empty")
        endpoint_kind(self.endpoint)  # raises ValueError on an unsupported URL

    @property
    def api_kind(self) -> ApiKind:
        """Which wire format the endpoint speaks."""
        return endpoint_kind(self.endpoint)


@dataclass
class RequestRecord:
    """Client-side measurements of one request.

    Times are in seconds; ``start_s`` is relative to the start of the run. ``e2e_s`` is set for
    failed requests too (time until the failure was seen), but only successful requests enter
    the latency statistics. ``itls_s`` holds one inter-token latency per token after the first
    token event (a gap covering *n* tokens contributes *n* values of gap / *n*).
    """

    index: int
    start_s: float
    ok: bool = False
    http_status: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    itls_s: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error_kind: str | None = None
    error: str | None = None

    @property
    def status(self) -> str:
        """``"ok"`` or ``"error"``."""
        return "ok" if self.ok else "error"

    @property
    def itl_mean_s(self) -> float | None:
        """Mean inter-token latency of this request, ``None`` with fewer than two tokens."""
        return sum(self.itls_s) / len(self.itls_s) if self.itls_s else None

    def fail(self, kind: str, message: str) -> None:
        """Mark the request failed with an error kind (used for counting) and a message."""
        self.ok = False
        self.error_kind = kind
        self.error = message[:_ERROR_MESSAGE_MAX_CHARS]


class _StreamError(Exception):
    """The server reported an error inside an otherwise successful (HTTP 200) stream."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


# --------------------------------------------------------------------------------------------
# Small parsers (also used as argparse types)
# --------------------------------------------------------------------------------------------

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Parse ``"60s"``, ``"2m"``, ``"90"`` (seconds), ``"500ms"`` or ``"1h"`` into seconds (> 0).

    Raises ``ValueError`` on anything else.
    """
    match = _DURATION_RE.match(text)
    if not match:
        raise ValueError(f"invalid duration {text!r}: use e.g. 60s, 2m, 90 or 500ms")
    seconds = float(match.group(1)) * _DURATION_UNITS[(match.group(2) or "s").lower()]
    if not seconds > 0 or not math.isfinite(seconds):
        raise ValueError(f"invalid duration {text!r}: must be > 0")
    return seconds


def endpoint_kind(url: str) -> ApiKind:
    """Classify an endpoint URL by its path; raises ``ValueError`` when unsupported.

    ``.../generate`` and ``.../api/generate`` are our JSON API, ``.../v1/completions`` and
    ``.../v1/chat/completions`` the OpenAI one.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"invalid endpoint {url!r}: expected an http:// or https:// URL")
    path = parts.path.rstrip("/")
    if path.endswith("/v1/chat/completions"):
        return "chat"
    if path.endswith("/v1/completions"):
        return "completions"
    if path.endswith("/generate"):
        return "generate"
    raise ValueError(
        f"invalid endpoint {url!r}: the path must end in /generate, /api/generate, "
        "/v1/completions or /v1/chat/completions"
    )


def parse_header(text: str) -> tuple[str, str]:
    """Split ``"Name: value"`` into ``("Name", "value")``; raises ``ValueError`` otherwise."""
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"invalid header {text!r}: expected 'Name: value'")
    return name.strip(), value.strip()


def _argparse_type(func: Any, name: str) -> Any:
    """Wrap a ``ValueError``-raising parser so argparse reports it against the flag."""

    def convert(text: str) -> Any:
        try:
            return func(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name  # argparse uses the name in its fallback message
    return convert


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"invalid value {text!r}: expected a positive integer") from None
    if value <= 0:
        raise ValueError(f"invalid value {text!r}: must be > 0")
    return value


def _endpoint_value(text: str) -> str:
    endpoint_kind(text)  # validation only
    return text


def _timeout_value(text: str) -> float:
    # --timeout accepts the same spellings as --duration ("120s", "2m", "90").
    return parse_duration(text)


# --------------------------------------------------------------------------------------------
# One request
# --------------------------------------------------------------------------------------------


def _request_body(config: LoadTestConfig, kind: ApiKind, prompt: str, model: str | None) -> dict[str, Any]:
    """The JSON body of one streaming request in the endpoint's format."""
    body: dict[str, Any]
    if kind == "generate":
        body = {"prompt": prompt, "max_tokens": config.max_tokens, "stream": True}
    else:
        body = {"max_tokens": config.max_tokens, "stream": True}
        # Ask for the usage chunk: the only exact output token count OpenAI streams carry.
        body["stream_options"] = {"include_usage": True}
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if model:
            body["model"] = model
    if config.temperature is not None:
        body["temperature"] = config.temperature
    return body


def _error_message_from_body(raw: bytes) -> str:
    """Best-effort short message from an error response (JSON ``error.message`` or text)."""
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return text or "(empty body)"
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail"))
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
    return text


class _StreamState:
    """Accumulates timings and token counts while one SSE stream is read."""

    def __init__(self, kind: ApiKind, start: float) -> None:
        self.kind = kind
        self.start = start
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.itls: list[float] = []
        self.chunks = 0  # events that carried text or tokens
        self.token_id_count = 0
        self.saw_token_ids = False
        self.usage_completion: int | None = None
        self.usage_prompt: int | None = None
        self.finish_reason: str | None = None
        self.done = False
        self.done_at: float | None = None

    def on_tokens(self, n_tokens: int, now: float) -> None:
        """Record a token event carrying ``n_tokens`` (>= 1) tokens received at ``now``."""
        self.chunks += 1
        if self.first_token_at is None:
            self.first_token_at = now
        elif self.last_token_at is not None:
            per_token = (now - self.last_token_at) / n_tokens
            self.itls.extend([per_token] * n_tokens)
        self.last_token_at = now

    def on_usage(self, usage: Any) -> None:
        """Take token counts from a ``usage`` object when present."""
        if not isinstance(usage, dict):
            return
        completion = usage.get("completion_tokens")
        prompt = usage.get("prompt_tokens")
        if isinstance(completion, int):
            self.usage_completion = completion
        if isinstance(prompt, int):
            self.usage_prompt = prompt

    def handle(self, data: str, now: float) -> None:
        """Process the ``data`` payload of one SSE event."""
        if data.strip() == "[DONE]":
            self.done = True
            self.done_at = now
            return
        try:
            obj = json.loads(data)
        except ValueError:
            raise _StreamError("bad_response", f"invalid JSON in SSE event: {data[:100]!r}") from None
        if not isinstance(obj, dict):
            raise _StreamError("bad_response", f"unexpected SSE event: {data[:100]!r}")
        if obj.get("error"):
            err = obj["error"]
            message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            raise _StreamError("stream_error", str(message))
        self.on_usage(obj.get("usage"))
        if self.kind == "generate":
            self._handle_generate(obj, now)
        else:
            self._handle_openai(obj, now)

    def _handle_generate(self, obj: dict[str, Any], now: float) -> None:
        if obj.get("finish_reason"):
            self.finish_reason = str(obj["finish_reason"])
        token_ids = obj.get("token_ids")
        text = obj.get("text") or ""
        if isinstance(token_ids, list):
            self.saw_token_ids = True
            n_tokens = len(token_ids)
            self.token_id_count += n_tokens
        elif text and not obj.get("finish_reason"):
            # No token ids: count the chunk as one token. The final event is skipped because a
            # server may repeat the whole text there.
            n_tokens = 1
        else:
            n_tokens = 0
        if n_tokens:
            self.on_tokens(n_tokens, now)

    def _handle_openai(self, obj: dict[str, Any], now: float) -> None:
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return  # e.g. the trailing usage-only chunk
        choice = choices[0]
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])
        if self.kind == "chat":
            delta = choice.get("delta")
            text = (delta.get("content") if isinstance(delta, dict) else None) or ""
        else:
            text = choice.get("text") or ""
        token_ids = choice.get("token_ids")
        if isinstance(token_ids, list) and token_ids:
            # Non-standard but exact; some servers (ours included, possibly) send it.
            self.saw_token_ids = True
            self.token_id_count += len(token_ids)
            self.on_tokens(len(token_ids), now)
        elif text:
            self.on_tokens(1, now)

    def output_tokens(self) -> int:
        """Output token count: token ids (our API) or usage (OpenAI), else the chunk count."""
        if self.kind == "generate":
            if self.saw_token_ids:
                return self.token_id_count
            if self.usage_completion is not None:
                return self.usage_completion
            return self.chunks
        if self.usage_completion is not None:
            return self.usage_completion
        if self.saw_token_ids:
            return self.token_id_count
        return self.chunks


async def _sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
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


async def _read_sse(response: httpx.Response, state: _StreamState) -> None:
    """Read a Server-Sent Events body and feed each event's data to ``state``."""
    data_lines: list[str] = []
    async for line in _sse_lines(response.aiter_bytes()):
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


async def _send_one(
    client: httpx.AsyncClient,
    config: LoadTestConfig,
    index: int,
    run_start: float,
    model: str | None,
) -> RequestRecord:
    """Send request number ``index`` and measure it; never raises except on cancellation."""
    kind = config.api_kind
    prompt = config.prompts[index % len(config.prompts)]
    body = _request_body(config, kind, prompt, model)
    start = time.perf_counter()
    record = RequestRecord(index=index, start_s=start - run_start)
    state = _StreamState(kind, start)
    try:
        # httpx's timeout is per network operation; this one bounds the whole request, so a
        # server that trickles tokens forever cannot hold a worker past --timeout.
        async with asyncio.timeout(config.timeout_s):
            async with client.stream("POST", config.endpoint, json=body) as response:
                record.http_status = response.status_code
                if response.status_code != 200:
                    raw = await response.aread()
                    record.fail(f"http_{response.status_code}", _error_message_from_body(raw))
                else:
                    await _read_sse(response, state)
                    if state.done:
                        record.ok = True
                    else:
                        record.fail("incomplete", "stream ended without data: [DONE]")
    except TimeoutError:
        record.fail("timeout", f"no complete response within {config.timeout_s:g} s")
    except _StreamError as exc:
        record.fail(exc.kind, str(exc))
    except httpx.ConnectError as exc:
        record.fail("connect", f"cannot connect to {config.endpoint}: {exc}")
    except httpx.ConnectTimeout as exc:
        record.fail("connect", f"connect timeout to {config.endpoint}: {exc}")
    except httpx.TimeoutException as exc:
        record.fail("timeout", f"{type(exc).__name__}: {exc}")
    except httpx.RemoteProtocolError as exc:
        record.fail("protocol", f"{type(exc).__name__}: {exc}")
    except httpx.HTTPError as exc:
        record.fail("network", f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001 - one odd response must not kill a worker
        record.fail("client_error", f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    record.e2e_s = (state.done_at or end) - start
    if state.first_token_at is not None:
        record.ttft_s = state.first_token_at - start
    record.itls_s = state.itls
    record.output_tokens = state.output_tokens()
    record.prompt_tokens = state.usage_prompt
    record.finish_reason = state.finish_reason
    return record


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


class _RunState:
    """Shared by the workers: the request counter, the deadline and the results."""

    def __init__(self, config: LoadTestConfig, stop: asyncio.Event) -> None:
        self.config = config
        self.stop = stop
        self.start = time.perf_counter()
        self.deadline = self.start + config.duration_s
        self.next_index = 0
        self.records: list[RequestRecord] = []
        self.ok = 0
        self.errors = 0

    def claim(self) -> int | None:
        """Next request index, or ``None`` once the time or request budget is spent.

        Safe without a lock: all workers run on one event loop and this does not await.
        """
        if self.stop.is_set() or time.perf_counter() >= self.deadline:
            return None
        if self.config.max_requests is not None and self.next_index >= self.config.max_requests:
            return None
        index = self.next_index
        self.next_index += 1
        return index

    def add(self, record: RequestRecord) -> None:
        """Store a finished request."""
        self.records.append(record)
        if record.ok:
            self.ok += 1
        else:
            self.errors += 1


async def _worker(client: httpx.AsyncClient, run: _RunState, model: str | None) -> None:
    """One closed-loop client: a request, wait for it, the next one, until the budget ends."""
    backoff = 0.0
    while (index := run.claim()) is not None:
        record = await _send_one(client, run.config, index, run.start, model)
        run.add(record)
        if record.error_kind == "connect":
            backoff = min(_CONNECT_BACKOFF_MAX_S, backoff * 2 or _CONNECT_BACKOFF_START_S)
            # Never sleep past the deadline: the run should end on time.
            pause = min(backoff, run.deadline - time.perf_counter())
            if pause > 0:
                try:
                    await asyncio.wait_for(run.stop.wait(), timeout=pause)
                except TimeoutError:
                    pass
        else:
            backoff = 0.0


async def _progress(run: _RunState) -> None:
    """Time-based tqdm bar on stderr showing requests done and errors; cancelled at the end."""
    from tqdm import tqdm

    total = run.config.duration_s
    bar = tqdm(
        total=total,
        file=sys.stderr,
        unit="s",
        dynamic_ncols=True,
        bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s [{elapsed}] {postfix}",
        desc="load_test",
    )
    try:
        while True:
            elapsed = time.perf_counter() - run.start
            bar.n = min(elapsed, total)
            inflight = run.next_index - len(run.records)
            phase = " draining" if elapsed >= total or run.stop.is_set() else ""
            bar.set_postfix_str(f"done={run.ok} errors={run.errors} in_flight={inflight}{phase}")
            await asyncio.sleep(0.25)
    finally:
        bar.n = min(time.perf_counter() - run.start, total)
        bar.set_postfix_str(f"done={run.ok} errors={run.errors}")
        bar.close()


async def _discover_model(client: httpx.AsyncClient, endpoint: str) -> str | None:
    """First model id from ``/v1/models`` next to an OpenAI endpoint, or ``None``."""
    parts = urlsplit(endpoint)
    path = parts.path.rstrip("/")
    base = path[: path.rfind("/v1/")] if "/v1/" in path else ""
    url = urlunsplit((parts.scheme, parts.netloc, base + "/v1/models", "", ""))
    try:
        response = await client.get(url, timeout=10.0)
        if response.status_code == 200:
            data = response.json().get("data") or []
            if data and isinstance(data[0], dict) and data[0].get("id"):
                return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, AttributeError):
        pass  # the request itself will report the real problem
    return None


async def run_load(config: LoadTestConfig, stop: asyncio.Event | None = None) -> list[RequestRecord]:
    """Run the load test described by ``config`` and return one record per request (by index).

    Exactly ``config.concurrency`` worker tasks run, each with its own keep-alive connection, so
    at most ``concurrency`` connections are open. Setting ``stop`` ends the run early: no new
    requests are started, requests in flight finish.
    """
    stop = stop or asyncio.Event()
    timeout = httpx.Timeout(config.timeout_s)
    # One single-connection AsyncClient per worker instead of one shared client with
    # max_connections=concurrency: httpcore 1.0.x rescans the whole pool (quadratically) on every
    # request start and end, which at concurrency 100 cost ~25 ms of client CPU per request and
    # made the load generator, not the server, the bottleneck. The total connection limit is
    # the same. One SSL context is shared because building one costs ~60 ms.
    ssl_context = httpx.create_ssl_context(trust_env=True)
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(
                    limits=limits,
                    timeout=timeout,
                    headers=config.headers,
                    verify=ssl_context,
                    # A proxy taken from the environment would be measured instead of the router.
                    trust_env=False,
                )
            )
            for _ in range(config.concurrency)
        ]
        model = config.model
        if model is None and config.api_kind != "generate":
            model = await _discover_model(clients[0], config.endpoint)
        run = _RunState(config, stop)
        progress = asyncio.create_task(_progress(run)) if config.progress else None
        try:
            workers = [asyncio.create_task(_worker(client, run, model)) for client in clients]
            await asyncio.gather(*workers)
        finally:
            if progress is not None:
                progress.cancel()
                try:
                    await progress
                except asyncio.CancelledError:
                    pass
    return sorted(run.records, key=lambda r: r.index)


# --------------------------------------------------------------------------------------------
# Summary, CSV, plot
# --------------------------------------------------------------------------------------------


def _stats_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean/p50/p90/p99/min/max in milliseconds (``None`` values when there is no data)."""
    if not values_s:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "min": None, "max": None}
    arr = np.asarray(values_s, dtype=float) * 1000.0
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {
        "mean": float(arr.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "min": float(arr.min()),
        "max": float(arr.max()),
    }


def summarize(records: Sequence[RequestRecord], duration_s: float | None = None) -> dict[str, Any]:
    """Aggregate request records into a JSON-safe summary dict.

    ``duration_s`` is the wall time of the run; when omitted it is the span from the first
    request start to the last request end. Throughputs count successful requests only.
    Latencies (``ttft_ms``, ``itl_ms``, ``e2e_ms``) are dicts with ``mean``, ``p50``, ``p90``,
    ``p99``, ``min``, ``max`` in milliseconds, over successful requests (ITL over all tokens).
    """
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    if duration_s is None:
        if records:
            first = min(r.start_s for r in records)
            last = max(r.start_s + (r.e2e_s or 0.0) for r in records)
            duration_s = last - first
        else:
            duration_s = 0.0
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_counts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    kinds = Counter(r.error_kind or "unknown" for r in failed)
    examples: dict[str, str] = {}
    for r in failed:
        examples.setdefault(r.error_kind or "unknown", r.error or "")
    per_s = (lambda n: n / duration_s) if duration_s and duration_s > 0 else (lambda n: 0.0)
    return {
        "duration_s": duration_s,
        "requests": len(records),
        "ok": len(ok),
        "errors": len(failed),
        "error_kinds": dict(kinds.most_common()),
        "error_examples": examples,
        "requests_per_s": per_s(len(ok)),
        "output_tokens": output_tokens,
        "output_tokens_per_s": per_s(output_tokens),
        "prompt_tokens": sum(prompt_counts) if prompt_counts else None,
        "mean_output_tokens": output_tokens / len(ok) if ok else None,
        "ttft_ms": _stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": _stats_ms([itl for r in ok for itl in r.itls_s]),
        "e2e_ms": _stats_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
    }


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_summary(summary: dict[str, Any], title: str | None = None) -> str:
    """Render a :func:`summarize` dict as a readable text table."""
    lines: list[str] = []
    if title:
        lines.append(title)
    lines.append(f"  {'Duration':<22}{summary['duration_s']:.2f} s")
    lines.append(
        f"  {'Requests':<22}{summary['requests']} total, {summary['ok']} ok, {summary['errors']} errors"
    )
    for kind, count in summary["error_kinds"].items():
        example = summary["error_examples"].get(kind, "")
        lines.append(f"  {'':<24}{kind}: {count}  (e.g. {example})")
    lines.append(f"  {'Request throughput':<22}{summary['requests_per_s']:.2f} req/s")
    lines.append(f"  {'Output throughput':<22}{summary['output_tokens_per_s']:.1f} tok/s")
    lines.append(
        f"  {'Output tokens':<22}{summary['output_tokens']} total, "
        f"{_fmt(summary['mean_output_tokens'])} per request"
    )
    if summary["prompt_tokens"] is not None:
        lines.append(f"  {'Prompt tokens':<22}{summary['prompt_tokens']} total")
    lines.append("")
    lines.append(f"  {'Latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for label, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("End-to-end", "e2e_ms")):
        s = summary[key]
        lines.append(
            f"  {label:<14}{_fmt(s['mean']):>10}{_fmt(s['p50']):>10}{_fmt(s['p90']):>10}{_fmt(s['p99']):>10}"
        )
    return "\n".join(lines)


def _csv_float(value: float | None) -> str:
    return "" if value is None else f"{value:.6f}"


def write_metrics_csv(records: Sequence[RequestRecord], path: str | Path) -> None:
    """Write one CSV row per request with the columns in :data:`CSV_COLUMNS`."""
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(CSV_COLUMNS)
        for r in records:
            error = f"{r.error_kind}: {r.error}" if r.error_kind else ""
            writer.writerow(
                [
                    r.index,
                    _csv_float(r.start_s),
                    r.status,
                    "" if r.http_status is None else r.http_status,
                    _csv_float(r.ttft_s),
                    _csv_float(r.e2e_s),
                    r.output_tokens,
                    "" if r.prompt_tokens is None else r.prompt_tokens,
                    _csv_float(r.itl_mean_s),
                    error,
                ]
            )


def _summary_line(summary: dict[str, Any]) -> str:
    return (
        f"{summary['ok']} ok / {summary['errors']} errors in {summary['duration_s']:.1f} s, "
        f"{summary['requests_per_s']:.2f} req/s, {summary['output_tokens_per_s']:.1f} tok/s\n"
        f"TTFT p50 {_fmt(summary['ttft_ms']['p50'])} ms, "
        f"ITL p50 {_fmt(summary['itl_ms']['p50'], 2)} ms, "
        f"E2E p50 {_fmt(summary['e2e_ms']['p50'])} / p99 {_fmt(summary['e2e_ms']['p99'])} ms"
    )


def plot_metrics(
    records: Sequence[RequestRecord],
    path: str | Path,
    summary: dict[str, Any] | None = None,
    title: str | None = None,
) -> None:
    """Save a PNG: latency over time (scatter) on top, TTFT and ITL histograms below."""
    # The object-oriented API with an explicit Agg canvas: no pyplot global state, no display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    summary = summary or summarize(records)
    fig = Figure(figsize=(12, 8), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 2)
    ax_time = fig.add_subplot(grid[0, :])
    ax_ttft = fig.add_subplot(grid[1, 0])
    ax_itl = fig.add_subplot(grid[1, 1])

    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    ax_time.scatter(
        [r.start_s for r in ok], [(r.e2e_s or 0.0) * 1000 for r in ok], s=8, alpha=0.6, label="end-to-end"
    )
    with_ttft = [r for r in ok if r.ttft_s is not None]
    ax_time.scatter(
        [r.start_s for r in with_ttft],
        [(r.ttft_s or 0.0) * 1000 for r in with_ttft],
        s=8,
        alpha=0.6,
        label="TTFT",
    )
    if failed:
        ax_time.scatter(
            [r.start_s for r in failed],
            [(r.e2e_s or 0.0) * 1000 for r in failed],
            s=14,
            marker="x",
            color="red",
            label="error",
        )
    ax_time.set_xlabel("request start (s since run start)")
    ax_time.set_ylabel("latency (ms)")
    ax_time.set_title("Latency over time")
    ax_time.grid(True, alpha=0.3)
    if records:
        ax_time.legend(loc="upper right")

    for ax, values, name in (
        (ax_ttft, [r.ttft_s * 1000 for r in with_ttft if r.ttft_s is not None], "TTFT"),
        (ax_itl, [itl * 1000 for r in ok for itl in r.itls_s], "Inter-token latency"),
    ):
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 5)), color="tab:blue", alpha=0.8)
            p50, p99 = np.percentile(values, [50, 99])
            ax.axvline(float(p50), color="black", linestyle="--", label=f"p50 {p50:.1f} ms")
            ax.axvline(float(p99), color="red", linestyle=":", label=f"p99 {p99:.1f} ms")
            ax.legend(loc="upper right")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(name)
        ax.set_xlabel("ms")
        ax.set_ylabel("count")

    heading = f"{title}\n" if title else ""
    fig.suptitle(heading + _summary_line(summary), fontsize=11)
    fig.savefig(str(path), dpi=100)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``load_test`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="load_test",
        description=(
            "Closed-loop load test of a streaming generation endpoint: --concurrency clients each "
            "send one request at a time until --duration (or --requests) is spent."
        ),
    )
    parser.add_argument(
        "--endpoint",
        required=True,
        type=_argparse_type(_endpoint_value, "endpoint"),
        help="URL ending in /generate or /api/generate (our SSE API) or /v1/completions or "
        "/v1/chat/completions (OpenAI streaming)",
    )
    parser.add_argument(
        "--concurrency",
        type=_argparse_type(_positive_int, "concurrency"),
        default=1,
        help="number of concurrent clients (default: 1)",
    )
    parser.add_argument(
        "--duration",
        type=_argparse_type(parse_duration, "duration"),
        default=60.0,
        help="how long to start new requests: 60s, 2m, 90 (seconds), 500ms (default: 60s)",
    )
    parser.add_argument(
        "--requests",
        type=_argparse_type(_positive_int, "requests"),
        default=None,
        help="stop after this many requests in total (whichever of this and --duration comes first)",
    )
    parser.add_argument(
        "--max-tokens",
        type=_argparse_type(_positive_int, "max-tokens"),
        default=64,
        help="max_tokens of each request (default: 64)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature to send (default: the server's)",
    )
    prompts = parser.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", default=None, help="send this prompt in every request")
    prompts.add_argument(
        "--prompts-file",
        default=None,
        help="file with one prompt a line, used round-robin (default: a built-in list)",
    )
    parser.add_argument(
        "--model", default=None, help="model name for /v1 endpoints (default: first of /v1/models)"
    )
    parser.add_argument("--metrics-file", default=None, help="per-request CSV output")
    parser.add_argument(
        "--plot",
        default=None,
        help="PNG plot output (default: the metrics file with .png; none without --metrics-file)",
    )
    parser.add_argument("--no-plot", action="store_true", help="do not write the plot")
    parser.add_argument("--summary-json", default=None, help="write the summary as JSON here")
    parser.add_argument(
        "--timeout",
        type=_argparse_type(_timeout_value, "timeout"),
        default=120.0,
        help="per-request time limit, e.g. 120s (default: 120s)",
    )
    parser.add_argument(
        "--header",
        action="append",
        default=[],
        type=_argparse_type(parse_header, "header"),
        help='extra HTTP header "Name: value" (repeatable)',
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def _load_prompts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        if not args.prompt:
            parser.error("argument --prompt: must not be empty")
        return [args.prompt]
    if args.prompts_file is not None:
        try:
            text = Path(args.prompts_file).read_text(encoding="utf-8")
        except OSError as exc:
            parser.error(f"argument --prompts-file: cannot read {args.prompts_file!r}: {exc.strerror}")
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if not lines:
            parser.error(f"argument --prompts-file: no prompts in {args.prompts_file!r}")
        return lines
    return list(DEFAULT_PROMPTS)


async def _run_with_signals(config: LoadTestConfig) -> tuple[list[RequestRecord], float]:
    """:func:`run_load` where Ctrl-C stops starting requests (a second one aborts)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:
        print(
            "\nload_test: stopping, waiting for requests in flight (Ctrl-C again to abort)", file=sys.stderr
        )
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)  # the next Ctrl-C is a plain KeyboardInterrupt

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        installed = True
    except (NotImplementedError, RuntimeError, ValueError):
        installed = False  # not the main thread / not supported: Ctrl-C just interrupts
    started = time.perf_counter()
    try:
        records = await run_load(config, stop)
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)
    return records, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``load_test`` console script; returns the process exit code.

    0 when at least one request succeeded, 1 when every request failed (or none was sent),
    2 on bad command-line arguments (via argparse).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    config = LoadTestConfig(
        endpoint=args.endpoint,
        concurrency=args.concurrency,
        duration_s=args.duration,
        max_requests=args.requests,
        max_tokens=args.max_tokens,
        prompts=_load_prompts(parser, args),
        model=args.model,
        temperature=args.temperature,
        timeout_s=args.timeout,
        headers=dict(args.header),
        progress=not args.no_progress,
    )
    started_at = datetime.now(UTC)
    records, elapsed = asyncio.run(_run_with_signals(config))
    summary = summarize(records, elapsed)
    summary.update(
        {
            "endpoint": config.endpoint,
            "concurrency": config.concurrency,
            "max_tokens": config.max_tokens,
            "started_at": started_at.isoformat(),
        }
    )

    title = (
        f"load_test {config.endpoint}: concurrency {config.concurrency}, "
        f"duration {config.duration_s:g} s"
        + (f", max {config.max_requests} requests" if config.max_requests else "")
    )
    print(format_summary(summary, title))
    if records and summary["ok"] == 0:
        kinds = summary["error_kinds"]
        if set(kinds) == {"connect"}:
            print(f"\nAll requests failed: could not connect to {config.endpoint} (is the router running?)")
        else:
            print("\nAll requests failed.")
    elif not records:
        print("\nNo request was sent.")

    if args.metrics_file:
        write_metrics_csv(records, args.metrics_file)
        print(f"Per-request metrics: {args.metrics_file}")
    plot_path = args.plot
    if plot_path is None and args.metrics_file:
        plot_path = str(Path(args.metrics_file).with_suffix(".png"))
    if plot_path and not args.no_plot:
        plot_metrics(records, plot_path, summary, title)
        print(f"Plot: {plot_path}")
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        print(f"Summary JSON: {args.summary_json}")
    return 0 if summary["ok"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
