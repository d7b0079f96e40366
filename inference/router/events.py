"""What a generation is made of on the router: the request, and the events clients are sent."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from inference.router.pin import Pin
from inference.wire.logprobs import Logprob
from inference.wire.sampling import Sampling


def new_request_id() -> str:
    """A fresh public request id."""
    return f"req-{uuid.uuid4().hex}"


@dataclass
class GenerateRequest:
    """One generation: the prompt (text, chat messages or token ids) and the sampling parameters.

    `sampling` goes to the decode worker as the wire's JSON; the worker checks it again (with the same
    rules) and against its own limits, answering 400, which the router passes through.
    """

    sampling: Sampling
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    # Chat tools (OpenAI function tools, checked): the decode worker renders them with the chat template.
    tools: list[dict[str, Any]] | None = None
    # The prompt's ids as the router computed them from `prompt` or `messages` (prompt_tokens.py): sent
    # to the worker instead of the text, so it does not tokenize again. None: the worker tokenizes.
    token_ids: list[int] | None = None
    request_id: str = field(default_factory=new_request_id)
    # Who sent it (its fair share in the admission queue) and its priority class (0 is served first).
    tenant: str = ""
    priority: int = 0
    # n > 1: where choice 0 ran, shared by the request's choices (pin.py); None for a request of one.
    pin: Pin | None = None

    @property
    def prompt_ids(self) -> list[int] | None:
        """The prompt's ids when known before a worker answers: the client's or the router's own."""
        return self.input_ids if self.input_ids is not None else self.token_ids

    def decode_body(self, request_id: str) -> dict[str, Any]:
        """The JSON body of `POST /internal/decode`."""
        body: dict[str, Any] = {"request_id": request_id, "sampling": self.sampling.to_json()}
        if self.input_ids is not None:
            body["input_ids"] = self.input_ids
        elif self.token_ids is not None:
            body["input_ids"] = self.token_ids
        elif self.messages is not None:
            body["messages"] = self.messages
            if self.tools:
                body["tools"] = self.tools
        else:
            body["prompt"] = self.prompt
        return body


@dataclass(slots=True)
class TokenEvent:
    """New output: the text delta and the token ids it came from; when the request asked, the
    tokens' log-probabilities (one per id; None where no worker reported one) and, on a stream's
    first event, the prompt's (echo). `index`: the choice it belongs to (n > 1)."""

    text: str
    token_ids: list[int]
    type: Literal["token"] = "token"
    logprobs: list[Logprob | None] | None = None
    prompt_logprobs: list[Logprob | None] | None = None
    index: int = 0


@dataclass(slots=True)
class DoneEvent:
    """The request finished: why, token counts, timings, and which workers served it."""

    request_id: str
    finish_reason: str
    # prompt_tokens, completion_tokens, total_tokens and, where the workers reported it,
    # prompt_tokens_details.cached_tokens (OpenAI's shape).
    usage: dict[str, Any]
    timings: dict[str, float | None]
    prefill: str
    decode: str
    kv_bytes: int | None = None
    retries: int = 0
    # Times the stream moved to another decode worker after its first token (a worker failed).
    migrations: int = 0
    type: Literal["done"] = "done"
    index: int = 0
    # n > 1: the one final event holds every choice's own (usage summed, the prompt counted once).
    choices: list[DoneEvent] | None = None


@dataclass(slots=True)
class ErrorEvent:
    """The stream broke after the first token; `status` is what a fresh request would have got."""

    message: str
    status: int = 502
    # False when moving the stream to another worker cannot help (the request's deadline passed).
    migratable: bool = True
    type: Literal["error"] = "error"


Event = TokenEvent | DoneEvent | ErrorEvent
