"""The decode stream: the NDJSON lines a decode worker answers `POST /internal/decode` with.

    {"type": "descriptor", "descriptor": {...}, "prompt_token_ids": [...], "sampling": {...}}   first
    {"type": "token", "token_ids": [...], "text": "..."[, "logprobs": [...]]}                   per output
    {"type": "done", "finish_reason": "...", "usage": {...}, "timings": {...}}                  last
    {"type": "error", "message": "..."[, "reason": "kv_timeout", "silent_s": ..., ...]}         or last

Workers encode with the `*_line` functions; the router decodes with `decode_line`, which gives a
typed line (`TokenLine` ... `ErrorLine`) or raises `WireError`; a token line's `logprobs` (only
when the request asked, one position per token id; `inference.wire.logprobs`) stay raw JSON until
the router shapes them; a line type it does not know (a
newer worker's) is `OtherLine`, skipped by the router. A token line is the per-token path: its
decoding is one orjson parse, two checks and one small object (bench/router_ab.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from inference.wire.line_safe import line_safe_json
from inference.wire.logprobs import Logprob, LogprobsError, decode_positions


class WireError(ValueError):
    """A line that is not what the wire allows (not JSON, not an object, a field of the wrong type)."""


@dataclass(slots=True)
class DescriptorLine:
    """Where the prefill worker must write the prompt's KV, the prompt's token ids, and the
    parameters the decode worker resolved (the prefill worker samples the first token with them)."""

    descriptor: dict[str, Any]
    prompt_token_ids: list[int]
    sampling: dict[str, Any] | None = None


@dataclass(slots=True)
class TokenLine:
    """New output: token ids and the text they complete (either may be empty), and the tokens'
    log-probabilities when the request asked (`wire.logprobs` positions, one per token id; a worker
    that did not compute one, the decode worker for a prefill-sampled first token, sends none)."""

    token_ids: list[int]
    text: str
    logprobs: list[Logprob] | None = None


@dataclass(slots=True)
class DoneLine:
    """The request finished on the decode worker: why, its token counts and timings."""

    finish_reason: str
    usage: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ErrorLine:
    """The stream ends with an error; `reason` "kv_timeout" means the lease on the reserved blocks
    ran out before the KV came (`fields` holds the worker's details: silent_s, last_progress...)."""

    message: str
    reason: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_timeout(self) -> bool:
        """Whether the decode worker freed the blocks because the KV did not arrive in time."""
        return self.reason == "kv_timeout"


@dataclass(slots=True)
class OtherLine:
    """A line type this router does not know (a newer worker may send some): skipped."""

    type: str


DecodeLine = DescriptorLine | TokenLine | DoneLine | ErrorLine | OtherLine


def _ids(value: Any) -> list[int]:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    raise WireError(f"token ids must be a list of integers, got {str(value)[:100]}")


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def decode_line(raw: bytes) -> DecodeLine:
    """One complete line of the decode stream, typed; WireError when it breaks the wire's rules."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise WireError(f"not JSON: {exc}") from None
    if type(obj) is not dict:
        raise WireError(f"expected a JSON object, got {raw[:100]!r}")
    kind = obj.get("type")
    if kind == "token":
        ids, text = obj.get("token_ids", []), obj.get("text")
        if not (type(ids) is list and len(ids) == 1 and type(ids[0]) is int):  # the usual line: one token
            ids = _ids(ids)
        logprobs = obj.get("logprobs")
        if logprobs is not None:
            try:
                logprobs = decode_positions(logprobs)
            except LogprobsError as exc:
                raise WireError(str(exc)) from None
        return TokenLine(ids, text if type(text) is str else "", logprobs)
    if kind == "done":
        return DoneLine(str(obj.get("finish_reason") or "stop"), _object(obj.get("usage")), _object(obj.get("timings")))
    if kind == "error":
        reason = obj.get("reason")
        return ErrorLine(str(obj.get("message") or ""), reason if isinstance(reason, str) else None, obj)
    if kind == "descriptor":
        descriptor, ids = obj.get("descriptor"), obj.get("prompt_token_ids")
        if not isinstance(descriptor, dict):
            raise WireError(f"expected a descriptor line, got {str(obj)[:200]}")
        if not isinstance(ids, list):
            raise WireError("descriptor line has no prompt_token_ids list")
        sampling = obj.get("sampling")
        return DescriptorLine(descriptor, [int(t) for t in ids if isinstance(t, int)],
                              sampling if isinstance(sampling, dict) else None)
    return OtherLine(str(kind))


def _line(obj: dict[str, Any]) -> bytes:
    # Line-safe: a request id or message may hold U+0085/U+2028/U+2029, at which splitlines-style
    # clients would cut the line.
    return line_safe_json(orjson.dumps(obj)) + b"\n"


def descriptor_line(descriptor: dict[str, Any], prompt_token_ids: list[int], sampling: dict[str, Any]) -> bytes:
    """The first line of a decode stream."""
    return _line({"type": "descriptor", "descriptor": descriptor, "prompt_token_ids": prompt_token_ids,
                  "sampling": sampling})


def token_line(token_ids: list[int], text: str, logprobs: list[Any] | None = None) -> bytes:
    """One output's line (`logprobs`: the positions' JSON, `wire.logprobs.encode_positions`)."""
    line = b'{"type":"token","token_ids":' + orjson.dumps(token_ids) + b',"text":' + line_safe_json(orjson.dumps(text))
    if logprobs is not None:
        line += b',"logprobs":' + orjson.dumps(logprobs)
    return line + b"}\n"


def done_line(finish_reason: str, usage: dict[str, Any], timings: dict[str, Any]) -> bytes:
    """The last line of a finished request."""
    return _line({"type": "done", "finish_reason": finish_reason, "usage": usage, "timings": timings})


def error_line(message: str, reason: str | None = None, **details: Any) -> bytes:
    """The last line of a failed request; `details` travel with a `reason` (kv_timeout: silent_s...)."""
    obj: dict[str, Any] = {"type": "error", "message": message}
    if reason is not None:
        obj["reason"] = reason
    obj.update(details)
    return _line(obj)
