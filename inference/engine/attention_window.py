"""Sliding-window attention as metadata: a step's `BatchMetadata` rewritten, once per forward, so that
the unchanged attention code attends to each query's last `window` keys only.

A sliding-window layer (Mistral, Phi-3, Gemma, Qwen with `use_sliding_window`) lets the query at
position `q` see keys `k` with `q - window < k <= q` (transformers' `sliding_window_overlay`). The
KV cache still holds every key (other layers, or later prefix reuse, may need them); only what is
read changes:

- a fresh prompt group longer than the window gets an additive banded causal mask;
- a prompt over a cached prefix gets its causal mask banded;
- a decode bucket's mask also hides keys before the window;
- a CPU-kernel decode step (`decode_slots`) gets each sequence's slot rows shifted to start at its
  window, and its length shortened to match: the kernel reads rows `[0, len)` of each sequence and
  writes the new key at row `len - 1`, which is still this token's slot.

`bucketed` turns a CPU-kernel decode step into a plain decode bucket, for models that cannot run
the kernel (Gemma's soft-capped attention).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from .batch import BatchMetadata, DecodeBucket, PrefillGroup


def _banded(q_pos: torch.Tensor, k_len: int, window: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask `[1, 1, len(q_pos), k_len]`: 0 where `q - window < k <= q`, -inf elsewhere."""
    k = torch.arange(k_len, device=q_pos.device)
    hidden = (k[None, :] > q_pos[:, None]) | (k[None, :] <= q_pos[:, None] - window)
    return torch.zeros(hidden.shape, dtype=dtype, device=q_pos.device).masked_fill_(hidden, float("-inf"))[
        None, None
    ]


def _windowed_group(g: PrefillGroup, window: int, dtype: torch.dtype, device: torch.device) -> PrefillGroup:
    """`g` with its keys limited to the window (unchanged when no query reaches past it)."""
    k_len = g.cached + g.q_len
    if k_len <= window:
        return g
    q_pos = torch.arange(g.cached, k_len, device=device)
    mask = _banded(q_pos, k_len, window, dtype)
    return replace(g, mask=mask)


def _windowed_bucket(bk: DecodeBucket, positions: torch.Tensor, window: int, dtype: torch.dtype) -> DecodeBucket:
    """`bk` with the keys before each row's window masked (unchanged when none is)."""
    pos = positions[bk.start : bk.end]
    k = torch.arange(bk.max_k, device=pos.device)
    hidden = k[None, :] <= pos[:, None] - window
    if not bool(hidden.any()):
        return bk
    mask = bk.mask if bk.mask is not None else torch.zeros((bk.end - bk.start, 1, 1, bk.max_k), dtype=dtype,
                                                          device=pos.device)
    return replace(bk, mask=mask.masked_fill(hidden[:, None, None, :], float("-inf")))


def _windowed_slots(meta: BatchMetadata, window: int) -> BatchMetadata:
    """A CPU-kernel decode step's slot rows shifted to each sequence's window (unchanged when no
    sequence is longer than the window)."""
    assert meta.decode_slots is not None and meta.decode_lens is not None
    lens = meta.decode_lens
    start = (lens - window).clamp(min=0)
    if not bool(start.any()):
        return meta
    slots = meta.decode_slots
    width = slots.shape[1]
    idx = (start[:, None] + torch.arange(width, device=slots.device)).clamp(max=width - 1)
    return replace(meta, decode_slots=slots.gather(1, idx).contiguous(), decode_lens=(lens - start).contiguous())


def windowed(meta: BatchMetadata, window: int, dtype: torch.dtype) -> BatchMetadata:
    """`meta` for a layer whose queries see only their last `window` keys (masks in `dtype`). A mixed
    step (prefill groups and kernel decode rows) gets both rewritten."""
    if meta.decode_slots is not None and meta.decode_lens is not None:
        meta = _windowed_slots(meta, window)
        if not meta.mixed_split:
            return meta
    device = meta.positions.device
    if meta.is_prefill:
        return replace(meta, prefill_groups=[_windowed_group(g, window, dtype, device) for g in meta.prefill_groups])
    buckets = [_windowed_bucket(b, meta.positions, window, dtype) for b in meta.decode_buckets]
    return replace(meta, decode_buckets=buckets)


def bucketed(meta: BatchMetadata, dtype: torch.dtype) -> BatchMetadata:
    """A CPU-kernel decode step's metadata (`decode_slots` / `decode_lens`) as one plain decode bucket
    (masks in `dtype`); any other metadata unchanged."""
    if meta.decode_slots is None or meta.decode_lens is None:
        return meta
    if meta.mixed_split:
        raise ValueError("a mixed prefill + decode step needs the CPU decode kernel")
    lens = meta.decode_lens
    n = lens.shape[0]
    max_k = int(lens.max())
    slots = meta.decode_slots[:, :max_k]
    write_rows = slots[torch.arange(n, device=slots.device), lens - 1]
    mask = None
    if bool((lens != max_k).any()):
        k = torch.arange(max_k, device=slots.device)
        mask = torch.zeros((n, 1, 1, max_k), dtype=dtype, device=slots.device).masked_fill_(
            (k[None, :] >= lens[:, None])[:, None, None, :], float("-inf")
        )
    bucket = DecodeBucket(0, n, max_k, slots.flatten(), mask)
    return BatchMetadata(positions=meta.positions, write_rows=write_rows, last_index=meta.last_index,
                         decode_buckets=[bucket])
