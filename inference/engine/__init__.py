"""The inference engine: Llama-family model with paged KV cache, continuous batching, sampling, and the
prefill/decode disaggregation hooks. Django-free (see docs/internals.md, "Engine").

The names below are imported on first use (PEP 562), not with the package: its torch-free parts (the
prefix cache's event log, `kv_events`) are then importable without torch, by a process that only
simulates workers (bench/sim)."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .async_engine import AsyncEngine
    from .block_manager import BlockManager, NoFreeBlocks
    from .config import ModelConfig
    from .engine import CompletionResult, LLMEngine
    from .kv_cache import KVCache
    from .sampling_params import SamplingParams
    from .sequence import RequestOutput, Sequence, SequenceStatus
    from .speculative import SpeculativeConfig
    from .tokenizer import Tokenizer

# Each public name and the submodule that defines it.
_WHERE = {
    "AsyncEngine": "async_engine",
    "BlockManager": "block_manager",
    "NoFreeBlocks": "block_manager",
    "ModelConfig": "config",
    "CompletionResult": "engine",
    "LLMEngine": "engine",
    "KVCache": "kv_cache",
    "SamplingParams": "sampling_params",
    "RequestOutput": "sequence",
    "Sequence": "sequence",
    "SequenceStatus": "sequence",
    "SpeculativeConfig": "speculative",
    "Tokenizer": "tokenizer",
}

__all__ = [
    "AsyncEngine",
    "BlockManager",
    "CompletionResult",
    "KVCache",
    "LLMEngine",
    "ModelConfig",
    "NoFreeBlocks",
    "RequestOutput",
    "SamplingParams",
    "Sequence",
    "SequenceStatus",
    "SpeculativeConfig",
    "Tokenizer",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value
