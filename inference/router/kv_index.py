"""The router's exact index of where prompt prefixes are cached: per worker, the block hashes it holds.

Fed by each worker's KV event stream (kv_events.py: a snapshot, then stored/removed batches), so it
is what the workers' prefix caches hold, a few tens of milliseconds late. Every router process
subscribes to every worker itself, so every process has the same view without sharing anything.

A prompt's blocks are hashed once per block size (`PromptBlocks`) with the engine's own chained
hash (inference/wire/kv_events.py), and a worker's cached prefix is the run of those hashes from the
first that it holds. The engine always computes at least a prompt's last token, so a prompt of
whole blocks is credited one block less, as the engine would reuse it.

Thread safety: the feed thread replaces a worker's entry by one assignment (a snapshot) or updates
its set in place (a batch); the request loop only looks hashes up (`in`), never iterates a set the
feed may change.
"""
from __future__ import annotations

import contextvars
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import takewhile
from typing import Any

from inference.router.endpoint import Endpoint
from inference.router.events import GenerateRequest
from inference.wire.kv_events import KVEventBatch, KVSnapshot, block_hashes


class PromptBlocks:
    """A prompt's token ids and their block hashes, computed once per block size.

    `token_ids` may be only the first of the prompt's ids (`total_tokens` then says about how many it
    has): a text prompt the router stopped tokenizing once no worker held its blocks (text_prefix.py).
    Every full block of such a prefix can be reused; of a whole prompt, the last token is left out."""

    __slots__ = ("token_ids", "total_tokens", "complete", "_hashes")

    def __init__(self, token_ids: list[int], total_tokens: int | None = None) -> None:
        self.token_ids = token_ids
        self.complete = total_tokens is None
        self.total_tokens = len(token_ids) if total_tokens is None else max(total_tokens, len(token_ids))
        self._hashes: dict[int, list[bytes]] = {}

    def hashes(self, block_size: int) -> list[bytes]:
        """The hashes of the blocks the engine could reuse: full blocks, the last token left out."""
        cached = self._hashes.get(block_size)
        if cached is None:
            usable = max(len(self.token_ids) - 1, 0) if self.complete else len(self.token_ids)
            cached = block_hashes(self.token_ids[: usable - usable % block_size], block_size)
            self._hashes[block_size] = cached
        return cached

    def reuse(self, hashes: dict[int, list[bytes]]) -> None:
        """Take hashes already computed of every full block of `token_ids` (a prefix's, per block size)."""
        if not self.complete:
            self._hashes.update(hashes)


# The prompt of the request whose worker is being chosen now (set around the choice by the request's
# own task; a policy reads it). A context variable: every request runs in a task of its own.
CURRENT_PROMPT: contextvars.ContextVar[PromptBlocks | None] = contextvars.ContextVar("current_prompt", default=None)

# What the last kv-aware choice of the current task predicted the chosen worker still computes
# (prefill_call counts it in the worker's `pending_tokens` while the prefill runs).
PREDICTED_UNCACHED: contextvars.ContextVar[int] = contextvars.ContextVar("predicted_uncached", default=0)


def set_prompt(req: GenerateRequest, prompt: PromptBlocks | None = None) -> None:
    """Make `req`'s prompt the one the current task's choices see: `prompt` when the router tokenized
    it (prompt_tokens.py; maybe a prefix of it), else its token ids when the client sent ids;
    otherwise the decode worker tokenizes, after the decode choice, which then goes by load."""
    if prompt is None:
        ids = req.prompt_ids
        prompt = PromptBlocks(ids) if ids is not None else None
    CURRENT_PROMPT.set(prompt)


@dataclass
class WorkerBlocks:
    """What one worker's prefix cache holds, as its last snapshot and batches said."""

    role: str
    block_size: int
    epoch: str
    seq: int
    held: set[bytes] = field(default_factory=set)


class PrefixWatch:
    """Whether some of a set of workers still holds every full block of a prompt's ids so far: the
    question a text prompt's chunked tokenization asks after each chunk (text_prefix.py). Each call
    hashes only the new blocks and looks them up only on the workers that held all earlier ones."""

    __slots__ = ("hashes", "_alive")

    def __init__(self, workers: list[WorkerBlocks]) -> None:
        self.hashes: dict[int, list[bytes]] = {}  # per block size, of every full block seen so far
        self._alive = [(worker, 0) for worker in workers]  # (worker, blocks of it checked)

    def __call__(self, token_ids: list[int]) -> bool:
        alive = []
        for worker, checked in self._alive:
            size = worker.block_size
            known = self.hashes.get(size)
            if known is None or len(token_ids) // size > len(known):
                known = self.hashes[size] = block_hashes(token_ids, size, known)
            held = worker.held
            if all(h in held for h in known[checked:]):
                alive.append((worker, len(known)))
        self._alive = alive
        return bool(alive)


class KVIndex:
    """Per worker URL: the block hashes it holds. Read by the `kv-aware` policy."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerBlocks] = {}
        self.snapshots = 0  # snapshots applied (a restart or reconnect of a worker, or a lagging feed)
        self.batches = 0

    def apply_snapshot(self, url: str, snapshot: KVSnapshot) -> None:
        """Replace what `url` holds by its snapshot (one assignment)."""
        self._workers[url] = WorkerBlocks(role=snapshot.role, block_size=snapshot.block_size,
                                          epoch=snapshot.epoch, seq=snapshot.seq, held=set(snapshot.hashes))
        self.snapshots += 1

    def apply_batch(self, url: str, batch: KVEventBatch) -> bool:
        """Apply one batch of changes; False when `url` has no snapshot yet (the batch is ignored)."""
        worker = self._workers.get(url)
        if worker is None:
            return False
        worker.held.difference_update(batch.removed)
        worker.held.update(batch.stored)
        worker.seq = batch.seq
        self.batches += 1
        return True

    def drop(self, url: str) -> None:
        """Forget `url` (its stream ended: the worker died, restarted or left the pool)."""
        self._workers.pop(url, None)

    def knows(self, url: str) -> bool:
        """Whether the index has a snapshot of `url`."""
        return url in self._workers

    def cached_tokens(self, url: str, prompt: PromptBlocks) -> int:
        """Tokens of `prompt` the worker at `url` holds the KV of (its longest cached prefix); 0 when unknown."""
        worker = self._workers.get(url)
        if worker is None:
            return 0
        # takewhile over the set's own __contains__ runs in C: at 256 candidates a choice walks ~8,000
        # blocks, and a Python loop per block was most of the kv-aware policy's cost.
        held_prefix = takewhile(worker.held.__contains__, prompt.hashes(worker.block_size))
        return len(list(held_prefix)) * worker.block_size

    def prefix_watch(self, endpoints: Iterable[Endpoint]) -> PrefixWatch:
        """A `PrefixWatch` over the workers of `endpoints` the index has a snapshot of."""
        workers = self._workers
        return PrefixWatch([w for e in endpoints if (w := workers.get(e.url)) is not None])

    def blocks(self, url: str) -> int:
        """How many blocks the index says `url` holds."""
        worker = self._workers.get(url)
        return len(worker.held) if worker is not None else 0

    def status(self) -> dict[str, Any]:
        """A JSON-safe summary for /router/status: per worker its role, block size, epoch and blocks."""
        return {
            "snapshots": self.snapshots,
            "batches": self.batches,
            "workers": {url: {"role": w.role, "block_size": w.block_size, "epoch": w.epoch, "seq": w.seq,
                              "blocks": len(w.held)} for url, w in list(self._workers.items())},
        }
