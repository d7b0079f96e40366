"""Model/KV dtype selection: `--dtype auto|float32|bfloat16|float16`.

`auto` is half precision on a GPU (bf16 where supported, else fp16). On a CPU it is bf16 only where
the CPU has native bf16 dot-product instructions (AVX-512 BF16 or AMX; elsewhere, e.g. AVX2-only
CPUs, bf16 matmuls are emulated and slower than fp32) and the model is big enough for bf16 to pay
(hidden size >= `MIN_BF16_HIDDEN`); otherwise fp32. fp32 is always available for outputs that match
transformers' fp32 token for token.

The rule is deliberately free of timing: a prefill and a decode worker on the same kind of host must
resolve "auto" to the same dtype, because the KV they exchange carries it (a timing probe on a busy
machine was seen to pick bf16 in one process and fp32 in the other).
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_CHOICES = ("auto", *DTYPES)

# CPU flags that mean native bf16 dot products (AVX-512 BF16, AMX).
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# Measured on an AVX-512 BF16 EPYC, one thread, a [32, h] x [h, 8h] matmul: h=64 fp32 23 µs vs bf16
# 21 µs (conversion overheads eat the gain; end to end the bf16 engine was slower), h=256 453 vs
# 112 µs, h=576 (SmolLM2) 1507 vs 428 µs.
MIN_BF16_HIDDEN = 256


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` → "bfloat16" (the name in KV layouts and flags)."""
    return str(dtype).removeprefix("torch.")


def _cpu_flags() -> set[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU has native bf16 dot-product instructions (and torch's kernels use AVX-512)."""
    capability = torch.backends.cpu.get_cpu_capability()
    native = any(f in _cpu_flags() for f in _BF16_FLAGS) and capability.startswith("AVX512")
    logger.info("CPU capability %s, native bf16: %s", capability, native)
    return native


def resolve_dtype(name: str | torch.dtype, device: torch.device, hidden_size: int = 1024) -> torch.dtype:
    """The dtype for `name` ("auto" or one of DTYPES, or a torch dtype) on `device` for a model of
    `hidden_size`."""
    if isinstance(name, torch.dtype):
        return name
    if name in DTYPES:
        return DTYPES[name]
    if name != "auto":
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {name!r}")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and hidden_size >= MIN_BF16_HIDDEN and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32
