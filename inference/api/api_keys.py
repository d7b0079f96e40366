"""REST API of generation API keys: /api/keys/ (create, list, edit limits, revoke, usage per minute).

A user sees and manages their own keys; staff see everybody's. The secret is in the create answer only
(`secret`); afterwards a key shows its prefix. State changes go through inference.actions.api_keys.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import QuerySet
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from inference.actions import api_keys as key_actions
from inference.api.views import PlatformViewSetMixin
from inference.models import ApiKey, Deployment
from inference.selectors import api_keys as key_selectors

_EDITABLE = ("name", "priority", "requests_per_minute", "tokens_per_minute", "max_concurrent", "expires_at")
_MAX_USAGE_MINUTES = 7 * 24 * 60


class ApiKeySerializer(serializers.ModelSerializer):
    """A key as listed: its prefix, scope, limits and state (never its secret)."""

    owner = serializers.CharField(source="owner.username", read_only=True)
    deployments = serializers.SlugRelatedField(
        slug_field="name", many=True, queryset=Deployment.objects.all(), required=False
    )
    active = serializers.BooleanField(source="is_active", read_only=True)

    class Meta:
        model = ApiKey
        fields = ["id", "name", "prefix", "owner", "deployments", "priority", "requests_per_minute",
                  "tokens_per_minute", "max_concurrent", "expires_at", "revoked_at", "active", "created_at"]
        read_only_fields = ["prefix", "revoked_at", "created_at"]


class CreatedApiKeySerializer(ApiKeySerializer):
    """The create answer: the key and its secret, shown this once."""

    secret = serializers.CharField(read_only=True, help_text="shown once: store it now")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "secret"]


class UsageMinuteSerializer(serializers.Serializer):
    """One minute of a key's usage, every deployment summed."""

    at = serializers.DateTimeField()
    requests = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    errors = serializers.IntegerField()
    rejected = serializers.IntegerField()


def _django_errors(exc: DjangoValidationError) -> ValidationError:
    return ValidationError(exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages})


class ApiKeyViewSet(PlatformViewSetMixin, mixins.CreateModelMixin, mixins.UpdateModelMixin,
                    viewsets.ReadOnlyModelViewSet):
    """Generation API keys: create (the answer holds the secret, once), list, edit, revoke, usage."""

    serializer_class = ApiKeySerializer
    queryset = ApiKey.objects.none()  # the schema's type of `id`; requests use get_queryset

    def get_queryset(self) -> QuerySet[ApiKey]:
        """Own keys; every key for staff."""
        keys = ApiKey.objects.select_related("owner").prefetch_related("deployments").order_by("-created_at")
        if getattr(self, "swagger_fake_view", False):  # schema generation: no request user
            return keys.none()
        user = self.request.user
        return keys if getattr(user, "is_staff", False) else keys.filter(owner=user)

    @extend_schema(responses={201: CreatedApiKeySerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Create a key owned by the caller; the answer's `secret` is never shown again."""
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        deployments = data.pop("deployments", [])
        fields = {name: data[name] for name in _EDITABLE if name in data and name != "name"}
        try:
            created = key_actions.create_key(name=data["name"], owner=request.user, deployments=deployments,
                                             **fields)
        except DjangoValidationError as exc:
            raise _django_errors(exc) from exc
        body = CreatedApiKeySerializer(created.key).data
        body["secret"] = created.secret
        return Response(body, status=status.HTTP_201_CREATED)

    def perform_update(self, serializer: serializers.BaseSerializer) -> None:
        """Apply the changed limits, scope or expiry through the action."""
        data = dict(serializer.validated_data)
        deployments = data.pop("deployments", None)
        changes = {name: data[name] for name in _EDITABLE if name in data}
        try:
            serializer.instance = key_actions.update_key(serializer.instance, changes, deployments)
        except DjangoValidationError as exc:
            raise _django_errors(exc) from exc

    @extend_schema(request=None, responses={200: ApiKeySerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        """Revoke the key: every router refuses it within ROUTER_KEY_MAX_STALE_S."""
        key = key_actions.revoke_key(self.get_object())
        return Response(ApiKeySerializer(key).data)

    @extend_schema(
        parameters=[OpenApiParameter("minutes", int, description=f"how far back (1-{_MAX_USAGE_MINUTES}; 60)")],
        responses={200: UsageMinuteSerializer(many=True)},
    )
    @action(detail=True, methods=["get"])
    def usage(self, request: Request, pk: str | None = None) -> Response:
        """The key's usage per minute over the last `minutes`."""
        raw = request.query_params.get("minutes", "60")
        try:
            minutes = int(raw)
        except ValueError:
            raise ValidationError({"minutes": f"{raw!r} is not an integer"}) from None
        if not 1 <= minutes <= _MAX_USAGE_MINUTES:
            raise ValidationError({"minutes": f"must be between 1 and {_MAX_USAGE_MINUTES}"})
        rows = key_selectors.usage_per_minute(self.get_object(), timezone.now() - timedelta(minutes=minutes))
        return Response(UsageMinuteSerializer(rows, many=True).data)
