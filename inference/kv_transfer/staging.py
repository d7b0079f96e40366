"""Host staging of KV blocks for the TCP transport: sockets read and write host memory only.

A CPU KV cache needs no staging: its blocks are sent from, and received into, the cache tensor itself.
A GPU cache goes through per-thread pairs of reusable host buffers, pinned (page-locked) when CUDA is
available so that the device copies are DMA transfers that can run asynchronously: the transfer is
cut into chunks and double-buffered, so that copying chunk i+1 off (or onto) the device overlaps with
sending (or receiving) chunk i on the socket. Buffers are allocated once per thread and grown only
when a larger chunk is needed: pinning memory costs far more than copying into it.

`always_stage` sends a CPU tensor through the same buffers; tests use it to check the chunking and
double-buffering on machines without a GPU.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import torch

# Chunk of one device↔host copy: large enough to keep DMA efficient, small enough that the first bytes
# reach the socket early and two buffers per thread stay cheap.
DEFAULT_CHUNK_BYTES = 8 << 20


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (any dtype: numpy has no bfloat16, bytes do)."""
    array = tensor.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")  # type: ignore[arg-type]  # ndarray supports the buffer protocol


class _Done:
    """Completion of an (asynchronous) copy: a CUDA event when one of the tensors is on a GPU."""

    def __init__(self, cuda_device: torch.device | None) -> None:
        self._event: torch.cuda.Event | None = None
        if cuda_device is not None:
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(cuda_device))

    def wait(self) -> None:
        """Block until the copy finished (no-op for CPU copies, which are synchronous)."""
        if self._event is not None:
            self._event.synchronize()


class HostStaging:
    """Per-thread double buffers for device↔host KV copies (see the module docstring)."""

    def __init__(
        self, *, pin: bool | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES, always_stage: bool = False
    ) -> None:
        """`pin` defaults to whether CUDA is available (pinning needs a CUDA driver)."""
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.chunk_bytes = chunk_bytes
        self.always_stage = always_stage
        self._local = threading.local()

    def _needs_staging(self, region: torch.Tensor) -> bool:
        return self.always_stage or region.device.type != "cpu"

    def buffers(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This thread's two uint8 host buffers, each at least `nbytes` long."""
        bufs: tuple[torch.Tensor, torch.Tensor] | None = getattr(self._local, "bufs", None)
        if bufs is None or bufs[0].numel() < nbytes:
            bufs = (
                torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin),
                torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin),
            )
            self._local.bufs = bufs
        return bufs

    def _chunks(self, nbytes: int) -> list[tuple[int, int]]:
        return [(off, min(self.chunk_bytes, nbytes - off)) for off in range(0, nbytes, self.chunk_bytes)]

    def host_chunks(self, region: torch.Tensor) -> Iterator[memoryview]:
        """The bytes of the contiguous `region`, as host memoryviews in order. A CPU region is one view of
        itself; a staged one comes chunk by chunk, each valid until the next is requested (the copy of
        the next chunk runs while the caller sends this one)."""
        if not region.is_contiguous():
            raise ValueError("KV region is not contiguous")
        if not self._needs_staging(region):
            yield byte_view(region)
            return
        flat = region.reshape(-1).view(torch.uint8)
        cuda = region.device if region.device.type == "cuda" else None
        chunks = self._chunks(flat.numel())
        bufs = self.buffers(min(self.chunk_bytes, flat.numel()))
        pending: tuple[torch.Tensor, _Done] | None = None
        for i, (off, size) in enumerate(chunks):
            host = bufs[i % 2][:size]
            host.copy_(flat[off : off + size], non_blocking=self.pin)
            done = _Done(cuda)
            if pending is not None:
                pending[1].wait()
                yield byte_view(pending[0])  # the other buffer: free again once the caller resumes us
            pending = (host, done)
        if pending is not None:
            pending[1].wait()
            yield byte_view(pending[0])

    def receive(self, region: torch.Tensor, fill: Callable[[memoryview], None]) -> int:
        """Fill the contiguous `region` with bytes that `fill(view)` writes into host memory, chunk by
        chunk (straight into a CPU region); returns the bytes received. The copy of chunk i onto the
        device overlaps with receiving chunk i+1; everything is on the device when this returns."""
        if not region.is_contiguous():
            raise ValueError("KV region is not contiguous")
        if not self._needs_staging(region):
            view = byte_view(region)
            fill(view)
            return len(view)
        flat = region.reshape(-1).view(torch.uint8)
        cuda = region.device if region.device.type == "cuda" else None
        bufs = self.buffers(min(self.chunk_bytes, flat.numel()))
        in_flight: list[_Done | None] = [None, None]
        total = 0
        for i, (off, size) in enumerate(self._chunks(flat.numel())):
            slot = i % 2
            previous = in_flight[slot]
            if previous is not None:
                previous.wait()  # this buffer's last copy onto the device must be done before refilling it
            host = bufs[slot][:size]
            fill(byte_view(host))
            flat[off : off + size].copy_(host, non_blocking=self.pin)
            in_flight[slot] = _Done(cuda)
            total += size
        for done in in_flight:
            if done is not None:
                done.wait()
        return total
