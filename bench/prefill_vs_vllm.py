"""Prefill speed against vLLM, both in-process: one `generate(max_tokens=1)` per set of fresh prompts.

Cases (default): 1 x 512, 4 x 512 and 1 x 2048 prompt tokens, random token ids (no prefix-cache hit on
either side: every set is new to the engine), greedy, one sampled token. Both engines get a token budget
of 2,048 a step (`max_num_batched_tokens`), so each case is one prefill step on both (`generate` turns
the engine's wave rule off, which would spread 4 x 512 over four steps). Each round runs our
engine and vLLM's offline `LLM` (bench/vllm_offline_child.py, from bench/.venv-vllm) in fresh processes,
alternating, one torch / OpenMP thread each; per case a warm-up call on prompts of its own, then
`--repeats` timed sets. Reported per case and round: the median call (ms, ms a prompt token) of each
and ours ÷ vLLM.

    .venv/bin/python -m bench.prefill_vs_vllm --rounds 3
    .venv/bin/python -m bench.prefill_vs_vllm --quick          # one round, one set, tiny model
    .venv/bin/python -m bench.prefill_vs_vllm --ours-env INFERENCE_AMX_GEMM=0   # a switch on our side

With `--baseline-env NAME=VALUE` (repeatable) each round also runs our engine with that environment (a
switch back to the previous behaviour) before ours, and the table adds ours ÷ baseline per round: an
A/B of the switch in the same run; `--baseline-tree DIR` runs the baseline from another checkout (a git
worktree of the previous commit: its engine and kernels), with or without an environment;
`--no-vllm` leaves vLLM out.

    .venv/bin/python -m bench.prefill_vs_vllm --no-vllm --baseline-tree ../wt-base   # this tree against another
"""
from __future__ import annotations

import json
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
    write_result,
)
from bench.engine_vs_vllm import VLLM_CHILD, VLLM_VENV, child_envs, run_child

MODULE = "bench.prefill_vs_vllm"
STEP_TOKENS = 2048

# Our side: the same calls as the vLLM child's prefill mode.
OURS_CHILD = r"""
import json, os, sys, time
import torch
cfg = json.load(open(sys.argv[1]))
torch.set_num_threads(cfg["threads"])
from inference.engine import LLMEngine, SamplingParams
t0 = time.perf_counter()
engine = LLMEngine(cfg["model"], block_size=16, max_num_seqs=cfg["max_num_seqs"], max_model_len=cfg["max_model_len"],
                   max_num_batched_tokens=cfg["max_num_batched_tokens"], dtype=cfg["dtype"])
load_s = time.perf_counter() - t0
params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
out = {}
for case in cfg["cases"]:
    engine.generate(case["warmup"], params)
    times = []
    for prompts in case["sets"]:
        t = time.perf_counter()
        engine.generate(prompts, params)
        times.append(time.perf_counter() - t)
    out[case["name"]] = times
print("RESULT " + json.dumps({"load_s": load_s, "cases": out, "dtype": str(engine.dtype)}), flush=True)
"""


def _ms(seconds: list[float]) -> float:
    """The median of `seconds`, in ms."""
    return 1e3 * (median(seconds) or 0.0)


def parse_cases(spec: str) -> list[tuple[str, int, int]]:
    """"1x512,4x512" -> [(name, prompts, tokens each), ...]."""
    out = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        n, _, length = part.partition("x")
        out.append((part, int(n), int(length)))
    return out


def case_configs(cases: list[tuple[str, int, int]], repeats: int, vocab: int) -> list[dict[str, Any]]:
    """Per case its warm-up prompts and `repeats` sets of prompts, all distinct (seeded)."""
    out = []
    for i, (name, n, length) in enumerate(cases):
        prompts = synthetic_prompts(n * (repeats + 1), length, vocab, seed=100 + i)
        out.append({"name": name, "warmup": prompts[:n],
                    "sets": [prompts[n * (r + 1):n * (r + 2)] for r in range(repeats)]})
    return out


def summarise(cases: list[tuple[str, int, int]], ours: list[dict[str, Any]], other: list[dict[str, Any]],
              key: str) -> list[dict[str, Any]]:
    """Per case: each round's median ms of ours and of the `other` side (`key`: "vllm" or "baseline")
    and their ratio."""
    rows = []
    for name, n, length in cases:
        o = [_ms(r["cases"][name]) for r in ours[: len(other)]]
        v = [_ms(r["cases"][name]) for r in other]
        rows.append({"case": name, "prompt_tokens": n * length, "ours_ms": o, f"{key}_ms": v,
                     "ratio": [a / b for a, b in zip(o, v, strict=True)],
                     "ours_best_ms": [1e3 * min(r["cases"][name]) for r in ours],
                     f"{key}_best_ms": [1e3 * min(r["cases"][name]) for r in other]})
    return rows


def table(rows: list[dict[str, Any]], key: str, title: str) -> str:
    """Markdown: per case, both sides per round and ours ÷ the other (`key`, shown as `title`)."""
    def per_round(xs: list[float], digits: int = 0) -> str:
        return ", ".join(f"{x:.{digits}f}" for x in xs)

    out = []
    for r in rows:
        tok = r["prompt_tokens"]
        out.append([r["case"], per_round(r["ours_ms"]), per_round(r[f"{key}_ms"]),
                    per_round([x / tok for x in r["ours_ms"]], 3), per_round([x / tok for x in r[f"{key}_ms"]], 3),
                    per_round(r["ratio"], 2), fmt(median(r["ratio"]))])
    return markdown_table(["prompts", "ours ms (per round)", f"{title} ms", "ours ms/token", f"{title} ms/token",
                           f"ours ÷ {title}", "median"], out)


def main(argv: list[str] | None = None) -> int:
    """Alternate the two engines' processes for the rounds; print the table and write the JSON."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--cases", default="1x512,4x512,1x2048", help="comma-separated PROMPTSxTOKENS")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5, help="timed sets per case and process")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--budget-s", type=float, default=840.0)
    p.add_argument("--vllm-venv", type=Path, default=VLLM_VENV)
    p.add_argument("--no-vllm", action="store_true", help="our engine only (rounds of ours alone)")
    p.add_argument("--ours-env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment of our side's process (repeatable), e.g. an engine switch")
    p.add_argument("--baseline-env", action="append", default=[], metavar="NAME=VALUE",
                   help="also run our engine with this environment each round (repeatable): the A/B baseline")
    p.add_argument("--baseline-tree", type=Path, default=None,
                   help="run the baseline from this checkout (e.g. a git worktree of the previous commit)")
    p.add_argument("--name", default="prefill_vs_vllm", help="result file name (without .json)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    deadline = Deadline(args.budget_s)
    model = args.model_dir or (None if args.quick else smollm2_dir()) or tiny_llama_hd64_dir()
    cases = parse_cases("1x64,2x64" if args.quick else args.cases)
    rounds, repeats = (1, 1) if args.quick else (args.rounds, args.repeats)
    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    most = max(n * length for _, n, length in cases)
    cfg = {"model": str(model), "dtype": args.dtype, "threads": args.threads,
           "cases": case_configs(cases, repeats, vocab), "max_num_batched_tokens": max(STEP_TOKENS, most),
           "max_model_len": max(length for _, _, length in cases) + 16,
           "max_num_seqs": max(n for _, n, _ in cases)}
    base_env, vllm_env = child_envs(args.threads)
    ours_env = base_env | {"PYTHONPATH": str(ROOT)} | dict(kv.split("=", 1) for kv in args.ours_env)
    ours: list[dict[str, Any]] = []
    theirs: list[dict[str, Any]] = []
    base: list[dict[str, Any]] = []
    for r in range(rounds):
        if deadline.expired():
            log("time budget spent, stopping rounds")
            break
        if args.baseline_env or args.baseline_tree:
            tree = (args.baseline_tree or ROOT).resolve()
            env = ours_env | {"PYTHONPATH": str(tree)} | dict(kv.split("=", 1) for kv in args.baseline_env)
            base.append(run_child([sys.executable, "-c", OURS_CHILD], cfg, env, tree, 900))
            log(f"round {r + 1} baseline: " + ", ".join(f"{k} {_ms(v):.0f} ms"
                                                         for k, v in base[-1]["cases"].items()))
        ours.append(run_child([sys.executable, "-c", OURS_CHILD], cfg, ours_env, ROOT, 900))
        log(f"round {r + 1} ours: " + ", ".join(f"{k} {_ms(v):.0f} ms" for k, v in ours[-1]["cases"].items()))
        if args.no_vllm:
            continue
        # -P and cwd outside the repository: vLLM's venv must not import this repository's packages.
        theirs.append(run_child([str(args.vllm_venv / "bin" / "python"), "-P", str(VLLM_CHILD)], cfg, vllm_env,
                                Path(tempfile.gettempdir()), 1200))
        log(f"round {r + 1} vLLM: " + ", ".join(f"{k} {_ms(v):.0f} ms"
                                                  for k, v in theirs[-1]["cases"].items()))
    title = f"prefill, one generate(max_tokens=1) a set ({Path(model).name}, {args.dtype}, median of sets)"
    rows: list[dict[str, Any]] = []
    ab_rows: list[dict[str, Any]] = []
    if base:
        ab_rows = summarise(cases, ours, base, "baseline")
        what = " ".join([*args.baseline_env, *([f"tree {args.baseline_tree}"] if args.baseline_tree else [])])
        print_header(f"{title}: ours against the baseline ({what})")
        print(table(ab_rows, "baseline", "baseline"))
    if theirs:
        rows = summarise(cases, ours, theirs, "vllm")
        print_header(title)
        print(table(rows, "vllm", "vLLM"))
    elif not base:
        for name, _, _ in cases:
            print(name, "ours ms per round:", ", ".join(f"{_ms(r['cases'][name]):.0f}" for r in ours))
    path = write_result(args.out_dir, "prefill_vs_vllm_quick" if args.quick else args.name, MODULE, argv,
                        {"note": note_shared_machine(), "threads": args.threads, "model_dir": str(model),
                         "ours_env": args.ours_env, "baseline_env": args.baseline_env,
                         "baseline_tree": str(args.baseline_tree) if args.baseline_tree else None, "rows": rows,
                         "ab_rows": ab_rows, "ours_runs": ours, "vllm_runs": theirs, "baseline_runs": base})
    print(f"\nresult: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
