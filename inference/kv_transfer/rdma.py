"""RDMA KV transfer: the prefill worker writes the prompt's KV blocks straight into decode memory.

The decode worker registers its whole KV pool once as one memory region and puts its address and rkey
in the descriptor's `rdma` section. Its TCP KV port stays the control channel (JSON frames from
`wire.py`, never pickle), behind the same gate and handshake as the TCP transport (`gate.py`,
`auth.py`: no slot, no QP, before an HMAC proof of the shared secret):

    prefill → {"op": "connect", "qp": QPInfo}   decode → {"ok": true, "qp": QPInfo}
        one RC queue pair per control connection; the prefill side caches the pair per decode peer
    prefill → {"op": "write", request_id, token, first_token, num_tokens, runs, nbytes}
    decode  → {"ok": true}         the grant, checked exactly like a TCP header
    prefill   RDMA WRITEs: source run → decode base + block_id * block_nbytes; waits for completions
    prefill → {"op": "done", "nbytes"}   (or {"op": "failed", "error"})
    decode  → {"ok": true, "nbytes"} once on_received accepted it, else {"ok": false, "error"}

Writes are one-sided: once a peer holds the rkey and a connected QP the decode side cannot refuse
bytes. The grant step is what keeps `cancel()` as strict as TCP's: cancel() cuts the control
connection of a transfer in progress, the serving thread destroys that QP (later writes fail at the
sender) and only then lets the blocks go. Peers that know the shared secret are trusted, as on TCP.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from inference.kv_transfer.auth import connect_authenticated
from inference.kv_transfer.base import (
    KVLayout,
    KVSender,
    KVTransferError,
    OnKVReceived,
    TransferDescriptor,
    TransferStats,
    block_runs,
    send_bound,
)
from inference.kv_transfer.receiver import GatedReceiver
from inference.kv_transfer.verbs import MemoryRegion, QPInfo, VerbsDevice, VerbsError, VerbsQP
from inference.kv_transfer.wire import recv_frame, send_frame

logger = logging.getLogger(__name__)


def _check_pool(kv_data: torch.Tensor, layout: KVLayout) -> None:
    """The KV pool must be one contiguous range of `num_blocks` blocks of the layout's size."""
    if kv_data.dim() < 1 or kv_data.shape[0] == 0 or not kv_data.is_contiguous():
        raise KVTransferError("the KV tensor must be contiguous with blocks along its first dimension")
    block_nbytes = kv_data[0].numel() * kv_data.element_size()
    if block_nbytes != layout.block_nbytes:
        raise KVTransferError(
            f"KV tensor blocks are {block_nbytes} bytes but the layout says {layout.block_nbytes}"
        )


def _register(device: VerbsDevice, kv_data: torch.Tensor) -> MemoryRegion:
    """Register the whole pool once: every transfer then only computes addresses inside it."""
    try:
        return device.reg_mr(kv_data)
    except VerbsError as exc:
        raise KVTransferError(f"cannot register the KV cache with RDMA device {device.name}: {exc}") from exc


def _segments(src_block_ids: list[int], dst_block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src_first, dst_first, count) ranges that are contiguous on both sides: one RDMA write each."""
    segments: list[tuple[int, int, int]] = []
    for src, dst in zip(src_block_ids, dst_block_ids, strict=True):
        if segments:
            s, d, n = segments[-1]
            if s + n == src and d + n == dst:
                segments[-1] = (s, d, n + 1)
                continue
        segments.append((src, dst, 1))
    return segments


class RdmaKVReceiver(GatedReceiver):
    """Decode side of the RDMA transport: one registered KV pool, a TCP control port, one QP per peer link."""

    transport = "rdma"

    def __init__(
        self,
        kv_data: torch.Tensor,
        layout: KVLayout,
        on_received: OnKVReceived,
        *,
        device: VerbsDevice,
        idle_timeout: float = 300.0,
        **gate_options: Any,
    ) -> None:
        _check_pool(kv_data, layout)
        super().__init__(kv_data, layout, on_received, **gate_options)
        self._device = device
        self._region = _register(device, kv_data)
        self._idle_timeout = idle_timeout  # a cached link may sit unused between transfers this long

    @property
    def region(self) -> MemoryRegion:
        """The registered KV pool (address, length, keys)."""
        return self._region

    def stop(self) -> None:
        """Stop accepting and cut every control connection, so their queue pairs are destroyed."""
        super().stop()
        self.gate.cut_all()

    def _descriptor_rdma(self) -> dict[str, Any]:
        """The pool's address and rkey: where the prefill side's one-sided writes go."""
        return {
            "addr": self._region.addr,
            "rkey": self._region.rkey,
            "block_nbytes": self._layout.block_nbytes,
            "num_blocks": int(self._kv.shape[0]),
            "device": self._device.name,
        }

    def _serve(self, conn: socket.socket, first: dict[str, Any]) -> None:
        """Bring up the link's QP, then grant writes on it until the link closes or idles out."""
        qp = self._handshake(conn, first)
        if qp is None:
            return
        try:
            # One link carries many transfers back to back; the prefill side caches it.
            while (header := self._next_frame(conn, self._idle_timeout)) is not None:
                if not self._receive_one(conn, header, qp):
                    return
        finally:
            qp.close()

    def _handshake(self, conn: socket.socket, hello: dict[str, Any]) -> VerbsQP | None:
        """Answer the prefill side's connect frame with a QP connected to its QP; None when refused."""
        if hello.get("op") != "connect":
            send_frame(conn, {"ok": False, "error": "expected a connect frame first (is the prefill side on tcp?)"})
            return None
        try:
            remote = QPInfo.from_dict(hello.get("qp"))
        except ValueError as exc:
            send_frame(conn, {"ok": False, "error": f"malformed QP info: {exc}"})
            return None
        qp: VerbsQP | None = None
        try:
            qp = self._device.create_qp()
            qp.connect(remote)
            send_frame(conn, {"ok": True, "qp": qp.info().to_dict()})
        except VerbsError as exc:
            if qp is not None:
                qp.close()
            send_frame(conn, {"ok": False, "error": f"decode cannot connect an RDMA queue pair: {exc}"})
            return None
        except BaseException:
            if qp is not None:
                qp.close()
            raise
        return qp

    def _receive_one(self, conn: socket.socket, header: dict[str, Any], qp: VerbsQP) -> bool:
        """Grant, wait for and acknowledge one transfer; False when the link must be closed."""
        started = time.perf_counter()
        grant = self._grant(header, op="write")
        if isinstance(grant, str):
            send_frame(conn, {"ok": False, "error": grant})
            return False
        pending, request_id = grant.pending, grant.request_id
        nbytes = len(pending.block_ids) * self._layout.block_nbytes
        with pending.lock:
            pending.conn = conn  # set before checking `cancelled`: cancel() sets it, then reads conn
            try:
                if pending.cancelled:
                    send_frame(conn, {"ok": False, "error": f"request {request_id!r} was aborted"})
                    return False
                try:
                    send_frame(conn, {"ok": True})
                    done = recv_frame(conn)
                except (OSError, KVTransferError):
                    # Cut off by cancel()/stop(), or the sender vanished with writes maybe in flight:
                    # destroy the QP before the blocks can be freed, so no late write lands in them.
                    qp.close()
                    if pending.cancelled or self._stopped.is_set():
                        logger.info("RDMA KV transfer of %s cut off (aborted)", request_id)
                        return False
                    raise
            finally:
                pending.conn = None
            if done.get("op") != "done":
                # The sender gave up (completion error or timeout): its writes may still be in flight.
                qp.close()
                logger.warning("RDMA KV transfer of %s failed on the prefill side: %s", request_id, done.get("error"))
                return False
            if done.get("nbytes") != nbytes:
                qp.close()
                send_frame(conn, {"ok": False, "error": f"prefill wrote {done.get('nbytes')} bytes, expected {nbytes}"})
                return False
            if pending.cancelled:  # aborted between the last write and now: nothing is in flight
                send_frame(conn, {"ok": False, "error": f"request {request_id!r} was aborted"})
                return False
            self._arrived(grant)
        return self._deliver(conn, grant, nbytes, started)


@dataclass(frozen=True)
class _Target:
    """The decode pool a descriptor points at."""

    addr: int
    rkey: int
    num_blocks: int


@dataclass
class _Channel:
    """A control connection plus the RC queue pair connected over it, used by one send at a time."""

    sock: socket.socket
    qp: VerbsQP
    peer: tuple[str, int]
    last_used: float = 0.0
    wr_ids: int = 0

    def close(self) -> None:
        """Destroy the QP and close the connection (the decode side then drops its QP too)."""
        self.qp.close()
        self.sock.close()


class RdmaKVSender(KVSender):
    """Prefill side of the RDMA transport: one registered KV pool and cached links per decode peer."""

    transport = "rdma"

    def __init__(
        self,
        kv_data: torch.Tensor,
        layout: KVLayout,
        *,
        device: VerbsDevice,
        secret: str = "",
        connect_timeout: float = 3.0,
        max_idle_per_peer: int = 4,
        idle_ttl: float = 60.0,
    ) -> None:
        _check_pool(kv_data, layout)
        self._kv = kv_data
        self._layout = layout
        self._device = device
        self._region = _register(device, kv_data)
        self._secret = secret
        self._connect_timeout = connect_timeout
        self._max_idle = max_idle_per_peer
        # Below the receiver's idle timeout, so a cached link is normally still alive when reused.
        self._idle_ttl = idle_ttl
        self._idle: dict[tuple[str, int], list[_Channel]] = {}
        self._lock = threading.Lock()
        self.links_opened = 0

    def close(self) -> None:
        """Close every cached link."""
        with self._lock:
            channels = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for channel in channels:
            channel.close()

    def send(
        self,
        descriptor: TransferDescriptor,
        src_block_ids: list[int],
        first_token: int,
        timeout: float,
    ) -> TransferStats:
        """RDMA-write `src_block_ids` into the descriptor's blocks; raises KVTransferError on any failure."""
        if descriptor.layout != self._layout:
            raise KVTransferError(
                f"KV layout mismatch: decode has {descriptor.layout.to_dict()}, "
                f"prefill has {self._layout.to_dict()} (same model and --block-size on both?)"
            )
        if descriptor.transport != self.transport:
            raise KVTransferError(f"descriptor is for the {descriptor.transport} transport, not rdma")
        target = self._target(descriptor)
        dst = descriptor.block_ids
        src = descriptor.source_blocks(src_block_ids)
        if any(not 0 <= b < self._kv.shape[0] for b in src):
            raise KVTransferError(f"source blocks {src} fall outside the local KV pool")
        if descriptor.lease_remaining() <= 0:
            raise KVTransferError(f"lease of request {descriptor.request_id} already expired")
        deadline = time.monotonic() + send_bound(descriptor, timeout)
        started = time.perf_counter()
        expected = len(dst) * self._layout.block_nbytes
        header = {
            "op": "write",
            "request_id": descriptor.request_id,
            "token": descriptor.token,
            "first_token": int(first_token),
            "num_tokens": descriptor.num_tokens,
            "runs": [list(r) for r in block_runs(dst)],
            "nbytes": expected,
        }
        peer = (descriptor.host, descriptor.port)
        where = f"{descriptor.host}:{descriptor.port}"
        channel = self._granted_channel(peer, header, deadline)
        try:
            nbytes = self._write(channel, _segments(src, dst), target, deadline)
        except KVTransferError as exc:
            _abandon(channel, str(exc))
            raise
        try:
            channel.sock.settimeout(_remaining(deadline))
            send_frame(channel.sock, {"op": "done", "nbytes": nbytes})
            ack = recv_frame(channel.sock)
        except TimeoutError as exc:
            channel.close()
            raise KVTransferError(f"KV transfer to {where} timed out") from exc
        except (OSError, KVTransferError) as exc:
            channel.close()
            raise KVTransferError(f"KV transfer to {where} failed: {exc}") from exc
        if not ack.get("ok"):
            channel.close()
            raise KVTransferError(f"decode refused the KV transfer: {ack.get('error', 'unknown error')}")
        self._checkin(channel)
        return TransferStats(nbytes=nbytes, seconds=time.perf_counter() - started)

    def _target(self, descriptor: TransferDescriptor) -> _Target:
        section = descriptor.rdma
        if not isinstance(section, dict):
            raise KVTransferError("descriptor has no 'rdma' section (is the decode worker on --kv-transport rdma?)")
        try:
            target = _Target(
                addr=int(section["addr"]), rkey=int(section["rkey"]), num_blocks=int(section["num_blocks"])
            )
            block_nbytes = int(section["block_nbytes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise KVTransferError(f"malformed 'rdma' section in descriptor: {exc!r}") from exc
        if block_nbytes != self._layout.block_nbytes:
            raise KVTransferError(
                f"KV layout mismatch: decode blocks are {block_nbytes} bytes, prefill blocks "
                f"{self._layout.block_nbytes}"
            )
        if any(not 0 <= b < target.num_blocks for b in descriptor.block_ids):
            raise KVTransferError("descriptor names blocks outside the decode KV pool")
        return target

    # ------------------------------------------------------------------ links
    def _granted_channel(self, peer: tuple[str, int], header: dict[str, object], deadline: float) -> _Channel:
        """A link on which decode granted this write (a dead cached link is replaced once)."""
        where = f"{peer[0]}:{peer[1]}"
        for attempt in range(2):
            channel, reused = self._checkout(peer, deadline)
            try:
                channel.sock.settimeout(_remaining(deadline))
                send_frame(channel.sock, header)
                reply = recv_frame(channel.sock)
            except TimeoutError as exc:
                channel.close()
                raise KVTransferError(f"KV transfer to {where} timed out") from exc
            except (OSError, KVTransferError) as exc:
                channel.close()
                if reused and attempt == 0:
                    continue  # the decode side dropped an idle link: open a fresh one
                raise KVTransferError(f"KV transfer to {where} failed: {exc}") from exc
            if not reply.get("ok"):
                channel.close()  # decode closes the link after a refusal
                raise KVTransferError(f"decode refused the KV transfer: {reply.get('error', 'unknown error')}")
            return channel
        raise AssertionError("unreachable")

    def _checkout(self, peer: tuple[str, int], deadline: float) -> tuple[_Channel, bool]:
        now = time.monotonic()
        stale: list[_Channel] = []
        found: _Channel | None = None
        with self._lock:
            idle = self._idle.get(peer, [])
            while idle and found is None:
                channel = idle.pop()
                if now - channel.last_used <= self._idle_ttl:
                    found = channel
                else:
                    stale.append(channel)
        for channel in stale:
            channel.close()
        if found is not None:
            return found, True
        return self._open(peer, deadline), False

    def _checkin(self, channel: _Channel) -> None:
        channel.last_used = time.monotonic()
        with self._lock:
            idle = self._idle.setdefault(channel.peer, [])
            if len(idle) < self._max_idle:
                idle.append(channel)
                return
        channel.close()

    def _open(self, peer: tuple[str, int], deadline: float) -> _Channel:
        """Connect the control channel and bring up a QP pair with the decode side."""
        host, port = peer
        where = f"{host}:{port}"
        sock = connect_authenticated(
            host, port, self._secret, connect_timeout=self._connect_timeout, deadline=deadline
        )
        qp: VerbsQP | None = None
        try:
            sock.settimeout(_remaining(deadline))
            qp = self._device.create_qp()
            send_frame(sock, {"op": "connect", "qp": qp.info().to_dict()})
            reply = recv_frame(sock)
            if not reply.get("ok"):
                raise KVTransferError(f"decode refused the KV transfer: {reply.get('error', 'unknown error')}")
            qp.connect(QPInfo.from_dict(reply.get("qp")))
        except BaseException as exc:
            if qp is not None:
                qp.close()
            sock.close()
            if isinstance(exc, TimeoutError):
                raise KVTransferError(f"KV transfer to {where} timed out") from exc
            if isinstance(exc, OSError):
                raise KVTransferError(f"KV transfer to {where} failed: {exc}") from exc
            if isinstance(exc, ValueError):
                raise KVTransferError(f"decode at {where} sent malformed QP info: {exc}") from exc
            if isinstance(exc, VerbsError):
                raise KVTransferError(f"cannot set up an RDMA queue pair with {where}: {exc}") from exc
            raise
        self.links_opened += 1
        return _Channel(sock=sock, qp=qp, peer=peer)

    # ------------------------------------------------------------------ data path
    def _write(
        self, channel: _Channel, segments: list[tuple[int, int, int]], target: _Target, deadline: float
    ) -> int:
        """Post every write (a bounded number in flight) and wait until all completed successfully."""
        where = f"{channel.peer[0]}:{channel.peer[1]}"
        block = self._layout.block_nbytes
        chunk = max(1, self._device.max_message_bytes)
        depth = max(1, self._device.send_queue_depth)
        qp = channel.qp
        in_flight: set[int] = set()
        nbytes = 0

        def reap() -> None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise KVTransferError(f"KV transfer to {where} timed out ({len(in_flight)} RDMA writes unfinished)")
            try:
                completions = qp.poll(len(in_flight), remaining)
            except VerbsError as exc:
                raise KVTransferError(f"RDMA write to {where} failed: {exc}") from exc
            for completion in completions:
                in_flight.discard(completion.wr_id)
                if not completion.ok:
                    raise KVTransferError(
                        f"RDMA write to {where} failed: {completion.message or 'error'} (status {completion.status})"
                    )

        for src, dst, count in segments:
            local = self._region.addr + src * block
            remote = target.addr + dst * block
            total = count * block
            for offset in range(0, total, chunk):
                length = min(chunk, total - offset)
                while len(in_flight) >= depth:
                    reap()
                channel.wr_ids += 1
                try:
                    qp.post_write(
                        local + offset,
                        self._region.lkey,
                        length,
                        remote + offset,
                        target.rkey,
                        wr_id=channel.wr_ids,
                        signaled=True,
                    )
                except VerbsError as exc:
                    raise KVTransferError(f"RDMA write to {where} failed: {exc}") from exc
                in_flight.add(channel.wr_ids)
                nbytes += length
        while in_flight:
            reap()
        return nbytes


def _remaining(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.01)


def _abandon(channel: _Channel, reason: str) -> None:
    """Tell decode this transfer failed (best effort), then drop the link: its QP may be in error."""
    try:
        channel.sock.settimeout(1.0)
        send_frame(channel.sock, {"op": "failed", "error": reason})
    except OSError:
        pass
    channel.close()
