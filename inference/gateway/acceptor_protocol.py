"""The router acceptor's two small protocols: the HTTP it reads and answers itself, and its control
messages with the router processes.

**HTTP.** The acceptor reads only the start of each new connection: a whole `GET /health` (or `HEAD
/health`) head with nothing after it is a probe it answers itself; anything else is handed to a
router process with the bytes read so far. A probe with a query, a body, a pipelined request after
it, or a head larger than `HEAD_LIMIT` goes to a router process too (exactly as the router's own
protocol fast path decides, inference/gateway/http_protocol.py).

**Control** (one SOCK_SEQPACKET connection per router process, so that every message is one record
and a passed descriptor stays with its record):

- router → acceptor: `S` + JSON snapshot `{"pid", "health": GET /health's body or null (not
  answerable yet), "loop_lag_s", "connections"}`, every `SNAPSHOT_INTERVAL_S`; `A` + a count in
  ASCII: that many more connections received (before reading any byte of them), so the acceptor
  may drop its copies; until then it keeps them and gives them to another router process if this
  one dies with them still in its socket's queue; `Q`: "hand me nothing more" (graceful stop);
- acceptor → router: `C` + the bytes read from the connection, with its descriptor (SCM_RIGHTS);
  `q`: the answer to `Q`, after which nothing more comes.

Django-free and stdlib-only (the acceptor process imports nothing else of the platform).
"""
from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any

ACCEPTOR_ENV = "ROUTER_ACCEPTOR_SOCKET"  # the control socket's path, in gunicorn's environment
HEAD_LIMIT = 16384  # the most the acceptor reads of a connection before handing it over
CONNECTION = b"C"
SNAPSHOT = b"S"
QUIT = b"Q"
RECEIVED = b"A"
QUIT_ACK = b"q"
SNAPSHOT_INTERVAL_S = 0.25
RECORD_LIMIT = HEAD_LIMIT + 64  # a control record's largest size (a connection's bytes + tag)
# A snapshot record's largest size. /health lists every endpoint (~80 bytes each), so a snapshot
# outgrew RECORD_LIMIT at ~200 endpoints: the acceptor read it cut short, never trusted the router
# process and handed it nothing. 192 KiB (~2,400 endpoints) stays within Linux's default socket send
# buffer (212,992 bytes: a SOCK_SEQPACKET record must fit it whole); a larger /health goes as null,
# and the router processes then answer probes themselves.
SNAPSHOT_LIMIT = 192 * 1024


def snapshot_record(snapshot: dict[str, Any],
                    dumps: Callable[[Any], bytes] = lambda o: json.dumps(o).encode()) -> bytes:
    """`S` + the snapshot as JSON (`dumps`: to bytes), within SNAPSHOT_LIMIT: its `health` sent as null
    when too large."""
    record = SNAPSHOT + dumps(snapshot)
    if len(record) > SNAPSHOT_LIMIT and snapshot.get("health") is not None:
        record = SNAPSHOT + dumps({**snapshot, "health": None, "health_bytes": len(record)})
    return record

_PROBE_STARTS = (b"GET /health ", b"HEAD /health ")
_VERSIONS = (b"HTTP/1.1", b"HTTP/1.0")
_BODY_HEADERS = (b"content-length", b"transfer-encoding", b"upgrade", b"expect")
_REASONS = {200: b"OK", 503: b"Service Unavailable"}


class Verdict(enum.Enum):
    """What the bytes read so far of a new connection are."""

    MORE = "more"  # the start of a probe's head: read on
    PROBE = "probe"  # a whole GET/HEAD /health head and nothing after it: the acceptor answers
    OTHER = "other"  # anything else: a router process serves the connection


@dataclass(frozen=True)
class Probe:
    """A health probe's head: HEAD (no body) or GET, and whether the connection closes after it."""

    head_only: bool
    close: bool


def classify(data: bytes) -> tuple[Verdict, Probe | None]:
    """The verdict on a connection's first bytes, and the probe when it is one."""
    if not data.startswith(_PROBE_STARTS):
        if len(data) < len(_PROBE_STARTS[1]) and any(start.startswith(data) for start in _PROBE_STARTS):
            return Verdict.MORE, None
        return Verdict.OTHER, None
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return (Verdict.MORE if len(data) < HEAD_LIMIT else Verdict.OTHER), None
    if end + 4 != len(data):
        return Verdict.OTHER, None  # a body or a pipelined request follows: the router reads it
    line, _, header_block = data[:end].partition(b"\r\n")
    parts = line.split(b" ")
    if len(parts) != 3 or parts[1] != b"/health" or parts[2] not in _VERSIONS:
        return Verdict.OTHER, None
    keep_alive = parts[2] == b"HTTP/1.1"
    for header in header_block.split(b"\r\n") if header_block else ():
        name, sep, value = header.partition(b":")
        name = name.strip().lower()
        if not sep or name in _BODY_HEADERS:
            return Verdict.OTHER, None
        if name == b"connection":
            tokens = {token.strip() for token in value.lower().split(b",")}
            if b"close" in tokens:
                keep_alive = False
            elif b"keep-alive" in tokens:
                keep_alive = True
    return Verdict.PROBE, Probe(head_only=parts[0] == b"HEAD", close=not keep_alive)


class DateHeader:
    """The `date` header's value, formatted at most once a second."""

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def value(self, now: float) -> bytes:
        """The HTTP date of `now` (time.time())."""
        second = int(now)
        if second != self._second:
            self._second, self._value = second, formatdate(second, usegmt=True).encode()
        return self._value


def response(status: int, body: dict[str, Any], probe: Probe, date: bytes) -> bytes:
    """A whole JSON response to `probe` (no body for HEAD); 503s say when to come back."""
    payload = json.dumps(body, separators=(",", ":")).encode()
    head = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"")), b"date: %s\r\n" % date,
            b"content-type: application/json\r\ncontent-length: %d\r\n" % len(payload)]
    if status == 503:
        head.append(b"retry-after: 1\r\n")
    if probe.close:
        head.append(b"connection: close\r\n")
    return b"".join(head) + b"\r\n" + (b"" if probe.head_only else payload)
