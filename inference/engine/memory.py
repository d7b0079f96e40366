"""Sizing the KV pool and the batch from memory (instead of a fixed 1 GiB pool and 32 sequences).

- CPU: the pool gets `kv_cache_bytes` when given (`--kv-cache-memory`), else `CPU_KV_FRACTION` of the
  memory available after the weights loaded (psutil) and not claimed by other workers of the host whose
  pools are not allocated yet (host_memory.py: workers started together share the host), at most
  `CPU_KV_CAP_BYTES`.
- GPU (vLLM's `--gpu-memory-utilization` semantics): weights, activations and KV together may use
  `utilization` of the device's total memory. A profiling forward at the largest batch the engine
  will run measures the activation peak; the KV pool gets what remains.
- Either way the pool never exceeds what the largest batch can use (`max_num_seqs * max_model_len`
  tokens), and it must hold at least one sequence of `max_model_len` tokens: `KVPoolTooSmall` says by
  how much it falls short and which setting to change.
- `max_num_seqs` left unset (`--batch-size` not given) is derived from the pool: as many sequences as
  the pool holds at `AUTO_BATCH_TOKENS_PER_SEQ` tokens each, capped per device kind.
"""
from __future__ import annotations

from dataclasses import dataclass

import psutil

# Share of the available (and unclaimed, host_memory.py) host memory the KV pool takes when
# `--kv-cache-memory` is not given. The rest stays for activations, the tokenizer, Python and whatever
# else runs on the host, the next worker's pool included: N workers together take at most 1 - 0.6^N.
CPU_KV_FRACTION = 0.4
# A CPU engine cannot use more: at the CPU's decode speed, tens of GiB of context would never be
# attended to within any reasonable latency.
CPU_KV_CAP_BYTES = 16 << 30
# Default of `--gpu-memory-utilization` (vLLM's default).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Context a sequence is expected to reach when the batch size is derived from the pool: the batch
# runs without preemption while its sequences average this many tokens.
AUTO_BATCH_TOKENS_PER_SEQ = 1024
# Largest automatic batch: on a CPU throughput is flat past 32 while each step (the ITL of every stream)
# grows with the batch (docs/benchmarks.md, issue 12); on a GPU vLLM's default.
AUTO_BATCH_CAP = {"cpu": 32, "cuda": 256}

# How the message of KVPoolTooSmall begins: the agent (inference/agent/lifecycle.py) finds it in a worker's
# log to fail the launch at once instead of restarting a worker that cannot fit.
POOL_TOO_SMALL_PREFIX = "KV pool too small: "


class KVPoolTooSmall(ValueError):
    """The KV pool cannot hold one sequence of the longest allowed length."""


def format_bytes(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (for messages)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}" if unit != "B" else f"{n} B"
        value /= 1024
    return f"{value:.1f} TiB"


def cpu_kv_bytes(requested: int | None, unclaimed: int | None = None) -> int:
    """The CPU pool's byte budget: `requested`, else a share of `unclaimed` (HostClaims.unclaimed(): the
    memory available and not claimed by other workers' pools), by default of the memory available now
    (call it after the weights are loaded, so that they are already not available)."""
    if requested is not None:
        return requested
    free = int(psutil.virtual_memory().available) if unclaimed is None else unclaimed
    return min(int(free * CPU_KV_FRACTION), CPU_KV_CAP_BYTES)


def gpu_kv_bytes(total: int, utilization: float, peak_allocated: int, non_torch: int) -> int:
    """vLLM's rule: of `utilization * total`, what the profiled peak (weights + activations, bytes
    torch allocated) and memory used outside torch's allocator (CUDA context, NCCL, other libraries of
    this process) leave. Negative when even the weights do not fit the budget."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu memory utilization must be in (0, 1], got {utilization}")
    return int(total * utilization) - peak_allocated - non_torch


@dataclass(frozen=True)
class PoolPlan:
    """The KV pool's size in blocks and the batch size that goes with it."""

    num_blocks: int
    max_num_seqs: int
    budget_bytes: int  # what the memory rule allowed (before the cap by what the batch can use)


def plan_pool(
    *,
    budget_bytes: int,
    block_bytes: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int | None,
    device_kind: str,
    source: str,
    flag: str | None = None,
) -> PoolPlan:
    """Blocks for `budget_bytes` (at most what `max_num_seqs` sequences of `max_model_len` can use) and the
    batch size (derived when `max_num_seqs` is None). `source` names the setting that set the budget, for
    the error raised when the pool cannot hold one `max_model_len`-token sequence; `flag`, the setting
    to raise (default: `source`'s first word)."""
    per_seq = -(-max_model_len // block_size)
    blocks = max(0, budget_bytes) // block_bytes
    if blocks < per_seq:
        raise KVPoolTooSmall(
            f"{POOL_TOO_SMALL_PREFIX}{source} leaves {format_bytes(max(0, budget_bytes))} for the KV cache: {blocks} "
            f"block{'' if blocks == 1 else 's'} of {block_size} tokens ({format_bytes(block_bytes)} each), but "
            f"one sequence of the maximum length {max_model_len} needs {per_seq} blocks "
            f"({format_bytes(per_seq * block_bytes)}); raise {flag or source.split()[0]} or lower the maximum "
            "sequence length (--max-sequence-length / --context-length)"
        )
    if max_num_seqs is None:
        cap = AUTO_BATCH_CAP.get(device_kind, AUTO_BATCH_CAP["cpu"])
        per_typical = -(-min(max_model_len, AUTO_BATCH_TOKENS_PER_SEQ) // block_size)
        max_num_seqs = max(1, min(cap, blocks // per_typical))
    return PoolPlan(num_blocks=min(blocks, max_num_seqs * per_seq), max_num_seqs=max_num_seqs,
                    budget_bytes=budget_bytes)
