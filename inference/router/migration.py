"""Stream migration: a stream whose decode worker fails after its first token continues elsewhere.

The router knows the prompt's token ids (the decode worker's descriptor line) and every token it
has forwarded. A new decode worker is given prompt + those tokens as its prompt, gets it prefilled
(prefix caching makes that cheap where the prefill worker has the prompt), and decodes the
remaining `max_tokens`; the client's stream goes on without a gap in its tokens. A greedy stream
produces the tokens an unbroken run would have. Bounded by `max_migrations` per request.
"""
from __future__ import annotations

from inference.router.events import GenerateRequest


def resumed_request(
    req: GenerateRequest, prompt_ids: list[int], emitted: list[int], migration: int
) -> GenerateRequest | None:
    """The request that continues `req` after `emitted` tokens, or None when nothing is left to do."""
    # The seeded sampler counts output tokens from `seed_offset`: the new worker's first token is
    # output token len(emitted) of the stream, as in an unbroken run.
    sampling = req.sampling.continued(len(emitted))
    if sampling is None or not prompt_ids:
        return None
    return GenerateRequest(sampling=sampling, input_ids=[*prompt_ids, *emitted],
                           request_id=f"{req.request_id}-m{migration}")
