"""A scheduler switch with a bad value stops the worker at startup with one line naming the variable
(not a traceback, not "cannot load the model")."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from inference.engine.scheduler import MIXED_BURST_ENV, PREFILL_WAVE_ENV
from tests.support.processes import build_kernels_once, free_port


@pytest.mark.parametrize("name", [PREFILL_WAVE_ENV, MIXED_BURST_ENV])
def test_a_bad_switch_names_itself_and_the_worker_exits_1(tiny_model_dir: Path, name: str) -> None:
    build_kernels_once()
    env = {**os.environ, name: "many", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-m", "inference.launch_server", "--model-path", str(tiny_model_dir),
         "--service-type", "decode", "--port", str(free_port()), "--kv-port", str(free_port()),
         "--num-threads", "1"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {name} must be a whole number of "), done.stderr[-2000:]
    assert "Traceback" not in done.stderr
