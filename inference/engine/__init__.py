"""The inference engine: Llama-family model with paged KV cache, continuous batching, sampling, and the
prefill/decode disaggregation hooks. Django-free (see docs/internals.md, "Engine")."""
from .async_engine import AsyncEngine
from .block_manager import BlockManager, NoFreeBlocks
from .config import ModelConfig
from .engine import CompletionResult, LLMEngine
from .kv_cache import KVCache
from .sampling_params import SamplingParams
from .sequence import RequestOutput, Sequence, SequenceStatus
from .speculative import SpeculativeConfig
from .tokenizer import Tokenizer

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
