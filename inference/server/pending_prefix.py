"""The prompt blocks a worker's queued prefills will compute: what a prompt arriving now will find cached
by the time the engine admits it, beyond what the prefix cache holds at receipt.

The engine's scheduler computes a prefix shared within a burst once: a prompt whose next blocks an
earlier prompt of the same step computes waits a step and then reuses them
(`scheduler.SHARED_PREFIX_WAIT_TOKENS`). So a burst of chats sharing a system prompt costs one system
prompt plus each chat's own tokens, though at receipt every one of them misses the cache. A decode
worker offered local prefill decides by the tokens a prompt leaves to compute (local_prefill.py);
counted at receipt, a burst's cold first turns all looked like whole prompts and half of them went
to the prefill workers, through the hop, while the prefill that would give them the system prompt
was already queued here (Zen 5, 32 x 4 multi-turn run: their remote first turns 3.0 s TTFT p50
against 1.9 s local, setting the run's p90). `PendingPrefixes` tracks the full-block content hashes of
the prompts this worker has taken and not yet computed, so that such a prompt counts only its own part.
"""
from __future__ import annotations

import os
import threading

from inference.engine.scheduler import SHARED_PREFIX_WAIT_TOKENS
from inference.wire.kv_events import block_hashes

# A/B switch for benchmarks: "0" counts the tokens to compute at receipt only (as before).
PENDING_PREFIX_ENV = "WORKER_PENDING_PREFIX_CREDIT"


def pending_prefix_credit_enabled() -> bool:
    """Whether queued prefills' blocks count as cached for a prompt's decision (unless the env says 0)."""
    return os.environ.get(PENDING_PREFIX_ENV, "1").strip() != "0"


class PendingPrefixes:
    """The full-block hashes of the prompts taken for prefill here and not computed yet, by request.

    Thread-safe (the decisions run on the event loop, but a stream may end from another task's
    cleanup); a few dict operations per prompt block."""

    def __init__(self, block_size: int, enabled: bool = True) -> None:
        """Blocks of `block_size` tokens, as the engine hashes them; `enabled` False: never credits."""
        self.block_size = block_size
        self.enabled = enabled
        self._lock = threading.Lock()
        self._by_request: dict[str, list[bytes]] = {}
        self._counts: dict[bytes, int] = {}

    def hashes(self, token_ids: list[int]) -> list[bytes]:
        """The prompt's blocks the engine may reuse (full ones, its last token always left to compute)."""
        usable = max(len(token_ids) - 1, 0) // self.block_size * self.block_size
        return block_hashes(token_ids[:usable], self.block_size)

    def shared_tokens(self, hashes: list[bytes]) -> int:
        """Tokens of the prompt's leading blocks that a queued prefill here computes, when they are enough
        for the engine to wait for them (`SHARED_PREFIX_WAIT_TOKENS`; fewer: it computes them itself)."""
        if not self.enabled:
            return 0
        with self._lock:
            shared = 0
            for h in hashes:
                if h not in self._counts:
                    break
                shared += 1
        tokens = shared * self.block_size
        return tokens if tokens >= SHARED_PREFIX_WAIT_TOKENS else 0

    def add(self, request_id: str, hashes: list[bytes]) -> None:
        """A prompt taken for prefill here: its blocks will be computed (or found cached) soon."""
        if not self.enabled:
            return
        with self._lock:
            if request_id in self._by_request:
                return
            self._by_request[request_id] = hashes
            for h in hashes:
                self._counts[h] = self._counts.get(h, 0) + 1

    def remove(self, request_id: str) -> None:
        """The prompt's prefill is done (its blocks are in the prefix cache now) or it ended without one."""
        with self._lock:
            hashes = self._by_request.pop(request_id, None)
            for h in hashes or ():
                left = self._counts[h] - 1
                if left:
                    self._counts[h] = left
                else:
                    del self._counts[h]

    def __len__(self) -> int:
        """Prompts tracked."""
        return len(self._by_request)
