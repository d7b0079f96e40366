"""Fixtures for the router and gateway tests: a cluster of stand-in workers shared by a module
(tests with their own `cluster` of real workers, like test_disaggregated_e2e, override it), a
small real deployment that a burst saturates, and an admin test client."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from tests.inference.router.stand_ins import Cluster
from tests.support.processes import Proc, start_router, start_worker

# The saturable deployment: its router gives a request this long in the queue (and 4 places).
SATURABLE_QUEUE_TIMEOUT_S = 0.5
SATURABLE_CONTEXT = 256


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Two prefill and two decode stand-ins, reset before each test that uses them."""
    stand_ins = Cluster()
    try:
        yield stand_ins
    finally:
        stand_ins.stop()


@pytest.fixture
def stand_ins(cluster: Cluster) -> Cluster:
    """The module's cluster, reset to well-behaved workers."""
    cluster.reset()
    return cluster


@pytest.fixture(scope="module")
def saturable_deployment(tiny_model_dir: Path, log_dir: Path) -> Iterator[dict[str, str]]:
    """Real processes: one prefill, one decode worker with `--batch-size 2`, and a router whose short
    queue (SATURABLE_QUEUE_TIMEOUT_S, 4 places) turns a burst partly into 429s. Their URLs by role."""
    procs: list[Proc] = []
    try:
        common = ["--context-length", str(SATURABLE_CONTEXT), "--block-size", "8"]
        prefill, prefill_url = start_worker("prefill", tiny_model_dir, log_dir, extra=common)
        procs.append(prefill)
        decode, decode_url = start_worker(
            "decode", tiny_model_dir, log_dir,
            extra=[*common, "--batch-size", "2", "--max-sequence-length", str(SATURABLE_CONTEXT)],
        )  # fmt: skip
        procs.append(decode)
        router, router_url = start_router(
            [prefill_url], [decode_url], log_dir,
            extra=["--queue-timeout", str(SATURABLE_QUEUE_TIMEOUT_S), "--max-queue", "4"],
        )  # fmt: skip
        procs.append(router)
        yield {"router": router_url, "prefill": prefill_url, "decode": decode_url}
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.fixture
def client_root() -> Client:
    """A Django test client logged in as the superuser "root" (the admin tests)."""
    user = get_user_model().objects.create_superuser("root", "root@example.com", None)
    client = Client()
    client.force_login(user)
    return client
