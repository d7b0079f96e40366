"""One decode worker's try at a request, with everything that must be closed or aborted after it."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from inference.router.decode_stream import DecodeStream
from inference.router.endpoint import Endpoint
from inference.router.upstream import UpstreamResponse
from inference.wire.prefill import PrefillAnswer


@dataclass(eq=False)
class Attempt:
    """A decode worker's stream for one request id, and the prefill worker that served it."""

    request_id: str
    decode: Endpoint
    response: UpstreamResponse | None = None
    stream: DecodeStream | None = None
    prompt_ids: list[int] = field(default_factory=list)
    prefill: Endpoint | None = None
    prefill_answer: PrefillAnswer = field(default_factory=PrefillAnswer)
    holds_decode_slot: bool = False
    # The prefill call, still finishing in the background after the first token came before it.
    pending_answer: asyncio.Future[None] | None = None
    # True when the decode worker certainly holds nothing for this request (it could not be
    # reached, or it refused the request with an error status): no abort is sent to it.
    decode_untouched: bool = False
    # Tokens of this attempt's stream handed to the client (what a credited stream acknowledges).
    relayed: int = 0
    # Whether the prefill answer's first-token log-probabilities went to the client already.
    first_logprobs_taken: bool = False

    def abort_urls(self) -> list[str]:
        """The workers that may hold something for this attempt."""
        urls = [] if self.decode_untouched else [self.decode.url]
        if self.prefill is not None:
            urls.append(self.prefill.url)
        return urls
