"""KV-cache transfer between prefill and decode workers (Django-free).

`base` holds the transport-neutral interface (descriptor, layout, sender/receiver), `tcp` the default
backend, `rdma` the RDMA backend (one-sided writes over pyverbs, through the thin `verbs` layer).
Prefill writes the prompt's KV blocks straight into the blocks a decode worker reserved.
"""
from inference.kv_transfer.base import (
    KVLayout,
    KVReceiver,
    KVSender,
    KVTransferError,
    TransferDescriptor,
    TransferStats,
    block_runs,
)
from inference.kv_transfer.rdma import RdmaKVReceiver, RdmaKVSender

__all__ = [
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "RdmaKVReceiver",
    "RdmaKVSender",
    "TransferDescriptor",
    "TransferStats",
    "block_runs",
]
