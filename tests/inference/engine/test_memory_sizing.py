"""KV pool and batch sized from memory (memory.py): the arithmetic, the CPU default, and the errors that
name the setting to change when the pool cannot hold one sequence of the maximum length."""
from __future__ import annotations

import psutil
import pytest

from inference.engine import LLMEngine
from inference.engine.memory import (
    AUTO_BATCH_CAP,
    AUTO_BATCH_TOKENS_PER_SEQ,
    CPU_KV_CAP_BYTES,
    CPU_KV_FRACTION,
    KVPoolTooSmall,
    cpu_kv_bytes,
    gpu_kv_bytes,
    plan_pool,
)

from .conftest import TinyModel

BLOCK = 16


def test_plan_pool_blocks_capped_by_what_the_batch_can_use() -> None:
    """Blocks are the budget over the block size, but never more than max_num_seqs full sequences."""
    plan = plan_pool(budget_bytes=1000 * 100 + 99, block_bytes=100, block_size=BLOCK, max_model_len=160,
                     max_num_seqs=4, device_kind="cpu", source="--kv-cache-memory")
    assert (plan.num_blocks, plan.max_num_seqs) == (4 * 10, 4)
    small = plan_pool(budget_bytes=25 * 100, block_bytes=100, block_size=BLOCK, max_model_len=160,
                      max_num_seqs=4, device_kind="cpu", source="--kv-cache-memory")
    assert small.num_blocks == 25


def test_plan_pool_derives_the_batch_from_the_pool() -> None:
    """Unset max_num_seqs: as many sequences as the pool holds at AUTO_BATCH_TOKENS_PER_SEQ tokens each,
    capped per device kind."""
    per_typical = AUTO_BATCH_TOKENS_PER_SEQ // BLOCK
    plan = plan_pool(budget_bytes=5 * per_typical * 10, block_bytes=10, block_size=BLOCK, max_model_len=4096,
                     max_num_seqs=None, device_kind="cpu", source="x")
    assert plan.max_num_seqs == 5
    huge = dict(budget_bytes=10**12, block_bytes=10, block_size=BLOCK, max_model_len=4096, max_num_seqs=None,
                source="x")
    assert plan_pool(device_kind="cpu", **huge).max_num_seqs == AUTO_BATCH_CAP["cpu"]  # type: ignore[arg-type]
    assert plan_pool(device_kind="cuda", **huge).max_num_seqs == AUTO_BATCH_CAP["cuda"]  # type: ignore[arg-type]
    # Short sequences: the per-sequence estimate is the maximum length itself.
    short = plan_pool(budget_bytes=64 * 10, block_bytes=10, block_size=BLOCK, max_model_len=64,
                      max_num_seqs=None, device_kind="cpu", source="x")
    assert short.max_num_seqs == 16


def test_plan_pool_too_small_names_the_setting() -> None:
    """A pool that cannot hold one max-length sequence is refused, naming the source and both numbers."""
    with pytest.raises(KVPoolTooSmall) as err:
        plan_pool(budget_bytes=7 * 100, block_bytes=100, block_size=BLOCK, max_model_len=128,
                  max_num_seqs=None, device_kind="cpu", source="--kv-cache-memory 700 B")
    text = str(err.value)
    assert "--kv-cache-memory 700 B" in text and "7 blocks" in text and "needs 8 blocks" in text
    assert "raise --kv-cache-memory or lower" in text and "--max-sequence-length" in text
    with pytest.raises(KVPoolTooSmall):
        plan_pool(budget_bytes=-5, block_bytes=100, block_size=BLOCK, max_model_len=16, max_num_seqs=1,
                  device_kind="cuda", source="--gpu-memory-utilization 0.1")


def test_gpu_budget_is_the_utilization_share_less_peak_and_non_torch() -> None:
    """vLLM's rule on made-up device numbers (the profile itself needs a GPU)."""
    gib = 1 << 30
    assert gpu_kv_bytes(80 * gib, 0.9, 20 * gib, gib) == int(72 * gib) - 21 * gib
    assert gpu_kv_bytes(16 * gib, 0.5, 9 * gib, 0) < 0  # weights alone over the share: the caller refuses
    with pytest.raises(ValueError, match="utilization"):
        gpu_kv_bytes(gib, 1.5, 0, 0)


def test_cpu_default_budget_follows_available_memory() -> None:
    """Without --kv-cache-memory: CPU_KV_FRACTION of what psutil says is available, capped."""
    assert cpu_kv_bytes(12345) == 12345
    before = psutil.virtual_memory().available
    got = cpu_kv_bytes(None)
    after = psutil.virtual_memory().available
    low, high = sorted((before, after))
    assert min(int(low * 0.9 * CPU_KV_FRACTION), CPU_KV_CAP_BYTES) <= got
    assert got <= min(int(high * 1.1 * CPU_KV_FRACTION), CPU_KV_CAP_BYTES)


def test_engine_sized_from_memory(llama: TinyModel) -> None:
    """No num_blocks: the pool is the byte budget (capped by the batch), the batch derived from it."""
    probe = LLMEngine(llama.path, block_size=BLOCK, num_blocks=2, load_tokenizer=False)
    block_bytes = probe.kv_cache.block_nbytes
    engine = LLMEngine(llama.path, block_size=BLOCK, max_model_len=128, kv_cache_bytes=40 * block_bytes,
                       load_tokenizer=False)
    # 40 blocks: 128-token sequences take 8 blocks each, so 5 of them fit and the batch is 5.
    assert engine.kv_cache.num_blocks == 40
    assert engine.max_num_seqs == engine.scheduler.max_num_seqs == 5
    default = LLMEngine(llama.path, block_size=BLOCK, load_tokenizer=False)
    per_seq = default.max_model_len // BLOCK
    assert default.max_num_seqs == AUTO_BATCH_CAP["cpu"]  # plenty of host memory for the tiny model
    assert default.kv_cache.num_blocks == AUTO_BATCH_CAP["cpu"] * per_seq


def test_engine_refuses_a_pool_smaller_than_one_sequence(llama: TinyModel) -> None:
    """kv_cache_bytes below one max-length sequence fails at construction, not at the first request."""
    with pytest.raises(KVPoolTooSmall, match="--kv-cache-memory"):
        LLMEngine(llama.path, block_size=BLOCK, max_model_len=512, kv_cache_bytes=4096, load_tokenizer=False)
