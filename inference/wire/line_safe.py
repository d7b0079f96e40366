"""JSON lines that no line splitter cuts.

JSON allows U+2028, U+2029 and U+0085 raw inside strings (orjson writes them so), but many clients split a
stream into lines like Python's `str.splitlines` (httpx's `iter_lines` / `aiter_lines`, for one), which also
breaks at these: a token or request id holding one would cut its line in two at the client (issue 26's
"torn event"). Written as JSON escapes they mean the same. The router's SSE events and the workers' NDJSON
streams both go through `line_safe_json`.
"""
from __future__ import annotations

# The three separators as UTF-8, and their JSON escapes.
_SPLITLINES_BREAKS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))


def line_safe_json(encoded: bytes) -> bytes:
    """`encoded` JSON with the non-ASCII line separators escaped, so no line splitter cuts it.

    The two `in` scans are the whole cost for text without them (most text: they look for lead bytes
    that only these and a few rarer characters share)."""
    if b"\xe2\x80" not in encoded and b"\xc2\x85" not in encoded:
        return encoded
    for raw, escaped in _SPLITLINES_BREAKS:
        encoded = encoded.replace(raw, escaped)
    return encoded
