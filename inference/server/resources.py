"""Where a worker runs: CPU pinning, device choice from CUDA_VISIBLE_DEVICES, utilisation readings."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import psutil
import torch

logger = logging.getLogger(__name__)


def pin_cpus(base_cpu_id: int | None, num_threads: int | None) -> list[int]:
    """Pin this process to CPUs [base, base+n) (clipped to the host) and size torch's thread pool.

    Returns the CPUs the process may run on. Without --base-cpu-id the process keeps its affinity.
    """
    available = sorted(os.sched_getaffinity(0))
    if base_cpu_id is not None:
        count = num_threads or max(1, len(available) - base_cpu_id)
        total = os.cpu_count() or 1
        cpus = [c for c in range(base_cpu_id, min(base_cpu_id + count, total))]
        os.sched_setaffinity(0, cpus)
        available = cpus
    threads = num_threads or len(available)
    torch.set_num_threads(max(1, min(threads, len(available))))
    return available


def select_device() -> torch.device:
    """cuda:0 when CUDA_VISIBLE_DEVICES names a GPU and torch sees one, else the CPU.

    An empty CUDA_VISIBLE_DEVICES (the guide's decode worker) always means the CPU.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() == "":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda:0")
    return torch.device("cpu")


class Utilization:
    """CPU utilisation of the CPUs this worker runs on, and GPU utilisation when it has one."""

    def __init__(self, cpus: list[int], device: torch.device) -> None:
        self._cpus = cpus
        self._device = device
        psutil.cpu_percent(percpu=True)  # primes the counters: the next reading covers the interval

    def cpu(self) -> float:
        """Mean busy fraction of the pinned CPUs since the previous reading (0..1)."""
        per_cpu = psutil.cpu_percent(percpu=True)
        chosen = [per_cpu[c] for c in self._cpus if c < len(per_cpu)] or per_cpu
        return round(sum(chosen) / len(chosen) / 100.0, 3)

    def gpu(self) -> float | None:
        """GPU busy fraction (needs NVML), None on a CPU worker."""
        if self._device.type != "cuda":
            return None
        try:
            return round(torch.cuda.utilization(self._device) / 100.0, 3)
        except Exception:  # noqa: BLE001  NVML missing: report memory pressure instead of failing health
            free, total = torch.cuda.mem_get_info(self._device)
            return round(1.0 - free / total, 3)


def lower_priority(nice: int) -> None:
    """Lower this process's CPU priority to `nice`: every thread it has (Linux nice is per thread;
    imports may have started some) and the threads it starts later, which inherit it.

    With the kernel's autogroups on, CPU time is shared between sessions first, so a thread's nice
    only ranks it within its own session; a worker that leads its session (agent-launched workers
    do) also sets the session's autogroup nice, else it would still compete as an equal with the
    router's session. Raising priority back needs privileges; lowering never does.
    """
    if nice <= 0:
        return
    tasks = Path("/proc/self/task")
    tids = [int(t.name) for t in tasks.iterdir()] if tasks.exists() else [0]
    for tid in tids:
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    autogroup = Path("/proc/self/autogroup")
    if os.getsid(0) == os.getpid() and autogroup.exists():
        try:
            autogroup.write_text(str(nice))
        except OSError as exc:  # e.g. a read-only /proc in a container: the thread nice still applies
            logger.warning("could not set the autogroup nice (%s); thread nice %d only", exc, nice)
