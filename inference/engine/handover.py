"""The disaggregation hooks of `LLMEngine`: decode-side reservations and KV arrival, prefill-side release.

A decode worker reserves a prompt's blocks (sharing the prefix it has cached), hands their ids to a
prefill worker, and resumes the request once the KV is in them (`kv_received`); a prefill worker keeps
a prefill-only request's blocks until its KV send has read them (`release`). The KV transports read and
write `kv_pool` in place, in the layout `kv_layout` describes.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from .block_manager import NoFreeBlocks
from .config import ModelConfig
from .kv_cache import KVCache
from .outputs import OutputProcessor
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import RequestOutput, Sequence, SequenceStatus


class KVHandover:
    """Mixed into `LLMEngine`, whose state it shares (under `lock`)."""

    lock: threading.RLock
    config: ModelConfig
    kv_cache: KVCache
    scheduler: Scheduler
    outputs: OutputProcessor
    max_queued_blocks: int
    _seqs: dict[str, Sequence]
    _reserved: dict[str, Sequence]
    _pending: list[RequestOutput]

    if TYPE_CHECKING:  # the lifecycle's, in engine.py

        def _new_sequence(
            self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prefill_only: bool
        ) -> Sequence: ...

        def _finish(self, seq: Sequence, reason: str) -> None: ...

        def _free_blocks(self, seq: Sequence) -> None: ...

        def abort(self, request_id: str) -> None: ...

    @property
    def queued_blocks(self) -> int:
        """KV blocks held by sequences that are not running yet (reserved or ready)."""
        with self.lock:
            held = sum(len(s.block_ids) for s in self._reserved.values())
            return held + sum(len(s.block_ids) for s in self.scheduler.ready)

    @property
    def num_reserved(self) -> int:
        """Decode-side sequences waiting for their prompt KV."""
        return len(self._reserved)

    @property
    def kv_pool(self) -> torch.Tensor:
        """The KV cache's block tensor, which KV transports read and write in place (`KVCache.data`)."""
        return self.kv_cache.data

    def kv_layout(self) -> dict[str, object]:
        """The layout both sides of a KV transfer must agree on (`KVCache.layout`)."""
        return self.kv_cache.layout()

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """Decode side: allocate blocks for the prompt's KV and park the request (`WAITING_FOR_KV`) until
        `kv_received`. Returns the block ids.

        Blocks are reserved at once (the prefill worker writes straight into them), but sequences not
        running yet may hold at most `max_queued_blocks` together, so the running batch keeps room to
        grow. Raises `NoFreeBlocks` when the pool cannot hold the prompt now or when that bound would be
        passed (a request alone in the queue is only bound by the free blocks, so any prompt that fits
        the pool can be served).
        """
        with self.lock:
            seq = self._new_sequence(request_id, prompt_token_ids, params, prefill_only=False)
            need = self.scheduler.blocks_for(seq.num_prompt_tokens)
            queued = self.queued_blocks
            if queued and queued + need > self.max_queued_blocks:
                raise NoFreeBlocks(
                    f"need {need} KV blocks; requests not running yet already hold {queued} of the "
                    f"{self.max_queued_blocks} they may"
                )
            # Prefix caching across the hop: blocks of this prompt's prefix cached here from earlier
            # requests are shared, and only the rest is sent (`reserved_hits`; always at least the
            # block of the last prompt token, whose KV comes with the first token).
            hits = self.scheduler.cached_prefix(seq)
            self.scheduler.take_prefix(seq, hits, need)
            seq.reserved_hits = len(hits)
            seq.status = SequenceStatus.WAITING_FOR_KV
            self._seqs[request_id] = seq
            self._reserved[request_id] = seq
            return list(seq.block_ids)

    def reserved_hits(self, request_id: str) -> int:
        """How many of a reserved request's first blocks were cached here when it was reserved (the
        prefill worker sends its prompt blocks from that index on); 0 for an unknown request."""
        with self.lock:
            seq = self._seqs.get(request_id)
            return seq.reserved_hits if seq is not None else 0

    def kv_received(self, request_id: str, first_token_id: int) -> None:
        """The prompt KV of a reserved request is in its blocks: append the first token (sampled by the
        prefill worker; its output is delivered by the next `step()`), then queue for a batch slot
        (FIFO in arrival order; it runs as soon as fewer than `max_num_seqs` sequences run)."""
        with self.lock:
            seq = self._seqs.get(request_id)
            if seq is None:
                raise KeyError(f"unknown request {request_id!r}")
            if seq.status != SequenceStatus.WAITING_FOR_KV:
                raise ValueError(f"request {request_id!r} is {seq.status.value}, not waiting for KV")
            if not 0 <= int(first_token_id) < self.config.vocab_size:
                raise ValueError(f"first_token_id {first_token_id} is outside the vocabulary")
            del self._reserved[request_id]
            seq.num_cached = seq.num_prompt_tokens
            self.scheduler.register_blocks(seq, 0)
            self.outputs.append_token(seq, int(first_token_id))
            if seq.finish_reason is not None:
                self._finish(seq, seq.finish_reason)
            else:
                self.scheduler.add_ready(seq)
            self._pending.append(seq.take_output())

    def release(self, request_id: str) -> None:
        """Free the blocks a prefill-only request kept for the KV transfer (abort if it is still live)."""
        with self.lock:
            seq = self._seqs.get(request_id)
            if seq is None:
                return
            if seq.status == SequenceStatus.PREFILLED:
                self._free_blocks(seq)
                seq.status = SequenceStatus.FINISHED
                del self._seqs[request_id]
            else:
                self.abort(request_id)
