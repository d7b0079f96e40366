"""bf16 linears on the engine's own AMX-tile GEMM (csrc/amx_gemm.cpp) for decode-sized row counts.

On the Intel Xeon with AMX-BF16 (family 6 model 207) a decode step is bound by reading the weights, and
oneDNN's AMX brgemm streamed them at 62-83 % of one thread's read bandwidth (twelfth session). This
kernel packs each weight once into AMX's B-tile layout, in the order it reads them (one sequential
stream, prefetched ahead), and computes each output row from its own input row alone, with a fixed
order of accumulation over K: a speculative verify step of any row count gives each row the bits a
decode step gives it (oneDNN's AMX kernel did only up to 32 rows). The measurements and the choice rule
(`cpu_linear.AMX_ROWS`) are in docs/benchmarks.md, fourteenth session.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .packed_linear import OwnKernelLinear


def amx_kernel_available(ops: Any) -> bool:
    """Whether the compiled CPU kernels `ops` have the AMX GEMM and this process may use AMX tiles (the
    build targets AMX-BF16 and Linux granted the tile state)."""
    return ops is not None and hasattr(ops, "amx_available") and bool(ops.amx_available())


class AmxLinear(OwnKernelLinear):
    """A bf16 `nn.Linear` on the AMX-tile GEMM, its weight packed once into B tiles ([ceil(out / 32),
    ceil(in / 32), 2, 16, 16, 2]: per 32 output columns and 32-wide K block, two 1 KiB VNNI tiles).

    With `max_rows`, inputs of more rows (prefill chunks) run on oneDNN's prepacked kernel instead
    (`OwnKernelLinear`).
    """

    def __init__(self, linear: nn.Linear, ops: Any, max_rows: int | None = None, batch_hint: int = 32) -> None:
        """Wrap the bf16 `linear`; `ops` is the compiled CPU kernel module with the AMX GEMM
        (`amx_kernel_available`); `max_rows`: see the class."""
        if linear.weight.dtype != torch.bfloat16:
            raise ValueError(f"AmxLinear is bf16 only, not {linear.weight.dtype}")
        super().__init__(linear, ops, max_rows, batch_hint)
        self.register_buffer("tiles", ops.amx_pack(linear.weight.detach()), persistent=False)
        self.tiles: torch.Tensor

    def _own_linear(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.amx_linear(x, self.tiles, self.out_features, self.bias)  # type: ignore[no-any-return]
