"""Whether a streaming client's connection is still open, asked between two events.

The server (uvicorn) notices a client that closed its socket when its event loop next reads from
it, or when a write to it fails; it then marks the request's cycle `disconnected` and drops every
later `send` silently, and only later does the consumer's own receive loop see `http.disconnect`
and cancel the handler. Until then the handler would go on relaying tokens into nothing, and
crediting the decode worker for them (inference/server/credit.py), so the worker could generate
further for a client that is gone. Asked after each send, this tells the handler at once.

It reads the uvicorn request cycle behind the ASGI `send` callable (its `disconnected` flag and
its transport's `is_closing`); under another server it always answers "open" and the handler
relies on `http.disconnect` alone.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class _Transport(Protocol):
    def is_closing(self) -> bool: ...


def client_gone_probe(send: Callable[..., Any]) -> Callable[[], bool]:
    """A cheap check of whether the client behind `send` has gone (its connection closed or broken)."""
    cycle = getattr(send, "__self__", None)
    transport: _Transport | None = getattr(cycle, "transport", None)
    if cycle is None or transport is None or not hasattr(cycle, "disconnected") \
            or not callable(getattr(transport, "is_closing", None)):
        return _never_gone

    def gone() -> bool:
        # `disconnected`: connection_lost ran; `is_closing`: a write already failed (a reset
        # socket) or the connection is being closed, one loop pass before connection_lost.
        return bool(cycle.disconnected) or transport.is_closing()

    return gone


def _never_gone() -> bool:
    return False
