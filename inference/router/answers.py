"""The router's answers in each endpoint's format: a whole generation's JSON body (`final_body`) or its
Server-Sent Events (`SseFormatter`), from the client events of a request parsed by `protocol.py`.
Django-free: the views and the WebSocket consumer share it.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from inference.router.choices_format import ChoicesStream, choices_body
from inference.router.errors import RouterError
from inference.router.events import DoneEvent, ErrorEvent, Event, TokenEvent
from inference.router.protocol import ParsedRequest
from inference.router.tool_calls import ToolCallStream, message
from inference.wire.line_safe import line_safe_json

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    """One Server-Sent Event carrying `obj` as JSON (line separators escaped: `line_safe_json`)."""
    return b"data: " + line_safe_json(orjson.dumps(obj)) + b"\n\n"


def error_body(status: int, message: str, error_type: str | None = None) -> dict[str, Any]:
    """`{"error": {...}}` as the router answers it (via RouterError's shape)."""
    return RouterError(status, message, error_type=error_type).to_dict()


def _openai_id(parsed: ParsedRequest) -> str:
    prefix = "chatcmpl-" if parsed.kind == "chat" else "cmpl-"
    return prefix + parsed.request.request_id.removeprefix("req-")


@dataclass
class Collected:
    """A whole (non-streamed) generation."""

    text: str
    token_ids: list[int]
    done: DoneEvent
    events: list[TokenEvent] = field(default_factory=list)  # every token event (n, logprobs, echo)


async def collect(events: AsyncIterator[Event]) -> Collected:
    """Run a generation to its end; an error after the first token raises RouterError."""
    parts: list[str] = []
    token_ids: list[int] = []
    token_events: list[TokenEvent] = []
    async for event in events:
        if isinstance(event, TokenEvent):
            parts.append(event.text)
            token_ids.extend(event.token_ids)
            token_events.append(event)
        elif isinstance(event, DoneEvent):
            return Collected("".join(parts), token_ids, event, token_events)
        elif isinstance(event, ErrorEvent):
            raise RouterError(event.status, event.message)
    raise RouterError(502, "the generation ended without a result")


def done_fields(done: DoneEvent) -> dict[str, Any]:
    """The fields of a DoneEvent that the /generate API reports."""
    return {
        "id": done.request_id,
        "finish_reason": done.finish_reason,
        "usage": done.usage,
        "timings": done.timings,
        "prefill": done.prefill,
        "decode": done.decode,
        "kv_bytes": done.kv_bytes,
        "retries": done.retries,
        "migrations": done.migrations,
    }


def final_body(parsed: ParsedRequest, result: Collected, model: str) -> dict[str, Any]:
    """The JSON answer of a non-streamed request, in the endpoint's format."""
    done = result.done
    if parsed.kind == "generate":
        return {"text": result.text, "tokens": result.token_ids, **done_fields(done)}
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": done.finish_reason}
    choices = [choice]
    if parsed.choices.rich and parsed.kind != "generate":
        choices = choices_body(parsed.kind, parsed.choices, parsed.request.prompt, result.events, done)
    elif parsed.kind == "chat" and parsed.tools is not None:
        choice["message"], called = message(parsed.tools, result.text)
        if called and done.finish_reason == "stop":
            choice["finish_reason"] = "tool_calls"
    elif parsed.kind == "chat":
        choice["message"] = {"role": "assistant", "content": result.text}
    else:
        choice["text"] = result.text
    return {
        "id": _openai_id(parsed),
        "object": "chat.completion" if parsed.kind == "chat" else "text_completion",
        "created": parsed.created,
        "model": model,
        "choices": choices,
        "usage": done.usage,
    }


def sse_event(parsed: ParsedRequest, event: Event, model: str) -> tuple[bytes, bool]:
    """The Server-Sent Event bytes for one event, and whether it ends the stream.

    A plain function rather than a generator around the event stream: a streamed token passes
    through one async generator fewer on its way to the client (measured per streamed token).
    The last event's bytes end with `data: [DONE]`.
    """
    if isinstance(event, TokenEvent):
        if parsed.kind == "generate":
            return sse({"text": event.text, "token_ids": event.token_ids}), False
        return sse(_chunk(parsed, model, {"content": event.text}, None, event.token_ids)), False
    if isinstance(event, DoneEvent):
        if parsed.kind == "generate":
            return sse(done_fields(event)) + SSE_DONE, True
        out = sse(_chunk(parsed, model, {}, event.finish_reason, None))
        if parsed.include_usage:
            out += sse(_usage_chunk(parsed, model, event.usage))
        return out + SSE_DONE, True
    return sse(error_body(event.status, event.message)) + SSE_DONE, True


class SseFormatter:
    """One stream's Server-Sent Events, with the per-stream part of a token chunk encoded once.

    A token chunk of an OpenAI stream repeats the id, object, created and model of its stream;
    building and encoding that dict per token was measured as the largest Python cost per streamed
    token in the router. Token chunks are the encoded prefix + the token's text and ids + the
    encoded suffix (the same JSON as `sse_event`); every other event goes through `sse_event`.
    """

    def __init__(self, parsed: ParsedRequest, model: str) -> None:
        self.parsed = parsed
        self.model = model
        self._tools = ToolCallStream(parsed.tools) if parsed.tools is not None and parsed.kind == "chat" else None
        self._choices: ChoicesStream | None = None
        if parsed.kind != "generate" and parsed.choices.rich:
            self._choices = ChoicesStream(parsed.kind, _head(parsed, model), parsed.choices, parsed.request.prompt,
                                          parsed.include_usage)
        self._prefix = b""
        self._close_text = b""
        self._suffix = b""
        if parsed.kind != "generate":
            head = line_safe_json(orjson.dumps({
                "id": _openai_id(parsed),
                "object": "chat.completion.chunk" if parsed.kind == "chat" else "text_completion",
                "created": parsed.created,
                "model": model,
            }))
            text_key = b'"delta":{"content":' if parsed.kind == "chat" else b'"text":'
            self._prefix = (b"data: " + head[:-1] + b',"choices":[{"index":0,"logprobs":null,"finish_reason":null,'
                            + text_key)
            self._close_text = b"}" if parsed.kind == "chat" else b""  # closes "delta"
            self._suffix = b"}]" + (b',"usage":null' if parsed.include_usage else b"") + b"}\n\n"

    def preamble(self) -> bytes:
        """What the stream starts with before its first token: the assistant role chunk for chat."""
        if self._choices is not None:
            return self._choices.preamble()
        if self.parsed.kind == "chat":
            return sse(_chunk(self.parsed, self.model, {"role": "assistant", "content": ""}, None, None))
        return b""

    def event(self, event: Event) -> tuple[bytes, bool]:
        """The bytes for `event`, and whether it ends the stream (see `sse_event`)."""
        if self._choices is not None:
            return self._choices.event(event)
        if self._tools is not None:
            return self._tool_event(event)
        if type(event) is not TokenEvent:
            return sse_event(self.parsed, event, self.model)
        text = line_safe_json(orjson.dumps(event.text))
        ids = orjson.dumps(event.token_ids)
        if self.parsed.kind == "generate":
            return b'data: {"text":' + text + b',"token_ids":' + ids + b"}\n\n", False
        return self._prefix + text + self._close_text + b',"token_ids":' + ids + self._suffix, False


    def _tool_event(self, event: Event) -> tuple[bytes, bool]:
        """A chat stream with tools: text becomes content and `tool_calls` deltas (`ToolCallStream`)."""
        assert self._tools is not None
        if isinstance(event, TokenEvent):
            deltas = self._tools.feed(event.text)
            return b"".join(sse(_chunk(self.parsed, self.model, d, None, None)) for d in deltas), False
        if isinstance(event, DoneEvent):
            out = b"".join(sse(_chunk(self.parsed, self.model, d, None, None)) for d in self._tools.finish())
            reason = "tool_calls" if self._tools.called and event.finish_reason == "stop" else event.finish_reason
            out += sse(_chunk(self.parsed, self.model, {}, reason, None))
            if self.parsed.include_usage:
                out += sse(_usage_chunk(self.parsed, self.model, event.usage))
            return out + SSE_DONE, True
        return sse_event(self.parsed, event, self.model)


def _chunk(
    parsed: ParsedRequest,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None,
    token_ids: list[int] | None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
    if parsed.kind == "chat":
        choice["delta"] = delta
    else:
        choice["text"] = delta.get("content", "")
    if token_ids is not None:
        # Not in OpenAI's schema (clients ignore it); load testers count tokens exactly with it.
        choice["token_ids"] = token_ids
    chunk: dict[str, Any] = {
        "id": _openai_id(parsed),
        "object": "chat.completion.chunk" if parsed.kind == "chat" else "text_completion",
        "created": parsed.created,
        "model": model,
        "choices": [choice],
    }
    if parsed.include_usage:
        chunk["usage"] = None
    return chunk


def _head(parsed: ParsedRequest, model: str) -> dict[str, Any]:
    """The fields every chunk of an OpenAI stream repeats."""
    return {
        "id": _openai_id(parsed),
        "object": "chat.completion.chunk" if parsed.kind == "chat" else "text_completion",
        "created": parsed.created,
        "model": model,
    }


def _usage_chunk(parsed: ParsedRequest, model: str, usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": _openai_id(parsed),
        "object": "chat.completion.chunk" if parsed.kind == "chat" else "text_completion",
        "created": parsed.created,
        "model": model,
        "choices": [],
        "usage": usage,
    }
