"""One worker endpoint as the router sees it: its URL, role, health and load.

What a request reads on its way through the policy and admission is computed when it changes, not
per request: an endpoint's decode slots when its health answer arrives, and a process-wide stamp
(`rotation_stamp`) moves whenever any endpoint goes in or out of rotation, so a pool can keep its
list of endpoints in rotation until the stamp moves (measured at 256 decode endpoints: the per-request
scan of every endpoint's health answer was most of the router's 250-290 µs per request).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from inference.wire.kv_events import WorkerLoad

ROLES = ("prefill", "decode")

# Unique, increasing values: a change made while a pool rebuilds its list still moves the stamp away
# from the one the pool read before rebuilding (`next` on a count is atomic under the GIL, which the
# health-check thread relies on).
_stamps = itertools.count(1)
_stamp = 0


def rotation_stamp() -> int:
    """A value that changes whenever any endpoint goes in or out of rotation (`healthy` flips)."""
    return _stamp


def _rotation_changed() -> None:
    global _stamp
    _stamp = next(_stamps)


def slots_for(batch_size: int) -> int:
    """Requests admitted to a decode worker of `batch_size`: the batch plus a quarter for prefill overlap."""
    return batch_size + max(1, batch_size // 4)


def reported_batch_size(health: dict[str, Any] | None) -> int | None:
    """The `batch_size` a worker's health answer reports, when it is a positive integer."""
    value = (health or {}).get("batch_size")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def normalize_url(url: str) -> str:
    """Validate a worker base URL and return it without a trailing slash.

    Only `http(s)://host[:port][/prefix]` is accepted: a query, a fragment or user info would be
    silently mangled when the router appends `/internal/...`, so they are refused.
    Raises ValueError with a message that says what is wrong.
    """
    text = url.strip()
    try:
        parts = urlsplit(text)
        port = parts.port  # raises ValueError for a non-numeric or out-of-range port
    except ValueError as exc:
        raise ValueError(f"{url!r} is not a valid URL: {exc}") from exc
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{url!r} is not an http(s) URL (expected e.g. http://10.0.0.5:8100)")
    if not parts.hostname:
        raise ValueError(f"{url!r} has no host")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{url!r} must not carry a query, fragment or credentials")
    if port == 0:
        raise ValueError(f"{url!r} has port 0")
    return text.rstrip("/")


@dataclass(eq=False)
class Endpoint:
    """A prefill or decode worker: where it is, whether it is in rotation, and its load.

    `inflight` counts requests this router process has open on the worker (the least-connections
    and power-of-two policies read it). `healthy` is False once the worker failed `N` requests in
    a row or failed a health check; only a healthy health check puts it back. Identity (not URL)
    equality is used on purpose: a pool may briefly hold an old and a new object for one URL.
    """

    url: str
    role: str
    inflight: int = 0
    consecutive_failures: int = 0
    last_error: str | None = None
    last_health_at: float | None = None
    total_requests: int = 0
    total_failures: int = 0
    # Health checks that timed out in a row: a late answer may be the router's own lateness, so
    # only `threshold` of them in a row (not one) take the worker out (see `record_health_timeout`).
    health_timeouts: int = 0
    # A decode worker that answered 429 gets no new request before this (time.monotonic()), unless
    # one of its requests finishes first: the router queues instead of hammering a full worker.
    full_until: float = 0.0
    # Requests admitted at once as the last health answer's batch size gives them (`slots_for`); 0
    # while no answer reported one (admission then uses its default). Set with `last_health`.
    slots: int = field(default=0, init=False)
    # Prompt tokens the prefills this router has in flight here still compute, as the kv-aware policy
    # predicted them (its measure of a prefill worker's queue; 0 under other policies).
    pending_tokens: int = field(default=0, init=False)
    # The worker's own load as its KV event stream last reported it (every router process reads the
    # same; None: no report, or the stream is down), and this process's counts when it came: what this
    # router changed since (requests sent minus ended, predicted prefill tokens sent minus done) is added
    # to it (`load`, `queued_tokens`), so its own requests count at once, and one that ended is not
    # counted until the next report. Monotonic counters: the feed thread only reads them (marks), the
    # request loop only writes them, so no count is lost.
    _report: WorkerLoad | None = field(default=None, init=False, repr=False)
    _released: int = field(default=0, init=False, repr=False)
    _tokens_sent: int = field(default=0, init=False, repr=False)
    _tokens_done: int = field(default=0, init=False, repr=False)
    _marks: tuple[int, int, int, int] = field(default=(0, 0, 0, 0), init=False, repr=False)
    _healthy: bool = field(default=True, init=False, repr=False)
    _last_health: dict[str, Any] | None = field(default=None, init=False, repr=False)
    _batch_size: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {self.role!r}")
        self.url = normalize_url(self.url)

    @property
    def healthy(self) -> bool:
        """Whether the worker is in rotation."""
        return self._healthy

    @healthy.setter
    def healthy(self, value: bool) -> None:
        if value != self._healthy:
            self._healthy = value
            _rotation_changed()

    @property
    def last_health(self) -> dict[str, Any] | None:
        """The worker's last health answer (None before the first)."""
        return self._last_health

    @last_health.setter
    def last_health(self, payload: dict[str, Any] | None) -> None:
        self._last_health = payload
        self._batch_size = reported_batch_size(payload)
        self.slots = slots_for(self._batch_size) if self._batch_size is not None else 0

    def acquire(self) -> None:
        """Count one more request in flight on this worker."""
        self.inflight += 1
        self.total_requests += 1

    def release(self) -> None:
        """Count one request fewer in flight (never below zero); a finished request frees a slot."""
        self.inflight = max(0, self.inflight - 1)
        self._released += 1
        self.full_until = 0.0

    def prefill_sent(self, tokens: int) -> None:
        """A prefill predicted to compute `tokens` was sent here (undo with `prefill_done`)."""
        self.pending_tokens += tokens
        self._tokens_sent += tokens

    def prefill_done(self, tokens: int) -> None:
        """The prefill `prefill_sent` counted has ended."""
        self.pending_tokens -= tokens
        self._tokens_done += tokens

    def apply_load(self, load: WorkerLoad | None) -> None:
        """The worker's load report (None: its stream ended; this router's own counts rule again).
        Called from the KV feed's thread: the marks are written before the report they go with."""
        self._marks = (self.total_requests, self._released, self._tokens_sent, self._tokens_done)
        self._report = load

    @property
    def reported_load(self) -> WorkerLoad | None:
        """The worker's last load report, if its stream is up."""
        return self._report

    def load(self) -> int:
        """Requests on the worker: its reported running and waiting plus those this router sent since the
        report, minus those of its requests that ended since; without a report, this router's own in flight."""
        report = self._report
        if report is None:
            return self.inflight
        sent, released, _, _ = self._marks
        return max(0, report.requests + self.total_requests - sent - (self._released - released))

    def queued_tokens(self) -> int:
        """Prompt tokens the worker still prefills: its report's plus what this router's prefills sent since
        then were predicted to compute, minus those of its prefills that ended since; without a report,
        those of this router's prefills in flight."""
        report = self._report
        if report is None:
            return self.pending_tokens
        _, _, sent, done = self._marks
        return max(0, report.prompt_tokens_pending + self._tokens_sent - sent - (self._tokens_done - done))

    def prefill_rate(self) -> float | None:
        """The prompt tokens/s the worker reported it prefills at (None: no report, or not measured)."""
        report = self._report
        return report.prefill_tokens_per_s if report is not None else None

    def batch_size(self) -> int | None:
        """The worker's `--batch-size` as its last health answer reported it, if it did."""
        return self._batch_size

    def takes_credit(self) -> bool:
        """Whether the worker takes credited decode streams: its health answer says so, or none came
        yet (the first requests may precede the first check). A worker of an older version, whose
        answer lacks the flag, would wait for the end of a body that stays open."""
        return self.last_health is None or self.last_health.get("stream_credit") is True

    def record_success(self) -> None:
        """A request went through: the failure streak is over."""
        self.consecutive_failures = 0

    def record_failure(self, error: str, threshold: int) -> None:
        """A request failed on this worker; `threshold` failures in a row take it out of rotation."""
        self.consecutive_failures += 1
        self.total_failures += 1
        self.last_error = error
        if self.consecutive_failures >= threshold:
            self.healthy = False

    def record_health(self, ok: bool, payload: dict[str, Any] | None, error: str | None) -> None:
        """Apply one health-check result: healthy puts the worker back, anything else takes it out."""
        self.last_health_at = time.time()
        self.health_timeouts = 0
        if payload is not None:
            self.last_health = payload
        if ok:
            self.healthy = True
            self.consecutive_failures = 0
        else:
            self.healthy = False
            self.last_error = error

    def record_health_timeout(self, error: str, threshold: int) -> bool:
        """A health check got no answer in time; True when that took the worker out of rotation.

        One slow answer says as much about a busy router as about the worker, so the worker stays
        in rotation until `threshold` checks in a row timed out (a stopped or wedged process).
        """
        self.health_timeouts += 1
        self.last_error = error
        if self.health_timeouts >= threshold and self.healthy:
            self.healthy = False
            return True
        return False

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe snapshot for /health and /router/status."""
        return {
            "url": self.url,
            "role": self.role,
            "healthy": self.healthy,
            "inflight": self.inflight,
            "pending_tokens": self.pending_tokens,
            "reported_load": asdict(self._report) if self._report is not None else None,
            "consecutive_failures": self.consecutive_failures,
            "last_error": self.last_error,
            "last_health": self.last_health,
            "last_health_at": self.last_health_at,
            "total_requests": self.total_requests,
            "total_failures": self.total_failures,
            "health_timeouts": self.health_timeouts,
        }
