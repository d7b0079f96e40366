"""A/B of the admin pages between two source trees on one kept fleet, alternating fresh processes.

    git archive BASE | tar -x -C /tmp/base     # the tree to compare with (same database, same rows)
    flock /tmp/bench.lock .venv/bin/python -m bench.sim.page_ab --prefix cp1234 --base /tmp/base \\
        --rounds 3 --repeats 20 [--pages NAME,...]

Each round runs bench/sim/page_timing.py (this tree's script) once with the base tree's code and once with
this one's, in fresh processes, the order swapped every round; this tree's run sets the garbage collector
as the web process does (config/web_gc.py, `--web-gc`) unless `--no-web-gc`. Prints per page and side the
pooled wall and CPU p50 / p95, the full collections during the timed requests, and the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import percentile

HERE = Path(__file__).resolve()
THIS_TREE = HERE.parents[2]
DEFAULT_PAGES = "admin deployment page,admin workers of the deployment,admin workers list,admin nodes list"
RUN_TIMEOUT_S = 540.0


def run_side(tree: Path, args: argparse.Namespace, web_gc: bool) -> dict[str, Any]:
    """page_timing.py (this tree's) run with `tree`'s code: its folder first on sys.path, the working folder."""
    argv = ["--prefix", args.prefix, "--repeats", str(args.repeats), "--pages", args.pages]
    argv += ["--web-gc"] if web_gc else []
    code = ("import runpy, sys; sys.argv = ['page_timing'] + sys.argv[1:]; "
            f"runpy.run_path({str(HERE.with_name('page_timing.py'))!r}, run_name='__main__')")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", code, *argv], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"page_timing in {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def load() -> str:
    """The 1-minute load average."""
    return Path("/proc/loadavg").read_text().split()[0]


def main(argv: list[str] | None = None) -> int:
    """Alternate the two trees, then print the pooled figures (and write them with --out)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix", required=True)
    p.add_argument("--base", type=Path, required=True, help="the other source tree (e.g. a git archive of a commit)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--pages", default=DEFAULT_PAGES)
    p.add_argument("--no-web-gc", action="store_true", help="this tree without config/web_gc.py's settings")
    p.add_argument("--out", type=Path, default=None, help="write every sample as JSON here")
    args = p.parse_args(argv)
    if not (args.base / "manage.py").exists() or args.rounds < 1:
        p.error(f"--base {args.base}: not a source tree (no manage.py), or --rounds < 1")
    sides = {"base": (args.base.resolve(), False), "this": (THIS_TREE, not args.no_web_gc)}
    samples: dict[str, dict[str, dict[str, list[float]]]] = {side: {} for side in sides}
    loads = [load()]
    for k in range(args.rounds):
        for side in (("base", "this") if k % 2 == 0 else ("this", "base")):
            tree, web_gc = sides[side]
            for page, figures in run_side(tree, args, web_gc).items():
                into = samples[side].setdefault(page, {"wall_ms": [], "cpu_ms": [], "full_gc_ms": []})
                for key in into:
                    into[key] += figures[key]
            loads.append(load())
            print(f"round {k + 1} {side}: load {loads[-1]}", file=sys.stderr)
    print(f"load average (1 min) before, after each run: {' '.join(loads)}")
    for page in samples["base"]:
        for side in sides:
            s = samples[side][page]
            print(f"{page:34s} {side:4s}  wall p50 {percentile(s['wall_ms'], 50):6.0f} p95 "
                  f"{percentile(s['wall_ms'], 95):6.0f}  cpu p50 {percentile(s['cpu_ms'], 50):6.0f} p95 "
                  f"{percentile(s['cpu_ms'], 95):6.0f}  full GCs {len(s['full_gc_ms'])} "
                  f"({sum(s['full_gc_ms']):.0f} ms) of {len(s['cpu_ms'])} requests")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps({"loads": loads, "samples": samples}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
