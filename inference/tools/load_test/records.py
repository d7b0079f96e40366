"""One request's client-side measurements (:class:`RequestRecord`), the unit every report aggregates."""

from __future__ import annotations

from dataclasses import dataclass, field

# Error bodies can be large HTML pages; the summary only needs the gist.
_ERROR_MESSAGE_MAX_CHARS = 300


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
