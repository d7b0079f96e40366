"""Workers by role: `create_worker` builds the role's class with its transport, and each role's app
serves only its own internal endpoint (the other role's answers a JSON 404, like any unknown path)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from inference.kv_transfer.tcp import TcpKVReceiver, TcpKVSender
from inference.server.app import create_app
from inference.server.args import parse_args
from inference.server.decode import DecodeWorker
from inference.server.prefill import PrefillWorker
from inference.server.worker import Worker, create_worker
from tests.support.worker_flags import worker_argv


@pytest.fixture(params=["prefill", "decode"])
def worker(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[Worker]:
    """A real worker of each role on the tiny model (the decode worker's KV port on loopback)."""
    argv = worker_argv(tiny_model_dir, request.param, "--num-kv-blocks", "8", "--host", "127.0.0.1", "--kv-port", "0")
    built = create_worker(parse_args(argv))
    built.start()
    try:
        yield built
    finally:
        built.stop()


def test_create_worker_builds_the_role_with_its_transport(worker: Worker) -> None:
    """A prefill worker has a sender and no receiver, a decode worker a receiver (its port in /info)."""
    if worker.args.service_type == "decode":
        assert isinstance(worker, DecodeWorker) and isinstance(worker.receiver, TcpKVReceiver)
        assert worker.info()["kv_port"] == worker.receiver.port > 0
        assert worker.health()["stream_credit"] is True
    else:
        assert isinstance(worker, PrefillWorker) and isinstance(worker.sender, TcpKVSender)
        assert not hasattr(worker, "receiver") and "kv_port" not in worker.info()
        assert "stream_credit" not in worker.health()
    assert worker.health()["role"] == worker.info()["role"] == worker.args.service_type


def test_each_app_mounts_only_its_roles_endpoint(worker: Worker) -> None:
    """The other role's endpoint is an unknown path: 404 with a JSON error naming it; the own one is
    there (a body without a request id is a 400 from its handler, not a 404)."""
    own, other = ("/internal/decode", "/internal/prefill")
    if worker.args.service_type == "prefill":
        own, other = other, own
    with TestClient(create_app(worker)) as client:
        missing = client.post(other, json={"request_id": "r1"})
        assert missing.status_code == 404
        assert missing.json() == {"error": {"message": f"no POST {other} on this worker", "type": "not_found"}}
        assert client.post(own, content=b"[]").status_code == 400
        assert client.post("/internal/abort", json={"request_id": "r2"}).json() == {"aborted": "r2"}
        assert client.get("/health").json()["role"] == worker.args.service_type
