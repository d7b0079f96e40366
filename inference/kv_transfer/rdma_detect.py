"""Clean 'is RDMA usable here?' check. Never raises; returns (ok, reason, device_names)."""
import ctypes
import ctypes.util
import errno
import os


def rdma_available():
    try:
        from pyverbs.device import get_device_list
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError as e:                       # pyverbs not installed / libibverbs ABI mismatch
        return False, f"pyverbs not importable: {e}", []
    if not os.path.isdir("/sys/class/infiniband_verbs"):
        # kernel has no ib_uverbs (CONFIG_INFINIBAND unset or module not loaded):
        # ibv_get_device_list() fails with ENOSYS and pyverbs raises PyverbsRDMAError
        return False, "kernel has no RDMA verbs support (/sys/class/infiniband_verbs missing)", []
    try:
        devs = get_device_list()
    except PyverbsError as e:                      # PyverbsRDMAError('Failed to get devices list')
        return False, f"ibv_get_device_list failed: {e} (errno {_ibv_errno()})", []
    if not devs:
        return False, "no RDMA devices (try: rdma link add rxe0 type rxe netdev <if>)", []
    return True, "ok", [d.name.decode() for d in devs]


def _ibv_errno():
    """errno left by ibv_get_device_list, read via ctypes (pyverbs does not expose it)."""
    name = ctypes.util.find_library("ibverbs") or "libibverbs.so.1"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    lib.ibv_get_device_list.restype = ctypes.c_void_p
    n = ctypes.c_int(0)
    p = lib.ibv_get_device_list(ctypes.byref(n))
    err = ctypes.get_errno()
    if p:
        lib.ibv_free_device_list(ctypes.c_void_p(p))
        return 0
    return f"{err} {errno.errorcode.get(err, '?')}"


if __name__ == "__main__":
    import sys
    print(sys.executable, "->", rdma_available(), "| raw ibv errno:", _ibv_errno())
