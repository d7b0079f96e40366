"""What a host offers the platform: CPUs, memory, GPUs and RDMA devices, plus its current load.

Every function here answers even on a host without the thing it looks for (no GPU, no NVIDIA driver,
no RDMA verbs, a broken torch): detection never raises, it reports an empty list and, for RDMA, the
reason it is unusable. The agent registers what `detect_resources()` finds with its Node.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

logger = logging.getLogger(__name__)

# nvidia-smi answers in well under a second; a hung driver must not hang the agent's start.
NVIDIA_SMI_TIMEOUT_S = 10.0


@dataclass
class NodeResources:
    """A host's resources as registered on its Node (`gpus` items: {index, name, memory_bytes})."""

    hostname: str
    cpu_count: int
    memory_bytes: int
    gpus: list[dict[str, Any]] = field(default_factory=list)
    rdma_devices: list[str] = field(default_factory=list)
    rdma_note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (the agent logs it at start)."""
        return asdict(self)


def detect_cpu_count() -> int:
    """CPUs this process may run on (its affinity, so a container's cpuset is honoured); at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def detect_memory_bytes() -> int:
    """Total physical memory in bytes (0 if unknown)."""
    try:
        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001  psutil can fail in odd sandboxes; detection never raises
        logger.warning("cannot read the memory size", exc_info=True)
        return 0


def _gpus_from_nvidia_smi() -> list[dict[str, Any]] | None:
    """GPUs listed by nvidia-smi, or None when nvidia-smi is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        logger.info("nvidia-smi failed (%s); trying torch.cuda", exc)
        return None
    gpus = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            # memory.total is in MiB with nounits.
            gpus.append({"index": int(parts[0]), "name": parts[1], "memory_bytes": int(float(parts[2]) * 2**20)})
        except ValueError:
            continue
    return gpus


def _gpus_from_torch() -> list[dict[str, Any]]:
    """GPUs torch.cuda sees (empty without a CUDA build or device)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        gpus = []
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            gpus.append({"index": index, "name": str(props.name), "memory_bytes": int(props.total_memory)})
        return gpus
    except Exception:  # noqa: BLE001  a broken driver or torch install means "no GPU", not a crash
        logger.info("torch.cuda GPU detection failed", exc_info=True)
        return []


def detect_gpus() -> list[dict[str, Any]]:
    """GPUs of the host: nvidia-smi first (it does not create a CUDA context in the agent), else torch.cuda.

    CUDA_VISIBLE_DEVICES of the agent itself is ignored on purpose: the agent hands GPUs to its workers
    by physical index (`Worker.gpu_ids` → the worker's CUDA_VISIBLE_DEVICES).
    """
    found = _gpus_from_nvidia_smi()
    if found is None:
        found = _gpus_from_torch()
    return sorted(found, key=lambda g: g["index"])


def detect_rdma() -> tuple[list[str], str]:
    """(RDMA device names, note): the note says why RDMA is unusable, empty when it is usable."""
    try:
        from inference.kv_transfer.rdma_detect import rdma_available

        ok, reason, devices = rdma_available()
    except Exception as exc:  # noqa: BLE001  rdma_available is meant not to raise; be sure anyway
        return [], f"RDMA detection failed: {exc}"[:255]
    if not ok:
        return [], reason[:255]
    return list(devices), ""


def detect_resources() -> NodeResources:
    """Everything the agent registers about its host; never raises."""
    rdma_devices, rdma_note = detect_rdma()
    return NodeResources(
        hostname=socket.gethostname(),
        cpu_count=detect_cpu_count(),
        memory_bytes=detect_memory_bytes(),
        gpus=detect_gpus(),
        rdma_devices=rdma_devices,
        rdma_note=rdma_note,
    )


def host_metrics() -> dict[str, Any]:
    """The host's current CPU/memory/load, sent with each heartbeat (Node.last_metrics)."""
    metrics: dict[str, Any] = {}
    try:
        # interval=None: the busy fraction since the previous call (the heartbeat interval), no sleeping.
        metrics["cpu_utilization"] = round(psutil.cpu_percent(interval=None) / 100.0, 3)
        mem = psutil.virtual_memory()
        metrics["memory_used_bytes"] = int(mem.total - mem.available)
        metrics["memory_total_bytes"] = int(mem.total)
        metrics["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    except Exception:  # noqa: BLE001  a heartbeat without metrics is better than no heartbeat
        logger.debug("host metrics unavailable", exc_info=True)
    return metrics


# psutil measures a process's CPU between two calls on the same Process object, so keep them per pid.
_process_cache: dict[int, psutil.Process] = {}


def process_metrics(pid: int) -> dict[str, Any] | None:
    """RSS, CPU percent (since the previous call for this pid) and thread count; None when it is gone."""
    try:
        proc = _process_cache.get(pid)
        if proc is None or not proc.is_running():  # is_running() also catches a reused pid
            proc = psutil.Process(pid)
            _process_cache[pid] = proc
        with proc.oneshot():
            return {
                "rss_bytes": int(proc.memory_info().rss),
                "cpu_percent": round(proc.cpu_percent(interval=None), 1),
                "num_threads": int(proc.num_threads()),
            }
    except (psutil.Error, OSError):
        _process_cache.pop(pid, None)
        return None


def forget_process(pid: int) -> None:
    """Drop the cached Process of a worker that stopped."""
    _process_cache.pop(pid, None)
