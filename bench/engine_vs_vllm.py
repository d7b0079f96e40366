"""Our engine against vLLM, both in-process: `LLMEngine.generate` against vLLM's offline `LLM.generate`.

Same checkpoint, same token-id prompts, greedy with `ignore_eos` and a fixed output length, requests in
waves of exactly `concurrency` (8 / 32 / 64 in flight by default), every wave's prompts new to both
engines (no prefix-cache hits on either side). No HTTP on either side (the serving
comparison through `vllm serve` is bench/serve_vs_vllm.py and `engine_throughput --vllm`).

Each (model, dtype) pair runs our engine and vLLM alternately for `--rounds` rounds, each side in a
fresh process per round (vLLM's from bench/.venv-vllm; it loads, compiles and warms up once per process,
then measures). The ratio reported per concurrency is the median over rounds of ours ÷ vLLM in that
round, so that a shared machine's drift hits both alike. Our engine runs with one torch thread;
vLLM with `OMP_NUM_THREADS` = the same count, its own defaults otherwise (note: vLLM V1 runs its
scheduler and its model worker in separate processes, so it can overlap scheduling with the forward
on a second core; our engine is one process).

The same run also measures the core's GEMM peak in the dtype (bench.cpu_limits' probe, before and after
the rounds, the better kept) and counts the FLOP every request costs any engine (projections, LM head,
attention: `cpu_limits.request_gflop`), so each round reports both engines' GFLOP/s as a share of
that peak and the **ceiling**: peak ÷ vLLM's GFLOP/s, the most any engine could lead vLLM by in that
round. Where the ceiling is below a target ratio, the target needs more than the core can compute.

    .venv/bin/python -m bench.engine_vs_vllm                        # tiny hd64 + SmolLM2, bf16 and fp32
    .venv/bin/python -m bench.engine_vs_vllm --models tiny --dtypes bfloat16 --rounds 1
    .venv/bin/python -m bench.engine_vs_vllm --cpus 1      # both confined to one core
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    Deadline,
    base_parser,
    fmt,
    log,
    markdown_table,
    median,
    note_shared_machine,
    parse_args,
    print_header,
    smollm2_dir,
    synthetic_prompts,
    tiny_llama_hd64_dir,
    torch_threads,
    write_result,
)
from bench.cpu_limits import peak_gemm_gflops, request_gflop

MODULE = "bench.engine_vs_vllm"
VLLM_VENV = ROOT / "bench" / ".venv-vllm"
VLLM_CHILD = ROOT / "bench" / "vllm_offline_child.py"

# Our side: the same measurement as engine_throughput's, one fresh process per round.
OURS_CHILD = r"""
import json, math, sys, time
import torch
cfg = json.load(open(sys.argv[1]))
torch.set_num_threads(cfg["threads"])
from inference.engine import LLMEngine, SamplingParams
t0 = time.perf_counter()
engine = LLMEngine(cfg["model"], block_size=16, max_num_seqs=cfg["max_num_seqs"], max_model_len=cfg["max_model_len"],
                   dtype=cfg["dtype"])
load_s = time.perf_counter() - t0
params = SamplingParams(max_tokens=cfg["max_tokens"], temperature=0.0, ignore_eos=True)
prompts = cfg["prompts"]
engine.generate(prompts[:2], params)  # warm-up
rounds = []
for _ in range(cfg["rounds"]):
    row = {}
    for c in cfg["concurrency"]:
        waves = max(1, math.ceil(cfg["waves_min_requests"] / c))
        tokens = 0
        t = time.perf_counter()
        for w in range(waves):
            for res in engine.generate(cfg["wave_prompts"][str(c)][w * c:(w + 1) * c], params):
                tokens += len(res.token_ids)
        el = time.perf_counter() - t
        row[str(c)] = {"output_tokens": tokens, "seconds": el, "tokens_per_s": tokens / el}
    rounds.append(row)
first = engine.generate(prompts[:4], params)
print("RESULT " + json.dumps({"load_s": load_s, "rounds": rounds, "dtype": str(engine.dtype),
                              "greedy_tokens": [r.token_ids for r in first]}), flush=True)
"""

MODELS = {"tiny": "tiny-llama-hd64", "smollm2": "SmolLM2-135M"}


def child_envs(threads: int) -> tuple[dict[str, str], dict[str, str]]:
    """The environments of a measuring child with `threads` compute threads: the base both sides share
    (offline, quiet), and vLLM's (its CPU backend, no usage report, a 2 GiB KV space)."""
    base = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PATH": "/usr/bin:/bin",
            "OMP_NUM_THREADS": str(threads)}
    vllm = base | {"VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                   "CUDA_VISIBLE_DEVICES": "", "VLLM_CPU_KVCACHE_SPACE": "2", "HOME": str(Path.home())}
    return base, vllm


def run_child(args: list[str], cfg: dict[str, Any], env: dict[str, str], cwd: Path, timeout: float,
              cpus: set[int] | None = None) -> dict[str, Any]:
    """Run one measuring child with `cfg` in a temporary JSON file (pinned to `cpus`, with every process
    it starts, when given); its RESULT line, parsed."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg, f)
        path = f.name

    def pin() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    try:
        proc = subprocess.run([*args, path], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout,
                              preexec_fn=pin)
    finally:
        Path(path).unlink(missing_ok=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{args[0]} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return dict(json.loads(line[len("RESULT "):]))


def measure_pair(model_dir: Path, dtype: str, vllm_dtype: str, concurrency: list[int], max_tokens: int,
                 prompt_len: int, min_requests: int, rounds: int, threads: int, deadline: Deadline,
                 venv: Path = VLLM_VENV, cpus: set[int] | None = None) -> dict[str, Any]:
    """Alternating rounds of our engine and vLLM on one checkpoint; per concurrency the per-round
    tok/s of both and the median of ours ÷ vLLM."""
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    # Every wave of every concurrency gets prompts of its own, unseen by the warm-up and the waves
    # before it: an engine whose prefix cache kept an earlier wave's blocks would otherwise skip part
    # of the prefill (ours caches 16-token blocks; vLLM's CPU default is 128-token blocks, so a
    # 32-token prompt never hits there) and the ratio would measure the cache, not the engine.
    waves_of = {c: max(1, math.ceil(min_requests / c)) for c in concurrency}
    fresh = synthetic_prompts(sum(c * n for c, n in waves_of.items()), prompt_len, vocab, seed=2)
    wave_prompts, start = {}, 0
    for c in concurrency:
        wave_prompts[str(c)] = fresh[start:start + c * waves_of[c]]
        start += c * waves_of[c]
    cfg = {"model": str(model_dir), "prompts": synthetic_prompts(4, prompt_len, vocab, seed=1),
           "wave_prompts": wave_prompts,
           "max_tokens": max_tokens, "concurrency": concurrency, "waves_min_requests": min_requests,
           "rounds": 1, "max_model_len": prompt_len + max_tokens + 16, "max_num_seqs": max(concurrency),
           "threads": threads}
    base_env, vllm_env = child_envs(threads)
    if cpus:  # vLLM's own "auto" binding would pick its cores (and reserve one) by itself
        vllm_env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in sorted(cpus))
    ours: list[dict[str, Any]] = []
    theirs: list[dict[str, Any]] = []
    for r in range(rounds):
        if deadline.expired():
            log("time budget spent, stopping rounds")
            break
        ours.append(run_child([sys.executable, "-c", OURS_CHILD], cfg | {"dtype": dtype},
                              base_env | {"PYTHONPATH": str(ROOT)}, ROOT, 900, cpus))
        log(f"round {r + 1} ours ({ours[-1]['dtype']}): "
            + ", ".join(f"c={c} {v['tokens_per_s']:.0f}" for c, v in ours[-1]["rounds"][0].items()))
        # -P and cwd outside the repository: vLLM's venv must not import this repository's packages.
        theirs.append(run_child([str(venv / "bin" / "python"), "-P", str(VLLM_CHILD)], cfg | {"dtype": vllm_dtype},
                                vllm_env, Path(tempfile.gettempdir()), 1200, cpus))
        log(f"round {r + 1} vLLM ({vllm_dtype}, loaded in {theirs[-1]['load_s']:.0f} s): "
            + ", ".join(f"c={c} {v['tokens_per_s']:.0f}" for c, v in theirs[-1]["rounds"][0].items()))
    rows = []
    for c in concurrency:
        o = [x["rounds"][0][str(c)]["tokens_per_s"] for x in ours[: len(theirs)]]
        v = [x["rounds"][0][str(c)]["tokens_per_s"] for x in theirs]
        rows.append({"concurrency": c, "ours_tokens_per_s": o, "vllm_tokens_per_s": v,
                     "ratio_median": median([a / b for a, b in zip(o, v, strict=True)]),
                     "ours_median": median(o), "vllm_median": median(v),
                     # Best round of each: on a shared machine interference only ever slows a run down.
                     "ratio_best": max(o) / max(v) if o and v else None})
    same_greedy = bool(ours and theirs and ours[0]["greedy_tokens"] == theirs[0]["greedy_tokens"])
    return {"model_dir": str(model_dir), "cpus": sorted(cpus) if cpus else "all",
            "dtype": dtype, "vllm_dtype": vllm_dtype, "rounds": len(theirs),
            "prompt_tokens": prompt_len, "max_tokens": max_tokens, "rows": rows,
            "greedy_tokens_equal_first_4": same_greedy, "ours_runs": ours, "vllm_runs": theirs}


def add_compute_shares(result: dict[str, Any], model_dir: Path, peak_gflops: float, target: float = 1.5) -> None:
    """Per concurrency and round: each engine's GFLOP/s from its tok/s and the workload's FLOP per
    request, as a share of `peak_gflops`, and the ceiling peak ÷ vLLM's GFLOP/s (the best lead any engine
    could have had in that round) beside the share of the peak `target` x vLLM would have needed."""
    per_request = request_gflop(model_dir, result["prompt_tokens"], result["max_tokens"])
    result["request_gflop"] = per_request
    result["peak_gflops"] = peak_gflops
    for row in result["rows"]:
        def gflops(tps: list[float]) -> list[float]:
            return [t / result["max_tokens"] * per_request for t in tps]
        ours, theirs = gflops(row["ours_tokens_per_s"]), gflops(row["vllm_tokens_per_s"])
        row["ours_gflops"], row["vllm_gflops"] = ours, theirs
        row["ours_peak_share"] = [g / peak_gflops for g in ours]
        row["vllm_peak_share"] = [g / peak_gflops for g in theirs]
        row["ceiling_ratio"] = [peak_gflops / g for g in theirs]
        row["target_needs_peak_share"] = [target * g / peak_gflops for g in theirs]


def _compute_table(results: list[dict[str, Any]]) -> str:
    """Per round: both engines' share of the measured peak, the ceiling, and what 1.5x would need."""
    rows = []
    for res in results:
        if "peak_gflops" not in res:
            continue
        for r in res["rows"]:
            def pct(xs: list[float]) -> str:
                return " ".join(f"{100 * x:.0f}" for x in xs)
            rows.append([res["model"], res["dtype"], r["concurrency"], fmt(res["request_gflop"], 2),
                         fmt(res["peak_gflops"], 0), pct(r["ours_peak_share"]), pct(r["vllm_peak_share"]),
                         " ".join(f"{x:.2f}" for x in r["ceiling_ratio"]), pct(r["target_needs_peak_share"])])
    return markdown_table(["model", "dtype", "in flight", "GFLOP per request", "peak GFLOP/s",
                           "ours % of peak (per round)", "vLLM % of peak", "ceiling: peak ÷ vLLM",
                           "1.5x vLLM needs % of peak"], rows)


def _table(results: list[dict[str, Any]]) -> str:
    rows = []
    for res in results:
        for r in res["rows"]:
            rows.append([res["model"], f"{res['dtype']} / {res['vllm_dtype']}", r["concurrency"],
                         fmt(r["ours_median"], 0), fmt(r["vllm_median"], 0), fmt(r["ratio_median"]),
                         fmt(r["ratio_best"]),
                         " ".join(f"{a / b:.2f}" for a, b in zip(r["ours_tokens_per_s"], r["vllm_tokens_per_s"],
                                                                  strict=True))])
    return markdown_table(["model", "dtype ours / vLLM", "in flight", "ours tok/s", "vLLM tok/s",
                           "ours ÷ vLLM (median of rounds)", "best ÷ best", "per round"], rows)


def _peak(dtype: str, args: Any) -> dict[str, Any]:
    """The GEMM peak probe in `dtype` with the rounds' thread count (small and quick under --quick)."""
    with torch_threads(args.threads):
        probe = peak_gemm_gflops(dtype, 256 if args.quick else args.gemm_n, 2 if args.quick else 5)
    log(f"{dtype} GEMM peak {probe['gflops']:.0f} GFLOP/s ({probe['kernel']})")
    return probe


def main(argv: list[str] | None = None) -> int:
    """Run the pairs, print the table, write the JSON."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny (hd64 Llama), smollm2")
    p.add_argument("--dtypes", default="bfloat16,float32",
                   help="comma-separated dtypes; each runs both systems in it (auto is bf16 on AMX)")
    p.add_argument("--concurrency", default="8,32,64")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=1500.0)
    p.add_argument("--vllm-venv", type=Path, default=VLLM_VENV)
    p.add_argument("--name", default="engine_vs_vllm_inprocess", help="result file name (without .json)")
    p.add_argument("--no-peak", action="store_true",
                   help="skip the GEMM peak probe (and the shares of it) before and after each pair's rounds")
    p.add_argument("--gemm-n", type=int, default=2048, help="square GEMM size of the peak probe")
    p.add_argument("--cpus", default=None,
                   help="pin both systems (all their processes) to these CPUs, e.g. 1: vLLM runs its scheduler "
                   "and model worker in separate processes, so unpinned it can use a second core; ours cannot")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    deadline = Deadline(args.budget_s)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    results = []
    for key in [m.strip() for m in args.models.split(",") if m.strip()]:
        if key == "tiny":
            model_dir, max_tokens, min_requests = tiny_llama_hd64_dir(), 64, 64
        elif key == "smollm2":
            found = smollm2_dir()
            if found is None:
                log("SmolLM2 is not prepared (make demo-model); skipped")
                continue
            model_dir, max_tokens, min_requests = found, 32, 8
        else:
            raise SystemExit(f"unknown model {key!r}")
        if args.quick:
            concurrency, max_tokens, min_requests = [8], 8, 8
        for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
            if deadline.expired():
                break
            peaks = [] if args.no_peak else [_peak(dtype, args)]
            res = measure_pair(model_dir, dtype, dtype, concurrency, max_tokens, 32, min_requests,
                               1 if args.quick else args.rounds, args.threads, deadline, args.vllm_venv,
                               {int(c) for c in args.cpus.split(",")} if args.cpus else None)
            res["model"] = MODELS[key]
            if peaks:
                # Interference only ever slows a probe down: the better of the two is the core's peak.
                peaks.append(_peak(dtype, args))
                res["peak_probes"] = peaks
                add_compute_shares(res, model_dir, max(p["gflops"] for p in peaks))
            results.append(res)
    print_header("our engine vs vLLM offline, both in-process")
    print(_table(results))
    if any("peak_gflops" in r for r in results):
        print_header("against the core's GEMM peak (one thread)")
        print(_compute_table(results))
    path = write_result(args.out_dir, args.name, MODULE, argv,
                        {"note": note_shared_machine(), "threads": args.threads, "results": results})
    print(f"\nresult: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
