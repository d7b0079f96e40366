"""Errors a worker answers with: an HTTP status and a JSON message, never a traceback."""
from __future__ import annotations

from typing import Any


class WorkerError(Exception):
    """A request the worker refuses or cannot finish; maps to `{"error": {...}}` with `status`."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind

    def to_json(self) -> dict[str, Any]:
        """The JSON body sent to the client."""
        return {"error": {"message": self.message, "type": self.kind, "code": self.status}}


def bad_request(message: str) -> WorkerError:
    """400: the request itself is wrong."""
    return WorkerError(400, message)


def overloaded(message: str) -> WorkerError:
    """429: try again later (queue or KV pool full)."""
    return WorkerError(429, message, "overloaded")


class StartupError(Exception):
    """The worker cannot start (bad model, missing RDMA device, port in use); printed without traceback."""
