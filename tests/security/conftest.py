"""A locked-down cluster shared by the security tests: real prefill, decode and router processes.

Every process holds the same PLATFORM_SHARED_SECRET; the router requires one of ROUTER_API_KEYS and
runs with small body and WebSocket message limits so that the limit tests stay cheap.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx
import pytest

from tests.support.processes import Proc, start_parallel, start_router, start_worker

SECRET = "test-shared-secret-3f9c"
API_KEY = "sk-test-router-key-1"
OTHER_API_KEY = "sk-test-router-key-2"
CONTEXT = 128
MAX_TOKENS_LIMIT = 32
ROUTER_MAX_BODY_BYTES = 65536
ROUTER_MAX_WS_MESSAGE_BYTES = 4096


@dataclass
class SecureCluster:
    """URLs of the processes and what a legitimate caller needs."""

    prefill: str
    decode: str
    router: str
    procs: list[Proc] = field(default_factory=list)

    @property
    def auth(self) -> dict[str, str]:
        """Headers of a client holding an API key."""
        return {"Authorization": f"Bearer {API_KEY}"}

    @property
    def internal(self) -> dict[str, str]:
        """Headers of a caller holding the platform's shared secret (the router)."""
        return {"X-Platform-Secret": SECRET}


@pytest.fixture(scope="session")
def secure_cluster(
    tiny_model_dir: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SecureCluster]:
    """Prefill + decode + router, all holding the shared secret; the router requires API keys."""
    procs: list[Proc] = []
    secret_env = {"PLATFORM_SHARED_SECRET": SECRET}
    common = ["--context-length", str(CONTEXT), "--block-size", "8", "--max-tokens-limit", str(MAX_TOKENS_LIMIT),
              "--kv-lease-timeout", "10"]
    try:
        started = start_parallel({
            "prefill": partial(start_worker, "prefill", tiny_model_dir, log_dir, extra=common, env=secret_env,
                               name="secure-prefill"),
            "decode": partial(start_worker, "decode", tiny_model_dir, log_dir, env=secret_env, name="secure-decode",
                              extra=[*common, "--max-sequence-length", str(CONTEXT)]),
        })
        (prefill, prefill_url), (decode, decode_url) = started["prefill"], started["decode"]
        procs += [prefill, decode]
        router_env = {
            **secret_env,
            "ROUTER_API_KEYS": f"{API_KEY},{OTHER_API_KEY}",
            "ROUTER_MAX_BODY_BYTES": str(ROUTER_MAX_BODY_BYTES),
            "ROUTER_MAX_WS_MESSAGE_BYTES": str(ROUTER_MAX_WS_MESSAGE_BYTES),
            "ROUTER_HEALTH_INTERVAL_S": "0.5",
            # Its own (empty) database folder: DRF token lookups must fail closed, not touch var/.
            "PLATFORM_VAR_DIR": str(tmp_path_factory.mktemp("secure-router-var")),
        }
        router, router_url = start_router([prefill_url], [decode_url], log_dir, env=router_env)
        procs.append(router)
        cluster = SecureCluster(prefill_url, decode_url, router_url, procs)
        wait_ready(cluster)
        yield cluster
    finally:
        for proc in reversed(procs):
            proc.stop()


def wait_ready(cluster: SecureCluster, timeout: float = 30.0) -> None:
    """Wait until the router has a prefill and a decode worker in rotation (health checks passed)."""
    import time

    deadline = time.monotonic() + timeout
    body: dict[str, object] = {}
    while time.monotonic() < deadline:
        body = httpx.get(f"{cluster.router}/health", timeout=5).json()
        if body.get("ready"):
            return
        time.sleep(0.2)
    raise AssertionError(f"router never became ready: {body}")
