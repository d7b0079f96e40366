"""oneDNN-prepacked bf16 linears for the CPU (AMX / AVX-512 BF16 kernels without per-call reorders).

`F.linear` on bf16 CPU tensors hands the weight to oneDNN in PyTorch's plain layout, so every call
pays a reorder into the blocked layout the AMX kernel wants plus a primitive lookup. Reordering each
weight once (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU freezing pass does) and
calling `torch.ops.mkldnn._linear_pointwise` removes that: measured on the AMX machine of issue 12
(one thread) 1.2-2.3x faster per projection at decode shapes (8-64 rows) and 1.5x at 300 rows,
bit-identical outputs. fp32 is left alone: its prepacked path rounds differently (~1e-4) and fp32 is
the exact mode that must match transformers.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def prepacked_linear_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether prepacked oneDNN linears apply: bf16 weights on a CPU with oneDNN built in."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PrepackedLinear(nn.Module):
    """A drop-in for an `nn.Linear` whose weight was reordered once for oneDNN.

    It keeps the original `weight`/`bias` parameters (so tied embeddings, `state_dict` and weight
    inspection keep working) and holds the reordered copy as a non-persistent buffer.
    """

    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        """Wrap `linear`; `batch_hint` is the row count oneDNN picks its blocking for (any row count
        works; decode batches are the hot case)."""
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.packed_weight: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T + bias over the last dimension (any leading shape)."""
        if x.dim() != 2:
            return self.forward(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")


def prepack_linears(model: nn.Module, batch_hint: int = 32) -> int:
    """Replace every `nn.Linear` of `model` by a `PrepackedLinear` in place; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PrepackedLinear(child, batch_hint))
                count += 1
    logger.info("prepacked %d bf16 linears for oneDNN", count)
    return count
