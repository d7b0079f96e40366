"""Where a `kv-aware` router gets its `PromptTokenizer`: from a worker, once per model.

The router needs no model folder of its own (its host may hold none): the first request that finds
no tokenizer for the model its decode workers report starts a fetch of `GET /internal/tokenizer`
from one of them, in a thread, and goes on untokenized (the worker tokenizes, as without this);
requests after the fetch are tokenized here. A fetch that fails, or a tokenizer that does not
reproduce the worker's probes, is tried again after `RETRY_S` on the next decode worker; the reason
shows in /router/status and is logged when it changes (a worker that does not serve its tokenizer,
404, is not an error: its prompts stay text and the decode choice goes by load).
"""
from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from inference.router.endpoint import Endpoint
from inference.router.prompt_tokens import PromptTokenizer
from inference.wire.tokenizer import TokenizerSpec

logger = logging.getLogger(__name__)

# A tokenizer answer is a few MB; a worker busy with prefills may take a while to send it.
FETCH_TIMEOUT_S = 30.0
# After a failed fetch (or a mismatch), the next try waits this long.
RETRY_S = 30.0


class TokenizerSource:
    """Per model name: its tokenizer once fetched. Read from the request loop, written by fetch threads
    (one assignment per model)."""

    def __init__(self, headers: Mapping[str, str] | None = None) -> None:
        self.headers = dict(headers or {})
        self._ready: dict[str, PromptTokenizer] = {}
        self._loading: set[str] = set()
        self._retry_at: dict[str, float] = {}
        self.errors: dict[str, str] = {}
        self._tries = 0

    def for_endpoints(self, decode: Sequence[Endpoint]) -> PromptTokenizer | None:
        """The tokenizer of the model the first of `decode` reports (a router serves one model), or
        None while it is not here yet (its fetch starts now, unless one runs or failed lately)."""
        if not decode:
            return None
        model = (decode[0].last_health or {}).get("model")
        if not isinstance(model, str) or not model:
            return None
        tokenizer = self._ready.get(model)
        if tokenizer is None and model not in self._loading and time.monotonic() >= self._retry_at.get(model, 0.0):
            self._loading.add(model)
            self._tries += 1  # each try asks the next decode worker: one of them may serve it
            url = decode[self._tries % len(decode)].url
            threading.Thread(target=self._load, args=(model, url), name="router-tokenizer", daemon=True).start()
        return tokenizer

    def _load(self, model: str, url: str) -> None:
        try:
            request = urllib.request.Request(f"{url}/internal/tokenizer", headers=self.headers)
            with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_S) as response:  # noqa: S310 (worker URL)
                spec = TokenizerSpec.from_json(orjson.loads(response.read()))
            if spec.model != model:
                raise ValueError(f"{url} serves {spec.model!r} now, not {model!r}")
            self._ready[model] = PromptTokenizer(spec)
            self.errors.pop(model, None)
            logger.info("tokenizing prompts of %s here (tokenizer %s from %s)", model, spec.digest, url)
        except Exception as exc:  # noqa: BLE001  any failure leaves requests untokenized, never broken
            not_served = isinstance(exc, urllib.error.HTTPError) and exc.code == 404
            reason = "does not serve GET /internal/tokenizer (404)" if not_served else f"{type(exc).__name__}: {exc}"
            if self.errors.get(model, "").partition(": ")[2] != reason:  # logged when the reason changes
                log = logger.info if not_served else logger.warning
                log("cannot tokenize prompts of %s in the router (%s: %s); the workers tokenize them", model, url,
                    reason)
            self.errors[model] = f"{url}: {reason}"
            self._retry_at[model] = time.monotonic() + RETRY_S
        finally:
            self._loading.discard(model)

    def status(self) -> dict[str, Any]:
        """For /router/status: the tokenizers here and the last failure per model."""
        return {"models": {name: t.status() for name, t in list(self._ready.items())},
                "loading": sorted(self._loading), "errors": dict(self.errors)}
