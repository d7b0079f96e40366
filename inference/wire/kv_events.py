"""The KV event stream: which prompt prefixes a worker holds, as a router subscribes to them.

`GET /internal/kv-events` on any worker answers an NDJSON stream. Its first line is a snapshot (every
block hash the worker's prefix cache holds, with the worker's role, block size and an epoch that
changes when the process restarts); the lines after it are batches of changes (`stored`, `removed`)
numbered by the worker's event sequence, and `load` lines (what the worker has ahead of it: running,
waiting, prompt tokens still to prefill, its prefill rate, KV usage; at most every 100 ms, when it
changed), so that every router process reads the same load. A batch is coalesced: a hash appears in at most one of its
two lists, with the state it ended in, so applying a batch is two set operations whatever order the
changes came in. A subscriber that fell too far behind gets a fresh snapshot instead of a batch.

Both ends compute a block's hash alike (`block_hashes`): block i's hash chains every token up to the
end of block i, so a router that has the prompt's token ids knows which blocks of it a worker holds.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Any

import orjson


def block_hashes(token_ids: list[int], block_size: int, start: list[bytes] | None = None) -> list[bytes]:
    """Chained content hashes of the full blocks of `token_ids`: block i's hash covers every token up to
    the end of block i, so equal hashes mean equal prefixes (hence equal KV). `start`: hashes already
    known for the first blocks (extended, not recomputed)."""
    out = list(start or [])
    prev = out[-1] if out else b""
    first, end = len(out), len(token_ids) // block_size
    if end <= first:
        return out
    # One conversion of the blocks to hash, sliced per block (a conversion per block cost as much as
    # the hashing: the router hashes every prompt it routes).
    raw = array("q", token_ids[first * block_size : end * block_size]).tobytes()
    step = block_size * 8
    blake2b = hashlib.blake2b
    for offset in range(0, len(raw), step):
        prev = blake2b(prev + raw[offset : offset + step], digest_size=16).digest()
        out.append(prev)
    return out


def _hashes(value: Any, name: str) -> list[bytes]:
    if not isinstance(value, list) or not all(isinstance(h, str) for h in value):
        raise ValueError(f"'{name}' must be a list of hex strings")
    try:
        return [bytes.fromhex(h) for h in value]
    except ValueError as exc:
        raise ValueError(f"'{name}' holds a string that is not hex: {exc}") from exc


def _int(obj: dict[str, Any], name: str, minimum: int) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"'{name}' must be an integer >= {minimum}")
    return value


@dataclass(slots=True)
class KVSnapshot:
    """Everything a worker's prefix cache holds at event sequence `seq` (the stream's first line)."""

    role: str
    block_size: int
    epoch: str
    seq: int
    hashes: list[bytes] = field(default_factory=list)

    def encode(self) -> bytes:
        """The NDJSON line, newline included."""
        return orjson.dumps({"type": "snapshot", "role": self.role, "block_size": self.block_size,
                             "epoch": self.epoch, "seq": self.seq,
                             "hashes": [h.hex() for h in self.hashes]}) + b"\n"


@dataclass(slots=True)
class KVEventBatch:
    """The changes up to event sequence `seq`: hashes now held (`stored`) and no longer held (`removed`)."""

    seq: int
    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)

    def encode(self) -> bytes:
        """The NDJSON line, newline included."""
        return orjson.dumps({"type": "events", "seq": self.seq, "stored": [h.hex() for h in self.stored],
                             "removed": [h.hex() for h in self.removed]}) + b"\n"


@dataclass(slots=True, frozen=True)
class WorkerLoad:
    """What a worker has ahead of it now (a `load` line), so that every router process sees the same load
    whoever sent the requests: `running` sequences in its batch, `waiting` ones (queued for a slot or,
    on a decode worker, for their KV: `reserved`), `prompt_tokens_pending` (prompt tokens it still
    prefills: a prefill worker's queue, a decode worker's local prefills), the prompt tokens/s it
    sustains while prefilling (None until measured), and the share of its KV pool in use."""

    running: int
    waiting: int
    prompt_tokens_pending: int
    prefill_tokens_per_s: float | None
    kv_usage: float

    @property
    def requests(self) -> int:
        """Requests on the worker: running and waiting."""
        return self.running + self.waiting

    def encode(self) -> bytes:
        """The NDJSON line, newline included."""
        return orjson.dumps({"type": "load", "running": self.running, "waiting": self.waiting,
                             "prompt_tokens_pending": self.prompt_tokens_pending,
                             "prefill_tokens_per_s": self.prefill_tokens_per_s, "kv_usage": self.kv_usage}) + b"\n"


def _rate(obj: dict[str, Any], name: str) -> float | None:
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"'{name}' must be a number > 0 or null")
    return float(value)


def _usage(obj: dict[str, Any]) -> float:
    value = obj.get("kv_usage")
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= 1:
        raise ValueError("'kv_usage' must be a number within [0, 1]")
    return float(value)


# A line a quiet stream sends now and then, so that a subscriber tells a quiet worker from a dead link.
KEEPALIVE_LINE = b'{"type":"keepalive"}\n'


def decode_line(obj: dict[str, Any]) -> KVSnapshot | KVEventBatch | WorkerLoad | None:
    """One parsed line of the stream: a snapshot, a batch, a load report, or None (a keepalive or a newer
    line type); ValueError for a malformed snapshot, batch or load report."""
    kind = obj.get("type")
    if kind == "snapshot":
        role, epoch = obj.get("role"), obj.get("epoch")
        if not isinstance(role, str) or not isinstance(epoch, str):
            raise ValueError("a snapshot needs 'role' and 'epoch' strings")
        return KVSnapshot(role=role, block_size=_int(obj, "block_size", 1), epoch=epoch,
                          seq=_int(obj, "seq", 0), hashes=_hashes(obj.get("hashes"), "hashes"))
    if kind == "events":
        return KVEventBatch(seq=_int(obj, "seq", 0), stored=_hashes(obj.get("stored"), "stored"),
                            removed=_hashes(obj.get("removed"), "removed"))
    if kind == "load":
        return WorkerLoad(running=_int(obj, "running", 0), waiting=_int(obj, "waiting", 0),
                          prompt_tokens_pending=_int(obj, "prompt_tokens_pending", 0),
                          prefill_tokens_per_s=_rate(obj, "prefill_tokens_per_s"), kv_usage=_usage(obj))
    return None
