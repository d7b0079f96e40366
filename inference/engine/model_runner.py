"""ModelRunner: the model, its KV pool and dtype, and one forward + sample per step.

`LLMEngine` owns the request lifecycle (queues, blocks, stopping, outputs); the runner turns a batch
of sequences into token ids: it orders the batch by context length (so that attention groups are
contiguous slices, see `batch.py`), builds the step's metadata with tensor ops, runs the model and
samples.
"""
from __future__ import annotations

import logging

import torch

from .batch import BatchMetadata, build_metadata
from .config import ModelConfig
from .dtypes import dtype_name, resolve_dtype
from .kv_cache import KVCache
from .model import LlamaForCausalLM
from .sampler import sample
from .sequence import Sequence
from .weights import load_model

logger = logging.getLogger(__name__)

# Default cap on the KV pool when `num_blocks` is not given.
DEFAULT_KV_CACHE_BYTES = 1 << 30


class ModelRunner:
    """Loads the weights in the resolved dtype, allocates the paged KV cache in the same dtype, and
    executes steps."""

    def __init__(
        self,
        model_path: str,
        config: ModelConfig,
        *,
        block_size: int,
        num_blocks: int | None,
        max_tokens_hint: int,
        kv_cache_bytes: int | None,
        device: torch.device,
        dtype: str | torch.dtype,
    ) -> None:
        """`num_blocks` defaults to enough blocks for `max_tokens_hint` tokens, capped by
        `kv_cache_bytes` (default 1 GiB). `dtype` is "auto", a name of `dtypes.DTYPES` or a dtype."""
        self.config = config
        self.device = device
        self.dtype = resolve_dtype(dtype, device, config.hidden_size)
        self.block_size = block_size
        self.model: LlamaForCausalLM = load_model(model_path, config, device, self.dtype)
        if num_blocks is None:
            per_block = KVCache.bytes_per_block(
                config.num_hidden_layers, block_size, config.num_key_value_heads, config.head_dim, self.dtype
            )
            wanted = -(-max_tokens_hint // block_size)
            cap = max(1, (kv_cache_bytes or DEFAULT_KV_CACHE_BYTES) // per_block)
            num_blocks = int(min(wanted, cap))
        self.kv_cache = KVCache(
            num_blocks,
            config.num_hidden_layers,
            block_size,
            config.num_key_value_heads,
            config.head_dim,
            self.dtype,
            device,
        )
        logger.info("model runner: %s on %s, KV cache %s", dtype_name(self.dtype), device, dtype_name(self.dtype))

    def prepare(self, seqs: list[Sequence], is_prefill: bool) -> tuple[torch.Tensor, BatchMetadata]:
        """Input ids and metadata for `seqs`, which must be in `order`'s order."""
        return build_metadata(
            seqs, is_prefill, self.block_size, self.kv_cache.block_stride, self.dtype, self.device
        )

    @staticmethod
    def order(batch: list[Sequence]) -> list[int]:
        """Indices of `batch` sorted by (cached tokens, context length), the order `prepare` needs: fresh
        prompts first, by length; in a decode step (one new token each) simply by context length."""
        return sorted(range(len(batch)), key=lambda i: (batch[i].num_cached, batch[i].num_tokens))

    @torch.inference_mode()
    def run(self, batch: list[Sequence], is_prefill: bool) -> list[int]:
        """Forward `batch` (a prefill of whole prompts, or one decode token each) and sample one token
        per sequence; returns them in `batch` order."""
        order = self.order(batch)
        seqs = [batch[i] for i in order]
        input_ids, meta = self.prepare(seqs, is_prefill)
        logits = self.model(input_ids, meta, self.kv_cache)
        sampled = sample(logits, [s.params for s in seqs], [len(s.output_token_ids) for s in seqs])
        tokens = [0] * len(batch)
        for pos, i in enumerate(order):
            tokens[i] = sampled[pos]
        return tokens
