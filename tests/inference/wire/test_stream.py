"""The decode stream's lines and the prefill call, as workers encode and the router decodes them."""
from __future__ import annotations

import orjson
import pytest

from inference.wire import DescriptorLine, DoneLine, ErrorLine, OtherLine, PrefillAnswer, PrefillRequest, TokenLine
from inference.wire.stream import WireError, decode_line, descriptor_line, done_line, error_line, token_line


def test_every_line_decodes_to_what_was_encoded() -> None:
    assert decode_line(descriptor_line({"token": "t"}, [1, 2], {"max_tokens": 3})) == DescriptorLine(
        {"token": "t"}, [1, 2], {"max_tokens": 3})
    assert decode_line(token_line([5], "caf\u00e9 \u2603")) == TokenLine([5], "caf\u00e9 \u2603")
    assert decode_line(token_line([], "")) == TokenLine([], "")
    assert decode_line(done_line("length", {"prompt_tokens": 2}, {"decode_s": 0.5})) == DoneLine(
        "length", {"prompt_tokens": 2}, {"decode_s": 0.5})
    line = decode_line(error_line("lease ran out", "kv_timeout", silent_s=3.0))
    assert isinstance(line, ErrorLine) and line.kv_timeout and line.fields["silent_s"] == 3.0
    assert decode_line(b'{"type": "progress"}') == OtherLine("progress")


@pytest.mark.parametrize("odd", ["\u0085", "\u2028", "\u2029"])
def test_lines_hold_no_splitlines_break(odd: str) -> None:
    """A request id or token text with U+0085/U+2028/U+2029 stays one line for a client that splits like
    str.splitlines (httpx's iter_lines), and decodes to the same text."""
    descriptor = descriptor_line({"request_id": f"a{odd}b"}, [1], {})
    token = token_line([7], f"x{odd}y")
    error = error_line(f"bad id a{odd}b")
    for line in (descriptor, token, error):
        assert len(line.decode().splitlines()) == 1, line
    assert decode_line(descriptor) == DescriptorLine({"request_id": f"a{odd}b"}, [1], {})
    assert decode_line(token) == TokenLine([7], f"x{odd}y")


@pytest.mark.parametrize(
    "raw",
    [b'{"type": "token", "token_ids": [1], "text": "ca', b"[1, 2]", b'{"type": "token", "token_ids": ["x"]}',
     b'{"type": "descriptor", "prompt_token_ids": [1]}', b'{"type": "descriptor", "descriptor": {}}',
     b'{"type": "token", "text": "\xe2\x80"}'],
)
def test_lines_that_break_the_wire_are_refused(raw: bytes) -> None:
    with pytest.raises(WireError):
        decode_line(raw)


def test_prefill_request_and_answer() -> None:
    body = PrefillRequest("r1", [1, 2], {"max_tokens": 2}, {"token": "t"}).encode()
    assert b'"request_id":"r1"' in body and b'"descriptor":{"token":"t"}' in body
    answer = PrefillAnswer.decode(b'{"first_token": 9, "kv_bytes": 100, "prefill_s": 0.1, "transfer_s": 1}')
    assert answer == PrefillAnswer(first_token=9, kv_bytes=100, prefill_s=0.1, transfer_s=1.0)
    assert PrefillAnswer.decode(b"{}") == PrefillAnswer()
    answer = PrefillAnswer(first_token=9, cached_tokens=32)
    assert PrefillAnswer.decode(orjson.dumps(answer.to_json())) == answer
    assert PrefillAnswer.decode(b'{"cached_tokens": -1}').cached_tokens is None
    assert PrefillAnswer.decode(b'{"cached_tokens": true}').cached_tokens is None
    with pytest.raises(ValueError, match="not a JSON object"):
        PrefillAnswer.decode(b"[]")
