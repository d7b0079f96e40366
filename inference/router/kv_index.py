"""The router's exact index of where prompt prefixes are cached: block hash -> the workers holding it.

Fed by each worker's KV event stream (kv_events.py: a snapshot, then stored/removed batches), so it
is what the workers' prefix caches hold, a few tens of milliseconds late. Every router process
subscribes to every worker itself, so every process has the same view without sharing anything.

A prompt's blocks are hashed once per block size (`PromptBlocks`) with the engine's own chained
hash (inference/wire/kv_events.py), and a worker's cached prefix is the run of those hashes from the
first that it holds. The engine always computes at least a prompt's last token, so a prompt of
whole blocks is credited one block less, as the engine would reuse it.

The index is inverted (as Dynamo's radix tree, for the same reason): each block hash maps to the set
of workers holding it, a bitmask over worker slots. A choice walks the prompt's blocks once, ANDing
the masks, whatever the number of workers (`PrefixMatch`); looking every candidate's prefix up in
its own set cost a lookup per block per worker, 714 us a request over 256 + 256 workers that all
held the same half of a 1,000-token prompt (docs/benchmarks.md, issue 25). Each worker also keeps its
own set, to take its bits out again when it is dropped or sends a new snapshot.

Thread safety: one lock orders the writers (the feed thread; tests); readers take no lock. A mask is
an int, replaced by one dict assignment, so a reader sees a mask before or after a change, never a
torn one; a choice made during a snapshot may see part of it, which only steers, never fails.
"""
from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inference.router.endpoint import Endpoint
from inference.router.events import GenerateRequest
from inference.wire.kv_events import KVEventBatch, KVSnapshot, block_hashes


class PromptBlocks:
    """A prompt's token ids and their block hashes, computed once per block size.

    `token_ids` may be only the first of the prompt's ids (`total_tokens` then says about how many it
    has): a text prompt the router stopped tokenizing once no worker held its blocks (text_prefix.py).
    Every full block of such a prefix can be reused; of a whole prompt, the last token is left out."""

    __slots__ = ("token_ids", "total_tokens", "complete", "_hashes", "matched")

    def __init__(self, token_ids: list[int], total_tokens: int | None = None) -> None:
        self.token_ids = token_ids
        self.complete = total_tokens is None
        self.total_tokens = len(token_ids) if total_tokens is None else max(total_tokens, len(token_ids))
        self._hashes: dict[int, list[bytes]] = {}
        # The last `KVIndex.match` of this prompt: (the index, its version then, the match). A request's
        # decode and prefill choices walk the index once between them while it does not change.
        self.matched: tuple[KVIndex, int, dict[str, int]] | None = None

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
    """What one worker's prefix cache holds, as its last snapshot and batches said, and its slot: the
    bit that stands for it in the index's masks."""

    role: str
    block_size: int
    epoch: str
    seq: int
    slot: int
    held: set[bytes] = field(default_factory=set)


class PrefixWatch:
    """Whether some of a set of workers still holds every full block of a prompt's ids so far: the
    question a text prompt's chunked tokenization asks after each chunk (text_prefix.py). Each call
    hashes only the new blocks and ANDs their holders into the workers still matching, per block size."""

    __slots__ = ("hashes", "_holders", "_alive")

    def __init__(self, holders: dict[bytes, int], alive: dict[int, int]) -> None:
        self.hashes: dict[int, list[bytes]] = {}  # per block size, of every full block seen so far
        self._holders = holders
        self._alive = {size: [mask, 0] for size, mask in alive.items() if mask}  # (workers, blocks checked)

    def __call__(self, token_ids: list[int]) -> bool:
        holders = self._holders
        for size, state in list(self._alive.items()):
            known = self.hashes.get(size)
            if known is None or len(token_ids) // size > len(known):
                known = self.hashes[size] = block_hashes(token_ids, size, known)
            mask = state[0]
            for h in known[state[1]:]:
                mask &= holders.get(h, 0)
                if not mask:
                    break
            if mask:
                state[0], state[1] = mask, len(known)
            else:
                del self._alive[size]
        return bool(self._alive)


def _depth_per_slot(levels: list[tuple[int, int]]) -> np.ndarray:
    """Tokens per slot from nested masks, widest first: a slot in mask j holds `tokens` more of the
    prompt. The masks are nested, so a slot in k of them is in the first k: its depth is the sum of the
    first k levels' tokens, read from their running sum by how many masks hold it."""
    width = (levels[0][0].bit_length() + 7) // 8
    rows = np.frombuffer(b"".join(mask.to_bytes(width, "little") for mask, _ in levels), np.uint8)
    bits = np.unpackbits(rows.reshape(len(levels), width), axis=1, bitorder="little")
    count = bits.sum(axis=0, dtype=np.intp) if len(levels) > 1 else bits[0].astype(np.intp)
    depth_of_count = np.zeros(len(levels) + 1, dtype=np.int64)
    np.cumsum([tokens for _, tokens in levels], out=depth_of_count[1:])
    return depth_of_count[count]


class KVIndex:
    """Block hash -> the workers holding it (a mask of slots), and per worker URL the hashes it holds.
    Read by the `kv-aware` policy."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerBlocks] = {}
        self._holders: dict[bytes, int] = {}
        self._free_slots: list[int] = []
        self._urls = np.empty(0, dtype=object)  # per slot, its worker's URL (None: free)
        self._sizes: dict[int, int] = {}  # block size -> workers of that size
        self.version = 0  # changes with every write: a match computed at this version is still exact
        self._lock = threading.Lock()
        self.snapshots = 0  # snapshots applied (a restart or reconnect of a worker, or a lagging feed)
        self.batches = 0

    def _add(self, hashes: Iterable[bytes], bit: int) -> None:
        holders = self._holders
        for h in hashes:
            holders[h] = holders.get(h, 0) | bit

    def _remove(self, hashes: Iterable[bytes], bit: int) -> None:
        holders = self._holders
        for h in hashes:
            mask = holders.get(h, 0) & ~bit
            if mask:
                holders[h] = mask
            else:
                holders.pop(h, None)

    def apply_snapshot(self, url: str, snapshot: KVSnapshot) -> None:
        """Replace what `url` holds by its snapshot."""
        held = set(snapshot.hashes)
        with self._lock:
            old = self._workers.get(url)
            if old is not None:
                slot = old.slot
                self._remove(old.held - held, 1 << slot)
                self._add(held - old.held, 1 << slot)
                self._count_size(old.block_size, -1)
            else:
                slot = self._free_slots.pop() if self._free_slots else self._next_slot()
                self._urls[slot] = url
                self._add(held, 1 << slot)
            self._count_size(snapshot.block_size, 1)
            self._workers[url] = WorkerBlocks(role=snapshot.role, block_size=snapshot.block_size,
                                              epoch=snapshot.epoch, seq=snapshot.seq, slot=slot, held=held)
            self.snapshots += 1
            self.version += 1

    def _next_slot(self) -> int:
        slot = len(self._urls)
        urls = np.empty(max(8, 2 * slot), dtype=object)  # a new array: a reader keeps the one it took
        urls[:slot] = self._urls
        self._free_slots.extend(range(len(urls) - 1, slot, -1))
        self._urls = urls
        return slot

    def _count_size(self, block_size: int, change: int) -> None:
        count = self._sizes.get(block_size, 0) + change
        if count:
            self._sizes[block_size] = count
        else:
            self._sizes.pop(block_size, None)

    def apply_batch(self, url: str, batch: KVEventBatch) -> bool:
        """Apply one batch of changes; False when `url` has no snapshot yet (the batch is ignored)."""
        with self._lock:
            worker = self._workers.get(url)
            if worker is None:
                return False
            bit = 1 << worker.slot
            removed = worker.held.intersection(batch.removed)
            worker.held.difference_update(removed)
            self._remove(removed, bit)
            worker.held.update(batch.stored)
            self._add(batch.stored, bit)
            worker.seq = batch.seq
            self.batches += 1
            self.version += 1
            return True

    def drop(self, url: str) -> None:
        """Forget `url` (its stream ended: the worker died, restarted or left the pool)."""
        with self._lock:
            worker = self._workers.pop(url, None)
            if worker is not None:
                self._remove(worker.held, 1 << worker.slot)
                self._urls[worker.slot] = None
                self._free_slots.append(worker.slot)
                self._count_size(worker.block_size, -1)
                self.version += 1

    def knows(self, url: str) -> bool:
        """Whether the index has a snapshot of `url`."""
        return url in self._workers

    def match(self, prompt: PromptBlocks) -> dict[str, int]:
        """Per worker holding some of `prompt`, the tokens of it it holds the KV of (its longest cached
        prefix): one walk over the prompt's blocks per block size in use, whatever the number of workers;
        none when the index has not changed since the prompt's last match."""
        matched = prompt.matched
        version = self.version
        if matched is not None and matched[0] is self and matched[1] == version:
            return matched[2]
        found = self._match(prompt)
        prompt.matched = (self, version, found)
        return found

    def _match(self, prompt: PromptBlocks) -> dict[str, int]:
        holders, urls = self._holders, self._urls
        depth: np.ndarray | None = None
        for size in list(self._sizes):
            levels: list[tuple[int, int]] = []  # nested masks, each with the tokens its holders add
            alive, run = -1, 0
            for h in prompt.hashes(size):
                held = alive & holders.get(h, 0)
                if held != alive:
                    if run:
                        levels.append((alive, run * size))
                    alive, run = held, 0
                    if not alive:
                        break
                run += 1
            if alive and run:
                levels.append((alive, run * size))
            if levels:
                tokens = _depth_per_slot(levels)
                if depth is None:
                    depth = tokens
                else:  # a second block size: add the shorter into the longer
                    shorter, depth = sorted((depth, tokens), key=len)
                    depth[: len(shorter)] += shorter
        if depth is None:
            return {}
        slots = np.flatnonzero(depth[: len(urls)])
        # C loops throughout: at 256 + 256 workers all holding the prompt this is ~10 us, not ~100.
        return dict(zip(urls[slots].tolist(), depth[slots].tolist(), strict=True))

    def cached_tokens(self, url: str, prompt: PromptBlocks) -> int:
        """Tokens of `prompt` the worker at `url` holds the KV of (its longest cached prefix); 0 when unknown."""
        return self.match(prompt).get(url, 0)

    def prefix_watch(self, endpoints: Iterable[Endpoint]) -> PrefixWatch:
        """A `PrefixWatch` over the workers of `endpoints` the index has a snapshot of."""
        workers = self._workers
        alive: dict[int, int] = {}
        for endpoint in endpoints:
            worker = workers.get(endpoint.url)
            if worker is not None:
                alive[worker.block_size] = alive.get(worker.block_size, 0) | (1 << worker.slot)
        return PrefixWatch(self._holders, alive)

    def blocks(self, url: str) -> int:
        """How many blocks the index says `url` holds."""
        worker = self._workers.get(url)
        return len(worker.held) if worker is not None else 0

    def status(self) -> dict[str, Any]:
        """A JSON-safe summary for /router/status: per worker its role, block size, epoch and blocks."""
        return {
            "snapshots": self.snapshots,
            "batches": self.batches,
            "distinct_blocks": len(self._holders),
            "workers": {url: {"role": w.role, "block_size": w.block_size, "epoch": w.epoch, "seq": w.seq,
                              "blocks": len(w.held)} for url, w in list(self._workers.items())},
        }
