"""What a simulated worker is like: its sizes (batch, KV pool) and its timings (prefill, decode, KV)."""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class SimConfig:
    """Sizes and timings of every simulated worker of a fleet.

    Defaults are in the range of a small model on one accelerator: a decode stream at 50 tokens/s
    (20 ms per step), prefill at 20,000 prompt tokens/s plus 5 ms, a 1 ms KV transfer.
    """

    model: str = "sim-model"
    vocab_size: int = 32000
    batch_size: int = 32
    block_size: int = 16
    kv_blocks: int = 4096
    context_length: int = 4096
    max_queue: int = 256
    max_tokens_limit: int = 4096
    kv_lease_timeout_s: float = 30.0
    # Per decode stream; each stream sleeps 1/rate between token lines (a step of the batch).
    decode_tokens_per_s: float = 50.0
    prefill_tokens_per_s: float = 20000.0
    prefill_base_s: float = 0.005
    # From the decode request's arrival to its descriptor line (reserving blocks).
    reserve_s: float = 0.0005
    kv_transfer_s: float = 0.001
    # KV layout reported in descriptors (SmolLM2-135M-like: 30 layers, 3 KV heads of 64, bf16).
    num_layers: int = 30
    num_kv_heads: int = 3
    head_dim: int = 64
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "batch_size", "block_size", "kv_blocks", "context_length", "max_queue",
                     "max_tokens_limit", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.decode_tokens_per_s <= 0 or self.prefill_tokens_per_s <= 0:
            raise ValueError("token rates must be > 0")
        for name in ("kv_lease_timeout_s", "prefill_base_s", "reserve_s", "kv_transfer_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def block_nbytes(self) -> int:
        """Bytes of one KV block (what a transfer of that many blocks would move)."""
        itemsize = 4 if self.dtype == "float32" else 2
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def layout(self) -> dict[str, Any]:
        """The KV layout as a real descriptor carries it (`KVLayout.to_dict`)."""
        return {"num_layers": self.num_layers, "block_size": self.block_size, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "dtype": self.dtype}

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (recorded with every result)."""
        return asdict(self)

    def to_argv(self) -> list[str]:
        """The flags that recreate this configuration in a fleet process (`add_arguments`)."""
        argv: list[str] = []
        for f in fields(self):
            argv += [f"--{f.name.replace('_', '-')}", str(getattr(self, f.name))]
        return argv


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per SimConfig field, with its default."""
    g = p.add_argument_group("simulated worker")
    for f in fields(SimConfig):
        default = getattr(SimConfig, f.name)
        g.add_argument(f"--{f.name.replace('_', '-')}", type=type(default), default=default,
                       help=f"(default {default})")


def from_arguments(args: argparse.Namespace) -> SimConfig:
    """The SimConfig the parsed flags describe (ValueError on an impossible one)."""
    return SimConfig(**{f.name: getattr(args, f.name) for f in fields(SimConfig)})
