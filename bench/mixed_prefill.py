"""Mixed prefill against alternating prefill and decode steps: inter-token latency, TTFT and tok/s of a
closed-loop workload driven in-process (no HTTP), same engine settings, same prompts, one run.

`alternating` is the engine's default with chunked prefill: a prefill step of up to
`--budget` prompt tokens, then a decode step of the running batch. `mixed` (`enable_mixed_prefill`)
runs one forward per step carrying the decode rows and prompt tokens, `--budget` tokens in all
(vLLM's chunked prefill). `mixed-<n>` is the same with a budget of n tokens. A closed loop keeps
`concurrency` requests in flight (a finished one is replaced at once), as `vllm bench serve
--max-concurrency` does; times are taken when `step()` returns (what a worker's stream sees, less
the HTTP hop). Workloads follow issue 19's tails: 64 random tokens in / 64 out, and a shared
384-token prefix + 128 random tokens in / 128 out (every prompt a prefix-cache hit).

    .venv/bin/python -m bench.mixed_prefill                       # SmolLM2 if prepared
    .venv/bin/python -m bench.mixed_prefill --quick               # tiny model, seconds
"""
from __future__ import annotations

import random
import sys
import time
from typing import Any

from bench.common import (
    base_parser,
    log,
    median,
    parse_args,
    percentile,
    print_header,
    smollm2_dir,
    tiny_model_dir,
    write_result,
)

MODULE = "bench.mixed_prefill"
# (name, shared prefix tokens, random input tokens, output tokens, requests in flight)
WORKLOADS: list[tuple[str, int, int, int, int]] = [
    ("64/64 c8", 0, 64, 64, 8),
    ("64/64 c32", 0, 64, 64, 32),
    ("prefix384+128/128 c16", 384, 128, 128, 16),
]


def closed_loop(engine: Any, prompts: list[list[int]], output_len: int, concurrency: int) -> dict[str, float]:
    """Run `prompts` keeping `concurrency` in flight; TTFT and inter-token latency percentiles (ms)
    and output tokens per second."""
    from inference.engine import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    queue = list(enumerate(prompts))
    started: dict[str, float] = {}
    last: dict[str, float] = {}
    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0
    begin = time.perf_counter()

    def admit() -> None:
        i, prompt = queue.pop(0)
        rid = f"q{i}"
        engine.add_request(rid, prompt, params)
        started[rid] = time.perf_counter()

    for _ in range(min(concurrency, len(queue))):
        admit()
    while engine.has_work():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if not out.new_token_ids:
                continue
            tokens += len(out.new_token_ids)
            rid = out.request_id
            if rid in last:
                itl.append((now - last[rid]) * 1000)
            else:
                ttft.append((now - started[rid]) * 1000)
            last[rid] = now
            if out.finished and queue:
                admit()
    wall = time.perf_counter() - begin
    return {
        "tok_per_s": tokens / wall, "ttft_p50_ms": median(ttft) or 0.0, "ttft_p99_ms": percentile(ttft, 99) or 0.0,
        "itl_p50_ms": median(itl) or 0.0, "itl_p99_ms": percentile(itl, 99) or 0.0, "wall_s": wall,
    }


def make_prompts(vocab: int, prefix: int, input_len: int, n: int, seed: int) -> list[list[int]]:
    """`n` prompts: one shared random prefix of `prefix` tokens, then `input_len` random tokens each."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(prefix)]
    return [shared + [rng.randrange(3, vocab) for _ in range(input_len)] for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    """Run every workload under every variant; print and write the result."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--budget", type=int, default=256, help="tokens per step (both-per-cpu's default)")
    p.add_argument("--variants", default="alternating,mixed,mixed-128")
    p.add_argument("--waves", type=int, default=2, help="requests per workload = waves x concurrency")
    p.add_argument("--workloads", default=",".join(w[0] for w in WORKLOADS))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    import os

    import torch

    from inference.engine import LLMEngine

    torch.set_num_threads(args.threads)
    model = args.model_dir or (None if args.quick else smollm2_dir()) or tiny_model_dir()
    chosen = [w for w in WORKLOADS if w[0] in args.workloads.split(",")]
    result: dict[str, Any] = {"model_dir": str(model), "budget": args.budget, "load_at_start": list(os.getloadavg())}
    engines: dict[str, Any] = {}
    for variant in args.variants.split(","):
        budget = int(variant.split("-")[1]) if "-" in variant else args.budget
        engines[variant] = LLMEngine(str(model), block_size=16, max_num_seqs=64, max_model_len=1024,
                                     dtype=args.dtype, num_blocks=4096 if not args.quick else 512,
                                     max_num_batched_tokens=budget,
                                     enable_mixed_prefill=variant.startswith("mixed"))
    for name, prefix, input_len, output_len, concurrency in chosen:
        n = 2 if args.quick else args.waves * concurrency
        vocab = next(iter(engines.values())).config.vocab_size
        prompts = make_prompts(vocab, prefix, 8 if args.quick else input_len, n, seed=11)
        out_len = 4 if args.quick else output_len
        conc = min(concurrency, 2) if args.quick else concurrency
        rows: dict[str, Any] = {}
        for variant, engine in engines.items():
            closed_loop(engine, prompts[:1], 2, 1)  # warm-up (and the shared prefix's blocks cached)
            rows[variant] = closed_loop(engine, prompts, out_len, conc)
            log(f"{name} {variant}: " + ", ".join(f"{k} {v:.1f}" for k, v in rows[variant].items()))
        result[name] = rows
    result["load_at_end"] = list(os.getloadavg())
    print_header(f"mixed prefill vs alternating steps (in-process closed loop, budget {args.budget})")
    for name, *_ in chosen:
        rows = result[name]
        base = rows.get("alternating")
        for variant, r in rows.items():
            ratio = ""
            if base is not None and variant != "alternating":
                ratio = (f"  vs alternating: ITL p99 {r['itl_p99_ms'] / base['itl_p99_ms']:.2f}x, "
                         f"TTFT p99 {r['ttft_p99_ms'] / base['ttft_p99_ms']:.2f}x, "
                         f"tok/s {r['tok_per_s'] / base['tok_per_s']:.2f}x")
            print(f"{name:22s} {variant:12s} tok/s {r['tok_per_s']:6.1f}  TTFT p50/p99 {r['ttft_p50_ms']:7.0f} / "
                  f"{r['ttft_p99_ms']:7.0f}  ITL p50/p99 {r['itl_p50_ms']:5.0f} / {r['itl_p99_ms']:5.0f} ms{ratio}")
    path = write_result(args.out_dir, "mixed_prefill_quick" if args.quick else "mixed_prefill", MODULE, argv, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
