"""Host staging of KV blocks (staging.py), checked on the CPU: the chunked, double-buffered path a GPU
cache takes (forced with `always_stage`) moves exactly the bytes of the region, in order, whatever the
dtype and chunk size; buffers are reused per thread; and a TCP transfer through it lands bit-exact."""
from __future__ import annotations

import threading

import pytest
import torch

from inference.kv_transfer import KVLayout, TransferStats
from inference.kv_transfer import tcp as tcp_module
from inference.kv_transfer.staging import HostStaging, byte_view
from inference.kv_transfer.tcp import TcpKVReceiver, TcpKVSender


def _region(dtype: torch.dtype, numel: int = 1000) -> torch.Tensor:
    return torch.randn(numel).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk", [64, 333, 1 << 20])
def test_host_chunks_are_the_region_bytes_in_order(dtype: torch.dtype, chunk: int) -> None:
    """Chunk sizes that divide the region, do not, and exceed it; every dtype the KV cache can have."""
    region = _region(dtype)
    staging = HostStaging(pin=False, chunk_bytes=chunk, always_stage=True)
    got = b"".join(bytes(view) for view in staging.host_chunks(region))
    assert got == bytes(byte_view(region))
    # While the caller holds a chunk, the copy of the next one (already issued) went to the other buffer.
    nbytes = region.numel() * region.element_size()
    first = next(staging.host_chunks(region))
    assert bytes(first) == bytes(byte_view(region))[: min(chunk, nbytes)]


@pytest.mark.parametrize("chunk", [64, 333, 1 << 20])
def test_receive_fills_the_region_exactly(chunk: int) -> None:
    """receive() hands out host views chunk by chunk and leaves the region equal to the source."""
    source = bytes(byte_view(_region(torch.bfloat16)))
    region = torch.zeros(1000, dtype=torch.bfloat16)
    staging = HostStaging(pin=False, chunk_bytes=chunk, always_stage=True)
    offset = 0

    def fill(view: memoryview) -> None:
        nonlocal offset
        view[:] = source[offset : offset + len(view)]
        offset += len(view)

    assert staging.receive(region, fill) == len(source)
    assert bytes(byte_view(region)) == source


def test_cpu_cache_is_used_in_place_and_buffers_are_reused_per_thread() -> None:
    """Without always_stage a CPU region is its own single view (no copy); staged buffers are allocated
    once per thread and only grow."""
    staging = HostStaging(pin=False, chunk_bytes=256)
    region = _region(torch.float32)
    (view,) = list(staging.host_chunks(region))
    view[0:4] = b"\x00\x00\x80\x3f"  # writing the view writes the tensor: 1.0f
    assert region[0].item() == 1.0
    a = staging.buffers(100)
    assert staging.buffers(50)[0].data_ptr() == a[0].data_ptr()
    other: list[int] = []
    thread = threading.Thread(target=lambda: other.append(staging.buffers(100)[0].data_ptr()))
    thread.start()
    thread.join()
    assert other[0] != a[0].data_ptr()
    assert staging.buffers(1000)[0].numel() == 1000
    assert not HostStaging(pin=None).pin or torch.cuda.is_available()


def test_tcp_transfer_through_the_staged_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sender and receiver both staged in small chunks (as for GPU caches): the reserved blocks receive
    the source blocks bit for bit, bf16 included, and nothing else changes."""
    layout = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    shape = (layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    monkeypatch.setattr(tcp_module, "_STAGING", HostStaging(pin=False, chunk_bytes=100, always_stage=True))
    decode_kv = torch.zeros((12, *shape), dtype=torch.bfloat16)
    prefill_kv = torch.randn((6, *shape)).to(torch.bfloat16)
    done = threading.Event()
    got: list[TransferStats] = []

    def arrived(request_id: str, first_token: int, stats: TransferStats) -> None:
        got.append(stats)
        done.set()

    receiver = TcpKVReceiver(decode_kv, layout, arrived, bind_host="127.0.0.1", secret="s")
    receiver.start()
    try:
        desc = receiver.expect("r", [3, 4, 9], num_tokens=12, lease_s=10, host="127.0.0.1")
        stats = TcpKVSender(prefill_kv, layout, secret="s").send(desc, [0, 1, 5], first_token=7, timeout=10)
        assert done.wait(10)
    finally:
        receiver.stop()
    assert stats.nbytes == 3 * layout.block_nbytes == got[0].nbytes
    assert torch.equal(decode_kv[3:5], prefill_kv[0:2]) and torch.equal(decode_kv[9], prefill_kv[5])
    untouched = [i for i in range(12) if i not in (3, 4, 9)]
    assert not decode_kv[untouched].any()
