"""What a decode / verify step costs per row count on this machine (speculative decoding's row budget).

One engine over the checkpoint (one torch thread), `--seqs` sequences prefilled with prompts of
`--prompt-len` random tokens; then, per row count from `--seqs` (a plain decode step's rows) to
`--seqs * (K + 1)`, `ModelRunner.run_verify` with the extra rows spread over the sequences as
proposals (round robin, at most K each), timed `--repeats` times with the row counts interleaved
(so that the machine's load drifts over all of them alike); also the plain decode step
(`ModelRunner.run`). Reported per dtype: the median and minimum ms per row count and the ratio to the
plain step's median, the curve the speculator's row budget learns online (spec_budget.py).

    flock /tmp/bench.lock .venv/bin/python -m bench.verify_cost            # SmolLM2, bf16 and fp32
    .venv/bin/python -m bench.verify_cost --quick                          # tiny model, seconds
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench import common

MODULE = "bench.verify_cost"


def spread(extra: int, seqs: int, k: int) -> list[int]:
    """Proposal lengths that add `extra` rows to `seqs` sequences, round robin, at most `k` each."""
    counts = [0] * seqs
    for j in range(extra):
        counts[j % seqs] += 1
    assert max(counts) <= k, "more extra rows than seqs * k"
    return counts


def measure_dtype(model: Any, dtype: str, seqs: int, k: int, prompt_len: int, repeats: int) -> dict[str, Any]:
    """Median / min ms of a plain step and of a verify step per row count, for one dtype."""
    import torch

    from inference.engine import LLMEngine, SamplingParams

    engine = LLMEngine(str(model), max_num_seqs=seqs, max_model_len=1024, dtype=dtype, num_blocks=64 * seqs,
                       enable_prefix_caching=False)
    vocab = engine.config.vocab_size
    params = SamplingParams(max_tokens=512, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(common.synthetic_prompts(seqs, prompt_len, vocab, seed=5)):
        engine.add_request(f"cost-{i}", prompt, params)
    for _ in range(4):  # the prefill, then a few decode steps (the batch is running)
        engine.step()
    batch = list(engine.scheduler.running)
    assert len(batch) == seqs, f"expected {seqs} running sequences, got {len(batch)}"
    bs = engine.runner.block_size
    for s in batch:  # KV slots for the longest proposals: verify rows write their keys there
        need = -(-(s.num_tokens + k) // bs) - len(s.block_ids)
        if need > 0:
            s.block_ids.extend(engine.block_manager.allocate(need))
    runner = engine.runner
    rows_list = list(range(seqs, seqs * (k + 1) + 1))
    proposals = {r: [[3 + (j % 50)] * c for j, c in enumerate(spread(r - seqs, seqs, k))] for r in rows_list}
    plain: list[float] = []
    verify: dict[int, list[float]] = {r: [] for r in rows_list}
    with torch.inference_mode():
        for r in rows_list:  # warm-up: every shape once
            runner.run_verify(batch, proposals[r])
        for rep in range(repeats):
            order = rows_list if rep % 2 == 0 else rows_list[::-1]
            for r in order:
                t = time.perf_counter()
                runner.run_verify(batch, proposals[r])
                verify[r].append(1e3 * (time.perf_counter() - t))
                if r % 4 == 0:  # plain steps spread over the repeats too
                    t = time.perf_counter()
                    runner.run(batch, False)
                    plain.append(1e3 * (time.perf_counter() - t))
    base = common.median(plain) or 0.0
    curve = {r: {"median_ms": common.median(v), "min_ms": min(v), "ratio_to_plain": (common.median(v) or 0) / base}
             for r, v in verify.items()}
    return {"dtype": str(engine.dtype), "plain_median_ms": base, "plain_min_ms": min(plain), "verify": curve,
            "context_tokens": batch[0].num_tokens}


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and print one table per dtype."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = common.base_parser(__doc__ or "")
    p.add_argument("--dtypes", default="bfloat16,float32", help="engine dtypes (default bfloat16,float32)")
    p.add_argument("--seqs", type=int, default=8, help="running sequences (default 8)")
    p.add_argument("--k", type=int, default=4, help="proposals per sequence at most (default 4: 8..40 rows)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per sequence (default 256)")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per row count (default 7)")
    args = common.parse_args(p, argv)
    import torch

    torch.set_num_threads(args.threads)
    model = args.model_dir or (None if args.quick else common.smollm2_dir()) or common.tiny_model_dir()
    repeats = 2 if args.quick else args.repeats
    load_before = os.getloadavg()[0]
    results = []
    for dtype in args.dtypes.split(","):
        res = measure_dtype(model, dtype, args.seqs, args.k, 32 if args.quick else args.prompt_len, repeats)
        results.append(res)
        common.print_header(f"{model.name}, {res['dtype']}: {args.seqs} sequences, plain step "
                            f"{res['plain_median_ms']:.2f} ms (min {res['plain_min_ms']:.2f}), load "
                            f"{os.getloadavg()[0]:.1f}")
        print(common.markdown_table(
            ["rows", "verify ms (median)", "min", "÷ plain step"],
            [[r, f"{c['median_ms']:.2f}", f"{c['min_ms']:.2f}", f"{c['ratio_to_plain']:.2f}"]
             for r, c in res["verify"].items()]))
    name = "verify_cost_quick" if args.quick else "verify_cost"
    path = common.write_result(args.out_dir, name, MODULE, argv, {
        "model": str(model), "seqs": args.seqs, "k": args.k, "repeats": repeats, "load_before": load_before,
        "results": results})
    common.log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
