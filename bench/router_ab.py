"""Router A/B: this tree's router against the router of a git revision, on the same workers, alternating.

The router's costs are small next to the shared machine's swings (other jobs change the load 2-4x
within minutes), so a before/after claim needs both routers measured in the same run. One prefill
and one decode worker (this tree, tiny model) serve two routers: the baseline's (started from a
git worktree of ``--baseline``) and this tree's. Each round measures, for each router in turn and
then the workers directly: requests/s of 16 closed-loop clients (2-token ``/generate``) and the
router's CPU per request, then a block of streamed 1- and 64-token requests at one client (CPU per
streamed token). Results are the medians over rounds of each round's figures.

    .venv/bin/python -m bench.router_ab --baseline HEAD~3 --rounds 3     # ~4 minutes
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import (
    Platform,
    base_parser,
    log,
    markdown_table,
    median,
    note_shared_machine,
    parse_args,
    platform_processes,
    print_header,
    process_cpu_seconds,
    ratio,
    synthetic_prompts,
    tiny_model_dir,
    write_result,
)
from bench.engine_ab import baseline_tree
from bench.router_overhead import _session, throughput, via_router_sse
from tests.support.processes import die_with_parent

MODULE = "bench.router_ab"


def start_baseline_router(tree: Path, plat: Platform, log_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The baseline revision's router (its own code, from its worktree) on the same workers."""
    import httpx

    from tests.support.processes import free_port

    port = free_port()
    log_file = open(log_dir / f"router-baseline-{port}.log", "wb")  # noqa: SIM115  lives as long as the process
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "inference.launch_router", "--listen-port", str(port), "--host", "127.0.0.1",
         "--prefill-endpoint", plat.prefill_url, "--decode-endpoint", plat.decode_url],
        cwd=tree, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=die_with_parent())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # bounded: 60 s to come up
        if proc.poll() is not None:
            raise RuntimeError(f"baseline router exited with {proc.returncode}; see {log_file.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("baseline router did not answer /health within 60 s")


async def streamed_cpu(plat: Platform, prompts: list[list[int]], requests: int) -> float:
    """Router CPU µs per streamed token: `requests` SSE requests of 64 tokens minus as many of 1."""
    assert plat.router_pid is not None
    cpu: dict[int, float] = {}
    async with _session() as client:
        for i in range(3):  # warm-up
            await via_router_sse(client, plat, prompts[i], 4)
        for max_tokens in (1, 64):
            before = process_cpu_seconds(plat.router_pid)
            for i in range(requests):
                await via_router_sse(client, plat, prompts[i % len(prompts)], max_tokens)
            cpu[max_tokens] = (process_cpu_seconds(plat.router_pid) - before) / requests
    return (cpu[64] - cpu[1]) * 1e6 / 63


def main(argv: list[str] | None = None) -> int:
    """Run the A/B, print the table, write JSON."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="git revision of the baseline router")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=6.0, help="seconds per closed-loop block")
    p.add_argument("--concurrency", type=int, default=16)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rounds, seconds, stream_requests = (1, 1.0, 4) if args.quick else (args.rounds, args.seconds, 40)
    tree = baseline_tree(args.baseline)
    model = args.model_dir or tiny_model_dir()
    from inference.engine.config import ModelConfig

    prompts = synthetic_prompts(16, 32, ModelConfig.from_pretrained(str(model)).vocab_size, seed=7)
    extra = ["--num-threads", "1"]
    rows: dict[str, list[dict[str, float]]] = {"baseline": [], "current": []}
    with platform_processes(model, args.log_dir, prefill_extra=[*extra, "--base-cpu-id", "0"],
                            decode_extra=[*extra, "--base-cpu-id", str(1 % (os.cpu_count() or 1))]) as cur:
        base_proc, base_url = start_baseline_router(tree, cur, args.log_dir)
        try:
            plats = {"baseline": Platform(base_url, cur.prefill_url, cur.decode_url, base_proc.pid),
                     "current": cur}
            for r in range(rounds):
                direct = asyncio.run(throughput(cur, prompts, 2, args.concurrency, seconds, "direct"))
                for name, plat in plats.items():
                    t = asyncio.run(throughput(plat, prompts, 2, args.concurrency, seconds, "router"))
                    rows[name].append({
                        "requests_per_s": t["requests_per_s"],
                        "ratio_to_direct": ratio(t["requests_per_s"], direct["requests_per_s"]) or 0.0,
                        "cpu_ms_per_request": t["cpu_ms_per_request"].get("router", 0.0),
                        "cpu_us_per_streamed_token": asyncio.run(streamed_cpu(plat, prompts, stream_requests)),
                        "errors": t["errors"],
                    })
                    log(f"round {r + 1} {name}: {rows[name][-1]}")
        finally:
            base_proc.terminate()
            try:
                base_proc.wait(10)
            except subprocess.TimeoutExpired:
                base_proc.kill()
    keys = ["requests_per_s", "ratio_to_direct", "cpu_ms_per_request", "cpu_us_per_streamed_token"]
    summary = {name: {k: median([row[k] for row in rows[name]]) for k in keys} for name in rows}
    result = {"note": note_shared_machine(), "baseline": args.baseline, "model": model.name,
              "concurrency": args.concurrency, "rounds": rows, "median": summary,
              "current_over_baseline": {k: ratio(summary["current"][k], summary["baseline"][k]) for k in keys}}
    print_header("router A/B")
    print(markdown_table(["router", f"req/s at c={args.concurrency}", "÷ direct", "router CPU ms/req",
                          "CPU µs per streamed token (1 stream)"],
                         [[name, f"{s['requests_per_s']:.1f}", f"{s['ratio_to_direct']:.2f}",
                           f"{s['cpu_ms_per_request']:.3f}", f"{s['cpu_us_per_streamed_token']:.1f}"]
                          for name, s in summary.items()]))
    name = "router_ab_quick" if args.quick else "router_ab"
    path = write_result(args.out_dir, name, MODULE, argv, result)
    print(f"\nresult: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
