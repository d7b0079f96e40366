"""One timed request: send it, read its stream, turn every outcome into a :class:`RequestRecord`."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from inference.tools.load_test.config import LoadTestConfig
from inference.tools.load_test.endpoints import models_url
from inference.tools.load_test.payloads import request_body
from inference.tools.load_test.records import RequestRecord
from inference.tools.load_test.sse import read_sse
from inference.tools.load_test.streams import StreamError, stream_for


def error_message_from_body(raw: bytes) -> str:
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


async def send_one(
    client: httpx.AsyncClient,
    config: LoadTestConfig,
    index: int,
    run_start: float,
    model: str | None,
) -> RequestRecord:
    """Send request number ``index`` and measure it; never raises except on cancellation."""
    kind = config.api_kind
    prompt = config.prompts[index % len(config.prompts)]
    body = request_body(kind, prompt, max_tokens=config.max_tokens, temperature=config.temperature, model=model)
    start = time.perf_counter()
    record = RequestRecord(index=index, start_s=start - run_start)
    state = stream_for(kind, start)
    try:
        # httpx's timeout is per network operation; this one bounds the whole request, so a
        # server that trickles tokens forever cannot hold a worker past --timeout.
        async with asyncio.timeout(config.timeout_s):
            async with client.stream("POST", config.endpoint, json=body) as response:
                record.http_status = response.status_code
                if response.status_code != 200:
                    raw = await response.aread()
                    record.fail(f"http_{response.status_code}", error_message_from_body(raw))
                else:
                    await read_sse(response, state)
                    if state.done:
                        record.ok = True
                    else:
                        record.fail("incomplete", "stream ended without data: [DONE]")
    except TimeoutError:
        record.fail("timeout", f"no complete response within {config.timeout_s:g} s")
    except StreamError as exc:
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


async def discover_model(client: httpx.AsyncClient, endpoint: str) -> str | None:
    """First model id from ``/v1/models`` next to an OpenAI endpoint, or ``None``."""
    try:
        response = await client.get(models_url(endpoint), timeout=10.0)
        if response.status_code == 200:
            data = response.json().get("data") or []
            if data and isinstance(data[0], dict) and data[0].get("id"):
                return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, AttributeError):
        pass  # the request itself will report the real problem
    return None
