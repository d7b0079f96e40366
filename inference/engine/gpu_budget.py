"""The GPU's KV budget, profiled: what a forward at the largest step leaves of the device's memory.

vLLM's rule (`--gpu-memory-utilization`): weights, activations and KV together may use `utilization` of
the device's memory; a profiling forward at the largest step the engine will run measures the
activation peak, and the KV pool gets what remains (memory.py `gpu_kv_bytes` does the arithmetic).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from .batch import build_metadata
from .memory import AUTO_BATCH_CAP, format_bytes, gpu_kv_bytes
from .sampler import sample
from .sampling_params import SamplingParams
from .sequence import Sequence

logger = logging.getLogger(__name__)


@torch.inference_mode()
def profile_gpu_kv_budget(
    model: nn.Module, device: torch.device, dtype: torch.dtype, block_size: int, utilization: float,
    max_num_seqs: int | None, max_tokens: int,
) -> int:
    """KV bytes left on the GPU after a profiling forward of `model` at the largest step this engine runs
    (`max_tokens` prompt tokens over the largest batch), as vLLM does: activations peak in a prefill
    of the whole token budget, and the sampler's logits grow with the batch."""
    seqs_n = max(1, min(max_num_seqs or AUTO_BATCH_CAP["cuda"], max_tokens))
    per_seq = max(1, max_tokens // seqs_n)
    params = SamplingParams(max_tokens=1)
    seqs = []
    for i in range(seqs_n):
        seq = Sequence(f"profile-{i}", [0] * per_seq, params, i)
        seq.block_ids = [0] * (-(-per_seq // block_size))  # read only by the write-row maths
        seqs.append(seq)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    # No KV cache yet: the prefill attends to its own K/V and writes nothing.
    input_ids, meta = build_metadata(seqs, True, block_size, 1, dtype, device)
    logits = model(input_ids, meta, None)
    sample(logits, [params] * seqs_n, [0] * seqs_n)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    del logits, input_ids, meta
    torch.cuda.empty_cache()
    budget = gpu_kv_bytes(total, utilization, peak, non_torch)
    logger.info(
        "GPU memory: total %s, utilization %.2f, profiled peak %s, outside torch %s -> KV %s",
        format_bytes(total), utilization, format_bytes(peak), format_bytes(non_torch),
        format_bytes(max(0, budget)),
    )
    return budget
