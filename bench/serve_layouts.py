"""How `bench.serve_vs_vllm` places our router and workers on a CPU host, and what the workers' per-step
timings say about the latency tails (issue 19).

Layouts (one thread per worker, `--dtype auto`):

- `split`: the prefill worker on CPU 0, one decode worker on CPU 1 (no core shared);
- `decode-per-cpu`: one decode worker per CPU at `--decode-nice`, the prefill worker beside the first
  (the layout of the fifth session: a prefill preempts that core's decode steps);
- `prefill-yields`: the same placement with the roles' priorities swapped: decode at nice 0, the
  prefill worker at `--prefill-nice`, so a decode step is never preempted by a prefill;
- `both-per-cpu`: one `--service-type both` worker per CPU and no prefill worker (a colocated pool:
  each worker prefills its own prompts), chunked prefill at `--prefill-budget` tokens per step with a
  decode step of the running batch after every prefill step, so no process preempts another and a
  decode waits for at most one budget's worth of prefill;
- `both-mixed`: the same workers with `--mixed-prefill`: every step one forward carrying the running
  batch's decode rows and up to `--mixed-budget` prompt tokens on top of them (measured beside
  `both-per-cpu` in one run);
- `both-burst`: `both-mixed` (at `--burst-budget` tokens a step when given) with the scheduler's burst
  rule on (`ENGINE_MIXED_BURST_TOKENS`, default `BURST_TOKENS`): while more prompts wait at a worker
  than streams run there, a step takes them all;
- `both-cost`: `both-burst` whose mixed steps take the prompt tokens that keep a step within
  `--step-target` on the step cost each worker measures (`--mixed-step-target`, step_cost.py) instead of
  the fixed budget (which they keep until the cost is measured); both-burst pins it off.
  `both-cost@<target>` (e.g. `both-cost@2x`) names its own target, so several run side by side.

The router in front of them balances by `--router-policy` (least-connections unless told: round-robin
let one worker collect 12-16 of 16 closed-loop streams in a thirteenth-session run).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import median, percentile

# The layout the benchmark measures unless told otherwise (README's recommended CPU layout: mixed steps of
# 64 prompt tokens with the burst rule, since the thirteenth session on Zen 4; their prompt tokens from the
# measured step cost at 2x the rows' decode step, since the fifteenth: on the shared 384-token prefix the
# fixed 64 tokens beside 6-7 rows took 139-157 ms, over vllm serve's ITL p99 of 132-137 ms, whenever a
# worker's arrivals drifted out of the waves, the measured budget 88-116 ms).
DEFAULT_LAYOUT = "both-cost"

# both-per-cpu's prefill tokens per step unless --prefill-budget says otherwise.
BOTH_BUDGET = 256
# both-mixed's prompt tokens per step (on top of the decode rows) unless --mixed-budget says otherwise.
MIXED_BUDGET = 64
# both-burst's cap on a burst step's prompt tokens (vllm serve's max_num_batched_tokens on a CPU).
BURST_TOKENS = 2048
# both-cost's --mixed-step-target unless --step-target says otherwise.
STEP_TARGET = "auto"
# The router's policy unless --router-policy says otherwise: by the requests each worker has in flight.
ROUTER_POLICY = "least-connections"

LAYOUTS = {
    "split": "prefill on CPU 0, one decode worker on CPU 1",
    "decode-per-cpu": "one decode worker per CPU (at --decode-nice), the prefill worker beside the first",
    "prefill-yields": "one decode worker per CPU at nice 0, the prefill worker beside the first at --prefill-nice",
    "both-per-cpu": "one --service-type both worker per CPU (local prefill, --prefill-budget tokens a step), "
                    "no prefill worker",
    "both-mixed": "both-per-cpu's workers with --mixed-prefill, --mixed-budget prompt tokens a step on top of "
                  "the decode rows",
    "both-burst": "both-mixed with the burst rule: while more prompts wait than streams run, a step takes "
                  f"them all (up to {BURST_TOKENS} tokens)",
    "both-cost": "both-burst with --mixed-step-target (--step-target): a mixed step's prompt tokens from the "
                 "measured step cost",
}


def split_layout(name: str) -> tuple[str, str | None]:
    """(layout, its own step target or None): `both-cost@2x` is ("both-cost", "2x")."""
    layout, _, target = name.partition("@")
    return layout, target or None


def worker_specs(layout: str, args: Any) -> list[tuple[str, list[str]]]:
    """(role, flags) of every worker of `layout`; the prefill worker first where there is one."""
    layout, own_target = split_layout(layout)
    cpus = os.cpu_count() or 1
    base = ["--num-threads", "1", "--dtype", "auto", "--context-length",
            str(args.prefix_len + args.input_len + args.output_len + 64), "--batch-size", str(max(args.concurrency))]
    if getattr(args, "mixed_prefill", False):  # prompt tokens in the decode batch's forward, every worker
        base.append("--mixed-prefill")
    # --prefill-budget for every worker that prefills; unset: the workers' default, both-per-cpu's BOTH_BUDGET.
    chosen = args.prefill_budget or (BOTH_BUDGET if layout == "both-per-cpu" else None)
    budget = ["--max-num-batched-tokens", str(chosen)] if chosen else []

    def at(cpu: int, nice: int) -> list[str]:
        return [*base, "--base-cpu-id", str(cpu % cpus), "--nice", str(nice)]

    if layout == "split":
        return [("prefill", [*at(0, 0), *budget]), ("decode", at(1, 0))]
    if layout == "decode-per-cpu":
        return [("prefill", [*at(0, 0), *budget])] + [("decode", at(c, args.decode_nice)) for c in range(cpus)]
    if layout == "prefill-yields":
        return [("prefill", [*at(0, args.prefill_nice), *budget])] + [("decode", at(c, 0)) for c in range(cpus)]
    if layout == "both-per-cpu":
        return [("both", [*at(c, args.both_nice), *budget]) for c in range(cpus)]
    if layout in ("both-mixed", "both-burst", "both-cost"):
        tokens = getattr(args, "mixed_budget", None) or MIXED_BUDGET
        if layout != "both-mixed":  # its own budget when given: the two measured side by side
            tokens = getattr(args, "burst_budget", None) or tokens
        target = own_target or getattr(args, "step_target", None) or STEP_TARGET
        target = target if layout == "both-cost" else "off"
        mixed = ["--mixed-prefill", "--max-num-batched-tokens", str(tokens), "--mixed-step-target", target]
        return [("both", [*at(c, args.both_nice), *mixed]) for c in range(cpus)]
    raise ValueError(f"unknown layout {layout!r}")


def layout_env(layout: str) -> dict[str, str]:
    """Environment `layout`'s workers start with on top of the benchmark's (the scheduler's switches):
    both-mixed keeps the mixed steps of the sessions before the burst rule whatever the engine's
    default, both-burst turns the rule on."""
    from inference.engine.scheduler import MIXED_BURST_ENV

    return {"both-mixed": {MIXED_BURST_ENV: "0"},
            "both-burst": {MIXED_BURST_ENV: str(BURST_TOKENS)},
            "both-cost": {MIXED_BURST_ENV: str(BURST_TOKENS)}}.get(split_layout(layout)[0], {})


@contextlib.contextmanager
def serving(layout: str, model: Path, log_dir: Path, args: Any, step_dir: Path | None,
            trace_dir: Path | None = None) -> Iterator[str]:
    """Start `layout`'s workers (in parallel) and the router in front of them; yield the router's URL;
    stop everything on exit. With `step_dir`, the workers log per-step timings there (ENGINE_STEP_LOG);
    with `trace_dir`, the workers and the router their tokens' timestamps (DELIVERY_TRACE)."""
    from inference.wire.delivery_trace import ENV as TRACE_ENV
    from tests.support.processes import Proc, start_router, start_worker

    traced = {TRACE_ENV: str(trace_dir)} if trace_dir is not None else {}
    env = {**layout_env(layout), **({"ENGINE_STEP_LOG": str(step_dir)} if step_dir is not None else {}), **traced}
    log_dir.mkdir(parents=True, exist_ok=True)  # a fresh clone has no var/bench/logs yet
    specs = worker_specs(layout, args)
    procs: list[Proc] = []
    try:
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = [pool.submit(start_worker, role, model, log_dir, extra=flags, env=env) for role, flags in specs]
        failed = None
        for fut in futures:
            if fut.exception() is None:
                procs.append(fut.result()[0])
            else:
                failed = failed or fut.exception()
        if failed is not None:
            raise failed
        urls = [fut.result()[1] for fut in futures]
        prefill = [url for (role, _), url in zip(specs, urls, strict=True) if role == "prefill"]
        decode = [url for (role, _), url in zip(specs, urls, strict=True) if role != "prefill"]
        router, router_url = start_router(prefill, decode, log_dir,
                                          policy=getattr(args, "router_policy", None) or ROUTER_POLICY, env=traced)
        procs.append(router)
        yield router_url
    finally:
        for proc in reversed(procs):
            proc.stop()


def step_summary(step_dir: Path, since: float) -> dict[str, Any]:
    """Per-step timings the workers logged after `since` (time.time()), per kind of step: decode-only
    steps, prefill steps; the longest run of prefill steps back to back; the slowest decode steps
    against the median decode step of the same batch size (a step far slower than its peers was
    preempted by another process on its core)."""
    decode: list[tuple[float, int]] = []
    prefill: list[tuple[float, int]] = []
    steps: list[dict[str, Any]] = []  # every step with decode rows: each row's gap is about its time
    longest_prefill_run = 0
    for path in sorted(step_dir.glob("steps-*.tsv")):
        run, runs = 0, 0  # prefill steps back to back on a worker that also decodes
        for line in path.read_text().splitlines():
            fields = line.split("\t")
            if len(fields) < 5 or float(fields[0]) < since:
                continue
            ms, tokens, n_decode = float(fields[1]), int(fields[2]), int(fields[4])
            if n_decode:
                rule = fields[5] if len(fields) > 5 and fields[5] != "-" else ("decode" if not tokens else "?")
                steps.append({"ms": ms, "tokens": tokens, "rows": n_decode, "rule": "decode" if not tokens else rule,
                              "waiting": int(fields[6]) if len(fields) > 6 else None})
            if tokens:
                prefill.append((ms, tokens))
                run += 1
            else:
                decode.append((ms, n_decode))
                runs, run = max(runs, run), 0
        longest_prefill_run = max(longest_prefill_run, runs)
    by_batch: dict[int, list[float]] = {}
    for ms, n in decode:
        by_batch.setdefault(n, []).append(ms)
    stretched = sorted((ms / (median(by_batch[n]) or ms), ms, n) for ms, n in decode)[-5:]
    return {
        "decode_steps": len(decode),
        "decode_ms_p50": median([ms for ms, _ in decode]),
        "decode_ms_p99": percentile([ms for ms, _ in decode], 99),
        "decode_ms_max": max((ms for ms, _ in decode), default=None),
        "prefill_steps": len(prefill),
        "prefill_ms_p50": median([ms for ms, _ in prefill]),
        "prefill_ms_max": max((ms for ms, _ in prefill), default=None),
        "prefill_tokens_max": max((t for _, t in prefill), default=None),
        "longest_prefill_run": longest_prefill_run,
        "slowest_decode_vs_batch_median": [{"x": round(x, 2), "ms": round(ms, 1), "batch": n}
                                           for x, ms, n in reversed(stretched)],
        "top_gaps": top_gaps(steps),
    }


def top_gaps(steps: list[dict[str, Any]], share: float = 0.01) -> dict[str, Any]:
    """Which steps make the slowest `share` of the inter-token gaps: a step with `rows` decode rows gives
    each of them a gap of about its own time, so the steps are taken slowest first, weighted by their
    rows, until they hold `share` of all rows. Per rule that set the step's prompt budget ("decode" for
    decode-only steps; the step log's StepPlan.rule): steps, gaps, their time range, prompt tokens and
    rows; `gap_ms` is the step time at the share's edge (about the client's ITL p99)."""
    total = sum(step["rows"] for step in steps)
    want = share * total
    taken = 0
    by_rule: dict[str, dict[str, Any]] = {}
    edge = None
    for step in sorted(steps, key=lambda st: -st["ms"]):
        if taken >= want:
            break
        taken += step["rows"]
        edge = step["ms"]
        entry = by_rule.setdefault(step["rule"], {"steps": 0, "gaps": 0, "ms": [], "tokens": [], "rows": [],
                                                  "waiting": []})
        entry["steps"] += 1
        entry["gaps"] += step["rows"]
        for key in ("ms", "tokens", "rows", "waiting"):
            if step[key] is not None:
                entry[key].append(step[key])
    for entry in by_rule.values():
        for key in ("ms", "tokens", "rows", "waiting"):
            values = entry.pop(key)
            entry[key] = [round(min(values), 1), round(max(values), 1)] if values else None
    return {"gaps": total, "gap_ms": edge, "by_rule": by_rule}
