"""The worker's KV transport: a sender on a prefill worker, a receiver on a decode worker, TCP or RDMA.

Both read and write the engine's KV block tensor in place (`AsyncEngine.kv_pool`); an RDMA device is
opened before the model loads, so that a host without RDMA fails fast with a message naming the flag.
"""
from __future__ import annotations

from inference.engine import AsyncEngine
from inference.kv_transfer import KVLayout, KVSender, KVTransferError
from inference.kv_transfer.base import OnKVReceived
from inference.kv_transfer.rdma import RdmaKVReceiver, RdmaKVSender
from inference.kv_transfer.receiver import GatedReceiver, kv_bind_host
from inference.kv_transfer.tcp import TcpKVReceiver, TcpKVSender
from inference.kv_transfer.verbs import VerbsDevice
from inference.server.args import ServerArgs
from inference.server.errors import StartupError


def open_rdma_device(args: ServerArgs) -> VerbsDevice | None:
    """The `--rdma-device` opened (None with `--kv-transport tcp`); StartupError naming the device and
    the tools to inspect it when RDMA is unusable here."""
    if args.kv_transport != "rdma":
        return None
    from inference.kv_transfer import verbs
    from inference.kv_transfer.rdma_detect import rdma_available

    device = args.rdma_device or ""
    ok, reason, devices = rdma_available()
    hint = "check `ibstat` / `ibv_devices`, or start with --kv-transport tcp"
    if not ok:
        raise StartupError(f"--rdma-device {device}: RDMA is not usable here ({reason}); {hint}")
    if device not in devices:
        raise StartupError(f"--rdma-device {device}: no such device (found {devices}); {hint}")
    try:
        return verbs.PyverbsVerbs.from_env().open_device(device)
    except (verbs.VerbsError, ValueError) as exc:  # ValueError: malformed PLATFORM_RDMA_* variables
        raise StartupError(f"--rdma-device {device}: cannot open it ({exc}); {hint}") from exc


def _rdma_failed(device: VerbsDevice, exc: KVTransferError) -> StartupError:
    """Registering the KV pool on `device` failed: close it, and say how to start without RDMA."""
    device.close()
    return StartupError(f"--rdma-device {device.name}: {exc}; start with --kv-transport tcp")


def build_sender(
    args: ServerArgs, engine: AsyncEngine, layout: KVLayout, rdma: VerbsDevice | None
) -> KVSender:
    """A prefill worker's sender over the engine's KV pool (RDMA on `rdma`, else TCP)."""
    if rdma is None:
        return TcpKVSender(engine.kv_pool, layout, secret=args.shared_secret)
    try:
        return RdmaKVSender(engine.kv_pool, layout, device=rdma, secret=args.shared_secret)
    except KVTransferError as exc:
        raise _rdma_failed(rdma, exc) from exc


def build_receiver(
    args: ServerArgs, engine: AsyncEngine, layout: KVLayout, on_received: OnKVReceived, rdma: VerbsDevice | None
) -> GatedReceiver:
    """A decode worker's receiver into the engine's KV pool (RDMA on `rdma`, else TCP); its port opens
    with `start()`."""
    bind_host = kv_bind_host(args.host, args.kv_advertise_host, args.shared_secret)
    if rdma is None:
        return TcpKVReceiver(
            engine.kv_pool, layout, on_received, bind_host=bind_host, port=args.kv_port, secret=args.shared_secret
        )
    try:
        return RdmaKVReceiver(
            engine.kv_pool, layout, on_received, device=rdma, bind_host=bind_host, port=args.kv_port,
            secret=args.shared_secret,
        )
    except KVTransferError as exc:
        raise _rdma_failed(rdma, exc) from exc
