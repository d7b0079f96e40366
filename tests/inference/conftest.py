"""Fixtures for the router and gateway tests: a cluster of stand-in workers shared by a module
(tests with their own `cluster` of real workers, like test_disaggregated_e2e, override it)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.inference.router.stand_ins import Cluster


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
