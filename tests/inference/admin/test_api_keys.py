"""Admin of API keys: add shows the secret once (only its hash stored), the list shows the prefix, limits
edited, revoke action, usage page with its chart and the CSV export."""
from __future__ import annotations

import csv
import io
import re
from datetime import UTC, datetime

import pytest
from django.test import Client
from django.urls import reverse

from inference.actions import api_keys as key_actions
from inference.models import ApiKey
from tests.support.control_plane import make_deployment

pytestmark = pytest.mark.django_db


def add_key(client: Client, **fields: object) -> tuple[ApiKey, str, str]:
    """Post the add form; the key, its secret as the page shows it, and the page."""
    owner = client.get(reverse("admin:inference_apikey_add")).context["adminform"].form.initial["owner"]
    data = {"name": "web", "owner": owner, "priority": "interactive", **fields}
    answer = client.post(reverse("admin:inference_apikey_add"), data)
    assert answer.status_code == 200, answer.content[:2000]
    page = answer.content.decode()
    found = re.search(r'id="api-key-secret"[^>]*>([^<]+)<', page)
    assert found, page[:3000]
    assert "no-store" in answer["Cache-Control"]
    return ApiKey.objects.get(name=data["name"]), found.group(1), page


def test_add_shows_the_secret_once(client_root: Client) -> None:
    deployment = make_deployment()
    key, secret, page = add_key(client_root, requests_per_minute="30", deployments=[deployment.pk])
    assert "shown only once" in page
    assert key.secret_hash == key_actions.hash_secret(secret) and secret.startswith(key.prefix)
    assert list(key.deployments.all()) == [deployment] and key.requests_per_minute == 30
    assert key.owner.username == "root"
    for url in (reverse("admin:inference_apikey_changelist"), reverse("admin:inference_apikey_change", args=[key.pk])):
        shown = client_root.get(url).content.decode()
        assert key.prefix in shown and secret not in shown


def test_limits_edit_and_revoke_action(client_root: Client) -> None:
    key, _, _ = add_key(client_root)
    change = reverse("admin:inference_apikey_change", args=[key.pk])
    data = {"name": "web", "owner": key.owner_id, "priority": "batch", "tokens_per_minute": "5000"}
    assert client_root.post(change, data).status_code == 302
    key.refresh_from_db()
    assert key.priority == "batch" and key.tokens_per_minute == 5000 and key.revoked_at is None
    changelist = reverse("admin:inference_apikey_changelist")
    answer = client_root.post(changelist, {"action": "revoke_selected", "_selected_action": [key.pk]}, follow=True)
    assert "Revoked 1 API key" in answer.content.decode()
    key.refresh_from_db()
    assert key.revoked_at is not None and not key.is_active
    assert "revoked" in client_root.get(changelist).content.decode()


def test_usage_page_chart_and_csv(client_root: Client) -> None:
    key, _, _ = add_key(client_root)
    minute = datetime.now(tz=UTC).replace(second=0, microsecond=0)
    key_actions.record_usage(key.pk, "chat", minute, key_actions.UsageDelta(7, 70, 21, 1, 2, {"bob"}))
    page = client_root.get(reverse("admin:inference_apikey_usage", args=[key.pk])).content.decode()
    assert page.count('class="usage-chart"') == 2 and "<rect" in page
    assert re.search(r'id="usage-totals"><td>7</td><td>70</td>\s*<td>21</td><td>1</td><td>2</td>', page)
    answer = client_root.get(reverse("admin:inference_apikey_usage_csv", args=[key.pk]))
    rows = list(csv.reader(io.StringIO(answer.content.decode())))
    assert rows[0][:3] == ["minute", "deployment", "requests"]
    assert rows[1][1:] == ["chat", "7", "70", "21", "1", "2", "bob"]
    empty = client_root.get(reverse("admin:inference_apikey_usage", args=[key.pk]) + "?minutes=60").content.decode()
    assert "usage-chart" in empty
    assert client_root.get(reverse("admin:inference_apikey_usage", args=[key.pk]) + "?minutes=7").status_code == 302
