"""API keys of the generation API: who may generate, on which deployments, how much and how urgently.

Only a SHA-256 of the secret is stored (the secret is 32 random bytes, so a fast hash is enough: there is
no dictionary to guess from); the secret is shown once when the key is created, and its prefix (the
first characters, which are not secret) lets an operator recognise a key in lists and logs.
The router never queries this table per request: it keeps a snapshot refreshed every few seconds
(inference/gateway/api_keys.py).
"""
from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from inference.models.deployments import Deployment


class PriorityClass(models.TextChoices):
    """How the router's admission queue orders a key's requests: interactive ones are served first."""

    INTERACTIVE = "interactive", "Interactive"
    BATCH = "batch", "Batch"


class ApiKey(models.Model):
    """A generation API key: owner, scope (deployments), expiry, revocation, limits and priority class.

    A limit left empty is no limit. An empty `deployments` means every deployment.
    """

    name = models.CharField(max_length=100)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys")
    prefix = models.CharField(max_length=16, unique=True, editable=False, help_text="the key's first characters")
    secret_hash = models.CharField(max_length=64, unique=True, editable=False)
    deployments = models.ManyToManyField(
        Deployment, blank=True, related_name="api_keys", help_text="empty: every deployment"
    )
    priority = models.CharField(max_length=16, choices=PriorityClass.choices, default=PriorityClass.INTERACTIVE)
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True, help_text="empty: no limit")
    tokens_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="prompt + completion tokens; empty: no limit"
    )
    max_concurrent = models.PositiveIntegerField(null=True, blank=True, help_text="empty: no limit")
    expires_at = models.DateTimeField(null=True, blank=True, help_text="empty: never")
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True, db_index=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def is_active(self) -> bool:
        """Neither revoked nor expired."""
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > timezone.now())


class ApiKeyUsage(models.Model):
    """One key's use of one deployment during one minute, aggregated from the routers' counters."""

    api_key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="usage")
    deployment = models.CharField(max_length=100, blank=True, help_text="empty: a router with static endpoints")
    minute = models.DateTimeField(db_index=True)
    requests = models.PositiveIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0)
    rejected = models.PositiveIntegerField(default=0, help_text="429 answers (limits, queue)")
    users = models.JSONField(default=list, blank=True, help_text="OpenAI `user` values seen (bounded)")

    class Meta:
        ordering = ["-minute"]
        constraints = [
            models.UniqueConstraint(fields=["api_key", "deployment", "minute"], name="api_key_usage_minute"),
        ]

    def __str__(self) -> str:
        return f"{self.api_key_id}/{self.deployment or '-'}@{self.minute:%H:%M}"
