"""Engine A/B: this working tree's engine against a baseline git revision, side by side in one run.

On a shared machine, absolute timings drift by several times within minutes, so the two engines are
measured alternately: each round runs the baseline and then every variant of the current tree, each in
a fresh process (the baseline from a git worktree of ``--baseline``), and the result is the median
over rounds of each side's numbers and of the per-round ratios to the baseline.

Measured per side (one torch thread): output tok/s of ``LLMEngine.generate`` with ``c`` requests in
flight (greedy, fixed output length), and the median decode step with mixed contexts (one long
sequence among 31 short ones: the case where padding every sequence to the longest hurt most).

    .venv/bin/python -m bench.engine_ab --baseline 16df5f7          # tiny + SmolLM2, ~10 minutes
    .venv/bin/python -m bench.engine_ab --baseline 16df5f7 --quick  # tiny only, one round
    .venv/bin/python -m bench.engine_ab --baseline b8b05b5 --baseline-dtype auto --variants auto --tiny hd64

A switch of the same tree (`--baseline .`: the working tree on both sides) is A/B'd with environment
variables per side, e.g. the AMX-tile GEMM against oneDNN's kernel in bf16:

    .venv/bin/python -m bench.engine_ab --baseline . --baseline-env INFERENCE_AMX_GEMM=0 \
        --baseline-dtype bfloat16 --variants bfloat16 --models smollm2 --smollm2-levels 8,32,64
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    SCRATCH_DIR,
    base_parser,
    log,
    markdown_table,
    median,
    parse_args,
    print_header,
    smollm2_dir,
    tiny_llama_hd64_dir,
    tiny_model_dir,
    write_result,
)

MODULE = "bench.engine_ab"

# Runs inside each measured tree; only uses engine APIs that both sides have.
CHILD = r"""
import json, sys, time, random, torch
torch.set_num_threads(1)
from inference.engine import LLMEngine, SamplingParams
cfg = json.loads(sys.argv[1])
dtype = torch.float32 if cfg["dtype"] == "float32" else cfg["dtype"]
levels, out_tokens, prompt_len, long_len = cfg["levels"], cfg["max_tokens"], cfg["prompt_len"], cfg["long_len"]
engine = LLMEngine(cfg["model"], block_size=16, max_num_seqs=max(max(levels), 32),
                   max_model_len=long_len + 64, dtype=dtype)
vocab = engine.config.vocab_size
rng = random.Random(1)
prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(max(levels))]
params = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True)
engine.generate(prompts[:2], params)  # warm-up
res = {"dtype": str(getattr(engine, "dtype", torch.float32)).removeprefix("torch.")}
for c in levels:
    t = time.perf_counter()
    n = sum(len(r.token_ids) for r in engine.generate(prompts[:c], params))
    res[f"tok_s_c{c}"] = n / (time.perf_counter() - t)
long_prompt = [rng.randrange(3, vocab) for _ in range(long_len)]
sp = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
for i, p in enumerate([long_prompt] + prompts[:31]):
    engine.add_request(f"m{i}", p, sp)
while engine.num_running < 32:
    engine.step()
engine.step()
steps = []
for _ in range(cfg["steps"]):
    t = time.perf_counter()
    engine.step()
    steps.append((time.perf_counter() - t) * 1000)
res["mixed_step_ms"] = sorted(steps)[len(steps) // 2]
print("RESULT " + json.dumps(res))
"""


def baseline_tree(rev: str) -> Path:
    """A detached git worktree of `rev` under var/bench/ab (created once)."""
    tree = SCRATCH_DIR / "ab" / rev
    if not (tree / "inference").is_dir():
        tree.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=ROOT, check=True,
                       capture_output=True)
    return tree


def measure(tree: Path, cfg: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the child measurement in `tree` (its own process, its own imports), with `env` added to its
    environment."""
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], cwd=tree, capture_output=True,
                          text=True, env={"PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
                                          **(env or {})},
                          timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT "):]))
    raise RuntimeError(f"measurement in {tree} failed:\n{proc.stderr[-3000:]}")


def compare(name: str, model: Path, baseline: Path, current: Path, variants: list[str], rounds: int,
            levels: list[int], max_tokens: int, steps: int, baseline_dtype: str = "float32",
            envs: tuple[dict[str, str], dict[str, str]] = ({}, {})) -> dict[str, Any]:
    """Alternate the baseline (in `baseline_dtype`) and each current-tree variant for `rounds` rounds;
    `envs`: what the baseline's and the current side's processes get added to their environment."""
    base_label = f"baseline {baseline_dtype}"
    sides = [(base_label, baseline, baseline_dtype)] + [(f"current {v}", current, v) for v in variants]
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in sides}
    for r in range(rounds):
        for label, tree, dtype in sides:
            cfg = {"model": str(model), "dtype": dtype, "levels": levels, "max_tokens": max_tokens,
                   "prompt_len": 32, "long_len": 1024, "steps": steps}
            runs[label].append(measure(tree, cfg, envs[0] if label == base_label else envs[1]))
            log(f"[{name}] round {r + 1} {label}: {runs[label][-1]}")
    metrics = [f"tok_s_c{c}" for c in levels] + ["mixed_step_ms"]
    summary: dict[str, Any] = {}
    for label, _, _ in sides:
        summary[label] = {m: median([run[m] for run in runs[label]]) for m in metrics}
        summary[label]["dtype"] = runs[label][0]["dtype"]
        base = runs[base_label]
        summary[label]["ratio_vs_baseline"] = {
            m: median([run[m] / b[m] for run, b in zip(runs[label], base, strict=True)]) for m in metrics
        }
    return {"model": name, "rounds": rounds, "levels": levels, "max_tokens": max_tokens, "sides": summary,
            "runs": runs}


def env_pairs(p: Any, pairs: list[str]) -> dict[str, str]:
    """KEY=VALUE flags as a dict (a malformed one is a usage error)."""
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            p.error(f"expected KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run the comparisons, print a table, write the JSON."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="git revision of the baseline engine ('.': the working tree)")
    p.add_argument("--baseline-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the baseline's processes (repeatable), e.g. INFERENCE_AMX_GEMM=0")
    p.add_argument("--current-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the current side's processes (repeatable)")
    p.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    p.add_argument("--smollm2-levels", default="8,32", help="requests in flight measured on SmolLM2")
    p.add_argument("--current", default=None,
                   help="git revision to measure as current (default: the working tree, which must then "
                   "not change during the run)")
    p.add_argument("--variants", default="float32,auto", help="dtypes of the current tree to measure")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline-dtype", default="float32", help="dtype of the baseline engine (e.g. auto)")
    p.add_argument("--tiny", choices=["hd16", "hd64"], default="hd16",
                   help="tiny model: hidden 64 / head_dim 16 (default) or hidden 256 / head_dim 64 (vLLM runs it)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    baseline = ROOT if args.baseline == "." else baseline_tree(args.baseline)
    current = baseline_tree(args.current) if args.current else ROOT
    variants = [v for v in args.variants.split(",") if v]
    envs = (env_pairs(p, args.baseline_env), env_pairs(p, args.current_env))
    wanted = {m for m in args.models.split(",") if m}
    tiny = ("tiny-llama-hd64", tiny_llama_hd64_dir()) if args.tiny == "hd64" else ("tiny-llama", tiny_model_dir())
    models: list[tuple[str, Path, list[int], int, int]] = []
    if "tiny" in wanted or args.quick:
        models.append((*tiny, [8, 32, 64], 64, 40))
    smol = smollm2_dir()
    if smol is not None and not args.quick and "smollm2" in wanted:
        models.append(("SmolLM2-135M", smol, [int(c) for c in args.smollm2_levels.split(",") if c], 16, 8))
    rounds = 1 if args.quick else args.rounds
    results = [compare(n, m, baseline, current, variants, rounds, lv, mt, st, args.baseline_dtype, envs)
               for n, m, lv, mt, st in models]
    print_header(f"engine A/B against {args.baseline}")
    for res in results:
        metrics = [f"tok_s_c{c}" for c in res["levels"]] + ["mixed_step_ms"]
        rows = [[label, s["dtype"], *[f"{s[m]:.1f} ({s['ratio_vs_baseline'][m]:.2f}x)" for m in metrics]]
                for label, s in res["sides"].items()]
        print(f"\n**{res['model']}**, median of {res['rounds']} alternating rounds (ratio to baseline)\n")
        print(markdown_table(["engine", "dtype", *metrics], rows))
    path = write_result(args.out_dir, "engine_ab_quick" if args.quick else "engine_ab", MODULE, argv,
                        {"baseline": args.baseline, "current": args.current or "working tree",
                         "baseline_env": envs[0], "current_env": envs[1], "models": results})
    print(f"\nresult: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
