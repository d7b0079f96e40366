"""The CPU kernels' build folder (cpu_kernels.build_extension): one per venv, one build for processes that
start at once, and no wait on a lock left by a killed build. A tiny C++ library stands in for the kernels
(it builds in about a second, the real ones in about a minute) through the same locked torch build."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from inference.engine import cpu_kernels

ROOT = Path(__file__).resolve().parents[3]
PROBE_SOURCE = 'extern "C" int kernel_build_probe() { return 42; }\n'
WAIT_S = 120.0

# Imports first (seconds on a busy host), then waits for the test's go file so that both builders reach
# the lock together; prints whether it waited for the other and what it loaded.
BUILDER = textwrap.dedent(
    """
    import ctypes, json, logging, sys, time
    from pathlib import Path
    from inference.engine.cpu_kernels import build_extension
    source, root, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    print("ready", flush=True)
    deadline = time.monotonic() + 120
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    path = build_extension("probe_ext", [source], ["-O1"], root=root, is_python_module=False)
    print(json.dumps({"answer": ctypes.CDLL(path).kernel_build_probe(), "path": path}), flush=True)
    """
)

# Takes the build lock, leaves torch's own lock file as a build does, and is then killed by the test.
HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from inference.engine.cpu_kernels import build_lock
    build_dir = Path(sys.argv[1])
    with build_lock(build_dir):
        (build_dir / "lock").touch()
        print("holding", flush=True)
        time.sleep(120)
    """
)


def _probe_source(tmp_path: Path) -> Path:
    source = tmp_path / "probe.cpp"
    source.write_text(PROBE_SOURCE)
    return source


def _child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _read_line(proc: subprocess.Popen[str], expect: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert expect in line, (line, proc.stderr.read() if proc.stderr and proc.poll() is not None else "")
    return line


def test_the_build_folder_is_the_venvs_own_unless_overridden(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two venvs (or checkouts) never share one: torch's default folder under ~/.cache is not used."""
    monkeypatch.delenv(cpu_kernels.ENV_DIR, raising=False)
    if sys.prefix != sys.base_prefix:
        assert cpu_kernels.build_root() == Path(sys.prefix) / "var" / "inference-kernels"
    else:
        assert cpu_kernels.build_root() == ROOT / "var" / "inference-kernels"
    monkeypatch.setenv(cpu_kernels.ENV_DIR, str(tmp_path / "kernels"))
    assert cpu_kernels.build_root() == tmp_path / "kernels"


def test_two_processes_starting_at_once_build_once_and_both_load(tmp_path: Path) -> None:
    """One builds while the other waits on the lock, then finds the build up to date and loads it."""
    source, root, go = _probe_source(tmp_path), tmp_path / "kernels", tmp_path / "go"
    procs = [
        subprocess.Popen([sys.executable, "-c", BUILDER, str(source), str(root), str(go)], cwd=ROOT,
                         env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        for proc in procs:
            _read_line(proc, "ready")
        go.touch()
        results = [proc.communicate(timeout=WAIT_S) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    for proc, (out, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
        assert '"answer": 42' in out, (out, err)
    # At most one waited on the lock: on a busy host the first can finish its build before the second
    # reaches the lock, which then finds it up to date. Building once is what the ninja log shows below.
    assert sum("waiting for it" in err for _, err in results) <= 1, [err for _, err in results]
    # ninja's log: one compile and one link, however many processes loaded the result
    entries = [line for line in (root / "probe_ext" / ".ninja_log").read_text().splitlines()
               if not line.startswith("#")]
    assert len(entries) == 2, entries


def test_a_lock_left_by_a_killed_build_does_not_delay_a_start(tmp_path: Path) -> None:
    """The lock is an flock: while its owner lives a start waits; once the owner is SIGKILLed the next
    start takes it at once, removes torch's leftover lock file (torch would wait on it forever) and builds."""
    source, root = _probe_source(tmp_path), tmp_path / "kernels"
    build_dir = root / "probe_ext"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(build_dir)], cwd=ROOT, env=_child_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _read_line(holder, "holding")
        with pytest.raises(TimeoutError), cpu_kernels.build_lock(build_dir, wait_s=0.5):
            pass  # the owner is alive: its build is respected
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    finally:
        holder.kill()
        holder.wait()
    assert (build_dir / "lock").exists() and (build_dir / "build.lock").exists()
    started = time.monotonic()
    path = cpu_kernels.build_extension("probe_ext", [source], ["-O1"], root=root, is_python_module=False)
    elapsed = time.monotonic() - started
    assert ctypes.CDLL(path).kernel_build_probe() == 42
    assert not (build_dir / "lock").exists()
    assert elapsed < 60, elapsed  # a compile and a link; torch's own wait would never end


def test_two_trees_with_the_same_kernels_build_in_folders_of_their_own(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A worktree run by the same venv (an A/B run, a drill): same sources, other paths, so other compile
    commands; sharing one folder, each start would rebuild the other's build."""
    names = []
    for tree in ("a", "b", "a"):
        csrc = tmp_path / tree / "csrc"
        csrc.mkdir(parents=True, exist_ok=True)
        copies = []
        for source in cpu_kernels.SOURCES:
            (csrc / source.name).write_bytes(source.read_bytes())
            copies.append(csrc / source.name)
        monkeypatch.setattr(cpu_kernels, "SOURCES", copies)
        names.append(cpu_kernels._build_name())
    assert names[0] != names[1]
    assert names[0] == names[2]
