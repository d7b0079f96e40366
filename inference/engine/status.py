"""A snapshot of an engine's load: what /health, /metrics and the decode worker's queue bound read."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineStatus:
    """Counts and usage of one engine at one moment (`LLMEngine.status()`).

    `queued`: sequences waiting for a batch slot (ready plus `waiting`, the ones queued for prefill);
    `running`: in the decode batch (at most `batch_size`); `reserved`: decode-side sequences waiting for
    their prompt KV; `kv_usage`: fraction of KV blocks in use; `prefix_cache_hit_rate`: share of admitted
    prompt tokens served from cached blocks.
    """

    waiting: int
    queued: int
    running: int
    reserved: int
    batch_size: int
    kv_usage: float
    kv_blocks: int
    kv_bytes: int
    prefix_cache_hit_rate: float
