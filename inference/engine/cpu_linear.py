"""Prepacked linears for the CPU: oneDNN's (bf16 and fp32) and the engine's own fp32 panel kernel.

`F.linear` on bf16 CPU tensors hands the weight to oneDNN in PyTorch's plain layout, so every call
pays a reorder into the blocked layout the AMX kernel wants plus a primitive lookup. Reordering each
weight once (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU freezing pass does) and
calling `torch.ops.mkldnn._linear_pointwise` removes that: measured on the AMX machine of issue 12
(one thread) 1.2-2.3x faster per projection at decode shapes (8-64 rows) and 1.5x at 300 rows,
bit-identical outputs.

fp32 is prepacked too since the fourth session: on its AMD EPYC (AVX-512, no AMX) `F.linear` in fp32
(MKL) was 2.4-2.7x slower per projection than oneDNN's packed kernel at 8-64 rows (SmolLM2's MLP
shapes), and the engine's fp32 tokens/s about doubled (alternating A/B). oneDNN sums in another order:
outputs differ from `F.linear` by ~1e-6 relative, SmolLM2's fp32 logits from transformers' by 1.0e-4
at most (5.3e-5 before; test_logits_parity.py allows 5e-4), greedy tokens unchanged in the tests.

On an AVX2-only CPU (sixth session, AMD EPYC without AVX-512) fp32 runs on the engine's own panel
kernel instead (csrc/panel_gemm.cpp, `PanelLinear`): oneDNN's fp32 kernel streamed the weights of an
8-row decode step at ~13 GB/s there, the panel kernel ran SmolLM2's projections 1.25-1.4x faster at 8
and 16 rows and 1.05-1.1x at 64-256. On AVX-512 CPUs oneDNN's 16-wide kernels stayed then (the panel kernel
was 8 wide and was not measured there); `INFERENCE_PANEL_GEMM=1` / `0` forces it on / off.

Since the seventh session the panel kernel has AVX-512 variants (csrc/panel_gemm512.cpp): 16-wide fp32,
and bf16 with AVX512-BF16's `vdpbf16ps` (weights packed once in the pair-interleaved layout it reads,
fp32 accumulation). On an AMD EPYC Zen 4 (AVX512-BF16, no AMX) one SmolLM2 decode step's projections
ran in 0.59-0.90x oneDNN's time in bf16 and 0.73-0.91x in fp32 at 1-64 rows, and as fast or slower
at 256 (bench/engine_linears.py, docs/benchmarks.md). So the choice is per row count
(`panel_rows_limit`): rows up to the limit run on the panels, more rows (prefill chunks) on oneDNN's
prepacked copy of the same weight, kept beside the panels only where the limit is finite.

Since the fifteenth session the AVX-512 panels are packed in pairs interleaved step by step (one stream
per pair) and prefetched into L2: on a Zen 4 EPYC whose core is shared (~25 GB/s read, ~220 bf16 GFLOP/s)
an 8-row step's projections went from 18.2 to 12.1 ms in bf16 (0.74x -> 0.49x of oneDNN's time) and
0.67x as long in fp32, the LM head included (2.4 ms against oneDNN's 4.2 at 8 rows: one rule for every
shape still fits).

On an Intel Xeon with AMX-BF16 (family 6 model 207, twelfth session) oneDNN's bf16 kernel runs on AMX
tiles (`brg_matmul:avx10_1_512_amx` in ONEDNN_VERBOSE): a SmolLM2 step's projections took about as long
at 64 rows as at 8 (34 ms against 29), where the AVX512-BF16 panels grow with the rows (205 ms at 64).
The panels won there only at 1-4 rows: 0.58-0.87x of oneDNN's time in a busy run, where oneDNN's 1-2-row
time swung between 24.5 and 50 ms a step's projections from run to run (AMX tiles are shared by a core's
two hyperthreads); on a quiet core oneDNN took the same 9.3 ms at 1 to 8 rows for 30 gate/up projections
and the panels 8.0 ms at 1 row (1.16x). bf16 runs on oneDNN's AMX kernel at every row count anyway, 1-3
rows padded with zero rows to 4 (`ONEDNN_MIN_ROWS`; 3 % faster at 1 row when quiet): one kernel from 1 to
32 rows, which computes each row alike however many rows share the call (`ONEDNN_ROW_INVARIANT_ROWS`), so
a speculative engine's verify steps give a plain engine's greedy tokens (the panels at 1-4 rows beside
oneDNN above did not), for at most ~15 % of a lone stream's projections. AMX has no fp32 tiles:
fp32 runs on the 16-wide panels up to 64 rows (0.80-0.94x of oneDNN's avx512_core kernel), as on Zen 4.

Since the fourteenth session bf16 runs there on the engine's own AMX-tile GEMM up to 64 rows
(amx_linear.py, csrc/amx_gemm.cpp; `AMX_ROWS`), oneDNN's AMX kernel above (prefill chunks): each weight
packed once into B tiles in the order the kernel reads them, one prefetched sequential stream. A SmolLM2
step's projections took 0.68-0.74x of oneDNN's time at 1-32 rows (21.7 ms at 1 row: the weights at
~12.4 GB/s, the read probe's 11.9), 0.79-0.91x at 64 and 1.00-1.10x at 128. It computes each row alone at
any row count, so a speculative engine's verify steps are bounded by its limit (64), not oneDNN's 32.
`INFERENCE_AMX_GEMM=0` / `1` forces it off (oneDNN, as before) / on at every row count.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .amx_linear import AmxLinear, amx_kernel_available
from .dtypes import _cpu_flags
from .packed_linear import OwnKernelLinear, PackedLinear, onednn_linear, onednn_pack

logger = logging.getLogger(__name__)

PANEL_SWITCH = "INFERENCE_PANEL_GEMM"
AMX_SWITCH = "INFERENCE_AMX_GEMM"
# Every row count runs on the panel kernel.
ALL_ROWS = 1 << 62
# Up to how many rows the panel kernel runs, per CPU kind and dtype: the largest measured row count at
# which it beat oneDNN's prepacked kernel on a whole step's projections (docs/benchmarks.md; absent: never).
# AVX2 EPYC (sixth session): fp32 faster at every row count measured (8-256). AMD EPYC Zen 4 (seventh,
# the final tiles): bf16 0.59-0.90x of oneDNN's time at 1-64 rows, 1.05x at 256; fp32 0.73-0.91x at 1-64,
# 1.00x at 256. AMD EPYC Zen 5 (eighth session, a step's projections without the LM head, load 6-9): bf16
# 0.47-0.72x at 1-64 rows, 0.60x at 128, 0.78-0.90x at 256 (one run of three 1.38x), 0.90-0.94x at 512,
# 1.02-1.05x at 2048; fp32 0.62-0.92x at 1-64 rows, 1.00-1.04x at 256-2048; sixteenth session, with every pass
# over a pair prefetching the next pair (panel_gemm512.cpp), load 2.5-6.3: fp32 0.87-0.91x at 64, 0.92-0.97x
# at 128, 0.97x at 256, 1.02-1.06x at 512-2048 (so fp32 up to 256). Intel Xeon with AMX (family 6
# model 207, twelfth session): bf16 0.58-0.78x at 1-2 rows, 0.87x at 4, 1.00x at 6, 1.04-1.12x at 8 and
# 1.5-11x at 12-256 (oneDNN's AMX tiles: a 64-row step's projections in 34 ms against the panels' 205), and
# oneDNN padded to 4 rows matches the panels at 1-3 (ONEDNN_MIN_ROWS), so bf16 stays on oneDNN; fp32 (no AMX
# for fp32: oneDNN's avx512_core kernel) 0.80-0.94x at 1-64 rows, 1.04-1.06x at 128-256.
PANEL_ROWS: dict[tuple[str, torch.dtype], int] = {
    ("avx2", torch.float32): ALL_ROWS,
    ("avx512", torch.float32): 64,
    ("avx512", torch.bfloat16): 64,
    ("avx512-zen5", torch.float32): 256,
    ("avx512-zen5", torch.bfloat16): 512,
    ("avx512-amx", torch.float32): 64,
}
# Up to how many rows bf16 linears run on the engine's AMX-tile GEMM (amx_linear.py), per CPU kind: the largest
# measured row count at which it beat oneDNN's AMX kernel on a whole step's projections. Intel Xeon with AMX
# (family 6 model 207, fourteenth session, SmolLM2, load ~1.8): 0.70-0.74x of oneDNN's time at 1-16 rows,
# 0.68x at 32, 0.79-0.91x at 64, 1.00-1.10x at 128 (docs/benchmarks.md).
AMX_ROWS: dict[tuple[str, torch.dtype], int] = {
    ("avx512-amx", torch.bfloat16): 64,
}
# Up to how many rows sharing one call oneDNN's prepacked kernel computes each row exactly as it computes
# that row alone, per CPU kind and dtype, where that bound matters (measured, twelfth session, Intel Xeon
# with AMX, family 6 model 207, weights packed with a batch hint of 32: bf16 on the AMX kernel, SmolLM2's
# projection and LM-head shapes, bit-identical rows up to 32 and not at 33-300; splitting 40-256 rows into
# 32-row calls cost 1.6-2.4x one call). The panel kernel computes each row alone at every row count.
ONEDNN_ROW_INVARIANT_ROWS: dict[tuple[str, torch.dtype], int] = {
    ("avx512-amx", torch.bfloat16): 32,
}
# Fewer rows than this are padded with zero rows for oneDNN's prepacked kernel, per CPU kind and dtype:
# on the AMX Xeon (twelfth session) 1-2 bf16 rows were never faster than 4 (quiet: 9.55 against 9.26 ms for
# 30 gate/up projections; busy runs: up to 42.8 against 25.1 ms a step), and a padded row is bit for bit
# the row computed alone.
ONEDNN_MIN_ROWS: dict[tuple[str, torch.dtype], int] = {
    ("avx512-amx", torch.bfloat16): 4,
}
# AMD's Zen 5 (EPYC 9005) is cpu family 26 (0x1a); Zen 4 and Zen 3 are 25.
ZEN5_FAMILY = 26


def prepacked_linear_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether prepacked oneDNN linears apply: bf16 or fp32 weights on a CPU with oneDNN built in.

    bf16 also needs oneDNN's bf16 support on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): on an
    AVX2-only CPU the reorder raises, and `--dtype bfloat16` there runs on `F.linear` instead.
    """
    if not (
        device.type == "cpu"
        and dtype in (torch.bfloat16, torch.float32)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PrepackedLinear(PackedLinear):
    """An `nn.Linear` on oneDNN's kernel, its weight reordered once into oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        """Wrap `linear`; `batch_hint` is the row count oneDNN picks its blocking for (any row count
        works; decode batches are the hot case). Fewer rows than `ONEDNN_MIN_ROWS` for this CPU kind
        are padded to it."""
        super().__init__(linear)
        self.register_buffer("packed_weight", onednn_pack(linear.weight, batch_hint), persistent=False)
        self.packed_weight: torch.Tensor
        self.min_rows = ONEDNN_MIN_ROWS.get((cpu_kind(), linear.weight.dtype), 1)

    def _linear2d(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if 0 < rows < self.min_rows:
            padded = torch.cat([x, x.new_zeros(self.min_rows - rows, x.shape[1])])
            return onednn_linear(padded, self.packed_weight, self.bias)[:rows]
        return onednn_linear(x, self.packed_weight, self.bias)


class PanelLinear(OwnKernelLinear):
    """An fp32 or bf16 `nn.Linear` on the CPU kernels' panel GEMM (csrc/panel_gemm*.cpp), its weight packed
    once into 16-column panels (fp32 [ceil(out / 16), in, 16]; bf16 [ceil(out / 16), ceil(in / 2), 16, 2]).

    With `max_rows`, inputs of more rows run on oneDNN's prepacked kernel instead (`OwnKernelLinear`): the
    panel kernel is for decode-sized row counts.
    """

    def __init__(self, linear: nn.Linear, ops: Any, max_rows: int | None = None, batch_hint: int = 32) -> None:
        """Wrap `linear` (fp32, or bf16 where the build has the bf16 kernel); `ops` is the compiled CPU
        kernel module (cpu_kernels.load_kernels); `max_rows`: see the class."""
        super().__init__(linear, ops, max_rows, batch_hint)
        self.register_buffer("panels", ops.pack_panels(linear.weight.detach()), persistent=False)
        self.panels: torch.Tensor

    def _own_linear(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.panel_linear(x, self.panels, self.out_features, self.bias)  # type: ignore[no-any-return]


def cpu_family() -> tuple[str, int]:
    """(vendor_id, cpu family) of /proc/cpuinfo's first processor (("", 0) where there is none)."""
    vendor, family = "", 0
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "vendor_id":
                vendor = value.strip()
            elif key.strip() == "cpu family":
                family = int(value.strip() or 0)
            elif not line.strip():
                break
    except (OSError, ValueError):
        pass
    return vendor, family


def cpu_kind() -> str:
    """The CPU kind the kernel choice is keyed by: "avx512-amx" (AMX tiles: oneDNN's bf16 kernels use
    them), "avx512-zen5" (AMD family 26 and later: AVX-512 on a full 512-bit datapath, where Zen 4 splits
    each 512-bit instruction in two halves), "avx512", "avx2", or another capability torch reports,
    lower-cased."""
    capability = torch.backends.cpu.get_cpu_capability().lower()
    if capability.startswith("avx512"):
        if "amx_tile" in _cpu_flags():
            return "avx512-amx"
        vendor, family = cpu_family()
        return "avx512-zen5" if vendor == "AuthenticAMD" and family >= ZEN5_FAMILY else "avx512"
    return capability


def amx_rows_limit(dtype: torch.dtype, ops: Any) -> int:
    """Up to how many rows bf16 linears run on the AMX-tile GEMM (0: never, `ALL_ROWS`: always): with the
    CPU kernels' AMX GEMM usable here, `AMX_ROWS` for this CPU kind, unless `INFERENCE_AMX_GEMM` says
    otherwise ("1": at every row count, "0": never); a forced `INFERENCE_PANEL_GEMM` (its A/B of the
    panels or oneDNN alone) turns the automatic choice off."""
    if dtype != torch.bfloat16 or not amx_kernel_available(ops):
        return 0
    switch = _switch(AMX_SWITCH)
    if switch != "auto":
        return ALL_ROWS if switch == "on" else 0
    return AMX_ROWS.get((cpu_kind(), dtype), 0) if _panel_switch() == "auto" else 0


def panel_rows_limit(dtype: torch.dtype, ops: Any) -> int:
    """Up to how many rows linears in `dtype` run on the engine's own kernels (0: never, `ALL_ROWS`: always):
    bf16 on the AMX-tile GEMM where `amx_rows_limit` chooses it; else, with the CPU kernels built and a
    panel kernel for `dtype` in the build, `PANEL_ROWS` for this CPU kind, unless `INFERENCE_PANEL_GEMM`
    says otherwise ("1": at every row count, "0": never)."""
    if ops is None or dtype not in (torch.float32, torch.bfloat16):
        return 0
    amx = amx_rows_limit(dtype, ops)
    if amx > 0:
        return amx
    if dtype == torch.bfloat16 and "bfloat16" not in ops.panel_variants():
        return 0  # no AVX512-BF16 here: the build has no bf16 panels
    switch = _panel_switch()
    if switch == "off":
        return 0
    if switch == "on":
        return ALL_ROWS
    return PANEL_ROWS.get((cpu_kind(), dtype), 0)


def _panel_switch() -> str:
    """`INFERENCE_PANEL_GEMM` as "on", "off" or "auto" (unset or anything else)."""
    return _switch(PANEL_SWITCH)


def _switch(name: str) -> str:
    """The environment variable `name` as "on", "off" or "auto" (unset or anything else)."""
    switch = os.environ.get(name, "auto").strip().lower()
    if switch in ("0", "false", "no", "off"):
        return "off"
    return "on" if switch in ("1", "true", "yes", "on") else "auto"


def row_invariant_plan(dtype: torch.dtype, ops: Any) -> tuple[int, int | None]:
    """(panel rows, the most rows a verify step may run) under which a speculative engine computes
    every token as a plain engine does, so that its greedy tokens are plain decoding's.

    Two things must hold. A verify step runs more rows than the decode step it replaces, so its rows
    must run on a kernel that computes each row as it would alone. And the prompt must be computed
    with the plain engine's kernels: the usual choice (`panel_rows_limit`) for every step, prefill
    chunks included (panels at every row count would give a prefill of more rows than the usual limit
    other bits than the plain engine's oneDNN: greedy tokens drifted on a Zen 4 EPYC, thirteenth
    session). So: where oneDNN is bit-stable only up to a row count (`ONEDNN_ROW_INVARIANT_ROWS`: the
    AMX kernel in bf16, which serves every row count there), oneDNN with verify steps within that many
    rows; else the usual panel limit, verify steps within it (the panels compute each row alone); with
    panels at every row count no bound; without panels the usual choice and no bound.
    """
    amx = amx_rows_limit(dtype, ops)
    if amx > 0:  # the AMX-tile GEMM computes each row alone at every row count, as the panels do
        return amx, (amx if amx < ALL_ROWS else None)
    limit = ONEDNN_ROW_INVARIANT_ROWS.get((cpu_kind(), dtype))
    if limit is not None and _panel_switch() == "auto":
        return 0, limit
    rows = panel_rows_limit(dtype, ops)
    return rows, (rows if 0 < rows < ALL_ROWS else None)


# Above this many bytes of linear weights the panels serve every row count, instead of a oneDNN copy of
# the weights kept beside them for prefill-sized inputs: for a large model a second copy of its weights
# costs more memory than it saves time (panel ÷ oneDNN per projection step at 256 rows on the Zen 4 EPYC:
# bf16 1.05x, fp32 1.00x; docs/benchmarks.md, seventh session). Small models keep both.
DUAL_COPY_MAX_BYTES = 1 << 30


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights of every `nn.Linear` of `model` (what a second packed copy would cost)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if type(m) is nn.Linear)


def panel_rows_with_memory(rows: int, model: nn.Module) -> int:
    """`rows` (the CPU kind's limit), or `ALL_ROWS` when the model's linear weights are too large to
    keep a oneDNN copy beside the panels (`DUAL_COPY_MAX_BYTES`)."""
    if 0 < rows < ALL_ROWS and linear_weight_bytes(model) > DUAL_COPY_MAX_BYTES:
        logger.info("linear weights over %d MiB: the panel kernel serves every row count (no second copy)",
                    DUAL_COPY_MAX_BYTES >> 20)
        return ALL_ROWS
    return rows


def prepack_linears(model: nn.Module, batch_hint: int = 32, panel_ops: Any = None, panel_rows: int = ALL_ROWS) -> int:
    """Replace every `nn.Linear` of `model` in place, when `panel_ops` (the CPU kernel module) is given by
    an `AmxLinear` (bf16 where `amx_rows_limit` chooses the AMX-tile GEMM) or a `PanelLinear`, up to
    `panel_rows` rows on it and more on oneDNN, else by a `PrepackedLinear`; returns how many."""
    max_rows = None if panel_rows >= ALL_ROWS else panel_rows
    count, own = 0, "panel kernel"
    amx = {dtype: amx_rows_limit(dtype, panel_ops) > 0 for dtype in (torch.bfloat16,)} if panel_ops is not None else {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                packed: PackedLinear
                if panel_ops is None:
                    packed = PrepackedLinear(child, batch_hint)
                elif amx.get(child.weight.dtype, False):
                    packed, own = AmxLinear(child, panel_ops, max_rows, batch_hint), "AMX-tile GEMM"
                else:
                    packed = PanelLinear(child, panel_ops, max_rows, batch_hint)
                setattr(parent, name, packed)
                count += 1
    kernel = "oneDNN" if panel_ops is None else own + (f" up to {max_rows} rows" if max_rows else "")
    logger.info("prepacked %d linears (%s)", count, kernel)
    return count
