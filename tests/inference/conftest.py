"""Fixtures for the router and gateway tests: a cluster of stand-in workers shared by a module
(tests with their own `cluster` of real workers, like test_disaggregated_e2e, override it), a
small real deployment that a burst saturates, the OpenAI-API deployment that the feature tests of the
generation API share (penalties, logprobs and n, structured output and tools), and an admin test client."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from tests.inference.router.stand_ins import Cluster
from tests.support.processes import Proc, start_prefill_and_decode, start_router

# The saturable deployment: its router gives a request this long in the queue (and 4 places).
SATURABLE_QUEUE_TIMEOUT_S = 0.5
# A burst's requests generate this many tokens: long enough that no slot frees within the queue timeout
# even on a fast idle CPU (200 tokens took under 0.5 s on a Zen 5 core, and a burst then saw no 429).
SATURABLE_TOKENS = 1000
SATURABLE_CONTEXT = 1088
# The OpenAI-API deployment: fp32 so that its log-probabilities equal a colocated fp32 engine's.
OPENAI_CONTEXT = 1024


@dataclass(frozen=True)
class OpenAIDeployment:
    """The URLs of a real prefill worker, decode worker and router on the tiny model."""

    router: str
    decode: str
    prefill: str


@pytest.fixture(scope="package")
def openai_deployment(tiny_model_dir: Path, log_dir: Path) -> Iterator[OpenAIDeployment]:
    """One prefill, one decode worker and a router (real processes, fp32, 8-token blocks), started once
    for every test module of the generation API's features: each start costs tens of seconds on a
    loaded CI machine, and none of these tests changes the deployment (they only send requests)."""
    procs: list[Proc] = []
    try:
        common = ["--context-length", str(OPENAI_CONTEXT), "--block-size", "8", "--dtype", "float32"]
        (prefill, prefill_url), (decode, decode_url) = start_prefill_and_decode(
            tiny_model_dir, log_dir, common, OPENAI_CONTEXT)
        procs += [prefill, decode]
        router, router_url = start_router([prefill_url], [decode_url], log_dir)
        procs.append(router)
        yield OpenAIDeployment(router=router_url, decode=decode_url, prefill=prefill_url)
    finally:
        for proc in reversed(procs):
            proc.stop()


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
        (prefill, prefill_url), (decode, decode_url) = start_prefill_and_decode(
            tiny_model_dir, log_dir, common, SATURABLE_CONTEXT, decode_extra=["--batch-size", "2"])
        procs += [prefill, decode]
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
