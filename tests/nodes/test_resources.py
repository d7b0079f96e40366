"""nodes.resources: detection answers on any host and never raises."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from nodes import resources


def test_detect_resources_on_this_host() -> None:
    found = resources.detect_resources()
    assert found.cpu_count == len(os.sched_getaffinity(0))
    assert found.memory_bytes > 0
    assert found.hostname
    assert isinstance(found.gpus, list)
    for gpu in found.gpus:
        assert {"index", "name", "memory_bytes"} <= gpu.keys()
    # Either usable RDMA devices, or none and a reason.
    assert bool(found.rdma_devices) != bool(found.rdma_note)
    assert set(found.to_dict()) == {"hostname", "cpu_count", "memory_bytes", "gpus", "rdma_devices", "rdma_note"}


def _fake_nvidia_smi(tmp_path: Path, script: str) -> Path:
    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + script)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return tmp_path


def test_gpus_from_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    line = "NVIDIA H100 80GB HBM3, 81559"
    bin_dir = _fake_nvidia_smi(tmp_path, f'echo "0, {line}"\necho "1, {line}"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    gpus = resources.detect_gpus()
    assert gpus == [
        {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 81559 * 2**20},
        {"index": 1, "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 81559 * 2**20},
    ]


def test_failing_nvidia_smi_falls_back_to_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = _fake_nvidia_smi(tmp_path, "echo 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(resources, "_gpus_from_torch", lambda: [{"index": 0, "name": "fake", "memory_bytes": 1}])
    assert resources.detect_gpus() == [{"index": 0, "name": "fake", "memory_bytes": 1}]


def test_broken_torch_means_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    def boom() -> bool:
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(resources.shutil, "which", lambda name: None)
    monkeypatch.setattr(torch.cuda, "is_available", boom)
    assert resources.detect_gpus() == []


def test_rdma_detection_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    from inference.kv_transfer import rdma_detect

    def boom() -> tuple[bool, str, list[str]]:
        raise OSError("verbs exploded")

    monkeypatch.setattr(rdma_detect, "rdma_available", boom)
    devices, note = resources.detect_rdma()
    assert devices == [] and "verbs exploded" in note

    monkeypatch.setattr(rdma_detect, "rdma_available", lambda: (True, "ok", ["mlx5_0"]))
    assert resources.detect_rdma() == (["mlx5_0"], "")


def test_memory_detection_failure_is_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> None:
        raise OSError("no /proc")

    monkeypatch.setattr(resources.psutil, "virtual_memory", boom)
    assert resources.detect_memory_bytes() == 0
    assert "memory_used_bytes" not in resources.host_metrics()  # metrics degrade, they do not fail


def test_host_and_process_metrics() -> None:
    metrics = resources.host_metrics()
    assert 0.0 <= metrics["cpu_utilization"] <= 1.0
    assert metrics["memory_total_bytes"] > 0
    mine = resources.process_metrics(os.getpid())
    assert mine is not None and mine["rss_bytes"] > 0 and mine["num_threads"] >= 1
    assert resources.process_metrics(2**22 + 12345) is None  # no such pid
