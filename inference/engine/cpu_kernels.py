"""C++ kernels for the CPU (csrc/): paged decode attention and the fused element-wise ops of the
Llama block, built on first use.

A decode step on a CPU otherwise gathers every sequence's keys and values into a padded batch (one
`index_select` per layer), then runs two batched matmuls, a mask and a softmax: on the tiny hd64 model
at batch 32 that was about a third of the step. The kernel reads each sequence's own rows in place and
computes scores, softmax and the weighted sum in fp32 in one pass per (sequence, KV head), and writes
the new token's K/V into its slot on the way. The element-wise ops (csrc/cpu_ops.cpp: RMSNorm, residual
add + RMSNorm, RoPE in place, SiLU·mul) each replace 3-8 torch kernels with bf16 casts between them.

It is compiled with the host's C++ compiler through `torch.utils.cpp_extension` (about a minute once)
into a build folder of the running venv, `<venv>/var/inference-kernels/<name>/` (`$INFERENCE_KERNELS_DIR`
overrides it; outside a venv, the checkout's `var/inference-kernels/`): torch's default folder
(~/.cache/torch_extensions) is shared by every checkout, and a venv at another path changes torch's build
arguments, so two checkouts rebuilt over each other in turn. Processes starting at once build once: the
build runs under an `flock` on a file of our own (`build.lock`), so one builds while the others wait on
it and then load what it built; the OS drops that lock when its holder dies however it dies, so a build
killed midway delays nobody (torch's own `lock` file, which it would wait on forever, is stale whenever
we hold ours and is removed). Without a compiler, or when the build fails, or with
`INFERENCE_CPU_KERNELS=0`, the engine keeps the torch path (model.py).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("cpu_ops.cpp", "paged_decode.cpp", "panel_gemm.cpp", "panel_gemm512.cpp",
                                    "amx_gemm.cpp")]
HEADERS = [CSRC / "panel_gemm.h"]  # part of the build's identity (hashed), not compiled on their own
ENV_SWITCH = "INFERENCE_CPU_KERNELS"
ENV_DIR = "INFERENCE_KERNELS_DIR"
# -ffast-math lets the compiler vectorize exp (glibc's vector math, only under finite math) and the fp32
# reductions; the kernels keep every intermediate finite (softmax exponents are <= 0, SiLU's clamped).
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd"]
# The raw log-probabilities' reductions (logprobs.py), bound in cpu_ops.cpp like the others.
SOURCES.append(SOURCES[0].with_name("row_logprobs.cpp"))

# How long a start waits for another process's build (one takes ~30-90 s on a busy 2-core host) before
# giving up on the kernels (torch ops); a live builder this slow is stuck.
BUILD_WAIT_S = 900.0
LOCK_POLL_S = 0.2

_lock = threading.Lock()
_module: Any = None
_tried = False


def kernels_enabled() -> bool:
    """Whether the kernels may be used here (not switched off by the environment)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def _build_name() -> str:
    """The extension's name: a hash of the sources (where they are and what they say), the flags and the
    CPU's feature set. One build folder holds one build, rebuilt whenever its compile commands change, and
    the sources' paths are part of those commands: two trees run by one venv (a git worktree for an A/B
    run or a drill, a copy) would otherwise rebuild each other's on every start even with identical
    kernels. The build uses -march=native, so a folder shared by hosts with different CPUs must not mix
    their binaries either."""
    digest = hashlib.sha256(" ".join(CFLAGS).encode())
    for path in [*SOURCES, *HEADERS]:
        digest.update(str(path.resolve()).encode())
        digest.update(path.read_bytes())
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                digest.update(line.encode())
                break
    except OSError:
        pass
    return "inference_cpu_kernels_" + digest.hexdigest()[:12]


def build_root() -> Path:
    """The folder the kernels are built in: `$INFERENCE_KERNELS_DIR`, else `<venv>/var/inference-kernels`
    of the running venv, else the checkout's `var/inference-kernels` (one per venv or checkout, never
    shared by two: their build arguments differ, so they would rebuild over each other)."""
    override = os.environ.get(ENV_DIR, "").strip()
    if override:
        return Path(override).expanduser().resolve()
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "var" / "inference-kernels"
    for folder in Path(__file__).resolve().parents:
        if (folder / "pyproject.toml").exists():
            return folder / "var" / "inference-kernels"
    return Path.home() / ".cache" / "inference-kernels"


@contextlib.contextmanager
def build_lock(build_dir: Path, wait_s: float = BUILD_WAIT_S) -> Iterator[None]:
    """Hold `build_dir`'s build lock: an exclusive `flock` on `build_dir/build.lock`, which the OS releases
    when its holder exits (a build killed midway leaves nothing that blocks). Holding it, torch's own
    `lock` file in the folder can only be a dead build's, so it is removed (torch would wait on it)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "build.lock", "a+b") as handle:
        deadline = time.monotonic() + wait_s
        waiting = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waiting:
                    logger.info("another process is building the CPU kernels in %s; waiting for it", build_dir)
                    waiting = True
                if time.monotonic() > deadline:
                    raise TimeoutError(f"a CPU kernel build in {build_dir} held its lock over {wait_s:.0f}s") from None
                time.sleep(LOCK_POLL_S)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing a CPU kernel build lock left by a killed build (%s)", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_extension(name: str, sources: Sequence[Path], cflags: Sequence[str], *, root: Path | None = None,
                    is_python_module: bool = True) -> Any:
    """Build (when its sources or flags changed) and load the extension `name` in `root/name` (default
    `build_root()`), one process at a time: a process arriving during another's build waits for it,
    then finds the build up to date and loads it."""
    from torch.utils.cpp_extension import load

    build_dir = (root or build_root()) / name
    with build_lock(build_dir):
        return load(name=name, sources=[str(p) for p in sources], extra_cflags=list(cflags),
                    build_directory=str(build_dir), is_python_module=is_python_module, verbose=False)


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
            _module = build_extension(_build_name(), SOURCES, CFLAGS)
        except Exception as exc:  # a broken toolchain must not stop the engine: the torch path works
            logger.warning("CPU kernels failed to build (%s); using torch ops", exc)
            _module = None
        return _module


def loaded_kernels() -> Any:
    """The extension when this process has loaded it already (`load_kernels`), else None; never builds.
    For optional users (logprobs.py) that must not start a build of minutes where the engine chose the
    torch path (`--compile`, a GPU) or has not started yet."""
    return _module
