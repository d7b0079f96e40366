"""The run's configuration (:class:`LoadTestConfig`) and the parsers of its command-line values."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from inference.tools.load_test.endpoints import ApiKind, endpoint_kind
from inference.tools.load_test.payloads import DEFAULT_PROMPTS

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass
class LoadTestConfig:
    """Everything :func:`~inference.tools.load_test.runner.run_load` needs; built by the CLI.

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


def parse_header(text: str) -> tuple[str, str]:
    """Split ``"Name: value"`` into ``("Name", "value")``; raises ``ValueError`` otherwise."""
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"invalid header {text!r}: expected 'Name: value'")
    return name.strip(), value.strip()


def parse_positive_int(text: str) -> int:
    """Parse a strictly positive integer; raises ``ValueError`` otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"invalid value {text!r}: expected a positive integer") from None
    if value <= 0:
        raise ValueError(f"invalid value {text!r}: must be > 0")
    return value
