"""The base of the engine's packed linears, and oneDNN's prepacked GEMM they fall back to.

Every kernel choice of cpu_linear.py (oneDNN prepacked, the panel GEMM, the AMX-tile GEMM in
amx_linear.py) replaces an `nn.Linear` by a module that keeps its parameters and holds the weight packed
once for its kernel; the panel and AMX linears keep a oneDNN copy for row counts past their limit. What
they share lives here, apart from the choice rules, so that imports run one way: cpu_linear.py (the
rules) imports amx_linear.py, and both import this module.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


class PackedLinear(nn.Module):
    """A drop-in for an `nn.Linear` whose weight was packed once for another GEMM kernel.

    It keeps the original `weight`/`bias` parameters (so tied embeddings, `state_dict` and weight
    inspection keep working); subclasses hold the packed copy as a non-persistent buffer and
    implement `_linear2d` on a contiguous [rows, in_features] input.
    """

    def __init__(self, linear: nn.Linear) -> None:
        """Take over `linear`'s shape and parameters."""
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def _linear2d(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T + bias for a contiguous 2-D `x`."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T + bias over the last dimension (any leading shape)."""
        if x.dim() != 2:
            return self.forward(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        return self._linear2d(x.contiguous())


class OwnKernelLinear(PackedLinear):
    """A linear on one of the engine's own GEMMs (csrc/: the panels, the AMX tiles) for decode-sized
    inputs: with `max_rows`, inputs of more rows (prefill chunks) run on oneDNN's prepacked kernel instead,
    from a copy of the weight in its layout kept for them. Subclasses pack the weight for their kernel and
    implement `_own_linear`."""

    def __init__(self, linear: nn.Linear, ops: Any, max_rows: int | None, batch_hint: int) -> None:
        """Wrap `linear`; `ops` is the compiled CPU kernel module (cpu_kernels.load_kernels)."""
        super().__init__(linear)
        self._ops = ops
        self.max_rows = max_rows
        onednn = onednn_pack(linear.weight, batch_hint) if max_rows is not None else None
        self.register_buffer("packed_weight", onednn, persistent=False)
        self.packed_weight: torch.Tensor | None

    def _own_linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T + bias on the subclass's kernel, for a contiguous 2-D `x`."""
        raise NotImplementedError

    def _linear2d(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None and self.max_rows is not None and x.shape[0] > self.max_rows:
            return onednn_linear(x, self.packed_weight, self.bias)
        return self._own_linear(x)


def onednn_pack(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """`weight` reordered once into oneDNN's blocked layout for `batch_hint` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)  # type: ignore[no-any-return]


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias on oneDNN's kernel, from `onednn_pack(weight)`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # type: ignore[no-any-return]
