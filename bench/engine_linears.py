"""The engine's linear kernels per shape and row count: the panel GEMM (and, in bf16 on a CPU with AMX, the
AMX-tile GEMM) against oneDNN's prepacked kernel.

One decode step of a model runs every projection of every layer once, with as many rows as sequences
in flight. This benchmark builds those projections with random weights of the checkpoint's shapes, one
distinct weight per layer (so the weights stream from memory as in the engine, not from the cache), packs
them for each kernel (`PrepackedLinear`: oneDNN; `PanelLinear`: csrc/panel_gemm*.cpp; `AmxLinear`:
csrc/amx_gemm.cpp) and times a whole step's projections per row count, the kernels alternating, best of
`--repeats`. It reports the step's time per kernel and per shape, and each kernel's ratio to oneDNN (below
1: faster), which is what `cpu_linear.panel_rows_limit` and `AMX_ROWS` are set from on each CPU kind.

    .venv/bin/python -m bench.engine_linears                                  # SmolLM2 shapes, fp32 and bf16
    .venv/bin/python -m bench.engine_linears --dtypes bfloat16 --rows 1,8,64
    .venv/bin/python -m bench.engine_linears --dtypes bfloat16 --kernels onednn,amx   # the AMX CPU kind
    .venv/bin/python -m bench.engine_linears --quick                          # seconds: checks it runs
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import (
    base_parser,
    markdown_table,
    parse_args,
    print_header,
    smollm2_dir,
    tiny_llama_hd64_dir,
    torch_threads,
    write_result,
)

MODULE = "bench.engine_linears"
KERNELS = ("onednn", "panel", "amx")


def projection_shapes(model_dir: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(layers, {name: (out_features, in_features)}) of the engine's linears for the checkpoint's config:
    fused q/k/v and gate/up as the engine runs them, and the LM head (once per step)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads", cfg["num_attention_heads"]))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    return int(cfg["num_hidden_layers"]), {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (int(cfg["vocab_size"]), hidden),
    }


def build_step(layers: int, shapes: dict[str, tuple[int, int]], dtype: Any, ops: Any,
               kernels: Sequence[str] = ("onednn", "panel")) -> dict[str, Any]:
    """{kernel: {shape name: [packed linear per layer]}} with the same random weights for every kernel
    ("onednn" always first: the ratios' base)."""
    import torch
    from torch import nn

    from inference.engine.amx_linear import AmxLinear
    from inference.engine.cpu_linear import PanelLinear, PrepackedLinear

    torch.manual_seed(0)
    step: dict[str, Any] = {k: {} for k in kernels}
    for name, (out_f, in_f) in shapes.items():
        count = 1 if name == "lm_head" else layers
        plain = [nn.Linear(in_f, out_f, bias=False).to(dtype) for _ in range(count)]
        step["onednn"][name] = [PrepackedLinear(lin, batch_hint=32) for lin in plain]
        if "panel" in step:
            step["panel"][name] = [PanelLinear(lin, ops) for lin in plain]
        if "amx" in step:
            step["amx"][name] = [AmxLinear(lin, ops) for lin in plain]
    return step


def time_step(linears: dict[str, list[Any]], x: dict[int, Any]) -> dict[str, float]:
    """Seconds per shape name of one pass over every layer's projection (inputs by in_features)."""
    out = {}
    for name, mods in linears.items():
        started = time.perf_counter()
        for mod in mods:
            mod(x[mod.in_features])
        out[name] = time.perf_counter() - started
    return out


def measure(step: dict[str, Any], rows: int, dtype: Any, repeats: int) -> dict[str, dict[str, float]]:
    """Best-of-`repeats` seconds per kernel and shape at `rows` rows, kernels alternating each repeat."""
    import torch

    widths = {mod.in_features for mods in step["onednn"].values() for mod in mods}
    x = {k: torch.randn(rows, k).to(dtype) for k in widths}
    best: dict[str, dict[str, float]] = {k: {} for k in step}
    with torch.inference_mode():
        for kernel in step:  # warm-up: oneDNN's primitive cache, page faults
            time_step(step[kernel], x)
        for _ in range(repeats):
            for kernel in step:
                for name, secs in time_step(step[kernel], x).items():
                    best[kernel][name] = min(secs, best[kernel].get(name, float("inf")))
    return best


def compare(model_dir: Path, dtype_name: str, rows_list: Sequence[int], repeats: int, ops: Any,
            kernels: Sequence[str] = ("onednn", "panel")) -> dict[str, Any]:
    """The kernels at every row count for one dtype; a row per (rows, shape) plus the whole step."""
    import torch

    dtype = getattr(torch, dtype_name)
    layers, shapes = projection_shapes(model_dir)
    step = build_step(layers, shapes, dtype, ops, kernels)
    results = []
    for rows in rows_list:
        best = measure(step, rows, dtype, repeats)
        for name in [*shapes, "step"]:
            ms = {k: 1e3 * (sum(best[k].values()) if name == "step" else best[k][name]) for k in step}
            results.append({"rows": rows, "shape": name, **{f"{k}_ms": v for k, v in ms.items()},
                            **{f"{k}_over_onednn": ms[k] / ms["onednn"] for k in step if k != "onednn"}})
    del step
    return {"dtype": dtype_name, "layers": layers, "shapes": shapes, "kernels": list(kernels), "results": results}


def kernels_for(dtype_name: str, wanted: Sequence[str], variants: Sequence[str], amx: bool) -> list[str]:
    """The kernels of `wanted` that exist here for `dtype_name`, oneDNN first: the panels where the build
    has them for the dtype, the AMX GEMM for bf16 where it runs."""
    have = {"onednn": True, "panel": dtype_name == "float32" or "bfloat16" in variants,
            "amx": dtype_name == "bfloat16" and amx}
    return ["onednn", *[k for k in KERNELS if k != "onednn" and k in wanted and have[k]]]


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    from inference.engine.amx_linear import amx_kernel_available
    from inference.engine.cpu_kernels import load_kernels

    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="float32,bfloat16", help="dtypes to measure (bf16 needs the bf16 panel kernel)")
    p.add_argument("--rows", default="1,8,16,32,64,256", help="row counts (sequences in flight)")
    p.add_argument("--repeats", type=int, default=5, help="alternating repeats per row count (best is kept)")
    p.add_argument("--kernels", default=",".join(KERNELS),
                   help="kernels to time beside oneDNN, where they exist here (panel; amx: bf16 with AMX-BF16)")
    args = parse_args(p, argv or [])
    argv = list(argv or [])
    ops = load_kernels()
    if ops is None:
        p.error("the CPU kernels do not build here (see the log); nothing to compare")
    variants = list(ops.panel_variants())
    dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = [d for d in dtypes if d not in ("float32", "bfloat16")]
    if unknown:
        p.error(f"--dtypes: {', '.join(unknown)} not measurable (float32, bfloat16)")
    amx = amx_kernel_available(ops)
    wanted = [k for k in args.kernels.split(",") if k]
    unknown = [k for k in wanted if k not in KERNELS]
    if unknown:
        p.error(f"--kernels: {', '.join(unknown)} unknown ({', '.join(KERNELS)})")
    per_dtype = {d: kernels_for(d, wanted, variants, amx) for d in dtypes}
    for d in [d for d, ks in per_dtype.items() if ks == ["onednn"]]:
        print(f"no kernel of {wanted} for {d} in this build ({variants}, AMX: {amx}): {d} skipped")
        dtypes.remove(d)
    if args.quick:
        args.rows, args.repeats = "1,9", 1
    model_dir = args.model_dir or (None if args.quick else smollm2_dir()) or tiny_llama_hd64_dir()
    rows_list = [int(r) for r in args.rows.split(",") if r.strip()]
    capability = torch.backends.cpu.get_cpu_capability()
    print_header(f"linear kernels per shape and row count ({model_dir.name}, {capability})")
    with torch_threads(args.threads):
        runs = [compare(model_dir, d, rows_list, args.repeats, ops, per_dtype[d]) for d in dtypes]
    for run in runs:
        others = [k for k in run["kernels"] if k != "onednn"]
        table = markdown_table(
            ["rows", "projection", "oneDNN ms", *[f"{k} ms" for k in others], *[f"{k} ÷ oneDNN" for k in others]],
            [[r["rows"], r["shape"], f"{r['onednn_ms']:.3f}", *[f"{r[k + '_ms']:.3f}" for k in others],
              *[f"{r[k + '_over_onednn']:.2f}" for k in others]] for r in run["results"]])
        run["table"] = table
        print(f"\n**{run['dtype']}**, {run['layers']} layers, best of {args.repeats}\n\n{table}")
    name = "engine_linears_quick" if args.quick else f"engine_linears_{model_dir.name}"
    path = write_result(args.out_dir, name, MODULE, argv, {
        "model": model_dir.name, "cpu_capability": capability,
        "panel_variants": variants, "amx": amx, "runs": runs})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
