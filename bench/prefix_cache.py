"""Prefix caching: time to first token of a request whose 512-token system prompt is cached, against
the same request with a cold cache, in one process, alternating.

Each pair draws a fresh random system prompt: the first request (cold) computes all of it, the
second (warm: same system prompt, another user suffix) reuses its full blocks. TTFT here is the
in-process time from ``add_request`` to the step that returns the first token (no HTTP). The same
pairs run on an engine with prefix caching off as the control.

    .venv/bin/python -m bench.prefix_cache            # SmolLM2 if prepared, else the tiny model
    .venv/bin/python -m bench.prefix_cache --quick    # tiny model, few pairs
"""
from __future__ import annotations

import random
import sys
import time
from typing import Any

from bench.common import base_parser, log, median, parse_args, print_header, smollm2_dir, tiny_model_dir, write_result

MODULE = "bench.prefix_cache"


def ttft_ms(engine: Any, rid: str, prompt: list[int]) -> float:
    """Milliseconds from add_request to the first output token (the request is then run to its end)."""
    from inference.engine import SamplingParams

    started = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    first = None
    while engine.has_work():
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids and first is None:
                first = (time.perf_counter() - started) * 1000
    assert first is not None
    return first


def pairs(engine: Any, n: int, system_len: int, user_len: int, seed: int) -> dict[str, Any]:
    """Median cold and warm TTFT over `n` (cold, warm) pairs."""
    rng = random.Random(seed)
    vocab = engine.config.vocab_size
    cold, warm = [], []
    for i in range(n):
        system = [rng.randrange(3, vocab) for _ in range(system_len)]
        cold.append(ttft_ms(engine, f"c{i}", system + [rng.randrange(3, vocab) for _ in range(user_len)]))
        warm.append(ttft_ms(engine, f"w{i}", system + [rng.randrange(3, vocab) for _ in range(user_len)]))
    c, w = median(cold) or 0.0, median(warm) or 0.0
    return {"cold_ttft_ms": c, "warm_ttft_ms": w, "cold_over_warm": c / w if w else None,
            "hit_rate": engine.prefix_cache_hit_rate}


def main(argv: list[str] | None = None) -> int:
    """Measure with prefix caching on and off; print and write the result."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--pairs", type=int, default=7)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    import torch

    from inference.engine import LLMEngine

    torch.set_num_threads(args.threads)
    model = args.model_dir or (None if args.quick else smollm2_dir()) or tiny_model_dir()
    n = 2 if args.quick else args.pairs
    rows = {}
    for caching in (True, False):
        engine = LLMEngine(str(model), block_size=16, max_num_seqs=4, max_model_len=1024, dtype=args.dtype,
                           enable_prefix_caching=caching)
        ttft_ms(engine, "warm-up", [5] * 40)
        rows["on" if caching else "off"] = pairs(engine, n, 512, 16, seed=7) | {
            "dtype": str(engine.dtype).removeprefix("torch.")}
        log(f"prefix caching {'on' if caching else 'off'}: {rows['on' if caching else 'off']}")
    print_header("prefix caching: TTFT with a cached 512-token system prompt")
    for k, r in rows.items():
        print(f"caching {k}: cold {r['cold_ttft_ms']:.1f} ms, warm {r['warm_ttft_ms']:.1f} ms, "
              f"cold/warm {r['cold_over_warm']:.2f}x ({r['dtype']})")
    path = write_result(args.out_dir, "prefix_cache_quick" if args.quick else "prefix_cache", MODULE, argv,
                        {"model_dir": str(model), "rows": rows})
    print(f"result: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
