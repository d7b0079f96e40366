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
and 16 rows and 1.05-1.1x at 64-256. On AVX-512 CPUs oneDNN's 16-wide kernels stay (the panel kernel is
8 wide and was not measured there); `INFERENCE_PANEL_GEMM=1` / `0` forces it on / off.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

PANEL_SWITCH = "INFERENCE_PANEL_GEMM"


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


class _PackedLinear(nn.Module):
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


class PrepackedLinear(_PackedLinear):
    """An `nn.Linear` on oneDNN's kernel, its weight reordered once into oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        """Wrap `linear`; `batch_hint` is the row count oneDNN picks its blocking for (any row count
        works; decode batches are the hot case)."""
        super().__init__(linear)
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.packed_weight: torch.Tensor

    def _linear2d(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class PanelLinear(_PackedLinear):
    """An fp32 `nn.Linear` on the CPU kernels' panel GEMM (csrc/panel_gemm.cpp), its weight packed once
    into 16-column panels ([ceil(out / 16), in, 16])."""

    def __init__(self, linear: nn.Linear, ops: Any) -> None:
        """Wrap `linear` (fp32); `ops` is the compiled CPU kernel module (cpu_kernels.load_kernels)."""
        super().__init__(linear)
        self._ops = ops
        self.register_buffer("panels", ops.pack_panels(linear.weight.detach()), persistent=False)
        self.panels: torch.Tensor

    def _linear2d(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.panel_linear(x, self.panels, self.out_features, self.bias)  # type: ignore[no-any-return]


def panel_linear_preferred(dtype: torch.dtype, ops: Any) -> bool:
    """Whether fp32 linears run on the panel kernel: with the CPU kernels built, on an AVX2-only CPU
    (where it was measured faster than oneDNN at every row count), unless `INFERENCE_PANEL_GEMM` says
    otherwise ("1": also elsewhere, "0": never)."""
    if dtype != torch.float32 or ops is None:
        return False
    switch = os.environ.get(PANEL_SWITCH, "auto").strip().lower()
    if switch in ("0", "false", "no", "off"):
        return False
    if switch in ("1", "true", "yes", "on"):
        return True
    return torch.backends.cpu.get_cpu_capability() == "AVX2"


def prepack_linears(model: nn.Module, batch_hint: int = 32, panel_ops: Any = None) -> int:
    """Replace every `nn.Linear` of `model` in place, by a `PanelLinear` when `panel_ops` (the CPU
    kernel module) is given, else by a `PrepackedLinear`; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                packed = PanelLinear(child, panel_ops) if panel_ops is not None else PrepackedLinear(child, batch_hint)
                setattr(parent, name, packed)
                count += 1
    logger.info("prepacked %d linears (%s)", count, "panel kernel" if panel_ops is not None else "oneDNN")
    return count
