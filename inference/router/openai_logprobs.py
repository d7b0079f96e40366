"""Log-probabilities in OpenAI's response shapes, from the wire's positions (`inference.wire.logprobs`).

Completions (`logprobs: N`): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, parallel
lists, top alternatives as `{token: logprob}`, text offsets into the choice's text (the echoed prompt
included), a prompt's first position null. Chat (`logprobs: true`, `top_logprobs: N`):
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`,
`bytes` the token text's UTF-8. A streamed chunk carries its own tokens' part; the completion's
text offsets continue from the chunk before (`CompletionOffsets`).
"""
from __future__ import annotations

from typing import Any

from inference.wire.logprobs import Logprob

# What a position no worker reported becomes (it should not happen; never a made-up number).
_UNKNOWN = Logprob("", float("nan"), [])


class CompletionOffsets:
    """One completion choice's running text offset across its chunks."""

    def __init__(self) -> None:
        self.offset = 0

    def shape(self, positions: list[Logprob | None], prompt: bool = False) -> dict[str, Any]:
        """The completions `logprobs` object of `positions` (`prompt`: a prompt's, whose first token
        has a null log-probability and null alternatives, as OpenAI writes it)."""
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for position in positions:
            p = position or _UNKNOWN
            tokens.append(p.token)
            values.append(_finite(p.logprob))
            tops.append(None if prompt and p.logprob is None else {t: lp for t, lp in p.top})
            offsets.append(self.offset)
            self.offset += len(p.token)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def advance(self, text: str) -> None:
        """Account for text before the next tokens that no position covers (an echoed prompt's)."""
        self.offset += len(text)


def merge_completion(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One completions `logprobs` object from consecutive parts (a whole, non-streamed choice)."""
    if not parts:
        return None
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key, values in out.items():
            values.extend(part[key])
    return out


def chat_content(positions: list[Logprob | None]) -> list[dict[str, Any]]:
    """The chat `logprobs.content` entries of `positions`."""
    out = []
    for position in positions:
        p = position or _UNKNOWN
        out.append({
            "token": p.token, "logprob": _finite(p.logprob), "bytes": list(p.token.encode("utf-8")),
            "top_logprobs": [{"token": t, "logprob": _finite(lp), "bytes": list(t.encode("utf-8"))} for t, lp in p.top],
        })
    return out


def _finite(value: float | None) -> float | None:
    """JSON has no NaN: an unknown log-probability is null; -inf (a masked token) is the least float."""
    if value is None or value != value:
        return None
    return max(value, -9999.0)
