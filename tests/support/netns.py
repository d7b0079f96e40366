"""Several "hosts" on one machine: Linux network namespaces joined by a bridge, for multi-host tests.

    lab = NetnsLab()            # a bridge <prefix>br with 10.A.B.1/24 in the root namespace
    ip = lab.add("pre")         # namespace <prefix>-pre, veth to the bridge, address 10.A.B.2
    lab.cmd("pre", [...])       # ["ip", "netns", "exec", "<prefix>-pre", ...]
    lab.forward(port, "127.0.0.1:5432")  # socat on 10.A.B.1:port → a root-namespace loopback service
    lab.teardown()              # kills every process in the namespaces, deletes namespaces, veths, bridge

Every name starts with a random prefix, so parallel runs never touch each other's devices. PostgreSQL
and Redis listen on 127.0.0.1 of the root namespace, which a namespace cannot reach (its loopback is
its own), hence the socat forwarders bound to the bridge address.
"""
from __future__ import annotations

import contextlib
import os
import random
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

# Every `ip` call is bounded; they take milliseconds.
IP_TIMEOUT_S = 15.0


class NetnsUnavailable(Exception):
    """`ip netns add` is not permitted here (no CAP_SYS_ADMIN, no iproute2, ...)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=check)


class NetnsLab:
    """Namespaces on one bridge; always call `teardown()` (it is safe to call more than once)."""

    def __init__(self, prefix: str | None = None) -> None:
        self.prefix = prefix or f"mh{secrets.token_hex(3)}"
        self.bridge = f"{self.prefix}br"
        self.namespaces: dict[str, str] = {}  # short name → namespace
        self.addresses: dict[str, str] = {}
        self._veths: list[str] = []
        self._forwarders: list[subprocess.Popen[bytes]] = []
        self._subnet = self._free_subnet()
        self.root_address = f"{self._subnet}.1"
        self._bridge_made = False

    @staticmethod
    def _free_subnet() -> str:
        """A 10.x.y/24 no route of this host uses."""
        try:
            routes = _ip("-4", "route", "show", "table", "all", check=False).stdout
        except (OSError, subprocess.SubprocessError):
            routes = ""
        for _ in range(200):
            subnet = f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
            if f"{subnet}." not in routes:
                return subnet
        raise RuntimeError("no free 10.x.y.0/24 subnet found")

    def add(self, name: str) -> str:
        """Create namespace <prefix>-<name> on the bridge; returns its address."""
        namespace = f"{self.prefix}-{name}"
        try:
            result = _ip("netns", "add", namespace, check=False)
        except FileNotFoundError as exc:
            raise NetnsUnavailable(f"iproute2 is not installed: {exc}") from exc
        if result.returncode != 0:
            raise NetnsUnavailable(f"`ip netns add` failed: {result.stderr.strip() or result.returncode}")
        self.namespaces[name] = namespace
        if not self._bridge_made:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._bridge_made = True
            _ip("addr", "add", f"{self.root_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        index = len(self.namespaces) + 1
        address = f"{self._subnet}.{index}"
        outside, inside = f"{self.prefix}v{index}a", f"{self.prefix}v{index}b"
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        self._veths.append(outside)
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        _ip("link", "set", inside, "netns", namespace)
        _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", inside)
        _ip("-n", namespace, "link", "set", inside, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        self.addresses[name] = address
        return address

    def cmd(self, name: str, args: list[str]) -> list[str]:
        """`args` run inside namespace `name`."""
        return ["ip", "netns", "exec", self.namespaces[name], *args]

    def forward(self, port: int, target: str, log: Path | None = None) -> None:
        """Forward root-namespace bridge address:port to `target` (host:port on the root namespace)."""
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115  closed by the child's exit
        proc = subprocess.Popen(
            ["socat", f"TCP-LISTEN:{port},bind={self.root_address},reuseaddr,fork", f"TCP:{target}"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self._forwarders.append(proc)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # listening?
            if proc.poll() is not None:
                raise RuntimeError(f"socat forwarder to {target} exited with {proc.returncode}")
            with socket.socket() as probe:
                probe.settimeout(1.0)
                if probe.connect_ex((self.root_address, port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"socat forwarder on {self.root_address}:{port} did not start")

    def pids(self, name: str) -> list[int]:
        """Processes running inside namespace `name`."""
        result = _ip("netns", "pids", self.namespaces[name], check=False)
        return [int(p) for p in result.stdout.split()]

    def teardown(self) -> None:
        """Kill what runs in the namespaces and the forwarders; delete namespaces, veths and the bridge."""
        for name in list(self.namespaces):
            for sig in (signal.SIGTERM, signal.SIGKILL):
                pids = self.pids(name)
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, sig)
                deadline = time.monotonic() + 5
                while pids and time.monotonic() < deadline and self.pids(name):
                    time.sleep(0.1)
        for proc in self._forwarders:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self._forwarders.clear()
        for namespace in list(self.namespaces.values()):
            _ip("netns", "del", namespace, check=False)
        self.namespaces.clear()
        for veth in self._veths:  # normally gone with their namespace's end
            _ip("link", "del", veth, check=False)
        self._veths.clear()
        if self._bridge_made:
            _ip("link", "del", self.bridge, check=False)
            self._bridge_made = False
