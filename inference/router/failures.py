"""How the router classifies what went wrong with a worker call.

A worker's answer is either the request's fault (passed through to the client: RouterError), a
full worker (`Busy`: try another or queue), a lost KV lease (`LeaseExpired`: reserve again), or a
failure of that worker (`BackendFailure`: count it and try another).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from inference.router.errors import RouterError

if TYPE_CHECKING:
    from inference.router.endpoint import Endpoint

# Transport errors of a worker call (aiohttp's, and the OS errors it lets through).
TRANSPORT_ERRORS = (aiohttp.ClientError, OSError)

# How much of a worker's error body is quoted back to the client.
MAX_ERROR_TEXT = 500


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    """What one worker did to a request before its first token, as the client's error names it."""

    url: str
    role: str
    error: str
    # The decode worker's lease ran out because the prefill side made no progress (nothing is
    # broken; a request whose every failure is one of these is a 504, not a 502).
    lease: bool = False

    def backend(self) -> dict[str, Any]:
        """The entry of RouterError's `backends`."""
        return {"url": self.url, "role": self.role, "error": self.error}


def backends(failures: list[WorkerFailure]) -> list[dict[str, Any]]:
    """RouterError's `backends` for `failures`."""
    return [f.backend() for f in failures]


class BackendFailure(Exception):
    """A worker failed in a way that says nothing about the request: try another worker."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class DecodePeerFailure(BackendFailure):
    """The prefill worker could not write the KV into the decode worker (it closed or vanished).

    Says nothing against the prefill worker: the decode side of the attempt is what failed, so the
    request starts over with another decode worker.
    """


class Busy(Exception):
    """A worker answered 429: it is alive but full, so another one may take the request."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class LeaseExpired(Exception):
    """The decode worker's lease on the reserved blocks ran out before the KV arrived.

    The decode worker is fine (it freed the blocks as specified); the request needs a fresh
    reservation. `stalled` is the prefill worker that held the request when the lease ran out,
    if any: it made no progress in time and is not tried again for this request.
    """

    def __init__(self, message: str, stalled: Endpoint | None = None, line: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.stalled = stalled
        self.line = line  # the decode worker's kv_timeout line, when it reported the loss


def error_message(raw: bytes) -> tuple[str, str | None]:
    """The message and `type` of a worker's error body (`{"error": {...}}` or plain text)."""
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        body = orjson.loads(text)
    except ValueError:
        return (text[:MAX_ERROR_TEXT] or "(empty body)"), None
    if isinstance(body, dict):
        error = body.get("error", body.get("detail"))
        if isinstance(error, dict) and "message" in error:
            kind = error.get("type")
            return str(error["message"])[:MAX_ERROR_TEXT], kind if isinstance(kind, str) else None
        if isinstance(error, str):
            return error[:MAX_ERROR_TEXT], None
    return text[:MAX_ERROR_TEXT], None


def raise_for_status(status: int, raw: bytes, role: str) -> None:
    """Classify a non-200 answer: passthrough (RouterError), busy (429), lost lease or worker failure."""
    message, kind = error_message(raw)
    if status == 429:
        raise Busy(message)
    if role == "prefill" and status == 409 and kind == "lease_expired":
        # Nobody's fault here (a previous prefill worker took the time): reserve again.
        raise LeaseExpired(message)
    if role == "prefill" and kind == "kv_transfer_error":
        raise DecodePeerFailure(f"the prefill worker could not deliver the KV: {message}")
    # The decode worker validates the request (prompt length, sampling values): its 4xx is the
    # client's error, except 401/403, which say the router's shared secret is wrong. A prefill
    # worker sees an already validated request, so only its 400 is the request's fault;
    # 401/404/409... mean that one worker is misconfigured.
    client_error = status == 400 or (role == "decode" and 400 <= status < 500 and status not in (401, 403))
    if client_error:
        raise RouterError(status, message, error_type=kind)
    raise BackendFailure(f"HTTP {status}: {message}")


def kv_timeout_message(line: Mapping[str, Any], prefill_url: str | None) -> str:
    """What a decode worker's `reason: kv_timeout` line means, naming the prefill worker that held it.

    The decode worker's message already says which prefill worker went silent, for how long and
    what it last reported (its `silent_s` / `last_progress` fields); it is passed on as it is, with
    the router's name for that worker when the worker did not give one.
    """
    detail = str(line.get("message") or "the KV cache did not arrive within the lease")
    if prefill_url is None or prefill_url in detail:
        return detail
    if "made no progress" in detail:
        return f"{detail} (routed to prefill worker {prefill_url})"
    silent = line.get("silent_s")
    if isinstance(silent, int | float) and not isinstance(silent, bool):
        return f"prefill worker {prefill_url} made no progress for {silent:.1f}s: {detail}"
    return f"prefill worker {prefill_url} made no progress within the lease: {detail}"
