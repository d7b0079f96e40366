"""Prefill over a cached prefix against a fresh prefill: one forward of the model, same process.

A 256-token chunk computed from an empty cache (one causal SDPA call over its own K/V) against the
same 256 tokens after 256 and 1,024 cached tokens (keys gathered from the paged cache, an additive
causal mask), plus the shared-prefix serving step of issue 19 (two prompts of 128 new tokens after a
384-token cached prefix, against two fresh 128-token prompts). Each forward is timed whole and split
into attention (`Attention._prefill`: the gather, the mask and SDPA) and the rest (projections, MLP,
norms, KV writes).

The bound checked: a chunk after a cached prefix should cost no more than the fresh chunk plus the
attention its extra keys need, priced at the fresh chunk's own attention cost per (query, key) pair
(a causal 256-token chunk attends to 256 * 257 / 2 pairs; after 1,024 cached tokens to 1,024 * 256
more). `over_bound` > 1 means the cached path pays more than the extra FLOPs.

In bf16 each case runs twice in the same process: with torch's SDPA (`sdpa`, the path before
prefill_attention.py, and the engine's path on a CPU with AMX tiles) and with the GEMM attention (`gemm`,
the engine's path on other CPUs; forced on here whatever the CPU).

    .venv/bin/python -m bench.prefill_cached                 # SmolLM2 if prepared (bf16 and fp32)
    .venv/bin/python -m bench.prefill_cached --quick         # tiny model, one repeat
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from bench.common import base_parser, log, parse_args, print_header, smollm2_dir, tiny_model_dir, write_result

MODULE = "bench.prefill_cached"
# (name, prompts, cached tokens each, new tokens each)
CASES: list[tuple[str, int, int, int]] = [
    ("fresh 256", 1, 0, 256),
    ("256 after 256 cached", 1, 256, 256),
    ("256 after 1024 cached", 1, 1024, 256),
    ("2x128 fresh", 2, 0, 128),
    ("2x128 after 384 cached", 2, 384, 128),
]


def pairs(cached: int, new: int) -> int:
    """(query, key) pairs a causal prefill of `new` tokens after `cached` ones attends to."""
    return new * cached + new * (new + 1) // 2


def _timed_attention(model: Any, sink: list[float]) -> Callable[[], None]:
    """Wrap every layer's `_prefill` so that its time adds to `sink[0]`; returns the undo."""
    import time as _t

    originals = []
    for layer in model.layers:
        attn = layer.self_attn
        orig = attn._prefill

        def timed(*a: Any, _orig: Any = orig, **kw: Any) -> Any:
            s = _t.perf_counter()
            try:
                return _orig(*a, **kw)
            finally:
                sink[0] += _t.perf_counter() - s

        attn._prefill = timed
        originals.append((attn, orig))

    def undo() -> None:
        for attn, orig in originals:
            attn._prefill = orig

    return undo


def measure(engine: Any, prompts: int, cached: int, new: int, repeats: int) -> dict[str, float]:
    """Best-of-`repeats` forward time (ms) of `prompts` prompts of `new` tokens after `cached` cached
    ones, and the attention share of that forward."""
    import torch

    from inference.engine import SamplingParams
    from inference.engine.batch import build_metadata
    from inference.engine.sequence import Sequence

    runner = engine.runner
    bs = runner.block_size
    seqs = []
    next_block = 0
    for i in range(prompts):
        tokens = [(7 * j + i) % (engine.config.vocab_size - 5) + 5 for j in range(cached + new)]
        seq = Sequence(f"p{i}", tokens, SamplingParams(max_tokens=1), i)
        nblocks = -(-(cached + new) // bs)
        seq.block_ids = list(range(next_block, next_block + nblocks))
        next_block += nblocks
        seq.num_cached = cached
        seqs.append(seq)
    ids, meta = build_metadata(seqs, True, bs, runner.kv_cache.block_stride, runner.dtype, runner.device)
    sink = [0.0]
    best, best_attn = float("inf"), 0.0
    undo = _timed_attention(runner.model, sink)
    try:
        with torch.inference_mode():
            runner.model(ids, meta, runner.kv_cache)  # warm-up
            for _ in range(repeats):
                sink[0] = 0.0
                start = time.perf_counter()
                runner.model(ids, meta, runner.kv_cache)
                took = time.perf_counter() - start
                if took < best:
                    best, best_attn = took, sink[0]
    finally:
        undo()
    return {"forward_ms": best * 1000, "attention_ms": best_attn * 1000, "rest_ms": (best - best_attn) * 1000,
            "ms_per_token": best * 1000 / (prompts * new)}


def bounds(rows: dict[str, dict[str, float]]) -> None:
    """Add to each cached row the bound (fresh forward + extra pairs at the fresh attention's cost per
    pair) and how far over it the row is."""
    for name, prompts, cached, new in CASES:
        if not cached:
            continue
        fresh = next(rows[n] for n, k, c, q in CASES if (k, c, q) == (prompts, 0, new))
        per_pair = fresh["attention_ms"] / (prompts * pairs(0, new))
        bound = fresh["forward_ms"] + per_pair * prompts * (pairs(cached, new) - pairs(0, new))
        row = rows[name]
        row["bound_ms"] = bound
        row["over_bound"] = row["forward_ms"] / bound
        row["per_token_vs_fresh"] = row["ms_per_token"] / fresh["ms_per_token"]


def main(argv: list[str] | None = None) -> int:
    """Measure every case in each dtype; print and write the result."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--repeats", type=int, default=5)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    import os

    import torch

    from inference.engine import LLMEngine

    torch.set_num_threads(args.threads)
    model = args.model_dir or (None if args.quick else smollm2_dir()) or tiny_model_dir()
    repeats = 1 if args.quick else args.repeats
    result: dict[str, Any] = {"model_dir": str(model), "load_at_start": list(os.getloadavg())}
    from inference.engine import prefill_attention

    gemm_bytes = prefill_attention.MAX_SCORE_BYTES
    wanted = prefill_attention.gemm_attention_wanted
    # The GEMM variant is forced on even where the engine would not choose it (a CPU with AMX tiles).
    prefill_attention.gemm_attention_wanted = lambda: True  # type: ignore[assignment]
    for dtype in args.dtypes.split(","):
        engine = LLMEngine(str(model), block_size=16, max_num_seqs=4, max_model_len=2048, dtype=dtype,
                           num_blocks=256)
        # bf16: torch's SDPA (the path before prefill_attention.py) against the GEMM attention, same run.
        for variant in ("sdpa", "gemm") if dtype == "bfloat16" else ("sdpa",):
            prefill_attention.MAX_SCORE_BYTES = gemm_bytes if variant == "gemm" else 0
            rows = {name: measure(engine, n, c, q, repeats) for name, n, c, q in CASES}
            bounds(rows)
            result[f"{dtype} {variant}"] = rows
            for name, row in rows.items():
                log(f"{dtype} {variant} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
        prefill_attention.MAX_SCORE_BYTES = gemm_bytes
        del engine
    prefill_attention.gemm_attention_wanted = wanted  # type: ignore[assignment]
    result["load_at_end"] = list(os.getloadavg())
    print_header("prefill over a cached prefix vs fresh (one forward, best of repeats)")
    for key, rows in result.items():
        if not isinstance(rows, dict):
            continue
        for name, row in rows.items():
            extra = f", bound {row['bound_ms']:.1f} ms ({row['over_bound']:.2f}x), per token " \
                    f"{row['per_token_vs_fresh']:.2f}x fresh" if "bound_ms" in row else ""
            print(f"{key:14s} {name:24s} {row['forward_ms']:7.1f} ms (attention {row['attention_ms']:6.1f}){extra}")
    if "bfloat16 gemm" in result:
        for name in result["bfloat16 gemm"]:
            before, after = result["bfloat16 sdpa"][name], result["bfloat16 gemm"][name]
            print(f"bf16 {name:24s} forward sdpa/gemm {before['forward_ms'] / after['forward_ms']:.2f}x, "
                  f"attention {before['attention_ms'] / after['attention_ms']:.2f}x")
    path = write_result(args.out_dir, "prefill_cached_quick" if args.quick else "prefill_cached", MODULE, argv, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
