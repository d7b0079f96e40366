"""Is RDMA usable on this host? A check that never raises: (ok, reason, device names)."""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os


def rdma_available() -> tuple[bool, str, list[str]]:
    """Whether pyverbs imports, the kernel has verbs support and at least one device exists."""
    try:
        from pyverbs.device import get_device_list
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError as exc:  # pyverbs not installed, or a libibverbs ABI mismatch
        return False, pyverbs_import_reason(exc), []
    if not os.path.isdir("/sys/class/infiniband_verbs"):
        # Without ib_uverbs, ibv_get_device_list() fails with ENOSYS and pyverbs raises.
        return False, "kernel has no RDMA verbs support (/sys/class/infiniband_verbs missing)", []
    try:
        devices = get_device_list()
    except PyverbsError as exc:
        return False, f"ibv_get_device_list failed: {exc} (errno {ibv_errno()})", []
    if not devices:
        return False, "no RDMA devices (see ibv_devices; Soft-RoCE: rdma link add rxe0 type rxe netdev IF)", []
    return True, "ok", [d.name.decode() for d in devices]


def pyverbs_import_reason(exc: ImportError) -> str:
    """Why pyverbs did not import, headline first: "pyverbs is not installed (No module named 'pyverbs')"
    for a missing module, naming it (a missing dependency of pyverbs is named too)."""
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        if exc.name.split(".")[0] == "pyverbs":
            return f"pyverbs is not installed ({exc})"
        return f"pyverbs needs the missing module {exc.name} ({exc})"
    return f"pyverbs not importable ({exc})"


def ibv_errno() -> str | None:
    """The errno ibv_get_device_list leaves behind, read through ctypes (pyverbs hides it)."""
    name = ctypes.util.find_library("ibverbs") or "libibverbs.so.1"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    lib.ibv_get_device_list.restype = ctypes.c_void_p
    count = ctypes.c_int(0)
    devices = lib.ibv_get_device_list(ctypes.byref(count))
    err = ctypes.get_errno()
    if devices:
        lib.ibv_free_device_list(ctypes.c_void_p(devices))
        return "0"
    return f"{err} {errno.errorcode.get(err, '?')}"
