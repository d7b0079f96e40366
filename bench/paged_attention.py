"""The paged decode attention kernel (csrc/paged_decode.cpp) against a git revision's, called directly.

Both kernels are built in this run: the working tree's, as the engine loads it, and `--base`'s
paged_decode.cpp compiled beside it as its own extension. Each point (model shape, dtype, batch,
context) runs the two in turn, `--rounds` alternations of `--calls` calls on the same inputs; the
result is each side's median time per call, their ratio, and the KV bytes read per second. The KV
blocks of every sequence are scattered over a pool larger than the last-level cache, as a real
engine's are across 30 layers.

    .venv/bin/python -m bench.paged_attention --base HEAD~1
    .venv/bin/python -m bench.paged_attention --quick --base self   # seconds: checks it runs
"""
from __future__ import annotations

import hashlib
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.common import (
    ROOT,
    SCRATCH_DIR,
    base_parser,
    fmt,
    log,
    markdown_table,
    parse_args,
    print_header,
    write_result,
)

MODULE = "bench.paged_attention"
KERNEL = "inference/engine/csrc/paged_decode.cpp"
BLOCK = 16
# (name, heads, kv_heads, head_dim): SmolLM2-135M, the tiny test Llama, bench.common's tiny hd64 Llama (the
# engine_vs_vllm tiny model) and a head_dim-128 shape.
SHAPES = {"smollm2": (9, 3, 64), "tiny": (8, 2, 64), "tiny-hd64": (4, 4, 64), "hd128": (16, 4, 128)}
BINDING = """#include <torch/extension.h>
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_new, torch::Tensor v_new, torch::Tensor rows,
                           torch::Tensor slots, torch::Tensor ctx_lens, int64_t layer_offset, int64_t v_offset,
                           double scale);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }
"""


def build_base(rev: str) -> Any:
    """`rev`'s paged_decode.cpp built as an extension of its own (same flags as the engine's kernels), in
    a scratch folder named by the source's hash: a rerun against the same source loads the earlier build."""
    from inference.engine.cpu_kernels import CFLAGS, build_extension

    source = subprocess.run(["git", "show", f"{rev}:{KERNEL}"], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout
    work = SCRATCH_DIR / "paged-attention-base" / hashlib.sha256(source.encode()).hexdigest()[:12]
    work.mkdir(parents=True, exist_ok=True)
    (work / "paged_decode_base.cpp").write_text(source)
    (work / "binding.cpp").write_text(BINDING)
    return build_extension("paged_decode_base", [work / "paged_decode_base.cpp", work / "binding.cpp"], CFLAGS,
                           root=work / "build")


def make_inputs(shape: tuple[int, int, int], dtype: Any, batch: int, ctx: int, seed: int) -> dict[str, Any]:
    """One layer's decode call: `batch` sequences of `ctx` keys, their blocks scattered over a pool."""
    import torch

    heads, kv_heads, hd = shape
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-ctx // BLOCK)
    pool_blocks = max(batch * blocks_per_seq * 2, 4096)  # > the LLC at these shapes: rows come from memory
    rows = torch.randn(pool_blocks * 2 * BLOCK, kv_heads, hd, generator=gen).to(dtype)
    order = torch.randperm(pool_blocks, generator=gen)[: batch * blocks_per_seq].view(batch, blocks_per_seq)
    t = torch.arange(blocks_per_seq * BLOCK)
    slots = (order[:, t // BLOCK] * 2 * BLOCK + t % BLOCK).contiguous()
    return {
        "q": torch.randn(batch, heads, hd, generator=gen).to(dtype),
        "k": torch.randn(batch, kv_heads, hd, generator=gen).to(dtype),
        "v": torch.randn(batch, kv_heads, hd, generator=gen).to(dtype),
        "rows": rows, "slots": slots, "lens": torch.full((batch,), ctx, dtype=torch.int64),
        "scale": hd ** -0.5,
    }


def call(ops: Any, x: dict[str, Any]) -> Any:
    """One paged decode call of `ops` on inputs `x` (layer 0; V rows one block size after K)."""
    return ops.paged_decode(x["q"], x["k"], x["v"], x["rows"], x["slots"], x["lens"], 0, BLOCK, x["scale"])


def time_calls(ops: Any, x: dict[str, Any], calls: int) -> float:
    """Seconds per call over `calls` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        call(ops, x)
    return (time.perf_counter() - start) / calls


def measure_point(ours: Any, base: Any, shape_name: str, dtype: Any, batch: int, ctx: int, rounds: int,
                  calls: int) -> dict[str, Any]:
    """Both kernels on one point, alternating `rounds` times: medians per call, ratio, KV read rate, and
    the largest difference between their outputs."""
    shape = SHAPES[shape_name]
    x = make_inputs(shape, dtype, batch, ctx, seed=batch * 1000 + ctx)
    diff = (call(ours, x).float() - call(base, x).float()).abs().max().item()
    times: dict[str, list[float]] = {"ours": [], "base": []}
    for _ in range(rounds):
        for side, ops in (("ours", ours), ("base", base)):
            times[side].append(time_calls(ops, x, calls))
    ours_s, base_s = statistics.median(times["ours"]), statistics.median(times["base"])
    kv_bytes = 2 * batch * ctx * shape[1] * shape[2] * x["rows"].element_size()
    dtype_name = str(dtype).removeprefix("torch.")
    log(f"{shape_name} {dtype_name} batch {batch} ctx {ctx}: {ours_s * 1e6:.0f} us vs {base_s * 1e6:.0f} us "
        f"({ours_s / base_s:.2f}x), diff {diff:.2e}")
    return {"shape": shape_name, "dtype": dtype_name, "batch": batch, "context": ctx,
            "ours_us": ours_s * 1e6, "base_us": base_s * 1e6, "ratio": ours_s / base_s,
            "ours_gbps": kv_bytes / ours_s / 1e9, "base_gbps": kv_bytes / base_s / 1e9, "max_abs_diff": diff}


def main(argv: list[str] | None = None) -> int:
    """Time the working tree's kernel against `--base`'s on each point; print and write the table."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--base", default="HEAD",
                   help="git revision whose paged_decode.cpp is the baseline ('self': the working tree's kernel "
                        "against itself, nothing to build: a smoke run)")
    p.add_argument("--shapes", default="smollm2,tiny", help=f"of {','.join(SHAPES)}")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--batches", default="8,32,64")
    p.add_argument("--contexts", default="64,512")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=30)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    import torch

    from inference.engine.cpu_kernels import load_kernels

    torch.set_num_threads(args.threads)
    if args.quick:
        args.batches, args.contexts, args.rounds, args.calls = "4", "40", 2, 3
    ours = load_kernels()
    if ours is None:
        print("the CPU kernels are not built here (needs a C++ compiler and ninja)", file=sys.stderr)
        return 1
    base = ours if args.base == "self" else build_base(args.base)
    points = [
        measure_point(ours, base, shape, getattr(torch, dtype), batch, ctx, args.rounds, args.calls)
        for shape in args.shapes.split(",") for dtype in args.dtypes.split(",")
        for batch in map(int, args.batches.split(",")) for ctx in map(int, args.contexts.split(","))
    ]
    print_header(f"paged decode attention: working tree ÷ {args.base}")
    print(markdown_table(
        ["shape", "dtype", "batch", "context", "ours µs", "base µs", "ours ÷ base", "ours GB/s", "base GB/s"],
        [[q["shape"], q["dtype"], q["batch"], q["context"], fmt(q["ours_us"], 0), fmt(q["base_us"], 0),
          fmt(q["ratio"]), fmt(q["ours_gbps"], 1), fmt(q["base_gbps"], 1)] for q in points]))
    write_result(args.out_dir, "paged_attention", MODULE, argv, {"base": args.base, "points": points})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
