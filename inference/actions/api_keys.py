"""API key changes: create (the secret returned once), update limits and scope, revoke; usage recorded.

The secret is `dpk-` + 32 random bytes (url-safe base64); its first characters are its prefix, kept in
clear to recognise it; only its SHA-256 is stored. Routers see a change within their key cache's refresh
(ROUTER_KEY_REFRESH_S), on every process.
"""
from __future__ import annotations

import dataclasses
import hashlib
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from inference.models import ApiKey, ApiKeyUsage, Deployment

SECRET_PREFIX = "dpk-"
# Shown prefix: "dpk-" and 8 characters of the random part (48 bits: unique enough to recognise a key).
PREFIX_LENGTH = len(SECRET_PREFIX) + 8
# Kept per usage row, so a client sending a new `user` per request cannot grow a row without bound.
MAX_USERS_PER_ROW = 50
_CREATE_ATTEMPTS = 5


def hash_secret(secret: str) -> str:
    """The stored (and cached) form of a secret: SHA-256 hex of its UTF-8 bytes."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def looks_like_key(secret: str) -> bool:
    """Whether `secret` has the shape of a key made here (cheap filter before any lookup)."""
    return secret.startswith(SECRET_PREFIX) and len(secret) > PREFIX_LENGTH


@dataclass(frozen=True)
class CreatedKey:
    """A key just created and its secret, which exists only here: show it once, never store it."""

    key: ApiKey
    secret: str


def create_key(
    *,
    name: str,
    owner: AbstractBaseUser,
    deployments: Iterable[Deployment] = (),
    **fields: Any,
) -> CreatedKey:
    """Create a key with a fresh secret (retried on the astronomically unlikely prefix collision).

    `fields` are ApiKey fields (priority, requests_per_minute, tokens_per_minute, max_concurrent,
    expires_at); the key is validated with `full_clean()` (django ValidationError naming the field).
    """
    for _ in range(_CREATE_ATTEMPTS):
        secret = SECRET_PREFIX + secrets.token_urlsafe(32)
        key = ApiKey(name=name, owner=owner, prefix=secret[:PREFIX_LENGTH], secret_hash=hash_secret(secret), **fields)
        key.full_clean(exclude=["prefix", "secret_hash"])
        try:
            with transaction.atomic():
                key.save()
                key.deployments.set(list(deployments))
        except IntegrityError:
            continue
        return CreatedKey(key=key, secret=secret)
    raise RuntimeError("could not draw a unique API key prefix")  # pragma: no cover - 2^-48 per draw


def update_key(key: ApiKey, changes: Mapping[str, Any], deployments: Iterable[Deployment] | None = None) -> ApiKey:
    """Apply `changes` (limits, name, priority, expiry) and, when given, the allowed deployments."""
    for field, value in changes.items():
        setattr(key, field, value)
    key.full_clean(exclude=["prefix", "secret_hash"])
    with transaction.atomic():
        key.save()
        if deployments is not None:
            key.deployments.set(list(deployments))
            ApiKey.objects.filter(pk=key.pk).update(updated_at=timezone.now())  # the routers reload it
    return key


def revoke_key(key: ApiKey) -> ApiKey:
    """Revoke `key` (idempotent: the first revocation time is kept). Routers refuse it within seconds."""
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at", "updated_at"])
    return key


@dataclass
class UsageDelta:
    """What one key did on one deployment during one minute, as counted by a router."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0
    rejected: int = 0
    users: set[str] = dataclasses.field(default_factory=set)

    def add(self, other: UsageDelta) -> None:
        """Count `other` in this one too (the users up to MAX_USERS_PER_ROW)."""
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.errors += other.errors
        self.rejected += other.rejected
        for user in other.users:
            if len(self.users) >= MAX_USERS_PER_ROW:
                break
            self.users.add(user)


def record_usage(key_id: int, deployment: str, minute: datetime, delta: UsageDelta) -> None:
    """Add `delta` to the key's row for (`deployment`, `minute`), creating it; atomic per row.

    A key deleted since the router counted is skipped (its usage went with it).
    """
    minute = minute.replace(second=0, microsecond=0)
    if not ApiKey.objects.filter(pk=key_id).exists():
        return
    with transaction.atomic():
        row, _ = ApiKeyUsage.objects.select_for_update().get_or_create(
            api_key_id=key_id, deployment=deployment, minute=minute
        )
        ApiKeyUsage.objects.filter(pk=row.pk).update(
            requests=F("requests") + delta.requests,
            prompt_tokens=F("prompt_tokens") + delta.prompt_tokens,
            completion_tokens=F("completion_tokens") + delta.completion_tokens,
            errors=F("errors") + delta.errors,
            rejected=F("rejected") + delta.rejected,
        )
        if delta.users:
            known = list(row.users)
            for user in sorted(delta.users):
                if len(known) >= MAX_USERS_PER_ROW:
                    break
                if user not in known:
                    known.append(user)
            if known != row.users:
                ApiKeyUsage.objects.filter(pk=row.pk).update(users=known)
