"""Reading one streaming response per API kind: token timings and counts from its SSE events.

:class:`StreamState` holds what every kind measures (first token, inter-token gaps, usage, the
``[DONE]`` marker); :class:`GenerateStream` reads our JSON API's events, :class:`CompletionsStream`
and :class:`ChatStream` the OpenAI ones. :func:`stream_for` picks the reader for an endpoint kind.
"""

from __future__ import annotations

import json
from typing import Any

from inference.tools.load_test.endpoints import ApiKind


class StreamError(Exception):
    """The server reported an error inside an otherwise successful (HTTP 200) stream."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class StreamState:
    """Accumulates timings and token counts while one SSE stream is read (the kind-independent part)."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.itls: list[float] = []
        self.chunks = 0  # events that carried text or tokens
        self.token_id_count = 0
        self.saw_token_ids = False
        self.usage_completion: int | None = None
        self.usage_prompt: int | None = None
        self.finish_reason: str | None = None
        self.done = False
        self.done_at: float | None = None

    def on_tokens(self, n_tokens: int, now: float) -> None:
        """Record a token event carrying ``n_tokens`` (>= 1) tokens received at ``now``."""
        self.chunks += 1
        if self.first_token_at is None:
            self.first_token_at = now
        elif self.last_token_at is not None:
            per_token = (now - self.last_token_at) / n_tokens
            self.itls.extend([per_token] * n_tokens)
        self.last_token_at = now

    def on_usage(self, usage: Any) -> None:
        """Take token counts from a ``usage`` object when present."""
        if not isinstance(usage, dict):
            return
        completion = usage.get("completion_tokens")
        prompt = usage.get("prompt_tokens")
        if isinstance(completion, int):
            self.usage_completion = completion
        if isinstance(prompt, int):
            self.usage_prompt = prompt

    def handle(self, data: str, now: float) -> None:
        """Process the ``data`` payload of one SSE event."""
        if data.strip() == "[DONE]":
            self.done = True
            self.done_at = now
            return
        try:
            obj = json.loads(data)
        except ValueError:
            raise StreamError("bad_response", f"invalid JSON in SSE event: {data[:100]!r}") from None
        if not isinstance(obj, dict):
            raise StreamError("bad_response", f"unexpected SSE event: {data[:100]!r}")
        if obj.get("error"):
            err = obj["error"]
            message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            raise StreamError("stream_error", str(message))
        self.on_usage(obj.get("usage"))
        self.on_event(obj, now)

    def on_event(self, obj: dict[str, Any], now: float) -> None:
        """Take the tokens of one decoded JSON event (the kind-specific part)."""
        raise NotImplementedError

    def output_tokens(self) -> int:
        """The request's output token count, from the most exact source the kind offers."""
        raise NotImplementedError


class GenerateStream(StreamState):
    """Our JSON API (``/generate``, ``/api/generate``): events carry ``text`` and ``token_ids``."""

    def on_event(self, obj: dict[str, Any], now: float) -> None:
        """Count the event's token ids (or one token per text chunk when the server sends none)."""
        if obj.get("finish_reason"):
            self.finish_reason = str(obj["finish_reason"])
        token_ids = obj.get("token_ids")
        text = obj.get("text") or ""
        if isinstance(token_ids, list):
            self.saw_token_ids = True
            n_tokens = len(token_ids)
            self.token_id_count += n_tokens
        elif text and not obj.get("finish_reason"):
            # No token ids: count the chunk as one token. The final event is skipped because a
            # server may repeat the whole text there.
            n_tokens = 1
        else:
            n_tokens = 0
        if n_tokens:
            self.on_tokens(n_tokens, now)

    def output_tokens(self) -> int:
        """Token ids when the server sent them, else usage, else the chunk count."""
        if self.saw_token_ids:
            return self.token_id_count
        if self.usage_completion is not None:
            return self.usage_completion
        return self.chunks


class CompletionsStream(StreamState):
    """OpenAI ``/v1/completions``: ``choices[0].text`` chunks and a trailing usage chunk."""

    def choice_text(self, choice: dict[str, Any]) -> str:
        """The text a choice of this kind carries."""
        return choice.get("text") or ""

    def on_event(self, obj: dict[str, Any], now: float) -> None:
        """Count the first choice's token ids (non-standard but exact) or one token per text chunk."""
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return  # e.g. the trailing usage-only chunk
        choice = choices[0]
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])
        text = self.choice_text(choice)
        token_ids = choice.get("token_ids")
        if isinstance(token_ids, list) and token_ids:
            # Non-standard but exact; some servers (ours included, possibly) send it.
            self.saw_token_ids = True
            self.token_id_count += len(token_ids)
            self.on_tokens(len(token_ids), now)
        elif text:
            self.on_tokens(1, now)

    def output_tokens(self) -> int:
        """Usage (the exact count OpenAI streams carry), else token ids, else the chunk count."""
        if self.usage_completion is not None:
            return self.usage_completion
        if self.saw_token_ids:
            return self.token_id_count
        return self.chunks


class ChatStream(CompletionsStream):
    """OpenAI ``/v1/chat/completions``: like completions, the text in ``choices[0].delta.content``."""

    def choice_text(self, choice: dict[str, Any]) -> str:
        """The delta's content (role-only and empty deltas carry none)."""
        delta = choice.get("delta")
        return (delta.get("content") if isinstance(delta, dict) else None) or ""


_STREAMS: dict[ApiKind, type[StreamState]] = {
    "generate": GenerateStream,
    "completions": CompletionsStream,
    "chat": ChatStream,
}


def stream_for(kind: ApiKind, start: float) -> StreamState:
    """A fresh reader for a response of ``kind`` whose request was sent at ``start``."""
    return _STREAMS[kind](start)
