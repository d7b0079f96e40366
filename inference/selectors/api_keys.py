"""Reads of API keys: the routers' snapshot of active keys, and a key's usage per minute."""
from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db.models import Sum
from django.db.models.functions import TruncMinute

from inference.models import ApiKey, ApiKeyUsage

SNAPSHOT_FIELDS = (
    "id", "prefix", "secret_hash", "priority", "requests_per_minute", "tokens_per_minute",
    "max_concurrent", "expires_at",
)


def key_scopes(key_ids: list[int] | None = None) -> dict[int, set[str]]:
    """The deployment names of every non-revoked key (or of `key_ids`) that is limited to some (one query)."""
    scopes: dict[int, set[str]] = {}
    through = ApiKey.deployments.through.objects.filter(apikey__revoked_at__isnull=True)
    if key_ids is not None:
        through = through.filter(apikey_id__in=key_ids)
    for key_id, name in through.values_list("apikey_id", "deployment__name"):
        scopes.setdefault(key_id, set()).add(name)
    return scopes


def active_key_rows(secret_hash: str | None = None) -> list[tuple[Any, ...]]:
    """Every non-revoked key (or the one of `secret_hash`) as a tuple of SNAPSHOT_FIELDS (expired ones
    included: the router checks the expiry per request, so a key expires to the second)."""
    keys = ApiKey.objects.filter(revoked_at__isnull=True)
    if secret_hash is not None:
        keys = keys.filter(secret_hash=secret_hash)
    return list(keys.values_list(*SNAPSHOT_FIELDS))


def usage_per_minute(key: ApiKey, since: datetime) -> list[dict[str, Any]]:
    """The key's usage per minute since `since`, all deployments summed, oldest first."""
    rows = (
        ApiKeyUsage.objects.filter(api_key=key, minute__gte=since)
        .annotate(at=TruncMinute("minute"))
        .values("at")
        .annotate(
            requests=Sum("requests"), prompt_tokens=Sum("prompt_tokens"),
            completion_tokens=Sum("completion_tokens"), errors=Sum("errors"), rejected=Sum("rejected"),
        )
        .order_by("at")
    )
    return list(rows)


def usage_rows(key: ApiKey) -> list[ApiKeyUsage]:
    """Every usage row of the key (per deployment and minute), newest first: the CSV export."""
    return list(ApiKeyUsage.objects.filter(api_key=key).order_by("-minute", "deployment"))
