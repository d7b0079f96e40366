"""OpenAI's `n`, `logprobs`, `top_logprobs` and `echo`: how a request asks for them and how the
answer carries them (several choices, each with its index; log-probabilities per token; the
completion's prompt echoed in front of its text).

`parse_choice_fields` reads the fields (400 naming the bad one) and sets the wire's `logprobs` /
`prompt_logprobs` on the request's sampling; `ChoicesStream` formats a stream's events and
`choices_body` a whole answer, for the requests that use any of these (`ChoiceFields.rich`); the
plain path (answers.py's `SseFormatter`) stays as fast as it is for the others.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from inference.router.choices import MAX_N
from inference.router.errors import RouterError
from inference.router.events import DoneEvent, ErrorEvent, Event, TokenEvent
from inference.router.openai_logprobs import CompletionOffsets, chat_content, merge_completion
from inference.wire.line_safe import line_safe_json
from inference.wire.logprobs import Logprob
from inference.wire.sampling import MAX_LOGPROBS, Sampling

SSE_DONE = b"data: [DONE]\n\n"


def _bad(message: str) -> RouterError:
    return RouterError(400, message, error_type="invalid_request_error")


def _int_field(data: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise _bad(f"'{name}' must be an integer in [{low}, {high}], got {value!r}")
    return value


@dataclass
class ChoiceFields:
    """What a request asked of its choices: how many, with log-probabilities, the prompt echoed."""

    n: int = 1
    logprobs: bool = False
    echo: bool = False
    # Choices generated, of which the `n` most likely are returned (choices.py); `n` unless asked.
    best_of: int = 1

    @property
    def rich(self) -> bool:
        """Whether the answer needs this module's formatting (else the plain, faster path)."""
        return self.n > 1 or self.logprobs or self.echo or self.best_of > self.n


def parse_choice_fields(data: dict[str, Any], kind: Literal["completion", "chat"], sampling: Sampling,
                        prompt_is_text: bool = True, stream: bool = False) -> ChoiceFields:
    """`n`, `best_of`, `logprobs`, `top_logprobs` and `echo` of an OpenAI body; sets `sampling`'s
    `logprobs` (and `prompt_logprobs` for an echo that needs the prompt's tokens). `best_of` > `n`
    cannot be streamed (OpenAI's rule: the best are known only at the end) and asks the workers for
    the sampled tokens' log-probabilities, which rank the choices."""
    n = _int_field(data, "n", 1, MAX_N) or 1
    best_of = _int_field(data, "best_of", 1, MAX_N) or n
    if best_of < n:
        raise _bad(f"'best_of' ({best_of}) must be at least 'n' ({n})")
    if best_of > n and stream:
        raise _bad(f"'best_of' greater than 'n' ({best_of} > {n}) cannot be streamed: set 'stream': false")
    fields = ChoiceFields(n=n, best_of=best_of)
    if best_of > n and sampling.logprobs is None:
        sampling.logprobs = 0  # the sampled tokens' own, for the ranking (shown only if asked below)
    if kind == "chat":
        wants = data.get("logprobs")
        if wants is not None and not isinstance(wants, bool):
            raise _bad(f"'logprobs' must be true or false, got {wants!r}")
        top = _int_field(data, "top_logprobs", 0, MAX_LOGPROBS)
        if top is not None and not wants:
            raise _bad("'top_logprobs' needs 'logprobs': true")
        if wants:
            sampling.logprobs = top or 0
            fields.logprobs = True
        return fields
    top = _int_field(data, "logprobs", 0, MAX_LOGPROBS)
    echo = data.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise _bad(f"'echo' must be true or false, got {echo!r}")
    if top is not None:
        sampling.logprobs = top
        fields.logprobs = True
    if echo:
        fields.echo = True
        if top is not None or not prompt_is_text:
            # The prompt's tokens (and their text, for a prompt of token ids) come from the prefill worker.
            sampling.prompt_logprobs = top or 0
    return fields


@dataclass
class _Choice:
    """One choice's state while its events go by."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    started: bool = False
    offsets: CompletionOffsets = field(default_factory=CompletionOffsets)
    completion_logprobs: list[dict[str, Any]] = field(default_factory=list)
    chat_logprobs: list[dict[str, Any]] = field(default_factory=list)


class ChoicesShaper:
    """Turns one choice's token events into its text delta and its logprobs part (stateful per
    choice: the echoed prompt goes in front of the first one, the text offsets run on)."""

    def __init__(self, kind: Literal["completion", "chat"], fields: ChoiceFields, prompt_text: str | None) -> None:
        self.kind = kind
        self.fields = fields
        self.prompt_text = prompt_text
        self.choices: dict[int, _Choice] = {}

    def choice(self, index: int) -> _Choice:
        """The state of choice `index`."""
        found = self.choices.get(index)
        if found is None:
            found = self.choices[index] = _Choice(index)
        return found

    def token(self, event: TokenEvent) -> tuple[_Choice, str, dict[str, Any] | None]:
        """The choice, its text delta and its `logprobs` object for `event`."""
        choice = self.choice(event.index)
        text = event.text
        part: dict[str, Any] | None = None
        positions: list[Logprob | None] = list(event.logprobs or ()) if self.fields.logprobs else []
        if self.kind == "chat":
            if self.fields.logprobs:
                content = chat_content(positions)
                choice.chat_logprobs.extend(content)
                part = {"content": content}
        else:
            parts = []
            if self.fields.echo and not choice.started:
                prompt = self._echo_text(event.prompt_logprobs)
                text = prompt + text
                if self.fields.logprobs and event.prompt_logprobs is not None:
                    parts.append(choice.offsets.shape(event.prompt_logprobs, prompt=True))
                else:
                    choice.offsets.advance(prompt)
            if self.fields.logprobs:
                parts.append(choice.offsets.shape(positions))
                part = merge_completion(parts)
                if part is not None:
                    choice.completion_logprobs.append(part)
        choice.started = True
        choice.text.append(text)
        choice.token_ids.extend(event.token_ids)
        return choice, text, part

    def _echo_text(self, prompt: list[Logprob | None] | None) -> str:
        if self.prompt_text is not None:
            return self.prompt_text
        return "".join(p.token for p in prompt or () if p is not None)


class ChoicesStream:
    """The Server-Sent Events of a request that uses `n`, `logprobs` or `echo`."""

    def __init__(self, kind: Literal["completion", "chat"], head: dict[str, Any], fields: ChoiceFields,
                 prompt_text: str | None, include_usage: bool) -> None:
        self.kind = kind
        self.head = head
        self.fields = fields
        self.include_usage = include_usage
        self.shaper = ChoicesShaper(kind, fields, prompt_text)

    def _sse(self, choices: list[dict[str, Any]], usage: Any = None, with_usage: bool = False) -> bytes:
        chunk = {**self.head, "choices": choices}
        if self.include_usage or with_usage:
            chunk["usage"] = usage
        return b"data: " + line_safe_json(orjson.dumps(chunk)) + b"\n\n"

    def _choice(self, index: int, text: str | None, logprobs: Any, finish_reason: str | None,
                role: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            out["delta"] = delta
        else:
            out["text"] = text or ""
        return out

    def preamble(self) -> bytes:
        """Chat: the assistant role chunk of every choice."""
        if self.kind != "chat":
            return b""
        return b"".join(self._sse([self._choice(i, "", None, None, role=True)]) for i in range(self.fields.n))

    def event(self, event: Event) -> tuple[bytes, bool]:
        """The bytes for `event`, and whether it ends the stream."""
        if isinstance(event, TokenEvent):
            choice, text, part = self.shaper.token(event)
            body = self._choice(choice.index, text, part, None)
            body["token_ids"] = event.token_ids  # as the plain path: not OpenAI's, load testers count with it
            return self._sse([body]), False
        if isinstance(event, DoneEvent):
            out = b"".join(self._sse([self._choice(d.index, None if self.kind == "chat" else "", None,
                                                   d.finish_reason)])
                           for d in (event.choices or [event]))
            if self.include_usage:
                out += self._sse([], event.usage, with_usage=True)
            return out + SSE_DONE, True
        error = RouterError(event.status, event.message).to_dict() if isinstance(event, ErrorEvent) else {}
        return b"data: " + orjson.dumps(error) + b"\n\n" + SSE_DONE, True


def choices_body(kind: Literal["completion", "chat"], fields: ChoiceFields, prompt_text: str | None,
                 events: list[TokenEvent], done: DoneEvent) -> list[dict[str, Any]]:
    """The `choices` of a whole answer from its token events and final event."""
    shaper = ChoicesShaper(kind, fields, prompt_text)
    for event in events:
        shaper.token(event)
    out = []
    for d in done.choices or [done]:
        choice = shaper.choice(d.index)
        body: dict[str, Any] = {"index": d.index, "finish_reason": d.finish_reason}
        text = "".join(choice.text)
        if fields.echo and not choice.started:  # no token at all: the prompt alone
            text = prompt_text or ""
        if kind == "chat":
            body["message"] = {"role": "assistant", "content": text}
            body["logprobs"] = {"content": choice.chat_logprobs} if fields.logprobs else None
        else:
            body["text"] = text
            body["logprobs"] = merge_completion(choice.completion_logprobs) if fields.logprobs else None
        out.append(body)
    return out
