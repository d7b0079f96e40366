"""Transport-neutral KV transfer interface: what a decode worker hands out and a prefill worker uses."""
from __future__ import annotations

import abc
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # lease.py imports this module for the descriptor
    from inference.kv_transfer.lease import Lease

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


# The longest lease a descriptor may carry (decode's --kv-lease-timeout is seconds to minutes).
_MAX_LEASE_S = 86400.0


class KVTransferError(Exception):
    """A transfer failed: peer unreachable, refused, timed out, or sent malformed data."""


@dataclass(frozen=True)
class KVLayout:
    """Shape of one KV block; both ends must agree on it byte for byte."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def block_nbytes(self) -> int:
        """Bytes in one block: every layer's keys and values for `block_size` tokens."""
        itemsize = torch.empty((), dtype=dtype_of(self.dtype)).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        """Parse a layout from JSON, raising ValueError on missing or malformed fields."""
        try:
            layout = cls(
                num_layers=int(data["num_layers"]),
                block_size=int(data["block_size"]),
                num_kv_heads=int(data["num_kv_heads"]),
                head_dim=int(data["head_dim"]),
                dtype=str(data["dtype"]),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int(Infinity)
            raise ValueError(f"malformed KV layout: {exc}") from exc
        if min(layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim) < 1:
            raise ValueError(f"malformed KV layout: sizes must be >= 1, got {layout.to_dict()}")
        dtype_of(layout.dtype)
        return layout

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form."""
        return asdict(self)


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype named in a layout; unknown names are a ValueError."""
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name!r}") from None


@dataclass
class TransferDescriptor:
    """Where and into which blocks a prefill worker must write a request's KV (issued by decode)."""

    request_id: str
    transport: str
    host: str
    port: int
    block_ids: list[int]
    num_tokens: int
    layout: KVLayout
    lease_expires_at: float
    token: str
    rdma: dict[str, Any] | None = field(default=None)
    # The lease period (renew after a fraction of it) and the hard cap on renewals (wall-clock
    # time on the decode host). 0 in a descriptor from a decode worker without renewals.
    lease_s: float = 0.0
    lease_cap_at: float = 0.0
    # Prefix caching across the hop: the decode worker already holds the prompt's first `first_block`
    # blocks (cached from an earlier request), so `block_ids` are those of blocks first_block.. only.
    first_block: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form, as sent through the router."""
        data = asdict(self)
        data["layout"] = self.layout.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Any) -> TransferDescriptor:
        """Parse and sanity-check a descriptor from JSON; ValueError names what is wrong."""
        if not isinstance(data, dict):
            raise ValueError("descriptor must be a JSON object")
        try:
            descriptor = cls(
                request_id=str(data["request_id"]),
                transport=str(data["transport"]),
                host=str(data["host"]),
                port=int(data["port"]),
                block_ids=[int(b) for b in data["block_ids"]],
                num_tokens=int(data["num_tokens"]),
                layout=KVLayout.from_dict(data["layout"]),
                lease_expires_at=float(data["lease_expires_at"]),
                token=str(data["token"]),
                rdma=data.get("rdma"),
                lease_s=float(data.get("lease_s", 0.0)),
                lease_cap_at=float(data.get("lease_cap_at", 0.0)),
                first_block=int(data.get("first_block", 0)),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int(Infinity)
            raise ValueError(f"malformed descriptor: missing or bad field {exc}") from exc
        # A lease is seconds long; an infinite or far-future one would overflow socket timeouts.
        if not math.isfinite(descriptor.lease_expires_at) or descriptor.lease_remaining() > _MAX_LEASE_S:
            raise ValueError(f"descriptor lease_expires_at {descriptor.lease_expires_at!r} is not a time soon")
        if not (math.isfinite(descriptor.lease_s) and 0.0 <= descriptor.lease_s <= _MAX_LEASE_S):
            raise ValueError(f"descriptor lease_s {descriptor.lease_s!r} is not a lease period")
        if not math.isfinite(descriptor.lease_cap_at) or descriptor.lease_cap_at - time.time() > _MAX_LEASE_S:
            raise ValueError(f"descriptor lease_cap_at {descriptor.lease_cap_at!r} is not a time soon")
        total = -(-descriptor.num_tokens // descriptor.layout.block_size)
        if not 0 <= descriptor.first_block < max(total, 1):
            raise ValueError(f"descriptor first_block {descriptor.first_block} is not a block of the prompt's {total}")
        needed = total - descriptor.first_block
        if descriptor.num_tokens <= 0 or len(descriptor.block_ids) != needed:
            raise ValueError(
                f"descriptor has {len(descriptor.block_ids)} blocks for {descriptor.num_tokens} tokens from block "
                f"{descriptor.first_block} (block size {descriptor.layout.block_size} needs {needed})"
            )
        if not 0 < descriptor.port < 65536:
            raise ValueError(f"descriptor port {descriptor.port} out of range")
        return descriptor

    def source_blocks(self, src_block_ids: list[int]) -> list[int]:
        """The prefill worker's blocks to send, in the order of `block_ids`: its prompt blocks from
        `first_block` on (the decode worker holds the ones before). KVTransferError if it has too few."""
        src = list(src_block_ids[self.first_block : self.first_block + len(self.block_ids)])
        if len(src) < len(self.block_ids):
            raise KVTransferError(
                f"prefill holds {len(src_block_ids)} blocks, decode expects {len(self.block_ids)} "
                f"from block {self.first_block}"
            )
        return src

    def lease_remaining(self) -> float:
        """Seconds until the decode worker frees the reserved blocks (unless the lease is renewed)."""
        return self.lease_expires_at - time.time()

    def renewable(self) -> bool:
        """Whether the decode worker accepts lease renewals for this descriptor."""
        return self.lease_s > 0 and self.lease_cap_at > 0

    def lease_cap_remaining(self) -> float:
        """Seconds until no renewal can extend the lease any more (the lease itself without renewals)."""
        if not self.renewable():
            return self.lease_remaining()
        return self.lease_cap_at - time.time()


@dataclass
class TransferStats:
    """What one transfer moved and how long it took."""

    nbytes: int
    seconds: float


def send_bound(descriptor: TransferDescriptor, timeout: float) -> float:
    """Seconds a KV send may take: `timeout`, and within the lease when nobody can renew it.

    A renewable lease is kept alive by the sender's lease keeper while the bytes flow (a large KV
    over a slow link may take longer than one lease), so only the caller's timeout bounds it.
    """
    if descriptor.renewable():
        return max(timeout, 0.0)
    return min(timeout, max(descriptor.lease_remaining(), 0.0))


def block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """Split block ids into runs of consecutive ids: each run is one contiguous memory range."""
    runs: list[tuple[int, int]] = []
    for block in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs


# Called on the decode side when a request's KV has fully arrived: (request_id, first_token, stats).
OnKVReceived = Callable[[str, int, TransferStats], None]


class KVReceiver(abc.ABC):
    """Decode side: accepts writes into reserved blocks of the local KV tensor."""

    transport: str

    @abc.abstractmethod
    def start(self) -> None:
        """Begin accepting transfers."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop accepting transfers and release resources."""

    @abc.abstractmethod
    def expect(
        self, request_id: str, block_ids: list[int], num_tokens: int, lease_s: float, host: str,
        first_block: int = 0,
    ) -> TransferDescriptor:
        """Register an incoming transfer for `request_id` and return the descriptor for the prefill side
        (`block_ids`: the blocks to write, the prompt's from `first_block` on)."""

    @abc.abstractmethod
    def cancel(self, request_id: str) -> None:
        """Forget a registered transfer (aborted or expired): later writes for it are refused."""

    @abc.abstractmethod
    def lease(self, request_id: str) -> Lease | None:
        """The lease of a transfer still expected (None once it arrived or was cancelled)."""


class KVSender(abc.ABC):
    """Prefill side: writes local KV blocks into a decode worker's reserved blocks."""

    transport: str

    @abc.abstractmethod
    def send(
        self,
        descriptor: TransferDescriptor,
        src_block_ids: list[int],
        first_token: int,
        timeout: float,
    ) -> TransferStats:
        """Write the blocks and the first token; return once the decode side acknowledged them.

        Bounded by `send_bound(descriptor, timeout)`; an already expired lease fails at once.
        """
