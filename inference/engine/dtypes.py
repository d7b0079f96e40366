"""Model/KV dtype selection: `--dtype auto|float32|bfloat16|float16`.

`auto` is half precision on a GPU (bf16 where supported, else fp16) and, on a CPU, bf16 only where
the CPU has native bf16 instructions *and* a measured matmul of the model's own MLP shape shows bf16
to be faster there (on AVX2-only CPUs bf16 matmuls are emulated and slower than fp32, and for very
small models the conversion overheads outweigh the gain); otherwise fp32. fp32 is always available for
outputs that match transformers' fp32 token for token.
"""
from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_CHOICES = ("auto", *DTYPES)

# bf16 must beat fp32 by this factor in the probe to be chosen: a tie is not worth the precision.
_BF16_MIN_SPEEDUP = 1.3
# CPU flags that mean native bf16 dot products (AVX-512 BF16, AMX).
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


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


def _matmul_seconds(dtype: torch.dtype, shape: tuple[int, int], repeats: int = 5) -> float:
    """Best time of a decode-sized matmul (32 rows x `shape`) in `dtype` on the CPU."""
    a = torch.randn(32, shape[0]).to(dtype)
    w = torch.randn(shape[1], shape[0]).to(dtype)
    torch.nn.functional.linear(a, w)  # first call: packing, allocation
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.nn.functional.linear(a, w)
        best = min(best, time.perf_counter() - started)
    return best


@functools.lru_cache(maxsize=8)
def cpu_has_fast_bf16(shape: tuple[int, int] = (1024, 4096)) -> bool:
    """Whether a `[32, in] x [in, out]` matmul (`shape` = (in, out)) is measured faster in bf16 than in
    fp32 on this CPU (needs native bf16 instructions)."""
    flags = _cpu_flags()
    capability = torch.backends.cpu.get_cpu_capability()
    if not any(f in flags for f in _BF16_FLAGS):
        logger.info("dtype auto: CPU (%s) has no native bf16 instructions; using float32", capability)
        return False
    fp32 = _matmul_seconds(torch.float32, shape)
    bf16 = _matmul_seconds(torch.bfloat16, shape)
    fast = fp32 / bf16 >= _BF16_MIN_SPEEDUP
    logger.info(
        "dtype auto: CPU (%s, native bf16) probe 32x%dx%d fp32 %.0f us, bf16 %.0f us: using %s",
        capability, shape[0], shape[1], fp32 * 1e6, bf16 * 1e6, "bfloat16" if fast else "float32",
    )
    return fast


def resolve_dtype(
    name: str | torch.dtype, device: torch.device, probe_shape: tuple[int, int] = (1024, 4096)
) -> torch.dtype:
    """The dtype for `name` ("auto" or one of DTYPES, or a torch dtype) on `device`; on a CPU "auto"
    measures a matmul of `probe_shape` (the model's hidden x intermediate size)."""
    if isinstance(name, torch.dtype):
        return name
    if name in DTYPES:
        return DTYPES[name]
    if name != "auto":
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {name!r}")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_fast_bf16(probe_shape) else torch.float32
    return torch.float32
