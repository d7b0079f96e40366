"""Per-key limits' CPU per request in process: this tree's Redis counters against a baseline revision's,
alternating in one run (issue 21: the router's CPU per request with limits, target +0.2 ms).

Eight clients of one key with all three limits (large enough never to refuse) each admit a request,
let the loop turn (a request's life), and end it with a few tokens, as the router's tenancy does;
the event loop thread's CPU per request (`time.thread_time`) over that of the same loop without
limits, and the Redis script calls per request. The baseline's `quotas.py` is read from git and
loaded as its own module (it used one script call per request, its end riding on the next one).

    REDIS_URL=redis://127.0.0.1:6379/3 .venv/bin/python -m bench.quota_cost --baseline 45a3816
"""
from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import base_parser, log, markdown_table, median, parse_args, ratio, write_result
from tests.support.processes import ROOT

MODULE = "bench.quota_cost"


def _baseline_quotas(rev: str) -> Any:
    """The baseline revision's inference/gateway/quotas.py as a module of its own."""
    source = subprocess.run(["git", "show", f"{rev}:inference/gateway/quotas.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "baseline_quotas.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_quotas", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_quotas"] = module
    spec.loader.exec_module(module)
    return module


async def _block(quotas: Any, tenant: Any, clients: int, per_client: int) -> float:
    """Loop-thread CPU seconds of `clients` x `per_client` requests through `quotas` (None: no limits)."""
    async def one_client() -> None:
        for _ in range(per_client):
            if quotas is not None:
                assert await quotas.admit(tenant) is None
            await asyncio.sleep(0)
            if quotas is not None:
                await quotas.finish(tenant, 10)

    started = time.thread_time()
    await asyncio.gather(*(one_client() for _ in range(clients)))
    return time.thread_time() - started


async def _run(args: Any, url: str) -> dict[str, Any]:
    from inference.gateway.api_keys import Tenant
    from inference.gateway.quota_leases import LeasedCounters
    from inference.gateway.quotas import Quotas

    baseline = _baseline_quotas(args.baseline)
    big = 10**9
    tenant = Tenant(key_id=5 * 10**9 + os.getpid(), label="dpk-bench", requests_per_minute=big,
                    tokens_per_minute=big, max_concurrent=big)
    leased = LeasedCounters(url)
    candidates = {"baseline": baseline.Quotas(baseline.RedisCounters(url)), "leased": Quotas(leased)}
    n = args.clients * args.per_client
    us: dict[str, list[float]] = {name: [] for name in candidates}
    for warming in candidates.values():
        await _block(warming, tenant, args.clients, 20)  # warm: clients, scripts loaded
    calls_before = leased.calls
    for _ in range(args.rounds):
        bare = await _block(None, tenant, args.clients, args.per_client)
        for name, quotas in candidates.items():
            used = await _block(quotas, tenant, args.clients, args.per_client)
            us[name].append(1e6 * (used - bare) / n)
            log(f"{name}: {us[name][-1]:.1f} us CPU per request over the loop without limits")
        await asyncio.sleep(0.3)  # what is owed is paid before the next round
    calls = (leased.calls - calls_before) / (n * args.rounds)
    med = {name: median(values) for name, values in us.items()}
    return {"cpu_us_per_request": med, "cpu_rounds_us": us,
            "baseline_over_leased": ratio(med["baseline"], med["leased"]),
            "leased_script_calls_per_request": calls, "baseline_script_calls_per_request": 1.0,
            "clients": args.clients, "requests_per_block": n, "baseline": args.baseline}


def main(argv: list[str] | None = None) -> int:
    """Measure both and write docs/benchmarks/quota_cost.json."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = base_parser(__doc__ or MODULE)
    p.add_argument("--baseline", required=True, help="git revision whose quotas.py is the baseline")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--per-client", type=int, default=500)
    args = parse_args(p, argv)
    url = os.environ.get("REDIS_URL")
    if not url:
        raise SystemExit("set REDIS_URL: the counters under test live in Redis")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()
    result = asyncio.run(_run(args, url))
    print(markdown_table(["counters", "CPU per request over no limits (us)", "Redis calls per request"],
                         [["baseline " + args.baseline, f"{result['cpu_us_per_request']['baseline']:.1f}", "1"],
                          ["leased (this tree)", f"{result['cpu_us_per_request']['leased']:.1f}",
                           f"{result['leased_script_calls_per_request']:.4f}"]]))
    log(f"wrote {write_result(args.out_dir, 'quota_cost', MODULE, argv, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
