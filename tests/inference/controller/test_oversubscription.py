"""Node.allow_cpu_oversubscription: off for a new node, kept by re-registration, set in the admin and the API."""
from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from inference.controller import placement
from nodes import actions as node_actions
from nodes.models import Node
from nodes.resources import NodeResources
from tests.support.control_plane import make_deployment, make_node, make_worker

pytestmark = pytest.mark.django_db

RES = NodeResources(hostname="h1", cpu_count=2, memory_bytes=8 * 2**30, gpus=[], rdma_devices=[], rdma_note="")


def test_off_for_a_new_node_and_kept_when_the_agent_registers_again() -> None:
    node = node_actions.register_node(name="n1", address="10.0.0.1", resources=RES)
    assert node.allow_cpu_oversubscription is False
    Node.objects.filter(pk=node.pk).update(allow_cpu_oversubscription=True)
    again = node_actions.register_node(name="n1", address="10.0.0.1", resources=RES)  # the agent restarts
    assert again.allow_cpu_oversubscription is True  # an operator's setting, not a detected resource


def test_set_in_the_node_admin() -> None:
    user = get_user_model().objects.create_superuser("root", "root@example.com", None)
    client = Client()
    client.force_login(user)
    node = make_node(name="box", labels={"roles": ["decode"]})
    url = reverse("admin:nodes_node_change", args=[node.pk])
    page = client.get(url).content.decode()
    assert 'name="allow_cpu_oversubscription"' in page
    form = {
        "name": "box", "address": node.address, "labels": '{"roles": ["decode"]}',
        "port_range_start": "30000", "port_range_end": "30999", "allow_cpu_oversubscription": "on",
        "workers-TOTAL_FORMS": "0", "workers-INITIAL_FORMS": "0",
        "workers-MIN_NUM_FORMS": "0", "workers-MAX_NUM_FORMS": "1000",
    }  # fmt: skip
    response = client.post(url, form)
    assert response.status_code == 302, response.content.decode()[:2000]
    assert Node.objects.get(pk=node.pk).allow_cpu_oversubscription is True
    listed = client.get(reverse("admin:nodes_node_changelist") + "?allow_cpu_oversubscription__exact=1")
    assert "8 CPUs (oversubscription allowed)" in listed.content.decode()


def test_set_with_patch_in_the_rest_api() -> None:
    token = Token.objects.create(user=get_user_model().objects.create_user("operator", password=None))
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    node = make_node(name="box", cpu_count=2)
    assert api.get(f"/api/nodes/{node.pk}/").json()["allow_cpu_oversubscription"] is False
    response = api.patch(f"/api/nodes/{node.pk}/", {"allow_cpu_oversubscription": True, "cpu_count": 64,
                                                     "name": "renamed"}, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["allow_cpu_oversubscription"] is True
    stored = Node.objects.get(pk=node.pk)
    # Only the placement setting is the operator's; the agent's fields are read-only (ignored).
    assert (stored.allow_cpu_oversubscription, stored.cpu_count, stored.name) == (True, 2, "box")
    assert api.put(f"/api/nodes/{node.pk}/", {"allow_cpu_oversubscription": False}, format="json").status_code == 405
    bad = api.patch(f"/api/nodes/{node.pk}/", {"allow_cpu_oversubscription": "sometimes"}, format="json")
    assert bad.status_code == 400 and "allow_cpu_oversubscription" in bad.json()
    schema = api.get("/api/schema/").content.decode()
    assert "allow_cpu_oversubscription" in schema


def test_the_setting_decides_whether_a_full_node_takes_another_worker() -> None:
    token = Token.objects.create(user=get_user_model().objects.create_user("operator", password=None))
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    node = make_node(name="box", cpu_count=1, last_heartbeat=timezone.now())
    make_worker(make_deployment(), node, role="decode", cpu_ids=[0])
    dep = make_deployment()
    assert placement.place_worker(dep, "decode") is None
    api.patch(f"/api/nodes/{node.pk}/", {"allow_cpu_oversubscription": True}, format="json")
    worker = placement.place_worker(dep, "decode")
    assert worker is not None and worker.cpu_ids == [0]
