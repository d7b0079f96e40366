"""Errors the router reports to its clients."""
from __future__ import annotations

from typing import Any

# The OpenAI-style `type` of an error, by HTTP status; the public API answers these shapes.
_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "backend_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_type_for(status: int) -> str:
    """The error `type` string the public API uses for an HTTP status."""
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


class RouterError(Exception):
    """A request the router cannot serve, with the HTTP status and message the client should see.

    `backends` lists what went wrong with each worker tried (`{"url", "role", "error"}`), so a
    502 tells the operator which endpoints were unreachable and why.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str | None = None,
        backends: list[dict[str, Any]] | None = None,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type or error_type_for(status)
        self.backends = backends or []
        self.code = code  # OpenAI's machine-readable `code`, e.g. "model_not_found"
        self.param = param  # the request field at fault, as OpenAI reports it

    def to_dict(self) -> dict[str, Any]:
        """The JSON body of the error response: `{"error": {"message", "type", "backends"?}}`."""
        error: dict[str, Any] = {"message": self.message, "type": self.error_type}
        if self.code is not None:
            error["code"] = self.code
        if self.param is not None:
            error["param"] = self.param
        if self.backends:
            error["backends"] = self.backends
        return {"error": error}

    def __repr__(self) -> str:
        return f"RouterError(status={self.status}, message={self.message!r})"
