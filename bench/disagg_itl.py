"""Decode ITL while long prefills arrive: colocated against disaggregated prefill/decode.

One arrival pattern, replayed against each configuration for the same wall time:

- ``streams`` closed-loop short requests (short prompt, fixed output length, ``ignore_eos``): as
  soon as one ends the next starts; these are the decode streams whose inter-token latency (ITL)
  we watch;
- every ``period`` seconds a long prompt (alternately ``long_lengths``, e.g. 1k and 2k tokens,
  a few output tokens).

Configurations:

- ``colocated-1core`` / ``colocated-2cores``: one ``LLMEngine`` in this process doing prefill and
  decode, driven by ``step()``, pinned to CPU 0 with one torch thread, or to CPUs 0-1 with two.
  A long prompt's prefill runs as one step, so every running stream waits for it: the interference
  disaggregation removes. Tokens are timed when ``step()`` returns them (no HTTP, no router),
  which flatters these configurations.
- ``pair-one-core``: the real router with a prefill and a decode worker both pinned to CPU 0
  (``--base-cpu-id 0 --num-threads 1``): the same CPU as ``colocated-1core``, split by the OS.
- ``disaggregated``: the real router with the prefill worker pinned to CPU 0 and the decode worker
  to CPU 1 (``--base-cpu-id 0/1 --num-threads 1``): the same CPUs as ``colocated-2cores``.
  Client-side timing over SSE for both worker-pair configurations.

Reported: ITL p50/p99 of the short streams, TTFT of both kinds, and goodput: requests per second
that met the SLO given by ``--slo-ttft-short``, ``--slo-ttft-long`` and ``--slo-itl`` (every gap
between two tokens of the request at most that long).

    .venv/bin/python -m bench.disagg_itl            # tiny model, about 5 minutes
    .venv/bin/python -m bench.disagg_itl --quick    # tiny model, short run
"""
from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    add_attach_args,
    base_parser,
    fmt,
    log,
    markdown_table,
    new_figure,
    note_shared_machine,
    parse_args,
    platform_processes,
    print_header,
    ratio,
    save_figure,
    stream_generate,
    synthetic_prompts,
    tiny_model_dir,
    torch_threads,
    write_result,
)

MODULE = "bench.disagg_itl"


@dataclass
class Pattern:
    """The arrival pattern every configuration replays."""

    duration_s: float
    streams: int
    short_prompt: int
    short_tokens: int
    period_s: float
    long_lengths: list[int]
    long_tokens: int
    vocab_size: int

    def long_arrivals(self) -> list[tuple[float, list[int]]]:
        """(offset in seconds, prompt ids) of each long prompt: the first after half a period."""
        out = []
        t, k = self.period_s / 2, 0
        while t < self.duration_s:
            length = self.long_lengths[k % len(self.long_lengths)]
            out.append((t, synthetic_prompts(1, length, self.vocab_size, seed=1000 + k)[0]))
            t += self.period_s
            k += 1
        return out

    def short_prompt_ids(self, index: int) -> list[int]:
        """The `index`-th short prompt (deterministic)."""
        return synthetic_prompts(1, self.short_prompt, self.vocab_size, seed=index)[0]


@dataclass
class Slo:
    """Service-level objective of one request."""

    ttft_short_s: float
    ttft_long_s: float
    itl_s: float

    def met(self, rec: Any, kind: str) -> bool:
        """Whether a finished request met its TTFT bound and every gap stayed under the ITL bound."""
        if not rec.ok or rec.ttft_s is None:
            return False
        bound = self.ttft_short_s if kind == "short" else self.ttft_long_s
        return bool(rec.ttft_s <= bound and (not rec.itls_s or max(rec.itls_s) <= self.itl_s))


# --------------------------------------------------------------------------------------- colocated


def run_colocated(model_dir: Path, pattern: Pattern, cpus: list[int]) -> tuple[list[Any], list[str], float]:
    """Replay the pattern on one in-process engine driven by `step()`, pinned to `cpus` with one torch
    thread per CPU (as a worker's --base-cpu-id/--num-threads would); records and their kinds."""
    cpus = sorted(set(cpus))
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        return _drive_engine(model_dir, pattern, len(cpus))
    finally:
        os.sched_setaffinity(0, affinity)


def _drive_engine(model_dir: Path, pattern: Pattern, threads: int) -> tuple[list[Any], list[str], float]:
    """The closed-loop replay itself (see `run_colocated`)."""
    from inference.engine import LLMEngine, SamplingParams
    from inference.tools.load_test import RequestRecord

    max_len = max(pattern.long_lengths) + pattern.long_tokens + 8
    with torch_threads(threads):
        engine = LLMEngine(str(model_dir), max_num_seqs=32, max_model_len=max_len)
        engine.generate([pattern.short_prompt_ids(0)], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        short_params = SamplingParams(max_tokens=pattern.short_tokens, temperature=0.0, ignore_eos=True)
        long_params = SamplingParams(max_tokens=pattern.long_tokens, temperature=0.0, ignore_eos=True)
        arrivals = pattern.long_arrivals()
        records: dict[str, Any] = {}
        kinds: dict[str, str] = {}
        starts: dict[str, float] = {}
        last_token: dict[str, float] = {}
        active_short = 0
        index = 0
        t0 = time.perf_counter()
        hard_stop = t0 + pattern.duration_s + 120  # drain bound

        def submit(kind: str, prompt: list[int], params: SamplingParams, now: float) -> None:
            nonlocal index
            rid = f"{kind}-{index}"
            records[rid] = RequestRecord(index=index, start_s=now - t0)
            kinds[rid] = kind
            starts[rid] = now
            index += 1
            engine.add_request(rid, prompt, params)

        while time.perf_counter() < hard_stop:
            now = time.perf_counter()
            running_time = now - t0 < pattern.duration_s
            while arrivals and arrivals[0][0] <= now - t0:
                submit("long", arrivals.pop(0)[1], long_params, now)
            while running_time and active_short < pattern.streams:  # closed loop: refill at once
                submit("short", pattern.short_prompt_ids(index), short_params, now)
                active_short += 1
            if not engine.has_work():
                if not running_time and not arrivals:
                    break
                time.sleep(0.001)
                continue
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                rec = records.get(out.request_id)
                if rec is None:
                    continue
                n = len(out.new_token_ids)
                if n:
                    if rec.ttft_s is None:
                        rec.ttft_s = now - starts[out.request_id]
                    else:
                        rec.itls_s.extend([(now - last_token[out.request_id]) / n] * n)
                    last_token[out.request_id] = now
                    rec.output_tokens += n
                if out.finished:
                    rec.finish_reason = out.finish_reason
                    rec.ok = out.finish_reason in ("stop", "length")
                    rec.e2e_s = now - starts[out.request_id]
                    if kinds[out.request_id] == "short":
                        active_short -= 1
        wall = time.perf_counter() - t0
    ordered = sorted(records, key=lambda r: records[r].index)
    return [records[r] for r in ordered], [kinds[r] for r in ordered], wall


# ------------------------------------------------------------------------------------ real processes


async def _replay_http(router_url: str, pattern: Pattern) -> tuple[list[Any], list[str], float]:
    import httpx

    records: list[tuple[Any, str]] = []
    t0 = time.perf_counter()
    counter = iter(range(10**9))
    limits = httpx.Limits(max_connections=pattern.streams + 16)
    async with httpx.AsyncClient(limits=limits, timeout=300, trust_env=False) as client:

        async def short_loop() -> None:
            while time.perf_counter() - t0 < pattern.duration_s:
                i = next(counter)
                body = {"input_ids": pattern.short_prompt_ids(i), "max_tokens": pattern.short_tokens,
                        "temperature": 0, "ignore_eos": True}
                records.append((await stream_generate(client, router_url, body, i, t0), "short"))

        async def long_one(offset: float, ids: list[int]) -> None:
            await asyncio.sleep(max(0.0, offset - (time.perf_counter() - t0)))
            body = {"input_ids": ids, "max_tokens": pattern.long_tokens, "temperature": 0, "ignore_eos": True}
            records.append((await stream_generate(client, router_url, body, next(counter), t0), "long"))

        tasks = [short_loop() for _ in range(pattern.streams)]
        tasks += [long_one(t, ids) for t, ids in pattern.long_arrivals()]
        await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    records.sort(key=lambda rk: rk[0].index)
    return [r for r, _ in records], [k for _, k in records], wall


def run_pair(model_dir: Path, pattern: Pattern, log_dir: Path, prefill_cpu: int, decode_cpu: int,
             attach: Any = None) -> tuple[list[Any], list[str], float]:
    """Replay the pattern through the router against a prefill and a decode worker on given CPUs."""
    import httpx

    # A long lease: on a busy shared machine a 2k-token prefill on one core can take many seconds.
    ctx = ["--context-length", str(max(pattern.long_lengths) + pattern.long_tokens + 8), "--num-threads", "1",
           "--kv-lease-timeout", "180"]
    with platform_processes(model_dir, log_dir, prefill_extra=[*ctx, "--base-cpu-id", str(prefill_cpu)],
                            decode_extra=[*ctx, "--base-cpu-id", str(decode_cpu)], attach=attach) as plat:
        # Warm-up: one request of each kind, so first-call costs are not in the measurement.
        with httpx.Client(timeout=300, trust_env=False) as client:
            for ids in (pattern.short_prompt_ids(10**6), pattern.long_arrivals()[0][1][:256]):
                client.post(plat.router_url + "/generate",
                            json={"input_ids": ids, "max_tokens": 2, "temperature": 0}).raise_for_status()
        return asyncio.run(_replay_http(plat.router_url, pattern))


# ------------------------------------------------------------------------------------------ report


def summarize_config(name: str, records: list[Any], kinds: list[str], wall: float, slo: Slo) -> dict[str, Any]:
    """Per-kind load_test summaries plus SLO attainment and goodput."""
    from inference.tools.load_test import summarize

    short = [r for r, k in zip(records, kinds, strict=True) if k == "short"]
    long = [r for r, k in zip(records, kinds, strict=True) if k == "long"]
    met = sum(slo.met(r, k) for r, k in zip(records, kinds, strict=True))
    s_sum, l_sum = summarize(short, wall), summarize(long, wall)
    return {
        "config": name,
        "wall_s": wall,
        "requests": len(records),
        "errors": sum(not r.ok for r in records),
        "short": {"count": len(short), "ttft_ms": s_sum["ttft_ms"], "itl_ms": s_sum["itl_ms"],
                  "output_tokens_per_s": s_sum["output_tokens_per_s"],
                  "slo_met": sum(slo.met(r, "short") for r in short)},
        "long": {"count": len(long), "ttft_ms": l_sum["ttft_ms"], "slo_met": sum(slo.met(r, "long") for r in long)},
        "slo_met": met,
        "slo_attainment": met / len(records) if records else None,
        "goodput_req_s": met / wall if wall else None,
        "itl_max_ms": max((v * 1000 for r in short for v in r.itls_s), default=None),
        # 201 quantiles of every gap (0 %, 0.5 %, ..., 100 %): the CDF plot without thousands of numbers.
        "itl_cdf_ms": itl_quantiles([v * 1000 for r in short for v in r.itls_s]),
    }


def itl_quantiles(values_ms: list[float], points: int = 201) -> list[float]:
    """`points` evenly spaced quantiles (0..100 %) of the values, rounded to µs; [] for none."""
    if not values_ms:
        return []
    ordered = sorted(values_ms)
    n = len(ordered)
    return [round(ordered[min(n - 1, round(i * (n - 1) / (points - 1)))], 3) for i in range(points)]


def _tables(result: dict[str, Any]) -> str:
    rows = []
    base = result["configs"][0]
    for c in result["configs"]:
        rows.append([
            c["config"], c["short"]["count"], fmt(c["short"]["itl_ms"]["p50"], 1), fmt(c["short"]["itl_ms"]["p99"], 1),
            fmt(ratio(c["short"]["itl_ms"]["p99"], base["short"]["itl_ms"]["p99"])),
            fmt(c["itl_max_ms"], 0),
            fmt(c["short"]["ttft_ms"]["p50"], 0), fmt(c["short"]["ttft_ms"]["p99"], 0),
            c["long"]["count"], fmt(c["long"]["ttft_ms"]["p50"], 0),
            f"{c['slo_met']}/{c['requests']}", fmt(c["goodput_req_s"]),
            fmt(ratio(c["goodput_req_s"], base["goodput_req_s"])), fmt(c["short"]["output_tokens_per_s"], 0),
            c["errors"],
        ])
    return markdown_table(
        ["config", "short reqs", "ITL p50 ms", "ITL p99 ms", "ITL p99 × first row", "ITL max ms", "TTFT p50 ms (short)",
         "TTFT p99 ms (short)", "long reqs", "TTFT p50 ms (long)", "met SLO", "goodput req/s",
         "goodput × first row", "short tok/s", "errors"], rows)


def _plot(result: dict[str, Any], img_dir: Path, name: str) -> Path:
    fig, (ax_cdf, ax_bar) = new_figure(12, 4.5, ncols=2)
    for c in result["configs"]:
        cdf = c["itl_cdf_ms"]
        if cdf:
            ax_cdf.plot(cdf, [i / (len(cdf) - 1) for i in range(len(cdf))], label=c["config"])
    ax_cdf.set(xscale="log", xlabel="inter-token latency of short streams (ms)", ylabel="fraction of tokens",
               title="ITL distribution while long prompts arrive")
    ax_cdf.axvline(result["slo"]["itl_s"] * 1000, color="grey", linestyle=":", label="ITL SLO")
    names = [c["config"] for c in result["configs"]]
    xs = list(range(len(names)))
    p99 = [c["short"]["itl_ms"]["p99"] or 0 for c in result["configs"]]
    worst = [c["itl_max_ms"] or 0 for c in result["configs"]]
    good = [c["goodput_req_s"] or 0 for c in result["configs"]]
    # Log scale: a colocated prefill stall is orders of magnitude above a normal token gap.
    ax_bar.bar([x - 0.2 for x in xs], p99, width=0.4, color="tab:orange", label="ITL p99")
    ax_bar.bar([x + 0.2 for x in xs], worst, width=0.4, color="tab:red", label="ITL max")
    ax_bar.set_xticks(xs, names, fontsize=8)
    ax_bar.set(yscale="log", ylabel="ms", title="ITL p99 / max (bars), goodput (line)")
    ax_bar.legend(fontsize=8, loc="upper left")
    ax_good = ax_bar.twinx()
    ax_good.plot(xs, good, "o-", color="tab:green", label="goodput req/s")
    ax_good.set_ylabel("goodput (requests/s meeting SLO)")
    ax_cdf.grid(True, which="both", alpha=0.3)
    ax_cdf.legend(fontsize=8)
    ax_good.legend(fontsize=8, loc="upper right")
    return save_figure(fig, img_dir, name)


def main(argv: list[str] | None = None) -> int:
    """Run every configuration, print the table, write JSON and the plot."""
    p = base_parser(__doc__.splitlines()[0])
    add_attach_args(p)
    p.add_argument("--duration-s", type=float, default=None, help="length of each replay (default 30, quick 6)")
    p.add_argument("--slo-ttft-short", type=float, default=None, help="TTFT bound of short requests (s)")
    p.add_argument("--slo-ttft-long", type=float, default=None, help="TTFT bound of long requests (s)")
    p.add_argument("--slo-itl", type=float, default=None, help="bound on every inter-token gap (s)")
    p.add_argument("--period-s", type=float, default=None, help="seconds between long prompts")
    p.add_argument("--long-lengths", default=None, help="comma list of long prompt lengths, used in turn")
    p.add_argument("--streams", type=int, default=None, help="closed-loop short streams")
    p.add_argument("--short-tokens", type=int, default=None, help="output tokens of each short request")
    p.add_argument("--tag", default="", help="suffix of the result name (e.g. smollm2)")
    p.add_argument("--configs", default=None, help="comma list of: colocated-1core, pair-one-core, "
                   "colocated-2cores, disaggregated")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.quick:
        model = args.model_dir or tiny_model_dir()
        vocab = 512
        pattern = Pattern(args.duration_s or 6.0, streams=2, short_prompt=16, short_tokens=16, period_s=2.0,
                          long_lengths=[256, 512], long_tokens=4, vocab_size=vocab)
        slo = Slo(args.slo_ttft_short or 0.5, args.slo_ttft_long or 2.0, args.slo_itl or 0.1)
        configs = ["colocated-1core", "disaggregated"]
    else:
        # The tiny model by default: on the shared 2-core machine one SmolLM2 prefill of 1k tokens on one
        # core takes ~10 s, so 1-2k prompts every few seconds overload every configuration and the
        # comparison degenerates into queueing (see docs/benchmarks.md). --model-dir selects another.
        model = args.model_dir or tiny_model_dir()
        pattern = Pattern(args.duration_s or 30.0, streams=4, short_prompt=48, short_tokens=64, period_s=4.0,
                          long_lengths=[1024, 2000], long_tokens=8, vocab_size=0)
        slo = Slo(args.slo_ttft_short or 0.5, args.slo_ttft_long or 3.0, args.slo_itl or 0.1)
        configs = ["colocated-1core", "pair-one-core", "colocated-2cores", "disaggregated"]
    if args.period_s:
        pattern.period_s = args.period_s
    if args.long_lengths:
        pattern.long_lengths = [int(x) for x in args.long_lengths.split(",")]
    if args.streams:
        pattern.streams = args.streams
    if args.short_tokens:
        pattern.short_tokens = args.short_tokens
    from inference.engine.config import ModelConfig

    pattern.vocab_size = ModelConfig.from_pretrained(str(model)).vocab_size
    if args.configs:
        configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.router_url and "pair-one-core" in configs:
        configs.remove("pair-one-core")  # attached processes cannot be re-pinned
    results = []
    for cfg in configs:
        log(f"[{cfg}] replaying {pattern.duration_s:.0f} s of traffic on {model.name}")
        if cfg == "colocated-1core":
            recs, kinds, wall = run_colocated(model, pattern, [0])
        elif cfg == "colocated-2cores":
            recs, kinds, wall = run_colocated(model, pattern, [0, 1 % (os.cpu_count() or 1)])
        elif cfg == "disaggregated":
            recs, kinds, wall = run_pair(model, pattern, args.log_dir, 0, 1 % (os.cpu_count() or 1), attach=args)
        elif cfg == "pair-one-core":
            recs, kinds, wall = run_pair(model, pattern, args.log_dir, 0, 0)
        else:
            raise SystemExit(f"unknown config {cfg!r}")
        results.append(summarize_config(cfg, recs, kinds, wall, slo))
        s = results[-1]
        log(f"[{cfg}] ITL p99 {fmt(s['short']['itl_ms']['p99'])} ms, goodput {fmt(s['goodput_req_s'])} req/s")
    result = {"note": note_shared_machine(), "model": model.name, "pattern": pattern.__dict__,
              "slo": slo.__dict__, "configs": results}
    name = ("disagg_itl_quick" if args.quick else "disagg_itl") + (f"_{args.tag}" if args.tag else "")
    print_header("decode ITL under long prefills")
    print(f"SLO: TTFT <= {slo.ttft_short_s} s (short) / {slo.ttft_long_s} s (long), every gap <= {slo.itl_s} s\n")
    print(_tables(result))
    plot = _plot(result, args.img_dir, name)
    path = write_result(args.out_dir, name, MODULE, argv, result | {"plot": str(plot)})
    print(f"\nresult: {path}\nplot: {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
