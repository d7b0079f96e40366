"""Where one steady decode step's time goes: every call into the CPU kernels timed by name (the linears by
kernel and shape), the rest of `engine.step()` (Python, torch glue, oneDNN linears) as one remainder.

The engine's compiled kernel module (cpu_kernels.py) is wrapped before the engine is built, so every
`ops.<name>(...)` the model makes is timed with perf_counter around the call: the AMX-tile and panel
GEMMs per (kind, out, in) shape, paged attention, the fused element-wise ops, argmax. The wrapper costs
~1 us a call (a few hundred calls a step); `rest` is the step minus the timed calls, so oneDNN's
linears (rows above the own kernels' limit) fall in it. The decode step is measured as
`bench.cpu_limits`' steady step: `batch` sequences decoding, 32-token prompts, after warm-up.

    .venv/bin/python -m bench.step_breakdown --dtype bfloat16 --batches 8,32,64

Prefill mode (`--prefill 1x512,4x512,1x2048`: prompts x tokens, one step each, fresh random prompts,
no prefix hit): every linear module timed by projection and kernel (oneDNN above the own kernels' row
limit), `Attention._prefill` (attention), `Attention._write_kv` (copies into the paged KV cache), the
kernel calls (norms, RoPE, SiLU·mul; the linears' own kernel calls are inside the linears' time), the
model's forward beside it (`glue in the forward`: embedding, RoPE tables, residual adds, indexing) and
`engine glue` (scheduler, metadata, sampling, outputs: the step minus the forward).

    .venv/bin/python -m bench.step_breakdown --dtype bfloat16 --prefill 1x512,4x512,1x2048
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from bench.common import (
    base_parser,
    parse_args,
    print_header,
    smollm2_dir,
    tiny_llama_hd64_dir,
    torch_threads,
    write_result,
)
from bench.cpu_limits import steady_engine

MODULE = "bench.step_breakdown"
# Kernel entry points whose calls are linears: named by (kernel, out, in) from their packed operand.
LINEARS = {"amx_linear", "panel_linear"}


class TimedOps:
    """The compiled kernel module with every function call timed into `totals` (seconds by label)."""

    def __init__(self, ops: Any) -> None:
        """Wrap `ops` (the module `cpu_kernels.load_kernels` returns)."""
        self._ops = ops
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._ops, name)
        if not callable(attr) or name in ("amx_available", "panel_variants", "amx_pack"):
            return attr
        return self._timed(name, attr)

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            out = fn(*args, **kwargs)
            label = name
            if name in LINEARS and hasattr(args[0], "shape") and hasattr(out, "shape"):
                label = f"{name} {int(out.shape[-1])}x{int(args[0].shape[-1])}"
            self.totals[label] += time.perf_counter() - started
            self.calls[label] += 1
            return out

        return call

    def reset(self) -> None:
        """Forget what was timed so far (warm-up)."""
        self.totals.clear()
        self.calls.clear()


def breakdown(model_dir: Path, dtype: str, batch: int, steps: int) -> dict[str, Any]:
    """Mean ms per label over `steps` steady decode steps at `batch` sequences, and the mean step."""
    from inference.engine import cpu_kernels

    real = cpu_kernels.load_kernels()
    if real is None:
        raise SystemExit("the CPU kernels do not build here: nothing to break down")
    timed = TimedOps(real)
    cpu_kernels._module = timed  # the engine built below loads this wrapper
    try:
        engine = steady_engine(model_dir, dtype, batch, steps)
        timed.reset()
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step_ms = 1e3 * (time.perf_counter() - started) / steps
    finally:
        cpu_kernels._module = real
    parts = {label: 1e3 * secs / steps for label, secs in timed.totals.items()}
    parts["rest (Python, torch glue, oneDNN)"] = step_ms - sum(parts.values())
    return {
        "batch": batch,
        "step_ms": step_ms,
        "parts_ms": dict(sorted(parts.items(), key=lambda kv: -kv[1])),
        "calls_per_step": {k: v / steps for k, v in timed.calls.items()},
    }


def _wrap(obj: Any, attr: str, label: Callable[..., str], totals: dict[str, float]) -> Callable[[], None]:
    """Time every call of `obj.attr` into `totals[label(*args)]` (an instance attribute shadowing the
    method); returns the undo."""
    orig = getattr(obj, attr)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return orig(*args, **kwargs)
        finally:
            totals[label(*args)] += time.perf_counter() - started

    setattr(obj, attr, timed)
    return lambda: delattr(obj, attr)


def prefill_breakdown(model_dir: Path, dtype: str, prompts: int, length: int, repeats: int) -> dict[str, Any]:
    """Mean ms per part over `repeats` prefill steps of `prompts` fresh prompts of `length` tokens."""
    import json

    from bench.common import synthetic_prompts
    from inference.engine import LLMEngine, SamplingParams, cpu_kernels
    from inference.engine.packed_linear import OwnKernelLinear

    real = cpu_kernels.load_kernels()
    timed = TimedOps(real) if real is not None else None
    if timed is not None:
        cpu_kernels._module = timed
    try:
        engine = LLMEngine(str(model_dir), block_size=16, max_num_seqs=prompts, max_model_len=length + 16,
                           max_num_batched_tokens=max(2048, prompts * length), dtype=dtype)
    finally:
        if timed is not None:
            cpu_kernels._module = real
    engine.scheduler.prefill_wave_steps = 1  # the whole set in one step, as `generate` takes it
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    sets = synthetic_prompts(prompts * (repeats + 1), length, vocab, seed=prompts * length)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    totals: dict[str, float] = defaultdict(float)
    model = engine.runner.model
    undo = [_wrap(model, "forward", lambda *a: "forward", totals)]
    for name, module in model.named_modules():
        if hasattr(module, "_prefill"):
            undo.append(_wrap(module, "_prefill", lambda *a: "attention (Attention._prefill)", totals))
            undo.append(_wrap(module, "_write_kv", lambda *a: "KV cache writes (index_copy_)", totals))
        if isinstance(module, nn.Linear) or hasattr(module, "_linear2d"):
            short = name.rsplit(".", 1)[-1]

            def label(x: Any, _short: str = short, _m: Any = module) -> str:
                rows = x.numel() // x.shape[-1]
                own = isinstance(_m, OwnKernelLinear) and (_m.max_rows is None or rows <= _m.max_rows)
                return f"linear {_short} ({'own kernel' if own else 'oneDNN'})"

            undo.append(_wrap(module, "forward", label, totals))
    steps = []
    try:
        for r in range(repeats + 1):
            for i, prompt in enumerate(sets[r * prompts:(r + 1) * prompts]):
                engine.add_request(f"p{r}-{i}", prompt, params)
            totals.clear()
            if timed is not None:
                timed.reset()
            started = time.perf_counter()
            engine.step()
            step_s = time.perf_counter() - started
            if r:  # the first is the warm-up
                kernel = {k: v for k, v in (timed.totals if timed else {}).items() if k.split()[0] not in LINEARS}
                steps.append((step_s, dict(totals), kernel))
            while engine.has_work():
                engine.step()
    finally:
        for u in reversed(undo):
            u()
    mean = lambda xs: 1e3 * sum(xs) / len(xs)  # noqa: E731
    step_ms = mean([s for s, _, _ in steps])
    parts: dict[str, float] = defaultdict(float)
    for _, tot, kern in steps:
        for k, v in tot.items():
            parts[k] += 1e3 * v / len(steps)
        for k, v in kern.items():
            parts[f"kernel {k}"] += 1e3 * v / len(steps)
    forward = parts.pop("forward")
    inside = sum(v for k, v in parts.items())
    parts["glue in the forward (embedding, RoPE tables, adds, indexing)"] = forward - inside
    parts["engine glue (scheduler, metadata, sampling, outputs)"] = step_ms - forward
    return {"prompts": prompts, "tokens": length, "step_ms": step_ms, "ms_per_token": step_ms / (prompts * length),
            "forward_ms": forward, "parts_ms": dict(sorted(parts.items(), key=lambda kv: -kv[1]))}


def main(argv: Sequence[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", help="engine dtype: float32, bfloat16")
    p.add_argument("--batches", default="8,32,64", help="sequences decoding")
    p.add_argument("--steps", type=int, default=20, help="steady steps timed per batch")
    p.add_argument("--prefill", default="", help="prefill mode: comma-separated PROMPTSxTOKENS, one step each")
    p.add_argument("--repeats", type=int, default=3, help="prefill mode: timed steps per case")
    args = parse_args(p, argv or [])
    if args.prefill:
        return prefill_main(args, list(argv or []))
    if args.quick:
        args.batches, args.steps = "2", 2
    model_dir = args.model_dir or (None if args.quick else smollm2_dir()) or tiny_llama_hd64_dir()
    print_header(f"one decode step's time by kernel ({model_dir.name}, {args.dtype})")
    runs = []
    with torch_threads(args.threads):
        for batch in [int(b) for b in args.batches.split(",") if b.strip()]:
            run = breakdown(model_dir, args.dtype, batch, args.steps)
            runs.append(run)
            print(f"\n== {args.dtype} batch {batch}: mean step {run['step_ms']:.2f} ms")
            for label, ms in run["parts_ms"].items():
                print(f"  {label:<40} {ms:8.2f} ms {100 * ms / run['step_ms']:6.1f} %")
    name = "step_breakdown_quick" if args.quick else f"step_breakdown_{model_dir.name}_{args.dtype}"
    path = write_result(
        args.out_dir, name, MODULE, list(argv or []), {"model": model_dir.name, "dtype": args.dtype, "runs": runs}
    )
    print(f"wrote {path}")
    return 0


def prefill_main(args: Any, argv: list[str]) -> int:
    """The prefill mode: print each case's parts and write the JSON."""
    model_dir = args.model_dir or (None if args.quick else smollm2_dir()) or tiny_llama_hd64_dir()
    cases = "1x32,2x16" if args.quick else args.prefill
    repeats = 1 if args.quick else args.repeats
    print_header(f"one prefill step's time by part ({model_dir.name}, {args.dtype})")
    runs = []
    with torch_threads(args.threads):
        for case in [c.strip() for c in cases.split(",") if c.strip()]:
            n, _, length = case.partition("x")
            run = prefill_breakdown(model_dir, args.dtype, int(n), int(length), repeats)
            runs.append(run)
            print(f"\n== {args.dtype} prefill {case}: mean step {run['step_ms']:.1f} ms, "
                  f"{run['ms_per_token']:.3f} ms a token")
            for label, ms in run["parts_ms"].items():
                print(f"  {label:<62} {ms:8.2f} ms {100 * ms / run['step_ms']:6.1f} %")
    name = "step_breakdown_prefill_quick" if args.quick else f"step_breakdown_prefill_{model_dir.name}_{args.dtype}"
    path = write_result(args.out_dir, name, MODULE, argv, {"model": model_dir.name, "dtype": args.dtype,
                                                           "prefill": runs})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
