"""Run every benchmark (``make bench``), one subprocess each, one after the other.

    .venv/bin/python -m bench.run_all                  # full sizes: about 40 minutes on the shared 2 cores
    .venv/bin/python -m bench.run_all --quick          # every benchmark in its seconds-long mode
    .venv/bin/python -m bench.run_all --only kv_transfer,router_overhead

Each benchmark writes its JSON to ``docs/benchmarks/`` and its plot to ``docs/img/`` (``--quick``:
both to ``var/bench/quick/``; or the given ``--out-dir`` / ``--img-dir``) and prints its tables;
this script adds a last line per benchmark with its exit status and wall time. Subprocesses keep
one benchmark's threads, pinning and memory from affecting the next, and each has a timeout so the
whole run is bounded.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT
from tests.support.processes import die_with_parent

#: In run order, with the timeout (s) of the full and of the quick run.
BENCHMARKS: dict[str, tuple[int, int]] = {
    "engine_throughput": (2100, 300),
    "kv_transfer": (900, 300),
    "disagg_itl": (1200, 300),
    "router_overhead": (900, 300),
    "peer_clients": (1500, 300),
    "cpu_limits": (900, 300),
    "sim.router_scale": (900, 120),
}


def build_command(name: str, quick: bool, out_dir: Path | None, img_dir: Path | None, extra: list[str]) -> list[str]:
    """The command line that runs benchmark `name` (output folders: the benchmark's defaults when None)."""
    cmd = [sys.executable, "-m", f"bench.{name}"]
    if out_dir is not None:
        cmd += ["--out-dir", str(out_dir)]
    if img_dir is not None:
        cmd += ["--img-dir", str(img_dir)]
    if quick:
        cmd.append("--quick")
    if name == "engine_throughput" and (ROOT / "bench" / ".venv-vllm" / "bin" / "python").exists():
        cmd.append("--vllm")  # measured only where the separate vLLM venv was installed
    return cmd + extra


def run_bounded(cmd: list[str], timeout: float) -> int:
    """Run `cmd`; past `timeout` send SIGTERM (benchmarks then stop the processes they started, see
    `bench.common.stop_on_sigterm`), and SIGKILL 30 s later. Returns the exit status (124: timeout)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, preexec_fn=die_with_parent())  # a killed run_all stops its benchmark
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return 124


def main(argv: list[str] | None = None) -> int:
    """Run the selected benchmarks; exit status 1 if any failed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="seconds-long mode of every benchmark")
    p.add_argument("--only", default="", help="comma-separated benchmark names (default: all)")
    p.add_argument("--out-dir", type=Path, default=None, help="default docs/benchmarks (quick: var/bench/quick)")
    p.add_argument("--img-dir", type=Path, default=None, help="default docs/img (quick: var/bench/quick)")
    args, extra = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}")
    status: list[tuple[str, int, float]] = []
    for name in names:
        full_timeout, quick_timeout = BENCHMARKS[name]
        cmd = build_command(name, args.quick, args.out_dir, args.img_dir, extra)
        print(f"\n### {' '.join(cmd[1:])}", flush=True)
        started = time.monotonic()
        rc = run_bounded(cmd, quick_timeout if args.quick else full_timeout)
        status.append((name, rc, time.monotonic() - started))
    print("\nsummary:")
    for name, rc, seconds in status:
        print(f"  {name:<20} {'ok' if rc == 0 else f'FAILED (exit {rc})':<18} {seconds:7.1f} s")
    return 0 if all(rc == 0 for _, rc, _ in status) else 1


if __name__ == "__main__":
    sys.exit(main())
