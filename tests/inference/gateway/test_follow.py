"""Managed router mode: the pool follows a deployment's RUNNING workers and policy from the database."""
from __future__ import annotations

import pytest

from inference.gateway.follow import apply_view, load_now, read_deployment
from inference.launch_router import parse_args
from inference.models import WorkerStatus
from inference.router import WorkerPool
from tests.support.control_plane import make_deployment, make_node, make_worker


def urls(pool: WorkerPool, role: str) -> list[str]:
    return [endpoint.url for endpoint in pool.endpoints(role)]


@pytest.mark.django_db(transaction=True)
def test_pool_follows_running_workers_and_policy() -> None:
    deployment = make_deployment(name="chat", router_policy="least-connections")
    host_a = make_node(name="host-a", address="10.9.0.2")
    host_b = make_node(name="host-b", address="10.9.0.3")
    make_worker(deployment, host_a, role="prefill", port=30000, status=WorkerStatus.RUNNING)
    decode = make_worker(deployment, host_b, role="decode", port=30001, status=WorkerStatus.RUNNING)
    make_worker(deployment, host_b, role="decode", port=30002, status=WorkerStatus.STARTING)
    other = make_deployment(name="other")
    make_worker(other, host_b, role="decode", port=30003, status=WorkerStatus.RUNNING)

    pool = WorkerPool(policy="round-robin")
    load_now(pool, "chat")
    assert urls(pool, "prefill") == ["http://10.9.0.2:30000"]
    assert urls(pool, "decode") == ["http://10.9.0.3:30001"]  # STARTING and other deployments excluded
    assert pool.policy_name == "least-connections"

    # A scale-up becomes RUNNING, the old decode worker is drained: applied without a restart.
    decode.status = WorkerStatus.DRAINING
    decode.save()
    make_worker(deployment, host_a, role="decode", port=30004, status=WorkerStatus.RUNNING)
    apply_view(pool, read_deployment("chat"))
    assert urls(pool, "decode") == ["http://10.9.0.2:30004"]


@pytest.mark.django_db(transaction=True)
def test_decode_workers_known_before_the_prefill_worker_do_not_prefill_everything() -> None:
    """A prefill + decode deployment whose decode worker is RUNNING before its prefill worker is not a
    colocated pool: it is not ready (as before the colocated role), so no request is prefilled on the
    decode worker; once the prefill worker runs, requests go through it (CI's three-host test saw the
    first generation prefilled on a decode worker)."""
    deployment = make_deployment(name="split")
    host = make_node(name="host-s", address="10.9.0.5")
    make_worker(deployment, host, role="decode", port=30020, status=WorkerStatus.RUNNING)
    prefill = make_worker(deployment, host, role="prefill", port=30021, status=WorkerStatus.STARTING)

    pool = WorkerPool(policy="round-robin")
    load_now(pool, "split")
    assert urls(pool, "prefill") == [] and urls(pool, "decode") == ["http://10.9.0.5:30020"]
    assert pool.prefill_expected and not pool.colocated
    assert pool.unknown_roles() == ["prefill", "decode"]  # not ready: no prefill endpoint at all
    prefill.status = WorkerStatus.RUNNING
    prefill.save()
    apply_view(pool, read_deployment("split"))
    assert urls(pool, "prefill") == ["http://10.9.0.5:30021"] and not pool.colocated


@pytest.mark.django_db(transaction=True)
def test_unknown_deployment_routes_nowhere() -> None:
    view = read_deployment("missing")
    assert not view.exists and view.prefill == [] and view.decode == []


def test_launch_router_flags_for_managed_mode(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args(["--deployment", "chat"]).deployment == "chat"
    with pytest.raises(SystemExit) as exc:
        parse_args(["--deployment", "chat", "--decode-endpoint", "http://h:1"])
    assert exc.value.code == 2
    assert "--deployment" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--listen-port", "8000"])
    assert "--prefill-endpoint" in capsys.readouterr().err


@pytest.mark.django_db(transaction=True)
def test_both_workers_are_decode_endpoints_and_router_settings_follow() -> None:
    from inference.router import DisaggregatedClient
    from inference.router.events import GenerateRequest
    from inference.router.policies import KVAware
    from inference.wire.sampling import Sampling

    deployment = make_deployment(name="one-host", router_policy="kv-aware", prefill_replicas=0, prefill_min=0,
                                 decode_replicas=0, decode_min=0, both_replicas=1, both_min=1,
                                 kv_token_weight=2.0, kv_load_weight=128.0, local_prefill_tokens=40)
    host = make_node(name="host-c", address="10.9.0.4")
    make_worker(deployment, host, role="both", port=30010, status=WorkerStatus.RUNNING)

    pool = WorkerPool(policy="round-robin")
    client = DisaggregatedClient(pool)
    load_now(pool, "one-host")
    assert urls(pool, "prefill") == [] and urls(pool, "decode") == ["http://10.9.0.4:30010"]
    assert not pool.prefill_expected and pool.colocated  # no prefill role: every prompt to the both worker
    policy = pool._policies["decode"]
    assert isinstance(policy, KVAware) and (policy.token_weight, policy.load_weight) == (2.0, 128.0)
    assert pool.local_prefill_tokens == 40

    # Edited in the admin or API: the router takes the new values on its next read.
    deployment.kv_load_weight, deployment.local_prefill_tokens = 8.0, 0
    deployment.save()
    make_worker(deployment, host, role="prefill", port=30011, status=WorkerStatus.RUNNING)
    apply_view(pool, read_deployment("one-host"))
    assert policy.load_weight == 8.0 and not pool.colocated
    body = client.encode_decode_body(GenerateRequest(sampling=Sampling(max_tokens=1), input_ids=[1, 2]), "r")
    assert b"local_prefill_max_tokens" not in body  # the deployment's 0 wins over the client's own
    deployment.local_prefill_tokens = 24
    deployment.save()
    apply_view(pool, read_deployment("one-host"))
    body = client.encode_decode_body(GenerateRequest(sampling=Sampling(max_tokens=1), input_ids=[1, 2]), "r")
    assert b'"local_prefill_max_tokens":24' in body
