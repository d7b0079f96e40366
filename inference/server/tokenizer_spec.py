"""`GET /internal/tokenizer`: this worker's tokenizer as a router needs it (inference/wire/tokenizer.py).

A router that routes by KV (the `kv-aware` policy) computes each text or chat prompt's ids before it
picks a decode worker; it fetches the spec once per model from any worker (no model folder on the
router's host needed) and sends the ids, so the worker does not tokenize again. The answer (a few MB:
the backend tokenizer's JSON) is built on first call and kept.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response

from inference.engine.tokenizer import Tokenizer
from inference.server.errors import WorkerError
from inference.wire.tokenizer import PROBE_MESSAGES, PROBE_TEXT, PROBE_TOOLS, TokenizerSpec


def tokenizer_spec(model: str, tokenizer: Tokenizer) -> TokenizerSpec | None:
    """The spec of `tokenizer` with its own ids for the probes; None for a tokenizer without a Rust
    backend (a router could not reproduce it cheaply)."""
    hf = tokenizer.hf
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return None
    chat = None
    if tokenizer.has_chat_template:
        chat = tokenizer.apply_chat_template(PROBE_MESSAGES, tools=PROBE_TOOLS)
    template = hf.chat_template
    return TokenizerSpec(
        model=model,
        tokenizer_json=backend.to_str(),
        chat_template=dict(template) if isinstance(template, dict) else template,
        special_tokens=dict(hf.special_tokens_map),
        probe_text_ids=tokenizer.encode(PROBE_TEXT),
        probe_chat_ids=chat,
    )


def tokenizer_handler(model: str, tokenizer: Tokenizer | None) -> Callable[[Request], Awaitable[Response]]:
    """The handler: the spec as JSON (built once), or 404 when this model has none to share."""
    body: list[bytes] = []

    async def handler(request: Request) -> Response:
        if not body:
            spec = tokenizer_spec(model, tokenizer) if tokenizer is not None else None
            if spec is None:
                raise WorkerError(404, "this worker's model has no fast (Rust) tokenizer to share", "not_found")
            body.append(orjson.dumps(spec.to_json()))
        return Response(body[0], media_type="application/json")

    return handler
