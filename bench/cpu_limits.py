"""The core's limits and the engine's decode step as a share of them, measured in one run.

A decode step of a small model on one CPU core is bound either by reading the weights (every
projection's weights are streamed once per step, whatever the batch) or by the arithmetic (2 FLOP per
weight per sequence of the batch). This benchmark measures both limits on the machine at hand, with
one torch thread, and then the engine's decode throughput at several batch sizes, and reports

- **bandwidth share**: weight bytes read per second by the engine's steps ÷ the measured read
  bandwidth (a STREAM-like sum over a buffer far larger than the caches);
- **compute share**: FLOP per second of the engine's projections ÷ the measured peak of a large
  square GEMM in the engine's dtype (the faster of `torch.mm` and the engine's prepacked oneDNN linear:
  the practical peak of one core; AMX tiles in bf16 where the CPU has them).

Both from two measurements per batch size: tok/s over whole `generate` calls (prompts prefilled, the
batch ramping up and draining: what a client sees), and the **steady** decode step (the median
`engine.step()` with the batch already decoding: the step the limits bound).

The weight bytes and FLOP per token come from the checkpoint's tensor shapes (safetensors headers),
not from the engine's internals: every linear weight (and the LM head, tied or not) is read once per
step and costs 2 FLOP per element per sequence; attention's share is left out (short contexts here),
so the compute share is a slight under-estimate.

    .venv/bin/python -m bench.cpu_limits                      # SmolLM2 if prepared, else tiny; auto dtype
    .venv/bin/python -m bench.cpu_limits --dtype bfloat16 --batches 1,8,32,64
    .venv/bin/python -m bench.cpu_limits --quick              # seconds: checks it runs
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import (
    base_parser,
    fmt,
    markdown_table,
    parse_args,
    print_header,
    smollm2_dir,
    synthetic_prompts,
    tiny_model_dir,
    torch_threads,
    write_result,
)

MODULE = "bench.cpu_limits"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def read_bandwidth_gbs(megabytes: int, repeats: int) -> dict[str, Any]:
    """Best-of-`repeats` read bandwidth (GB/s) of one thread summing a float32 buffer of `megabytes`."""
    import torch

    buf = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    buf.sum()  # touch every page once, so the first timed pass does not pay the page faults
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - started)
    best = min(times)
    return {"megabytes": megabytes, "repeats": repeats, "best_s": best, "gb_per_s": buf.numel() * 4 / best / 1e9}


def peak_gemm_gflops(dtype: str, n: int, repeats: int) -> dict[str, Any]:
    """Best-of-`repeats` GFLOP/s of one thread multiplying two n x n matrices in `dtype`, on the fastest
    of the GEMMs at hand: `torch.mm` (oneDNN or MKL) and the engine's prepacked oneDNN linear (its weight
    reordered once, as `cpu_linear.PrepackedLinear` runs it). On an AMX CPU both reach oneDNN's AMX
    kernel in bf16 (`brg_matmul:avx10_1_512_amx` in ONEDNN_VERBOSE); elsewhere the faster one counts."""
    import torch

    torch_dtype = getattr(torch, dtype)
    a = torch.randn(n, n).to(torch_dtype)
    b = torch.randn(n, n).to(torch_dtype)
    kernels = {"torch.mm": lambda: torch.mm(a, b)}
    try:
        from torch import nn

        from inference.engine.cpu_linear import PrepackedLinear, prepacked_linear_available

        if prepacked_linear_available(torch_dtype, torch.device("cpu")):
            linear = nn.Linear(n, n, bias=False).to(torch_dtype)
            with torch.no_grad():
                linear.weight.copy_(b.t())
            packed = PrepackedLinear(linear, batch_hint=n)
            kernels["onednn prepacked"] = lambda: packed(a)
    except (ImportError, RuntimeError):  # no oneDNN in this torch: torch.mm alone
        pass
    best = {}
    with torch.inference_mode():
        for name, run in kernels.items():
            run()  # warm-up: primitive creation, page faults
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                run()
                times.append(time.perf_counter() - started)
            best[name] = 2 * n**3 / min(times) / 1e9
    kernel = max(best, key=lambda k: best[k])
    return {"dtype": dtype, "n": n, "repeats": repeats, "kernel": kernel, "gflops": best[kernel],
            "gflops_per_kernel": best}


def weight_elements(model_dir: Path) -> dict[str, int]:
    """Elements of the weights one decode step reads in full: every 2-D projection and the LM head.

    The input embedding is only gathered (a row per sequence), so it counts only where it doubles as
    the LM head (tied embeddings, no separate `lm_head.weight`). Norm weights and biases are noise.
    """
    from safetensors import safe_open

    linear = 0
    embedding = 0
    head = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shape = f.get_slice(name).get_shape()
                if len(shape) != 2:
                    continue
                count = int(shape[0]) * int(shape[1])
                if name.endswith("embed_tokens.weight"):
                    embedding = count
                elif name.endswith("lm_head.weight"):
                    head = count
                else:
                    linear += count
    return {"linear": linear, "lm_head": head or embedding, "tied": int(not head)}


def request_gflop(model_dir: Path, prompt_len: int, max_tokens: int) -> float:
    """GFLOP one request of `prompt_len` prompt tokens and `max_tokens` output tokens costs any engine.

    Every prompt token passes through every projection (2 FLOP per weight element), the LM head runs
    once per emitted token (the prefill's last row gives the first), and attention adds 4 FLOP per
    query head dimension per attended position (q·k and the weighted sum of v; causal in the prefill).
    Nothing an engine can skip on a fresh prompt: the floor both engines of a comparison share.
    """
    config = json.loads((model_dir / "config.json").read_text())
    weights = weight_elements(model_dir)
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    tokens = prompt_len + max_tokens - 1  # every token but the last emitted one is fed through the model
    # attended positions summed over the fed tokens: token i (0-based) attends to i + 1 positions
    attended = tokens * (tokens + 1) // 2
    flop = (2 * weights["linear"] * tokens + 2 * weights["lm_head"] * max_tokens
            + 4 * layers * heads * head_dim * attended)
    return flop / 1e9


def engine_decode_tps(model_dir: Path, dtype: str, batch: int, max_tokens: int, waves: int) -> dict[str, Any]:
    """Output tok/s of the engine with exactly `batch` sequences decoding (short prompts, fixed length)."""
    from bench.engine_throughput import _engine, engine_generate_tps

    engine = _engine(model_dir, max_num_seqs=max(batch, 1), max_len=64 + max_tokens, dtype=dtype)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    prompts = synthetic_prompts(batch * waves, 8, vocab, seed=batch)
    engine_generate_tps(engine, prompts[:batch], 4, batch, batch)  # warm-up: kernels, allocator
    result = engine_generate_tps(engine, prompts, max_tokens, batch, batch * waves)
    result["engine_dtype"] = str(engine.dtype).removeprefix("torch.")
    return result


def steady_engine(model_dir: Path, dtype: str, batch: int, steps: int) -> Any:
    """An engine with exactly `batch` sequences decoding (32-token prompts, already prefilled and a few
    steps in, room for `steps` more): the steady decode step, without `generate`'s prefills, ramp-up and
    drain."""
    from bench.engine_throughput import _engine
    from inference.engine import SamplingParams

    engine = _engine(model_dir, max_num_seqs=max(batch, 1), max_len=64 + steps + 16, dtype=dtype)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(synthetic_prompts(batch, 32, vocab, seed=batch)):
        engine.add_request(f"steady-{i}", prompt, params)
    while engine.num_running < batch:
        engine.step()
    for _ in range(4):  # warm-up: the decode fast path's caches
        engine.step()
    return engine


def engine_steady_step_ms(model_dir: Path, dtype: str, batch: int, steps: int) -> float:
    """Median ms of one steady decode step at `batch` sequences (`steady_engine`): the step the limits bound."""
    engine = steady_engine(model_dir, dtype, batch, steps)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return 1e3 * sorted(times)[len(times) // 2]


def shares(weights: dict[str, int], dtype: str, tps: float, batch: int, bandwidth_gbs: float,
           peak_gflops: float) -> dict[str, float]:
    """The engine's step as a share of the read bandwidth and of the compute peak."""
    elements = weights["linear"] + weights["lm_head"]
    steps_per_s = tps / batch
    weight_gbs = elements * DTYPE_BYTES[dtype] * steps_per_s / 1e9
    gflops = 2 * elements * tps / 1e9
    return {"steps_per_s": steps_per_s, "weight_gb_per_s": weight_gbs, "bandwidth_share": weight_gbs / bandwidth_gbs,
            "gflops": gflops, "compute_share": gflops / peak_gflops}


def _resolve_dtype(requested: str, model_dir: Path) -> str:
    """The dtype the engine runs for `requested` on this CPU (auto: bf16 only with native support)."""
    if requested != "auto":
        return requested
    import torch

    from inference.engine.dtypes import resolve_dtype

    hidden = int(json.loads((model_dir / "config.json").read_text())["hidden_size"])
    return str(resolve_dtype("auto", torch.device("cpu"), hidden_size=hidden)).removeprefix("torch.")


def main(argv: Sequence[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--dtype", default="auto", help="engine dtype: auto (the engine's choice), float32, bfloat16")
    p.add_argument("--batches", default="1,8,32,64", help="decode batch sizes")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per sequence")
    p.add_argument("--waves", type=int, default=2, help="waves of `batch` requests per batch size")
    p.add_argument("--buffer-mb", type=int, default=1024, help="read-bandwidth buffer (far above the L3)")
    p.add_argument("--gemm-n", type=int, default=2048, help="square GEMM size of the peak probe")
    p.add_argument("--steady-steps", type=int, default=30,
                   help="decode steps timed per batch size with the batch already decoding (median kept)")
    args = parse_args(p, argv or [])
    argv = list(argv or [])
    if args.quick:
        args.batches, args.max_tokens, args.waves, args.buffer_mb, args.gemm_n = "1,4", 8, 1, 64, 256
        args.steady_steps = 3
    model_dir = args.model_dir or (None if args.quick else smollm2_dir()) or tiny_model_dir()
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    print_header(f"CPU limits and the decode step ({model_dir.name})")
    with torch_threads(args.threads):
        dtype = _resolve_dtype(args.dtype, model_dir)
        bandwidth = read_bandwidth_gbs(args.buffer_mb, repeats=3 if args.quick else 7)
        peak = peak_gemm_gflops(dtype, args.gemm_n, repeats=2 if args.quick else 5)
        weights = weight_elements(model_dir)
        rows = []
        for batch in batches:
            run = engine_decode_tps(model_dir, dtype, batch, args.max_tokens, args.waves)
            step_ms = engine_steady_step_ms(model_dir, dtype, batch, args.steady_steps)
            steady = shares(weights, dtype, batch * 1e3 / step_ms, batch, bandwidth["gb_per_s"], peak["gflops"])
            rows.append({"batch": batch, **run,
                         **shares(weights, dtype, run["tokens_per_s"], batch, bandwidth["gb_per_s"], peak["gflops"]),
                         "steady_step_ms": step_ms, "steady": steady})
    table = markdown_table(
        ["batch", "tok/s", "steps/s", "weights GB/s", "share of read bandwidth", "GFLOP/s", "share of GEMM peak",
         "steady step ms", "steady: share of read bandwidth", "steady: share of GEMM peak"],
        [[r["batch"], fmt(r["tokens_per_s"], 1), fmt(r["steps_per_s"], 1), fmt(r["weight_gb_per_s"], 2),
          f"{100 * r['bandwidth_share']:.0f} %", fmt(r["gflops"], 1), f"{100 * r['compute_share']:.0f} %",
          fmt(r["steady_step_ms"], 2), f"{100 * r['steady']['bandwidth_share']:.0f} %",
          f"{100 * r['steady']['compute_share']:.0f} %"]
         for r in rows])
    per_kernel = ", ".join(f"{k} {v:.1f}" for k, v in peak["gflops_per_kernel"].items())
    print(f"read bandwidth {bandwidth['gb_per_s']:.1f} GB/s; {dtype} GEMM peak {peak['gflops']:.1f} GFLOP/s "
          f"({peak['kernel']}; {per_kernel}; n = {args.gemm_n}, one thread)\n{table}")
    name = "cpu_limits_quick" if args.quick else f"cpu_limits_{model_dir.name}_{dtype}"
    path = write_result(args.out_dir, name, MODULE, argv, {
        "model": model_dir.name, "dtype": dtype, "weights": weights, "read_bandwidth": bandwidth,
        "gemm_peak": peak, "decode": rows, "table": table,
    })
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
