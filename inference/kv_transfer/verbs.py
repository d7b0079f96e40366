"""A thin RDMA verbs layer: the few operations the RDMA KV transport needs, implemented with pyverbs.

The transport (`inference.kv_transfer.rdma`) talks only to the `Verbs` / `VerbsDevice` / `VerbsQP`
protocols below, so tests can drive its real logic with an in-process fake while production uses
`PyverbsVerbs` (Debian's python3-pyverbs 44 or newer; pyverbs ships no type stubs, hence `Any`).

What pyverbs 44 offers and this module relies on: `MR(pd, length, access, address=...)` registers
caller-owned memory (the KV tensor, no copy); RC `QP` with `to_rts()` walking RESET→INIT→RTR→RTS with
the right attribute masks; `SendWR(opcode=IBV_WR_RDMA_WRITE)` + `set_wr_rdma(rkey, addr)`; a
non-blocking `CQ.poll()`. What it lacks or makes awkward: a `SendWR` needs at least one SGE (so no
zero-length WRITE_WITH_IMM as a pure doorbell; completion is signalled over the TCP control channel
instead), no completion-channel poll with a timeout (we poll with a short back-off), and no dma-buf
export from torch (a CUDA KV cache registers through plain `ibv_reg_mr`, which needs nvidia-peermem).

Environment (read by `PyverbsVerbs.from_env`): `PLATFORM_RDMA_IB_PORT` (default 1) and
`PLATFORM_RDMA_GID_INDEX` (default: picked automatically, RoCE v2 with an IPv4 address preferred).
"""
from __future__ import annotations

import logging
import os
import re
import secrets
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

# ibv_wc_status values the transport names (see <infiniband/verbs.h>).
WC_SUCCESS = 0
WC_REM_ACCESS_ERR = 10
WC_RETRY_EXC_ERR = 12

# ibv_mtu enum: 1 = 256 bytes ... 5 = 4096 bytes.
MTU_MIN, MTU_MAX = 1, 5

# One SGE length is a 32-bit field and many HCAs cap messages at 1 GiB: split longer ranges.
MAX_MESSAGE_BYTES = 1 << 30

logger = logging.getLogger(__name__)

_GID_RE = re.compile(r"^[0-9a-fA-F]{4}(:[0-9a-fA-F]{4}){7}$")
_ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


class VerbsError(Exception):
    """An RDMA verbs call failed (device missing, registration refused, QP transition failed...)."""


@dataclass(frozen=True)
class MemoryRegion:
    """A registered memory range: where it is and the keys that let local/remote work requests use it."""

    addr: int
    length: int
    lkey: int
    rkey: int

    def contains(self, addr: int, length: int) -> bool:
        """Whether [addr, addr + length) lies inside the region."""
        return length >= 0 and self.addr <= addr and addr + length <= self.addr + self.length


@dataclass(frozen=True)
class QPInfo:
    """What the peer needs to connect its RC queue pair to ours (exchanged as JSON)."""

    qp_num: int
    lid: int
    gid: str
    psn: int
    port: int
    mtu: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> QPInfo:
        """Parse peer-supplied QP info; ValueError names the field that is missing or out of range."""
        if not isinstance(data, dict):
            raise ValueError("QP info must be a JSON object")
        limits = {
            "qp_num": (1, (1 << 24) - 1),
            "lid": (0, 0xFFFF),
            "psn": (0, (1 << 24) - 1),
            "port": (1, 255),
            "mtu": (MTU_MIN, MTU_MAX),
        }
        values: dict[str, int] = {}
        for name, (low, high) in limits.items():
            value = data.get(name)
            # bool is an int subclass; a JSON true is not a queue pair number.
            if type(value) is not int or not low <= value <= high:
                raise ValueError(f"QP info field {name!r} must be an integer in [{low}, {high}], got {value!r}")
            values[name] = value
        gid = data.get("gid")
        if not isinstance(gid, str) or not _GID_RE.match(gid):
            raise ValueError(f"QP info field 'gid' must look like 'fe80:0000:...' (8 groups), got {gid!r}")
        return cls(gid=gid.lower(), **values)


@dataclass(frozen=True)
class Completion:
    """One work completion: which work request, and whether it succeeded."""

    wr_id: int
    status: int
    message: str = ""

    @property
    def ok(self) -> bool:
        """True for IBV_WC_SUCCESS."""
        return self.status == WC_SUCCESS


class VerbsQP(Protocol):
    """A reliable-connected queue pair with its own completion queue, used by one thread at a time."""

    def info(self) -> QPInfo:
        """This QP's address for the peer."""
        ...

    def connect(self, remote: QPInfo) -> None:
        """Bring the QP to RTS connected to `remote` (remote writes into our regions allowed)."""
        ...

    def post_write(
        self, local_addr: int, lkey: int, length: int, remote_addr: int, rkey: int, *, wr_id: int, signaled: bool
    ) -> None:
        """Post one RDMA WRITE of `length` bytes from a local region into a remote one."""
        ...

    def poll(self, max_entries: int, timeout: float) -> list[Completion]:
        """Completions available within `timeout` seconds (at most `max_entries`; [] on timeout)."""
        ...

    def close(self) -> None:
        """Destroy the QP (idempotent); the peer's further writes to it fail."""
        ...


class VerbsDevice(Protocol):
    """An opened RDMA device port with its protection domain."""

    name: str
    max_message_bytes: int
    send_queue_depth: int

    def reg_mr(self, tensor: torch.Tensor) -> MemoryRegion:
        """Register a contiguous tensor's memory in place (local and remote write access)."""
        ...

    def create_qp(self) -> VerbsQP:
        """A new RC queue pair in RESET state, ready for `connect`."""
        ...

    def close(self) -> None:
        """Release the device and everything created on it."""
        ...


class Verbs(Protocol):
    """Opens RDMA devices by name (pyverbs in production, a fake in tests)."""

    def open_device(self, name: str) -> VerbsDevice:
        """Open `name` (e.g. mlx5_0); VerbsError if it cannot be used."""
        ...


def tensor_span(tensor: torch.Tensor) -> tuple[int, int]:
    """(address, nbytes) of a contiguous, non-empty tensor: what gets registered."""
    if not tensor.is_contiguous():
        raise VerbsError("only a contiguous tensor can be registered as one memory region")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        raise VerbsError("cannot register an empty tensor")
    return int(tensor.data_ptr()), nbytes


def random_psn() -> int:
    """A random 24-bit packet sequence number (a fresh one per QP, as the verbs examples do)."""
    return secrets.randbelow(1 << 24)


def _status_text(status: int, to_str: Any) -> str:
    """pyverbs' name for a failed completion's status ('' for success)."""
    return "" if status == WC_SUCCESS else str(to_str(status))


# --------------------------------------------------------------------------- pyverbs implementation
class PyverbsVerbs:
    """`Verbs` backed by pyverbs (imported lazily so this module loads where pyverbs is absent)."""

    def __init__(self, *, ib_port: int = 1, gid_index: int | None = None, queue_depth: int = 256) -> None:
        self.ib_port = ib_port
        self.gid_index = gid_index
        self.queue_depth = queue_depth

    @classmethod
    def from_env(cls) -> PyverbsVerbs:
        """Port and GID index from PLATFORM_RDMA_IB_PORT / PLATFORM_RDMA_GID_INDEX (ValueError if malformed)."""
        port = int(os.environ.get("PLATFORM_RDMA_IB_PORT", "1"))
        raw_gid = os.environ.get("PLATFORM_RDMA_GID_INDEX", "").strip()
        return cls(ib_port=port, gid_index=int(raw_gid) if raw_gid else None)

    def open_device(self, name: str) -> PyverbsDevice:
        """Open `name`, query its port and pick the GID; VerbsError names the device on failure."""
        return PyverbsDevice(name, self.ib_port, self.gid_index, self.queue_depth)


class PyverbsDevice:
    """One opened device port: context, protection domain and the regions registered on it."""

    def __init__(self, name: str, ib_port: int, gid_index: int | None, queue_depth: int) -> None:
        try:
            import pyverbs.enums as e
            from pyverbs.device import Context
            from pyverbs.pd import PD
            from pyverbs.pyverbs_error import PyverbsError
        except ImportError as exc:
            raise VerbsError(f"cannot open RDMA device {name}: pyverbs not importable ({exc})") from exc
        self.name = name
        self.port = ib_port
        self.send_queue_depth = queue_depth
        self._lock = threading.Lock()
        self._regions: list[tuple[Any, torch.Tensor]] = []  # (MR, tensor): the tensor must outlive its MR
        try:
            self._ctx = Context(name=name)
        except PyverbsError as exc:
            raise VerbsError(f"cannot open RDMA device {name}: {exc}") from exc
        try:
            port_attr = self._ctx.query_port(ib_port)
            if port_attr.state != e.IBV_PORT_ACTIVE:
                raise VerbsError(
                    f"port {ib_port} of RDMA device {name} is not active (state {port_attr.state}; see ibstat)"
                )
            self.lid = int(port_attr.lid)
            self.mtu = int(port_attr.active_mtu)
            # RoCE has no LIDs: every packet needs a global route header.
            self.ethernet = port_attr.link_layer == e.IBV_LINK_LAYER_ETHERNET
            self.max_message_bytes = min(int(port_attr.max_msg_sz) or MAX_MESSAGE_BYTES, MAX_MESSAGE_BYTES)
            self.gid_index = gid_index if gid_index is not None else self._pick_gid_index(int(port_attr.gid_tbl_len))
            self.gid = str(self._ctx.query_gid(port_num=ib_port, index=self.gid_index).gid).lower()
            self._pd = PD(self._ctx)
        except PyverbsError as exc:
            self._ctx.close()
            raise VerbsError(f"RDMA device {name} port {ib_port}: {exc}") from exc
        except VerbsError:
            self._ctx.close()
            raise

    def _pick_gid_index(self, table_len: int) -> int:
        """InfiniBand: 0. RoCE: a RoCE v2 GID carrying an IPv4 address, else any RoCE v2, else any non-zero."""
        if not self.ethernet:
            return 0
        import pyverbs.enums as e
        from pyverbs.pyverbs_error import PyverbsError

        ranked: list[tuple[int, int]] = []
        for index in range(table_len):
            try:
                gid = str(self._ctx.query_gid(port_num=self.port, index=index).gid).lower()
                if gid == _ZERO_GID:
                    continue
                v2 = self._ctx.query_gid_type(self.port, index) == e.IBV_GID_TYPE_SYSFS_ROCE_V2
            except PyverbsError:
                continue  # holes in the GID table are normal
            ipv4 = gid.startswith("0000:0000:0000:0000:0000:ffff:")
            ranked.append((0 if v2 and ipv4 else 1 if v2 else 2, index))
        if not ranked:
            raise VerbsError(
                f"RDMA device {self.name} port {self.port} has no usable GID (is the interface up with an IP?)"
            )
        return min(ranked)[1]

    def reg_mr(self, tensor: torch.Tensor) -> MemoryRegion:
        """Register the tensor's memory in place (pyverbs 44 supports `address=`: no bounce buffer)."""
        import pyverbs.enums as e
        from pyverbs.mr import MR
        from pyverbs.pyverbs_error import PyverbsError

        addr, nbytes = tensor_span(tensor)
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        try:
            mr = MR(self._pd, nbytes, access, address=addr)
        except PyverbsError as exc:
            where = "GPU memory needs the nvidia-peermem module; " if tensor.device.type == "cuda" else ""
            raise VerbsError(f"cannot register {nbytes} bytes on {self.name}: {where}{exc}") from exc
        with self._lock:
            self._regions.append((mr, tensor))
        return MemoryRegion(addr=addr, length=nbytes, lkey=int(mr.lkey), rkey=int(mr.rkey))

    def create_qp(self) -> PyverbsQP:
        """A new RC QP with its own CQ (each transfer channel polls only its own completions)."""
        return PyverbsQP(self)

    def close(self) -> None:
        """Close the context; pyverbs closes the PD, MRs, QPs and CQs created from it first."""
        with self._lock:
            self._regions.clear()
        self._ctx.close()


class PyverbsQP:
    """An RC QP plus CQ on a `PyverbsDevice`."""

    def __init__(self, device: PyverbsDevice) -> None:
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.qp import QP, QPCap, QPInitAttr

        self._device = device
        self._psn = random_psn()
        depth = device.send_queue_depth
        try:
            self._cq = CQ(device._ctx, depth + 16)
            cap = QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
            # sq_sig_all=0: only WRs posted with IBV_SEND_SIGNALED produce completions.
            init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self._cq, rcq=self._cq, cap=cap, sq_sig_all=0)
            self._qp = QP(device._pd, init)
        except PyverbsError as exc:
            raise VerbsError(f"cannot create a queue pair on {device.name}: {exc}") from exc
        self._closed = False

    def info(self) -> QPInfo:
        """QP number, LID, GID, starting PSN, port and active MTU."""
        d = self._device
        return QPInfo(qp_num=int(self._qp.qp_num), lid=d.lid, gid=d.gid, psn=self._psn, port=d.port, mtu=d.mtu)

    def connect(self, remote: QPInfo) -> None:
        """RESET→INIT→RTR→RTS towards `remote` (pyverbs' to_rts walks the states with the RC masks)."""
        import pyverbs.enums as e
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.qp import QPAttr

        d = self._device
        attr = QPAttr(port_num=d.port)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        attr.path_mtu = min(d.mtu, remote.mtu)
        attr.dest_qp_num = remote.qp_num
        attr.rq_psn = remote.psn
        attr.sq_psn = self._psn
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12
        # timeout 14 ≈ 67 ms per retry, 7 retries: a dead peer surfaces as RETRY_EXC_ERR in about 0.5 s.
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        try:
            if d.ethernet or remote.lid == 0:
                route = GlobalRoute(dgid=GID(remote.gid), sgid_index=d.gid_index, hop_limit=64)
                attr.ah_attr = AHAttr(port_num=d.port, is_global=1, gr=route, dlid=remote.lid, sl=0)
            else:
                attr.ah_attr = AHAttr(port_num=d.port, is_global=0, dlid=remote.lid, sl=0)
            self._qp.to_rts(attr)
        except PyverbsError as exc:
            raise VerbsError(f"cannot connect queue pair {self._qp.qp_num} to {remote.qp_num}: {exc}") from exc

    def post_write(
        self, local_addr: int, lkey: int, length: int, remote_addr: int, rkey: int, *, wr_id: int, signaled: bool
    ) -> None:
        """Post an IBV_WR_RDMA_WRITE with one SGE."""
        import pyverbs.enums as e
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.wr import SGE, SendWR

        if self._closed:
            raise VerbsError("queue pair is closed")
        try:
            wr = SendWR(
                wr_id=wr_id,
                opcode=e.IBV_WR_RDMA_WRITE,
                num_sge=1,
                sg=[SGE(local_addr, length, lkey)],
                send_flags=e.IBV_SEND_SIGNALED if signaled else 0,
            )
            wr.set_wr_rdma(rkey=rkey, addr=remote_addr)
            self._qp.post_send(wr)
        except PyverbsError as exc:
            raise VerbsError(f"cannot post an RDMA write: {exc}") from exc

    def poll(self, max_entries: int, timeout: float) -> list[Completion]:
        """Busy-poll the CQ with a growing sleep (≤ 1 ms): pyverbs has no blocking poll with a timeout."""
        from pyverbs.cq import cqe_status_to_str
        from pyverbs.pyverbs_error import PyverbsError

        deadline = time.monotonic() + max(timeout, 0.0)
        delay = 0.0
        while True:
            try:
                count, wcs = self._cq.poll(num_entries=max(1, max_entries))
            except PyverbsError as exc:
                raise VerbsError(f"polling the completion queue failed: {exc}") from exc
            if count:
                return [
                    Completion(int(wc.wr_id), int(wc.status), _status_text(wc.status, cqe_status_to_str))
                    for wc in wcs[:count]
                ]
            if time.monotonic() >= deadline:
                return []
            if delay:
                time.sleep(delay)
            delay = min(max(delay * 2, 20e-6), 1e-3)

    def close(self) -> None:
        """Destroy the QP and its CQ (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._qp.close()
            self._cq.close()
        except Exception as exc:  # closing runs on error paths: log rather than mask the real error
            logger.warning("cannot destroy RDMA queue pair on %s: %s", self._device.name, exc)
