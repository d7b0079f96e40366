"""StreamCredit: the decode worker's view of its router's acknowledgements (unit level)."""
from __future__ import annotations

import asyncio

import pytest

from inference.server.credit import StreamCredit, parse_credit


def test_credit_bounds_what_a_stream_may_send_until_acknowledged() -> None:
    credit = StreamCredit(8)
    assert credit.allows(7) and not credit.allows(8)
    credit.feed(b"5\n")
    assert credit.acked == 5 and credit.allows(12) and not credit.allows(13)


def test_lines_may_arrive_in_pieces_and_counts_never_go_back() -> None:
    credit = StreamCredit(4)
    credit.feed(b"1")
    assert credit.acked == 0  # half a line: not yet
    credit.feed(b"2\n3")
    assert credit.acked == 12
    credit.feed(b"\n\n7\n")  # "3" and "7": older (smaller) counts; an empty line: nothing
    assert credit.acked == 12
    credit.feed(b"13\n")
    assert credit.acked == 13


@pytest.mark.parametrize("junk", [b"abc\n", b"9" * 64])
def test_a_broken_acknowledgement_lifts_the_bound_rather_than_hanging(junk: bytes) -> None:
    credit = StreamCredit(4)
    credit.feed(junk)
    assert credit.closed and credit.allows(10**6)


def test_wait_returns_on_an_acknowledgement_or_on_close() -> None:
    async def main() -> None:
        credit = StreamCredit(2)
        waiter = asyncio.ensure_future(credit.wait(2))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        credit.feed(b"1\n")
        await asyncio.wait_for(waiter, 1)
        waiter = asyncio.ensure_future(credit.wait(10))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        credit.close()
        await asyncio.wait_for(waiter, 1)

    asyncio.run(main())


@pytest.mark.parametrize("value", ["1", "0", "-3", "x", str(2**21)])
def test_header_values_out_of_range_are_refused(value: str) -> None:
    with pytest.raises(ValueError):
        parse_credit(value)
    assert parse_credit(" 32 ") == 32
