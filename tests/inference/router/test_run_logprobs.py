"""Each attempt's first token (sampled by its prefill worker) gets the prefill answer's log-probabilities,
so a stream that moved to another decode worker keeps reporting one position per token."""
from __future__ import annotations

from inference.router.attempt import Attempt
from inference.router.endpoint import Endpoint
from inference.router.run import RequestRun
from inference.wire.logprobs import Logprob
from inference.wire.prefill import PrefillAnswer
from inference.wire.stream import TokenLine, decode_line, token_line


def attempt(first: Logprob | None) -> Attempt:
    return Attempt(request_id="r", decode=Endpoint("http://127.0.0.1:1", "decode"),
                   prefill_answer=PrefillAnswer(first_token=7, first_logprobs=first))


def test_the_first_line_of_each_attempt_takes_its_prefill_answers_entry() -> None:
    a_first, b_first = Logprob("a", -0.1, []), Logprob("m", -0.7, [])
    decoded = Logprob("b", -0.2, [("b", -0.2)])
    first = attempt(a_first)
    # The decode worker's first line: the prefill-sampled token, no entry of its own.
    assert RequestRun.positions(first, TokenLine([7], "a")) == [a_first]
    assert RequestRun.positions(first, TokenLine([8], "b", [decoded])) == [decoded]
    # A line without entries after the first one is unknown, never the prefill's again.
    assert RequestRun.positions(first, TokenLine([9], "c")) == [None]
    # The stream moved: the new attempt's first token is its own prefill worker's.
    moved = attempt(b_first)
    assert RequestRun.positions(moved, TokenLine([5, 6], "mn", [decoded])) == [b_first, decoded]


def test_the_token_line_carries_positions_on_the_wire() -> None:
    raw = token_line([3, 4], "xy", [["x", -1.0, [["x", -1.0]]], ["y", -2.0, []]])
    line = decode_line(raw)
    assert isinstance(line, TokenLine)
    assert line.logprobs == [Logprob("x", -1.0, [("x", -1.0)]), Logprob("y", -2.0, [])]
    plain = decode_line(token_line([3], "x"))
    assert isinstance(plain, TokenLine) and plain.logprobs is None
