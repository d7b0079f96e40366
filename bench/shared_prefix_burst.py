"""A burst of prompts sharing a system prompt: computed once (the scheduler's shared-prefix wait) against
once per prompt, in-process, same engine settings, rounds alternating.

`burst` requests arrive together, each a shared `--prefix`-token system prompt (a new one every round,
so no round finds the last one's blocks) plus `--input` random tokens; every request decodes `--output`
tokens. `wait` is the engine's default: a prompt whose next `SHARED_PREFIX_WAIT_TOKENS` or more blocks
another prompt of the same step is computing waits one step and finds them cached
(inference/engine/scheduler.py); `no-wait` sets the threshold off, so every prompt of the burst computes
the system prompt itself (what the engine did before). Reported per variant: TTFT p50 / p90 / max,
the burst's wall time, output tok/s and the prompt tokens served from the prefix cache.

    .venv/bin/python -m bench.shared_prefix_burst                 # SmolLM2 if prepared
    .venv/bin/python -m bench.shared_prefix_burst --quick         # tiny model, seconds
"""
from __future__ import annotations

import os
import sys
from typing import Any

from bench.common import base_parser, log, median, parse_args, print_header, smollm2_dir, tiny_model_dir, write_result
from bench.mixed_prefill import closed_loop, make_prompts

MODULE = "bench.shared_prefix_burst"
VARIANTS = ("no-wait", "wait")


def run_variant(engine: Any, variant: str, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """The burst on `engine` with the shared-prefix wait on or off; its latency figures and cache hits."""
    from inference.engine.scheduler import SHARED_PREFIX_WAIT_TOKENS

    sch = engine.scheduler
    sch.shared_prefix_wait_tokens = SHARED_PREFIX_WAIT_TOKENS if variant == "wait" else None
    hits0, waits0 = sch.prefix_hit_tokens, sch.shared_prefix_waits
    row = closed_loop(engine, prompts, output_len, len(prompts))
    row["prefix_hit_tokens"] = float(sch.prefix_hit_tokens - hits0)
    row["shared_prefix_waits"] = float(sch.shared_prefix_waits - waits0)
    return row


def main(argv: list[str] | None = None) -> int:
    """Alternate the variants over rounds; print the medians and the ratios, write the JSON."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--budget", type=int, default=256, help="prompt tokens per step (both-per-cpu's default)")
    p.add_argument("--burst", type=int, default=16, help="requests arriving together")
    p.add_argument("--prefix", type=int, default=256, help="shared system prompt tokens")
    p.add_argument("--input", type=int, default=64, help="each request's own prompt tokens")
    p.add_argument("--output", type=int, default=32, help="output tokens per request")
    p.add_argument("--rounds", type=int, default=3)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    if min(args.budget, args.burst, args.prefix, args.input, args.output, args.rounds) < 1:
        p.error("--budget, --burst, --prefix, --input, --output and --rounds must be >= 1")
    import torch

    from inference.engine import LLMEngine

    torch.set_num_threads(args.threads)
    model = args.model_dir or (None if args.quick else smollm2_dir()) or tiny_model_dir()
    burst, prefix, input_len, output_len, rounds = ((4, 64, 8, 4, 1) if args.quick else
                                                   (args.burst, args.prefix, args.input, args.output, args.rounds))
    engine = LLMEngine(str(model), block_size=16, max_num_seqs=max(64, burst), max_model_len=prefix + input_len + 64,
                       dtype=args.dtype, num_blocks=4096 if not args.quick else 512,
                       max_num_batched_tokens=args.budget)
    vocab = engine.config.vocab_size
    closed_loop(engine, make_prompts(vocab, 0, 8, 1, seed=0), 2, 1)  # warm-up
    samples: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    load_start = list(os.getloadavg())
    for r in range(rounds):
        for i, variant in enumerate(VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            prompts = make_prompts(vocab, prefix, input_len, burst, seed=1000 * r + 10 * i + 1)  # a fresh prefix
            row = run_variant(engine, variant, prompts, output_len)
            samples[variant].append(row)
            log(f"round {r + 1} {variant}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()))
    keys = next(iter(samples.values()))[0].keys()
    medians = {v: {k: median([row[k] for row in rows]) or 0.0 for k in keys} for v, rows in samples.items()}
    result: dict[str, Any] = {"model_dir": str(model), "budget": args.budget, "burst": burst, "prefix": prefix,
                              "input": input_len, "output": output_len, "rounds": samples, "medians": medians,
                              "load_at_start": load_start, "load_at_end": list(os.getloadavg())}
    print_header(f"a burst of {burst} sharing a {prefix}-token prefix (+{input_len} each, {output_len} out), "
                 f"budget {args.budget}, medians of {rounds} rounds")
    base = medians["no-wait"]
    for variant, m in medians.items():
        print(f"{variant:8s} TTFT p50 / p99 {m['ttft_p50_ms']:7.0f} / {m['ttft_p99_ms']:7.0f} ms, wall "
              f"{m['wall_s']:.2f} s, tok/s {m['tok_per_s']:.1f}, cached prompt tokens {m['prefix_hit_tokens']:.0f}")
    m = medians["wait"]
    print(f"no-wait / wait: TTFT p50 {base['ttft_p50_ms'] / m['ttft_p50_ms']:.2f}x, "
          f"p99 {base['ttft_p99_ms'] / m['ttft_p99_ms']:.2f}x, wall {base['wall_s'] / m['wall_s']:.2f}x")
    path = write_result(args.out_dir, "shared_prefix_burst_quick" if args.quick else "shared_prefix_burst", MODULE,
                        argv, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
