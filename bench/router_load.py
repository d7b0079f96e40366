"""The guide's load test against a running router, watching the router while it runs.

Runs ``load_test`` (the guide's tool) at ``--concurrency`` for ``--duration`` against
``--router-url`` (e.g. ``make up``'s demo), and meanwhile polls the router's ``GET /health`` every
50 ms (its latency is how responsive the router stays under load) and ``GET /router/status`` every
0.5 s (any worker it takes out of rotation is recorded). Reports the load test's summary, how the
requests ended (completed, 429 and how fast, timeouts, 5xx, dropped connections), /health
latency percentiles and the workers ejected.

    make up   # in another shell
    .venv/bin/python -m bench.router_load --router-url http://127.0.0.1:8000 --concurrency 100 --duration 60s
    .venv/bin/python -m bench.router_load --router-url http://127.0.0.1:8000 --concurrency 400 --duration 30s
"""
from __future__ import annotations

import csv
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import _check_loopback, base_parser, fmt, log, markdown_table, parse_args, percentile, write_result


class Watcher(threading.Thread):
    """Polls /health and /router/status of the router until stopped (bounded by the load test)."""

    def __init__(self, router: str) -> None:
        super().__init__(daemon=True)
        self.router = router
        self.stop = threading.Event()
        self.health_s: list[float] = []
        self.health_failures = 0
        self.ejections: list[dict[str, Any]] = []
        self.max_queued = 0

    def run(self) -> None:
        """Poll until `stop` is set."""
        with httpx.Client(timeout=10, trust_env=False) as client:
            last_status = 0.0
            while not self.stop.is_set():
                started = time.perf_counter()
                try:
                    body = client.get(f"{self.router}/health").json()
                    self.health_s.append(time.perf_counter() - started)
                    self.max_queued = max(self.max_queued, int(body.get("queued") or 0))
                except (httpx.HTTPError, ValueError):
                    self.health_failures += 1
                if time.monotonic() - last_status > 0.5:
                    last_status = time.monotonic()
                    try:
                        status = client.get(f"{self.router}/router/status").json()
                        for endpoint in status.get("prefill", []) + status.get("decode", []):
                            if not endpoint.get("healthy"):
                                self.ejections.append({"at": time.time(), "url": endpoint["url"],
                                                       "error": endpoint.get("last_error")})
                    except (httpx.HTTPError, ValueError):
                        self.health_failures += 1
                time.sleep(0.05)


def outcomes(csv_path: Path) -> dict[str, Any]:
    """How the load test's requests ended, from its per-request CSV."""
    rows = list(csv.DictReader(csv_path.open()))
    by_status: dict[str, int] = {}
    for row in rows:
        by_status[row["http_status"] or row["status"]] = by_status.get(row["http_status"] or row["status"], 0) + 1
    rejected = [float(r["e2e_s"]) for r in rows if r["http_status"] == "429"]
    errors = [r["error"] for r in rows if r["error"] and r["http_status"] != "429"]
    return {
        "requests": len(rows),
        "completed": sum(1 for r in rows if r["status"] == "ok"),
        "by_http_status": by_status,
        "rejected_429": len(rejected),
        "rejected_max_s": max(rejected) if rejected else None,
        "server_errors_5xx": sum(1 for r in rows if r["http_status"].startswith("5")),
        "other_errors": len(errors),
        "other_error_examples": sorted(set(e[:120] for e in errors))[:5],
    }


def main(argv: list[str] | None = None) -> int:
    """Run the load test with the watcher and write the result."""
    p = base_parser(__doc__.splitlines()[0] if __doc__ else "router load")
    p.add_argument("--router-url", required=True, help="the router to load (loopback only)")
    p.add_argument("--concurrency", type=int, default=100)
    p.add_argument("--duration", default="60s")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--name", default=None, help="result name (default router_load_c<concurrency>)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    router = _check_loopback(args.router_url).rstrip("/")
    name = args.name or f"router_load_c{args.concurrency}"
    scratch = Path(args.log_dir)
    scratch.mkdir(parents=True, exist_ok=True)
    csv_path, summary_path = scratch / f"{name}.csv", scratch / f"{name}.json"
    watcher = Watcher(router)
    watcher.start()
    started = time.monotonic()
    try:
        subprocess.run(
            [str(Path(sys.executable).with_name("load_test")), "--endpoint", f"{router}/generate",
             "--concurrency", str(args.concurrency), "--duration", args.duration, "--max-tokens",
             str(args.max_tokens), "--metrics-file", str(csv_path), "--summary-json", str(summary_path),
             "--no-plot", "--no-progress"],
            check=True, timeout=3600,
        )
    finally:
        watcher.stop.set()
        watcher.join(15)
    summary = json.loads(summary_path.read_text())
    result = {
        "router": router,
        "concurrency": args.concurrency,
        "duration": args.duration,
        "wall_s": time.monotonic() - started,
        "outcomes": outcomes(csv_path),
        "load_test": summary,
        "health": {
            "polls": len(watcher.health_s),
            "failures": watcher.health_failures,
            "p50_ms": (percentile(watcher.health_s, 50) or 0) * 1000,
            "p99_ms": (percentile(watcher.health_s, 99) or 0) * 1000,
            "max_ms": max(watcher.health_s, default=0) * 1000,
        },
        "ejections": watcher.ejections,
        "max_queued": watcher.max_queued,
    }
    o, h = result["outcomes"], result["health"]
    print(markdown_table(
        ["clients", "requests", "completed", "429 (max s)", "5xx", "other errors", "/health p50 / p99 ms",
         "workers ejected"],
        [[args.concurrency, o["requests"], o["completed"], f"{o['rejected_429']} ({fmt(o['rejected_max_s'])})",
          o["server_errors_5xx"], o["other_errors"], f"{fmt(h['p50_ms'], 1)} / {fmt(h['p99_ms'], 1)}",
          len({e['url'] for e in watcher.ejections})]],
    ))
    path = write_result(args.out_dir, name, "bench.router_load", argv, result)
    log(f"result: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
