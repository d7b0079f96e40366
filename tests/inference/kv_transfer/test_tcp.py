"""The TCP KV transport moves block bytes exactly, into the reserved blocks only, and fails cleanly."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from inference.kv_transfer import KVLayout, KVTransferError, TransferDescriptor, TransferStats, block_runs
from inference.kv_transfer.tcp import TcpKVReceiver, TcpKVSender

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


def make_kv(num_blocks: int, fill: float | None = None) -> torch.Tensor:
    shape = (num_blocks, LAYOUT.num_layers, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    if fill is None:
        return torch.randn(shape)
    return torch.full(shape, fill)


class Received:
    """Records what the receiver reported, like the decode server does."""

    def __init__(self) -> None:
        self.items: list[tuple[str, int, TransferStats]] = []
        self.event = threading.Event()

    def __call__(self, request_id: str, first_token: int, stats: TransferStats) -> None:
        self.items.append((request_id, first_token, stats))
        self.event.set()


@pytest.fixture
def pair():
    decode_kv = make_kv(16, fill=0.0)
    prefill_kv = make_kv(8)
    received = Received()
    receiver = TcpKVReceiver(decode_kv, LAYOUT, received, bind_host="127.0.0.1", secret="s3cret")
    receiver.start()
    sender = TcpKVSender(prefill_kv, LAYOUT, secret="s3cret")
    yield decode_kv, prefill_kv, receiver, sender, received
    receiver.stop()


def test_block_runs_groups_consecutive_ids() -> None:
    assert block_runs([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]
    assert block_runs([]) == []


def test_transfer_writes_exactly_the_reserved_blocks(pair) -> None:
    decode_kv, prefill_kv, receiver, sender, received = pair
    dst = [5, 6, 11]  # two runs on the decode side
    desc = receiver.expect("req-1", dst, num_tokens=10, lease_s=10, host="127.0.0.1")
    # The descriptor survives a JSON round trip, as it does through the router.
    desc = TransferDescriptor.from_dict(desc.to_dict())
    stats = sender.send(desc, src_block_ids=[1, 2, 7], first_token=42, timeout=5)
    assert stats.nbytes == 3 * LAYOUT.block_nbytes
    for s, d in zip([1, 2, 7], dst, strict=True):
        assert torch.equal(decode_kv[d], prefill_kv[s])
    untouched = [b for b in range(16) if b not in dst]
    assert torch.count_nonzero(decode_kv[untouched]) == 0
    assert received.items[0][:2] == ("req-1", 42)
    assert receiver.bytes_received == stats.nbytes


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_blocks_move_bit_exact(dtype: str) -> None:
    """A bf16/fp16 KV cache (--dtype) goes over the wire as raw bytes (numpy has no bfloat16)."""
    layout = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    torch_dtype = getattr(torch, dtype)
    shape = (8, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    decode_kv, prefill_kv = torch.zeros(shape, dtype=torch_dtype), torch.randn(shape).to(torch_dtype)
    received = Received()
    receiver = TcpKVReceiver(decode_kv, layout, received, bind_host="127.0.0.1", secret="s3cret")
    receiver.start()
    try:
        desc = receiver.expect("req-half", [3, 4], num_tokens=8, lease_s=10, host="127.0.0.1")
        stats = TcpKVSender(prefill_kv, layout, secret="s3cret").send(desc, src_block_ids=[6, 1], first_token=7,
                                                                      timeout=5)
    finally:
        receiver.stop()
    assert stats.nbytes == 2 * layout.block_nbytes
    assert torch.equal(decode_kv[3].view(torch.int16), prefill_kv[6].view(torch.int16))
    assert torch.equal(decode_kv[4].view(torch.int16), prefill_kv[1].view(torch.int16))


def test_second_write_for_same_request_is_refused(pair) -> None:
    _, _, receiver, sender, _ = pair
    desc = receiver.expect("req-2", [0], num_tokens=3, lease_s=10, host="127.0.0.1")
    sender.send(desc, [0], first_token=1, timeout=5)
    with pytest.raises(KVTransferError, match="unknown or expired"):
        sender.send(desc, [0], first_token=1, timeout=5)


def test_cancelled_request_and_bad_token_are_refused(pair) -> None:
    decode_kv, _, receiver, sender, received = pair
    desc = receiver.expect("req-3", [1, 2], num_tokens=8, lease_s=10, host="127.0.0.1")
    receiver.cancel("req-3")
    with pytest.raises(KVTransferError, match="unknown or expired"):
        sender.send(desc, [0, 1], first_token=1, timeout=5)
    desc = receiver.expect("req-4", [1, 2], num_tokens=8, lease_s=10, host="127.0.0.1")
    desc.token = "forged"
    with pytest.raises(KVTransferError, match="bad transfer token"):
        sender.send(desc, [0, 1], first_token=1, timeout=5)
    assert torch.count_nonzero(decode_kv) == 0
    assert received.items == []


def test_wrong_shared_secret_is_refused(pair) -> None:
    _, prefill_kv, receiver, _, _ = pair
    desc = receiver.expect("req-5", [1], num_tokens=2, lease_s=10, host="127.0.0.1")
    intruder = TcpKVSender(prefill_kv, LAYOUT, secret="guess")
    with pytest.raises(KVTransferError, match="shared secret"):
        intruder.send(desc, [0], first_token=1, timeout=5)


def test_layout_mismatch_is_a_clear_error(pair) -> None:
    _, prefill_kv, receiver, _, _ = pair
    desc = receiver.expect("req-6", [1], num_tokens=2, lease_s=10, host="127.0.0.1")
    other = KVLayout(num_layers=2, block_size=8, num_kv_heads=2, head_dim=8, dtype="float32")
    with pytest.raises(KVTransferError, match="layout mismatch"):
        TcpKVSender(prefill_kv, other).send(desc, [0], first_token=1, timeout=5)


def test_unreachable_decode_and_expired_lease_fail_fast() -> None:
    sender = TcpKVSender(make_kv(2), LAYOUT, connect_timeout=1)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    desc = TransferDescriptor("r", "tcp", "127.0.0.1", free_port, [0], 2, LAYOUT, time.time() + 10, "t")
    with pytest.raises(KVTransferError, match="cannot connect"):
        sender.send(desc, [0], first_token=1, timeout=2)
    desc.lease_expires_at = time.time() - 1
    with pytest.raises(KVTransferError, match="expired"):
        sender.send(desc, [0], first_token=1, timeout=2)


def test_silent_peer_times_out() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # accepts the connection in the backlog but never answers
    try:
        port = listener.getsockname()[1]
        desc = TransferDescriptor("r", "tcp", "127.0.0.1", port, [0], 2, LAYOUT, time.time() + 10, "t")
        started = time.monotonic()
        with pytest.raises(KVTransferError, match="timed out"):
            TcpKVSender(make_kv(2), LAYOUT).send(desc, [0], first_token=1, timeout=0.5)
        assert time.monotonic() - started < 3
    finally:
        listener.close()


def test_descriptor_validation_names_the_problem() -> None:
    good = TransferDescriptor("r", "tcp", "h", 1, [0, 1], 5, LAYOUT, 0.0, "t").to_dict()
    with pytest.raises(ValueError, match="blocks for"):
        TransferDescriptor.from_dict({**good, "block_ids": [0]})
    with pytest.raises(ValueError, match="missing or bad field"):
        TransferDescriptor.from_dict({k: v for k, v in good.items() if k != "host"})
    with pytest.raises(ValueError, match="dtype"):
        TransferDescriptor.from_dict({**good, "layout": {**good["layout"], "dtype": "int7"}})


def test_a_prefix_the_decode_side_holds_is_not_sent(pair) -> None:
    """The decode worker holds the prompt's first two blocks (prefix caching): the prefill side sends
    its blocks from the third on, into the descriptor's blocks, and nothing else."""
    decode_kv, prefill_kv, receiver, sender, received = pair
    dst = [9, 10]
    tokens = 3 * LAYOUT.block_size + 1  # four blocks, the first two cached on the decode side
    desc = receiver.expect("req-p", dst, num_tokens=tokens, lease_s=10, host="127.0.0.1", first_block=2)
    desc = TransferDescriptor.from_dict(desc.to_dict())
    assert desc.first_block == 2 and desc.source_blocks([4, 5, 6, 7]) == [6, 7]
    stats = sender.send(desc, src_block_ids=[4, 5, 6, 7], first_token=3, timeout=5)
    assert stats.nbytes == 2 * LAYOUT.block_nbytes
    assert torch.equal(decode_kv[9], prefill_kv[6]) and torch.equal(decode_kv[10], prefill_kv[7])
    assert torch.count_nonzero(decode_kv[[b for b in range(16) if b not in dst]]) == 0
    assert received.items[0][:2] == ("req-p", 3)
    with pytest.raises(KVTransferError, match="from block 2"):
        desc.source_blocks([4, 5, 6])  # a prefill worker holding fewer blocks than the prompt's


def test_descriptor_first_block_is_checked() -> None:
    good = TransferDescriptor("r", "tcp", "h", 1, [1], 2 * LAYOUT.block_size, LAYOUT, 0.0, "t",
                              first_block=1).to_dict()
    assert TransferDescriptor.from_dict(good).first_block == 1
    with pytest.raises(ValueError, match="first_block"):
        TransferDescriptor.from_dict({**good, "first_block": 2, "block_ids": []})  # nothing left to send
    with pytest.raises(ValueError, match="first_block"):
        TransferDescriptor.from_dict({**good, "first_block": -1})
    with pytest.raises(ValueError, match="blocks for"):
        TransferDescriptor.from_dict({**good, "block_ids": [1, 2]})
