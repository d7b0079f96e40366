"""The decode worker's stream as the router reads it: complete lines, typed by the wire.

`DecodeStream` wraps the NDJSON reader (ndjson.py: only newline-terminated lines are lines) with
`inference.wire.stream.decode_line`, so the router sees `DescriptorLine`, `TokenLine`, `DoneLine`,
`ErrorLine` or `OtherLine` objects and a `WireError` (a ValueError) for a line that breaks the
wire. The two reads before the first token have their own rules, here: the first line must be the
descriptor, and the first output is a token or done line (a `kv_timeout` error line is a lost
lease, any other error a failed worker).
"""
from __future__ import annotations

from typing import TypeAlias

from inference.router.failures import BackendFailure, LeaseExpired, kv_timeout_message
from inference.router.ndjson import BodyStream, NdjsonReader
from inference.wire.stream import DecodeLine, DescriptorLine, DoneLine, ErrorLine, TokenLine, decode_line

DecodeStream: TypeAlias = NdjsonReader[DecodeLine]


def open_stream(content: BodyStream) -> DecodeStream:
    """A reader of typed decode lines over a response body."""
    return NdjsonReader(content, decode_line)


def as_descriptor(line: DecodeLine | None) -> DescriptorLine:
    """The decode stream's first line, which must be its descriptor; BackendFailure otherwise."""
    if line is None:
        raise BackendFailure("closed the stream before sending a descriptor")
    if isinstance(line, ErrorLine):
        raise BackendFailure(f"error before the descriptor: {line.message}")
    if not isinstance(line, DescriptorLine):
        raise BackendFailure(f"expected a descriptor line, got {line!r}"[:200])
    return line


async def first_output(stream: DecodeStream) -> TokenLine | DoneLine:
    """The stream's first token (or done) line; other line types are skipped.

    Raises BackendFailure when the stream ends or reports an error, LeaseExpired for a `kv_timeout`
    error line (the caller names the prefill worker that held the request), and the reader's own
    transport and wire errors. Bounded by the caller's timeout.
    """
    while True:  # bounded by the caller's timeout
        line = await stream.next()
        if line is None:
            raise BackendFailure("decode stream ended before the first token")
        if isinstance(line, TokenLine | DoneLine):
            return line
        if isinstance(line, ErrorLine):
            if line.kv_timeout:
                raise LeaseExpired(kv_timeout_message(line.fields, None), line=line.fields)
            raise BackendFailure(f"error before the first token: {line.message}")
