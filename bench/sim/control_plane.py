"""The control plane at 10 / 100 nodes and 100 / 1,000 workers (issue 25), with simulated agents and workers.

    DATABASE_URL=postgres://... REDIS_URL=redis://... .venv/bin/python -m bench.sim.control_plane   # minutes
    ... .venv/bin/python -m bench.sim.control_plane --quick                                         # seconds

For each size (nodes, workers) on PostgreSQL + Redis:
- the real controller (`manage.py controller --no-beat`, its own control queue) and simulated agents
  (bench/sim/agents.py: real Nodes, the real node queues and reports, simulated workers on the placed
  ports) in `--agent-processes` processes;
- fill: the deployment is scaled to `workers - step` decode workers, waited for until all run;
- scale: + `step` decode workers; from the decision (the scale action's commit) to the first and the
  last new Worker row (the control queue's latency, then reconcile + placement), and to all of them
  RUNNING (ScaleEvent.time_to_run_s: placed, started by their agents, healthy);
- collector: `--rounds` scrape rounds of inference.metrics.collector.collect (in this process, as the
  controller's task runs it) with their time and statements;
- control queue: the latency of no-op scale tasks through the controller's queue, idle and beside the
  periodic tasks beat would send (bench/sim/queue_latency.py), `--queue-seconds` each;
- database: `--raw-hours` of raw samples and `--rollup-hours` of minute rollups written for the
  workers (bench/sim/db_load.py), bytes per row from PostgreSQL, a day's size under the default
  retention and under the old one (raw samples kept METRICS_RETENTION_HOURS);
- pages: the admin's deployment page and worker lists and the REST list endpoints, p50/p95 with the
  samples in place (bench/sim/page_timing.py: Django's test Client as a superuser, the real database).
Everything the run created (deployment, nodes, workers, samples) is deleted at the end.
"""
from __future__ import annotations

import functools
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import base_parser, fmt, log, markdown_table, note_shared_machine, parse_args, write_result

MODULE = "bench.sim.control_plane"
FULL_SIZES = ((10, 100), (100, 1000))
QUICK_SIZES = ((3, 12),)
WAIT_FULL_S = 600.0
WAIT_QUICK_S = 60.0


def _setup_django(control_queue: str) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ["PLATFORM_CONTROL_QUEUE"] = control_queue  # the driver's scale messages reach our controller
    os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "*")
    import django

    django.setup()


def _wait(what: str, check: Any, timeout: float, procs: list[Any], interval: float = 0.25) -> float:
    """Poll `check()` until true (bounded); fail naming the process that died. Returns seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic() - start
        for proc in procs:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited while waiting for {what}:\n{proc.log()[-3000:]}")
        time.sleep(interval)
    raise TimeoutError(f"{what}: not within {timeout:.0f}s")


def cleanup(prefix: str) -> None:
    """Delete what a run with `prefix` created (its deployment cascades workers, samples and rollups)."""
    from inference.models import Deployment, Model
    from nodes.models import Node

    Deployment.objects.filter(name__startswith=prefix).delete()
    Model.objects.filter(name__startswith=prefix).delete()
    Node.objects.filter(name__startswith=prefix).delete()


def scrape_ab(deployment: Any) -> dict[str, float]:
    """Seconds to scrape every worker of the deployment: an HTTP client per scrape (before) and one shared
    client (the collector now), same threads, side by side."""
    from concurrent.futures import ThreadPoolExecutor

    from inference.metrics import collector
    from inference.models import Worker, WorkerStatus

    workers = list(Worker.objects.select_related("node").filter(deployment=deployment, status=WorkerStatus.RUNNING))
    threads = min(collector.MAX_SCRAPE_THREADS, len(workers))
    out: dict[str, float] = {}
    for name in ("client_per_scrape", "shared_client"):
        start, cpu = time.perf_counter(), time.process_time()
        with collector.scrape_client(2.0, threads) as client, ThreadPoolExecutor(threads) as pool:
            one = functools.partial(collector.scrape, timeout=5.0, client=client if name == "shared_client" else None)
            failed = sum(1 for s in pool.map(one, workers) if s.error)
        out[f"{name}_s"] = time.perf_counter() - start
        out[f"{name}_cpu_s"] = time.process_time() - cpu
        out[f"{name}_failed"] = failed
    return out


def run_size(nodes: int, workers: int, step: int, args: Any, log_dir: Path) -> dict[str, Any]:
    """One size: start the controller and the agents, fill, scale, collect, load samples, time pages."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from bench.sim import db_load, page_timing, queue_latency
    from inference.actions.scale import scale_deployment
    from inference.metrics import collector
    from inference.models import Deployment, Model, ScaleEvent, Worker, WorkerStatus
    from tests.support.processes import Proc

    prefix = f"cp{secrets.token_hex(2)}"
    wait_s = WAIT_QUICK_S if args.quick else WAIT_FULL_S
    model = Model.objects.create(name=f"{prefix}-model", path="/sim/model")
    deployment = Deployment.objects.create(
        name=f"{prefix}-dep", model=model, prefill_replicas=0, prefill_min=0, prefill_max=0,
        decode_replicas=0, decode_min=0, decode_max=workers,
    )
    procs: list[Proc] = []
    result: dict[str, Any] = {"nodes": nodes, "workers": workers, "step": step}
    try:
        procs.append(Proc(f"{prefix}-controller", [sys.executable, "manage.py", "controller", "--no-beat",
                                                   "--no-setup-schedules", "--concurrency", "4",
                                                   "--loglevel", "WARNING"], log_dir))
        per_proc = -(-nodes // args.agent_processes)
        ready_files = []
        for k, first in enumerate(range(0, nodes, per_proc)):
            ready = log_dir / f"{prefix}-agents-{k}.json"
            ready_files.append(ready)
            procs.append(Proc(f"{prefix}-agents-{k}", [
                sys.executable, "-m", "bench.sim.agents", "--prefix", prefix, "--first-index", str(first),
                "--nodes", str(min(per_proc, nodes - first)), "--first-port", str(args.first_port),
                "--ports-per-node", str(2 * (-(-workers // nodes)) + 4), "--ready-file", str(ready),
            ], log_dir))
        _wait("agents registered", lambda: all(f.exists() for f in ready_files), wait_s, procs)

        def running() -> int:
            return Worker.objects.filter(deployment=deployment, status=WorkerStatus.RUNNING).count()

        t0 = time.monotonic()
        scale_deployment(deployment, "decode", workers - step, source="manual", reason="sim fill")
        result["fill_s"] = _wait(f"{workers - step} running", lambda: running() == workers - step, wait_s, procs)
        log(f"{nodes} nodes: {workers - step} decode workers running after {time.monotonic() - t0:.1f}s")

        first_new = Worker.objects.filter(deployment=deployment).order_by("-pk").values_list("pk", flat=True)[0]
        decided = time.time()
        event = scale_deployment(deployment, "decode", workers, source="manual", reason="sim +step")
        waited = _wait(f"{workers} running", lambda: running() == workers, wait_s, procs, interval=0.1)
        assert event is not None
        # report_healthy fills the event's time_to_run_s right after the last worker turns RUNNING.
        _wait("time_to_run_s", lambda: ScaleEvent.objects.get(pk=event.pk).time_to_run_s is not None, 30, procs)
        new = Worker.objects.filter(deployment=deployment, pk__gt=first_new)
        created = list(new.order_by("created_at").values_list("created_at", flat=True))
        result["scale"] = {
            "queue_to_first_placed_s": created[0].timestamp() - decided,
            "placement_s": created[-1].timestamp() - created[0].timestamp(),
            "decision_to_all_placed_s": created[-1].timestamp() - decided,
            "decision_to_all_running_s": ScaleEvent.objects.get(pk=event.pk).time_to_run_s,
            "polled_all_running_s": waited,
        }
        log(f"  +{step}: {result['scale']}")

        rounds = []
        for _ in range(args.rounds):
            with CaptureQueriesContext(connection) as queries:
                start, cpu = time.perf_counter(), time.process_time()
                collector.collect()
                elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
            # CPU seconds of this process (all threads): what the round needs of a core, whatever the load.
            # The database's part: every statement's time, and the writes' (the round's one UPDATE of the
            # workers and INSERTs of its samples), from Django's record of the queries.
            timed = [(q["sql"].lstrip()[:6].upper(), float(q["time"])) for q in queries.captured_queries]
            rounds.append({"round_s": elapsed, "cpu_s": cpu, "statements": len(queries),
                           "db_s": sum(t for _, t in timed),
                           "write_s": sum(t for verb, t in timed if verb in ("INSERT", "UPDATE"))})
            time.sleep(1.0)
        result["collector"] = {"rounds": rounds, "scrapes_per_round": 2 * workers,
                               "rows_per_round": workers + 2, "client_ab": scrape_ab(deployment)}
        log(f"  collector rounds: {[round(r['round_s'], 2) for r in rounds]}")

        result["queue_latency"] = queue_latency.measure(deployment, seconds=args.queue_seconds)
        log(f"  control queue latency p95 idle / loaded: {result['queue_latency']['idle']['p95_s']} / "
            f"{result['queue_latency']['loaded']['p95_s']} s")
        result["database"] = db_load.measure(deployment, raw_hours=args.raw_hours, rollup_hours=args.rollup_hours)
        log(f"  database: {result['database']['per_day']}")
        page_timing.add_history(deployment)
        # The garbage collector as the web process sets it (config/web_gc.py): this process is no web process,
        # but its pages should pay what a web process's do.
        result["pages"] = page_timing.measure(deployment, repeats=args.repeats, web_gc=True)
        log(f"  pages p95: { {k: round(v['p95_ms']) for k, v in result['pages'].items()} }")
    finally:
        for proc in procs:
            proc.stop()
        if args.keep:
            log(f"  kept the rows of {prefix} (remove them with --cleanup {prefix})")
        else:
            cleanup(prefix)
    return result


def main(argv: list[str] | None = None) -> int:
    """Run every size and write the result."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", default=None, help="NODES:WORKERS,... (default 10:100,100:1000; --quick 3:12)")
    p.add_argument("--step", type=int, default=None, help="decode workers added at once (default 100; quick 4)")
    p.add_argument("--agent-processes", type=int, default=2)
    p.add_argument("--first-port", type=int, default=11000, help="below the ephemeral ports")
    p.add_argument("--rounds", type=int, default=None, help="collector rounds (default 3; quick 2)")
    p.add_argument("--queue-seconds", type=float, default=None,
                   help="seconds of control-queue probes, idle then under the periodic tasks (default 30; quick 3)")
    p.add_argument("--raw-hours", type=float, default=None, help="raw samples loaded (default 2: the retention)")
    p.add_argument("--rollup-hours", type=float, default=None, help="minute rollups loaded (default 24)")
    p.add_argument("--repeats", type=int, default=None, help="requests per page (default 20; quick 3)")
    p.add_argument("--keep", action="store_true",
                   help="leave the run's deployment, nodes, workers and samples in the database (to profile pages)")
    p.add_argument("--cleanup", metavar="PREFIX", default=None, help="delete what a --keep run left, and exit")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    sizes: list[tuple[int, int]] = list(QUICK_SIZES if args.quick else FULL_SIZES)
    if args.sizes:
        try:
            sizes = [(int(s.split(":")[0]), int(s.split(":")[1])) for s in args.sizes.split(",")]
        except (ValueError, IndexError):
            p.error(f"--sizes {args.sizes!r}: expected NODES:WORKERS,...")
    args.step = args.step or (4 if args.quick else 100)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.queue_seconds = args.queue_seconds if args.queue_seconds is not None else (3.0 if args.quick else 30.0)
    args.raw_hours = args.raw_hours if args.raw_hours is not None else (0.05 if args.quick else 2.0)
    args.rollup_hours = args.rollup_hours if args.rollup_hours is not None else (0.5 if args.quick else 24.0)
    args.repeats = args.repeats or (3 if args.quick else 20)
    if any(w < 2 or n < 1 for n, w in sizes) or args.agent_processes < 1 or args.step < 1:
        p.error("each size needs workers >= 2 and nodes >= 1; --agent-processes and --step >= 1")
    _setup_django(f"control-sim-{secrets.token_hex(3)}")
    if args.cleanup:
        if not args.cleanup.startswith("cp") or len(args.cleanup) != 6:
            p.error(f"--cleanup {args.cleanup!r}: expected the prefix a --keep run printed (cp + 4 hex digits)")
        cleanup(args.cleanup)
        return 0
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    # The step is at most half the size (a size of 100 workers adds 50).
    results = []
    for n, w in sizes:
        results.append(run_size(n, w, min(args.step, w // 2), args, args.log_dir))
        # Written after each size: a later size that fails leaves the earlier ones on record.
        write_result(args.out_dir, "sim_control_plane", MODULE, argv, {"sizes": results})
    rows = [
        [f"{r['nodes']} / {r['workers']}", f"+{r['step']}", fmt(r["scale"]["queue_to_first_placed_s"]),
         fmt(r["scale"]["decision_to_all_placed_s"]), fmt(r["scale"]["decision_to_all_running_s"]),
         fmt(max(x["round_s"] for x in r["collector"]["rounds"])),
         fmt(r["database"]["per_day"]["default_gb"], 3), fmt(r["database"]["per_day"]["raw_only_gb"], 3),
         fmt(max(v["p95_ms"] for v in r["pages"].values()), 0)]
        for r in results
    ]  # fmt: skip
    headers = ["nodes / workers", "scale", "queue → 1st placed s", "all placed s", "all running s",
               "collector round s", "GB/day (rollups)", "GB/day (raw)", "worst page p95 ms"]
    print(markdown_table(headers, rows))
    print(note_shared_machine())
    path = write_result(args.out_dir, "sim_control_plane", MODULE, argv, {"sizes": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
