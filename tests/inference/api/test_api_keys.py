"""REST API of API keys: the secret once at creation, own keys only, limits edited, revoke, usage, 400s."""
from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from inference.actions import api_keys as key_actions
from inference.models import ApiKey
from tests.support.control_plane import make_deployment

pytestmark = pytest.mark.django_db


def client_of(username: str, *, staff: bool = False) -> APIClient:
    user = get_user_model().objects.create_user(username, password=None, is_staff=staff)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def test_create_shows_the_secret_once_and_stores_only_its_hash() -> None:
    api = client_of("alice")
    deployment = make_deployment()
    answer = api.post("/api/keys/", {"name": "ci", "requests_per_minute": 60, "priority": "batch",
                                     "deployments": [deployment.name]}, format="json")
    assert answer.status_code == 201, answer.content
    body = answer.json()
    secret = body["secret"]
    assert secret.startswith(body["prefix"]) and body["prefix"].startswith("dpk-")
    assert body["owner"] == "alice" and body["deployments"] == [deployment.name] and body["active"]
    key = ApiKey.objects.get(pk=body["id"])
    assert key.secret_hash == key_actions.hash_secret(secret) and secret not in key.secret_hash
    listed = api.get(f"/api/keys/{key.pk}/").json()
    assert "secret" not in listed and secret not in str(api.get("/api/keys/").content)


def test_users_see_their_own_keys_and_staff_see_all() -> None:
    alice, bob, staff = client_of("alice"), client_of("bob"), client_of("root", staff=True)
    alice_key = alice.post("/api/keys/", {"name": "a"}, format="json").json()["id"]
    bob.post("/api/keys/", {"name": "b"}, format="json")
    assert [k["name"] for k in alice.get("/api/keys/").json()["results"]] == ["a"]
    assert bob.get(f"/api/keys/{alice_key}/").status_code == 404
    assert bob.post(f"/api/keys/{alice_key}/revoke/").status_code == 404
    assert sorted(k["name"] for k in staff.get("/api/keys/").json()["results"]) == ["a", "b"]


def test_limits_are_edited_and_revocation_sticks() -> None:
    api = client_of("alice")
    key_id = api.post("/api/keys/", {"name": "edit"}, format="json").json()["id"]
    changed = api.patch(f"/api/keys/{key_id}/", {"tokens_per_minute": 1000, "max_concurrent": 2}, format="json")
    assert changed.status_code == 200 and changed.json()["tokens_per_minute"] == 1000
    revoked = api.post(f"/api/keys/{key_id}/revoke/").json()
    assert revoked["revoked_at"] and not revoked["active"]
    again = api.post(f"/api/keys/{key_id}/revoke/").json()
    assert again["revoked_at"] == revoked["revoked_at"]  # the first revocation time is kept


@pytest.mark.parametrize(
    "body, field",
    [({}, "name"), ({"name": "x", "priority": "urgent"}, "priority"),
     ({"name": "x", "requests_per_minute": -1}, "requests_per_minute"),
     ({"name": "x", "deployments": ["nope"]}, "deployments")],
)
def test_bad_input_is_a_400_naming_the_field(body: dict[str, object], field: str) -> None:
    answer = client_of("alice").post("/api/keys/", body, format="json")
    assert answer.status_code == 400 and field in answer.json()


def test_usage_per_minute() -> None:
    api = client_of("alice")
    created = key_actions.create_key(name="u", owner=get_user_model().objects.get(username="alice"))
    minute = datetime.now(tz=UTC).replace(second=0, microsecond=0)
    delta = key_actions.UsageDelta(3, 30, 12, 1, 0, {"u1"})
    key_actions.record_usage(created.key.pk, "dep-a", minute, delta)
    key_actions.record_usage(created.key.pk, "dep-b", minute, key_actions.UsageDelta(2, 20, 8, 0, 5))
    rows = api.get(f"/api/keys/{created.key.pk}/usage/?minutes=5").json()
    assert len(rows) == 1
    assert {k: rows[0][k] for k in ("requests", "prompt_tokens", "completion_tokens", "errors", "rejected")} == {
        "requests": 5, "prompt_tokens": 50, "completion_tokens": 20, "errors": 1, "rejected": 5}
    assert api.get(f"/api/keys/{created.key.pk}/usage/?minutes=zero").status_code == 400
    assert api.get(f"/api/keys/{created.key.pk}/usage/?minutes=0").status_code == 400
