"""Where one steady decode step's time goes: every call into the CPU kernels timed by name (the linears by
kernel and shape), the rest of `engine.step()` (Python, torch glue, oneDNN linears) as one remainder.

The engine's compiled kernel module (cpu_kernels.py) is wrapped before the engine is built, so every
`ops.<name>(...)` the model makes is timed with perf_counter around the call: the AMX-tile and panel
GEMMs per (kind, out, in) shape, paged attention, the fused element-wise ops, argmax. The wrapper costs
~1 us a call (a few hundred calls a step); `rest` is the step minus the timed calls, so oneDNN's
linears (rows above the own kernels' limit) fall in it. The decode step is measured as
`bench.cpu_limits`' steady step: `batch` sequences decoding, 32-token prompts, after warm-up.

    .venv/bin/python -m bench.step_breakdown --dtype bfloat16 --batches 8,32,64
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

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


def main(argv: Sequence[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", help="engine dtype: float32, bfloat16")
    p.add_argument("--batches", default="8,32,64", help="sequences decoding")
    p.add_argument("--steps", type=int, default=20, help="steady steps timed per batch")
    args = parse_args(p, argv or [])
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


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
