"""The paged KV cache: one contiguous tensor holding every block of every layer."""
from __future__ import annotations

from typing import Any

import torch


class KVCache:
    """Paged key/value storage.

    `data` has shape `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`: block-major so
    that one block (all layers, K and V) is one contiguous byte range and a run of consecutive block ids
    is one contiguous range too. The KV transfer receives straight into `data[first:first + n]` and RDMA
    registers `data` as a single memory region.
    """

    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        """Allocate the zero-filled cache (zeros, not empty: masked slots must never hold NaN bit patterns,
        because 0 * NaN in the attention-weighted sum would still poison the output)."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.data = torch.zeros(
            (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        # A flat [rows, kv_heads, head_dim] view of the same storage: writes and gathers use row indices
        # computed once per step (see `slot_rows`), so each layer only adds a constant offset.
        self.rows = self.data.view(-1, num_kv_heads, head_dim)
        # The same storage as one row per (token, KV head): decode attention on a CPU gathers keys and
        # values head-major from it (see `DecodeBucket.head_rows`); offsets there are `rows` offsets
        # times num_kv_heads.
        self.head_rows = self.data.view(-1, head_dim)
        self.layer_stride = 2 * block_size  # rows between layer l and l+1 inside one block
        self.block_stride = num_layers * 2 * block_size  # rows between block b and b+1

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block (all layers, K and V)."""
        return self.data[0].numel() * self.data.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the whole cache."""
        return self.data.numel() * self.data.element_size()

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes a block would take with these dimensions (used to size the pool before allocating)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * elem

    def layout(self) -> dict[str, Any]:
        """The layout descriptor sent with KV transfers (both sides must agree on it)."""
        return {
            "num_layers": self.num_layers,
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    def slot_rows(self, block_ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Row index (in `rows`) of the layer-0 K entry for each (block, offset) pair.

        Layer l's K row is `base + l * layer_stride`; its V row is that plus `block_size`.
        """
        return block_ids * self.block_stride + offsets
