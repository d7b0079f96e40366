"""C++ kernels for the CPU (csrc/): paged decode attention and the fused element-wise ops of the
Llama block, built on first use.

A decode step on a CPU otherwise gathers every sequence's keys and values into a padded batch (one
`index_select` per layer), then runs two batched matmuls, a mask and a softmax: on the tiny hd64 model
at batch 32 that was about a third of the step. The kernel reads each sequence's own rows in place and
computes scores, softmax and the weighted sum in fp32 in one pass per (sequence, KV head), and writes
the new token's K/V into its slot on the way. The element-wise ops (csrc/cpu_ops.cpp: RMSNorm, residual
add + RMSNorm, RoPE in place, SiLU·mul) each replace 3-8 torch kernels with bf16 casts between them.

It is compiled with the host's C++ compiler through `torch.utils.cpp_extension` (about 30 s once; the
build is cached under torch's extensions folder). Without a compiler, or when the build fails, or with
`INFERENCE_CPU_KERNELS=0`, the engine keeps the torch path (model.py).
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("csrc") / name for name in ("cpu_ops.cpp", "paged_decode.cpp", "panel_gemm.cpp")]
ENV_SWITCH = "INFERENCE_CPU_KERNELS"
# -ffast-math lets the compiler vectorize exp (glibc's vector math, only under finite math) and the fp32
# reductions; the kernels keep every intermediate finite (softmax exponents are <= 0, SiLU's clamped).
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd"]

# A build lock older than this belongs to a dead process (a build takes ~30-60 s on a busy 2-core host).
STALE_LOCK_S = 600.0

_lock = threading.Lock()
_module: Any = None
_tried = False


def kernels_enabled() -> bool:
    """Whether the kernels may be used here (not switched off by the environment)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def _build_name() -> str:
    """The extension's name: a hash of the sources, the flags and the CPU's feature set. torch keeps one
    build per name and rebuilds it whenever the sources differ, so two trees with different kernels (an
    A/B run, a git worktree) would otherwise rebuild each other's on every start; and the build uses
    -march=native, so a cache folder shared by hosts with different CPUs must not mix their binaries."""
    digest = hashlib.sha256(" ".join(CFLAGS).encode())
    for path in SOURCES:
        digest.update(path.read_bytes())
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                digest.update(line.encode())
                break
    except OSError:
        pass
    return "inference_cpu_kernels_" + digest.hexdigest()[:12]


def _clear_stale_lock(name: str) -> None:
    """Remove a build lock left by a process killed while building or loading (torch waits for it to
    go away forever: every later engine start would hang). A real build takes about a minute."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            logger.warning("removing a stale CPU kernel build lock (%s)", lock)
            lock.unlink(missing_ok=True)
    except (ImportError, OSError):  # a private torch helper: without it, torch's own waiting applies
        pass


def load_kernels() -> Any:
    """The compiled extension module, or None when it cannot be built here (logged once)."""
    global _module, _tried
    with _lock:
        if _tried:
            return _module
        _tried = True
        if not kernels_enabled():
            logger.info("CPU kernels off (%s=0)", ENV_SWITCH)
            return None
        if shutil.which(os.environ.get("CXX", "c++")) is None or shutil.which("ninja") is None:
            logger.warning("CPU kernels unavailable (needs a C++ compiler and ninja); using torch ops")
            return None
        try:
            from torch.utils.cpp_extension import load

            _clear_stale_lock(_build_name())
            _module = load(name=_build_name(), sources=[str(p) for p in SOURCES], extra_cflags=CFLAGS,
                           verbose=False)
        except Exception as exc:  # a broken toolchain must not stop the engine: the torch path works
            logger.warning("CPU kernels failed to build (%s); using torch ops", exc)
            _module = None
        return _module
