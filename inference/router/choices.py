"""`n` > 1: several choices for one prompt, as one stream of events tagged with their choice index.

The router fans the request out into `n` runs of the same prompt (request ids `<id>-c<i>`; a seeded
request's choice i is seeded `seed + i`, as vLLM does, so the choices differ and each is
reproducible). Choice 0 runs first; the others start once it has its first token, when its prompt's
KV is in the decode worker's prefix cache (registered on arrival) and the prefill worker's. The
choices share a `Pin` (pin.py) that sends the others to choice 0's decode and prefill workers while
those are in rotation with a free slot, so their prefills compute only the prompt's last, partial
block and their reservations take the cached full blocks (`tests/inference/test_n_pinning_e2e.py`:
two workers of each role). Every choice is an ordinary run: it retries, migrates and aborts on its
own, and falls back to the usual routing where its pinned worker is gone, full or failed it. Errors before every choice
has its first token are the request's status (nothing was sent yet); after that an error ends the
whole stream. The last event is one DoneEvent holding each choice's (`choices`), with usage counting
the prompt once and the completions of all choices.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from inference.router.events import DoneEvent, ErrorEvent, Event, GenerateRequest, TokenEvent
from inference.router.pin import Pin

if TYPE_CHECKING:
    from inference.router.pd_client import DisaggregatedClient

# The most choices one request may ask for (each one is a decode slot and a stream).
MAX_N = 16


def choice_request(req: GenerateRequest, index: int) -> GenerateRequest:
    """Choice `index` of `req`: its own request id and, when seeded, its own seed."""
    if index == 0:
        return req
    sampling = req.sampling
    if sampling.seed is not None:
        sampling = replace(sampling, seed=sampling.seed + index)
    return replace(req, sampling=sampling, request_id=f"{req.request_id}-c{index}")


def generate_choices(
    client: DisaggregatedClient, req: GenerateRequest, n: int, arrived: float | None = None, best_of: int = 1
) -> AsyncGenerator[Event, None]:
    """The events of `n` choices of `req` (`client.generate`'s own stream when n is 1); with `best_of` > n,
    the n most likely of `best_of` choices (`_best`)."""
    if best_of > n:
        return _best(client, req, n, best_of, arrived)
    if n == 1:
        return client.generate(req, arrived)
    return _merged(client, req, n, arrived)


async def _best(
    client: DisaggregatedClient, req: GenerateRequest, n: int, best_of: int, arrived: float | None
) -> AsyncGenerator[Event, None]:
    """`best_of` choices run as for `n` (one pinned prompt), then the `n` whose tokens have the highest
    cumulative log-probability, most likely first and indexed 0..n-1 (as vLLM's `best_of`). The
    log-probabilities are the workers' raw ones of each sampled token (the request asks them; the
    protocol shows them only when the client did). Nothing is sent before the end (the protocol refuses
    to stream `best_of` > n); usage counts every generated token, the ones of the choices dropped too."""
    events: list[TokenEvent] = []
    scores = [0.0] * best_of
    done: DoneEvent | None = None
    stream = _merged(client, req, best_of, arrived)
    try:
        async for event in stream:  # bounded: every run's waits time out
            if isinstance(event, ErrorEvent):
                yield event
                return
            if isinstance(event, DoneEvent):
                done = event
                break
            events.append(event)
            scores[event.index] += sum(p.logprob for p in event.logprobs or ()
                                       if p is not None and p.logprob is not None)
    finally:
        await stream.aclose()
    assert done is not None and done.choices is not None  # _merged ends with its combined event
    # Stable: of equally likely choices the lower index wins.
    kept = {old: new for new, old in enumerate(sorted(range(best_of), key=lambda i: -scores[i])[:n])}
    for event in events:
        if event.index in kept:
            event.index = kept[event.index]
            yield event
    choices = sorted((replace(c, index=kept[c.index]) for c in done.choices if c.index in kept),
                     key=lambda c: c.index)
    yield replace(done, choices=choices, finish_reason=choices[0].finish_reason)


async def _merged(
    client: DisaggregatedClient, req: GenerateRequest, n: int, arrived: float | None
) -> AsyncGenerator[Event, None]:
    req = replace(req, pin=Pin())  # choice 0's run records its workers in it; the others read them
    streams: list[AsyncGenerator[Event, None]] = [client.generate(req, arrived)]
    reads: dict[asyncio.Future[Event], int] = {}
    try:
        # Choice 0 alone up to its first token: the prompt's KV is then cached for the others.
        first: list[Event] = [await anext(streams[0])]
        streams += [client.generate(choice_request(req, i), arrived) for i in range(1, n)]
        starts = await asyncio.gather(*(anext(s) for s in streams[1:]), return_exceptions=True)
        for start in starts:
            if isinstance(start, BaseException):
                raise start  # the request's status (a RouterError); the finally closes every run
        first += [start for start in starts if not isinstance(start, BaseException)]
        done: list[DoneEvent | None] = [None] * n
        pending_first = list(enumerate(first))
        while True:  # bounded: every run's waits time out, and each ends with a done or error event
            if pending_first:
                index, event = pending_first.pop(0)
            else:
                if not reads:
                    break
                finished, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
                future = next(iter(finished))
                index = reads.pop(future)
                event = future.result()  # a run ends with an event, never by running out
            if isinstance(event, ErrorEvent):
                yield event
                return
            event.index = index
            if isinstance(event, DoneEvent):
                done[index] = event
                continue
            yield event
            reads[asyncio.ensure_future(anext(streams[index]))] = index
        yield _combined([d for d in done if d is not None])
    finally:
        for future in reads:
            future.cancel()
        # Bounded: a cancelled read ends its run's wait at once (its cleanup aborts the workers).
        await asyncio.gather(*reads, return_exceptions=True)
        for stream in streams:
            with contextlib.suppress(Exception):
                await stream.aclose()


def _combined(choices: list[DoneEvent]) -> DoneEvent:
    """The one final event of `choices`: the first choice's fields, usage over all of them."""
    head = choices[0]
    prompt = head.usage.get("prompt_tokens", 0)
    completion = sum(c.usage.get("completion_tokens", 0) for c in choices)
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
    if "prompt_tokens_details" in head.usage:
        usage["prompt_tokens_details"] = head.usage["prompt_tokens_details"]
    return replace(head, usage=usage,
                   retries=sum(c.retries for c in choices), migrations=sum(c.migrations for c in choices),
                   choices=sorted(choices, key=lambda c: c.index))
