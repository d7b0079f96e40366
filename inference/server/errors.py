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


# The exit status of a worker whose KV pool does not fit its host's memory (sysexits' EX_TEMPFAIL): the
# agent fails it at once and the controller places it on another node, where a restart here would fail
# the same way (every other startup error exits 1 and is restarted with backoff).
EXIT_KV_POOL_TOO_SMALL = 75


class StartupError(Exception):
    """The worker cannot start (bad model, missing RDMA device, port in use); printed without traceback,
    the process exiting with `exit_code`."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
