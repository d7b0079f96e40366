"""Log-probabilities on the wire: what a worker sends for each position it reports.

One position is `[token, logprob, [[token, logprob], ...]]`: the token's text as the model's
tokenizer renders that token alone (a piece of a multi-byte character renders as U+FFFD, as in
vLLM), its log-probability, and the most likely tokens there, most likely first. The worker renders
the texts (it has the tokenizer; the router has none). A prompt's first token, which nothing
predicts, is `[token, null, []]`. The lists are compact on purpose: a streamed token line carries one per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class LogprobsError(ValueError):
    """A log-probabilities field that is not what the wire allows."""


@dataclass(slots=True)
class Logprob:
    """One position: its token's text and log-probability, and the top alternatives."""

    token: str
    logprob: float | None  # None: nothing predicts this position (a prompt's first token)
    top: list[tuple[str, float]]

    def to_json(self) -> list[Any]:
        """The wire's compact form."""
        return [self.token, self.logprob, [[t, lp] for t, lp in self.top]]


def _number(value: Any) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise LogprobsError(f"a log-probability must be a number, got {str(value)[:50]}")


def _one(raw: Any, unpredicted: bool = False) -> Logprob:
    if not (isinstance(raw, list) and len(raw) == 3 and isinstance(raw[0], str) and isinstance(raw[2], list)):
        raise LogprobsError(f"expected [token, logprob, top], got {str(raw)[:100]}")
    top: list[tuple[str, float]] = []
    for alt in raw[2]:
        if not (isinstance(alt, list) and len(alt) == 2 and isinstance(alt[0], str)):
            raise LogprobsError(f"expected [token, logprob] in top, got {str(alt)[:100]}")
        top.append((alt[0], _number(alt[1])))
    if raw[1] is None and unpredicted:
        return Logprob(raw[0], None, top)
    return Logprob(raw[0], _number(raw[1]), top)


def decode_positions(raw: Any) -> list[Logprob]:
    """The positions of a token line or a prefill answer's first token (LogprobsError when malformed)."""
    if not isinstance(raw, list):
        raise LogprobsError("logprobs must be a list")
    return [_one(item) for item in raw]


def decode_prompt(raw: Any) -> list[Logprob | None]:
    """A prompt's positions (the first one's log-probability null)."""
    if not isinstance(raw, list):
        raise LogprobsError("prompt_logprobs must be a list")
    return [None if item is None else _one(item, unpredicted=True) for item in raw]


def encode_positions(positions: list[Logprob | None]) -> list[Any]:
    """The JSON list of `positions` (None stays null)."""
    return [None if p is None else p.to_json() for p in positions]
