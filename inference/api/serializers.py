"""Serializers of the REST API; model `clean()` rules are enforced here so violations answer 400."""
from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.utils import timezone
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from inference.actions import scale as scale_actions
from inference.models import (
    ACTIVE_WORKER_STATUSES,
    Deployment,
    ScaleEvent,
    ScaleOverride,
    ScalingRule,
    Worker,
    WorkerRole,
)
from inference.models import Model as ServedModel
from inference.selectors.schedules import active_overrides
from nodes.models import Node


class ModelCleanMixin(serializers.ModelSerializer):
    """Runs the model's `clean()` on the would-be instance and reports its errors per field.

    DRF does not call `Model.clean()`; without this, a deployment with min > max or a threshold
    rule without a threshold would be saved through the API although the admin refuses it.
    """

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """Apply `attrs` to a copy of the instance (or a new one) and run its `clean()`."""
        attrs = super().validate(attrs)
        # A copy, so that a refused update leaves the instance the view holds untouched.
        candidate = copy.copy(self.instance) if self.instance is not None else self.Meta.model()
        for field, value in attrs.items():
            setattr(candidate, field, value)
        self.prepare_candidate(candidate, attrs)
        try:
            candidate.clean()
        except DjangoValidationError as exc:
            detail = exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
            raise serializers.ValidationError(detail) from exc
        return attrs

    def prepare_candidate(self, candidate: Any, attrs: dict[str, Any]) -> None:
        """Adjust the would-be instance before `clean()` (hook for subclasses)."""


class NodeSerializer(serializers.ModelSerializer):
    """A host with the resources its agent registered, its heartbeat age and live worker count.

    Agents own these rows; the operator's only write is `allow_cpu_oversubscription` (PATCH), which
    lets the controller place workers on CPUs other workers of the host already use.
    """

    queue_name = serializers.CharField(read_only=True)
    heartbeat_age_s = serializers.SerializerMethodField()
    worker_count = serializers.SerializerMethodField()

    class Meta:
        model = Node
        read_only_fields = [
            "id", "name", "hostname", "address", "status", "cpu_count", "memory_bytes", "gpus",
            "rdma_devices", "rdma_note", "labels", "port_range_start", "port_range_end", "last_heartbeat",
            "heartbeat_age_s", "last_metrics", "registered_at", "queue_name", "worker_count",
        ]  # fmt: skip
        fields = [*read_only_fields, "allow_cpu_oversubscription"]

    @extend_schema_field(serializers.FloatField(allow_null=True))
    def get_heartbeat_age_s(self, node: Node) -> float | None:
        """Seconds since the agent's last heartbeat (null: never)."""
        if node.last_heartbeat is None:
            return None
        return round((timezone.now() - node.last_heartbeat).total_seconds(), 1)

    @extend_schema_field(serializers.IntegerField())
    def get_worker_count(self, node: Node) -> int:
        """Workers on the node that are pending, starting, running or unhealthy."""
        annotated = getattr(node, "live_workers", None)
        if annotated is not None:
            return int(annotated)
        return int(node.workers.filter(status__in=ACTIVE_WORKER_STATUSES).count())


class ServedModelSerializer(serializers.ModelSerializer):
    """A model checkpoint the platform can serve."""

    class Meta:
        model = ServedModel
        fields = ["id", "name", "source", "source_ref", "path", "created_at"]
        read_only_fields = ["id", "created_at"]


class ScaleOverrideSerializer(serializers.ModelSerializer):
    """An operator's count for a role that scaling rules leave alone until `ends_at`."""

    rule_name = serializers.CharField(source="rule.name", read_only=True, allow_null=True, default=None)
    active = serializers.SerializerMethodField()
    # Plain text in the schema: a second component with ScaleSource's enum would make drf-spectacular
    # name the enums of ScaleEvent.source and Model.source by hash.
    source = serializers.CharField(read_only=True, help_text="who made it: manual (admin) or api")

    class Meta:
        model = ScaleOverride
        fields = ["id", "deployment", "role", "replicas", "ends_at", "active", "rule", "rule_name", "source",
                  "created_by", "reason", "created_at"]  # fmt: skip
        read_only_fields = fields

    @extend_schema_field(serializers.BooleanField())
    def get_active(self, override: ScaleOverride) -> bool:
        """Whether the override still holds its role."""
        return bool(override.ends_at > timezone.now())


class DeploymentSerializer(ModelCleanMixin):
    """A disaggregated deployment: replicas and bounds per role, router and worker flags."""

    model_name = serializers.CharField(source="model.name", read_only=True)
    overrides = serializers.SerializerMethodField()

    class Meta:
        model = Deployment
        fields = [
            "id", "name", "model", "model_name", "status", "overrides",
            "prefill_replicas", "prefill_min", "prefill_max", "decode_replicas", "decode_min", "decode_max",
            "both_replicas", "both_min", "both_max", "router_policy", "kv_token_weight", "kv_load_weight",
            "local_prefill_tokens", "context_length", "max_sequence_length", "batch_size", "block_size",
            "kv_transport", "threads_per_worker", "speculative", "num_speculative_tokens", "created_at", "updated_at",
        ]  # fmt: skip
        read_only_fields = ["id", "created_at", "updated_at"]

    @extend_schema_field(ScaleOverrideSerializer(many=True))
    def get_overrides(self, deployment: Deployment) -> list[dict[str, Any]]:
        """Overrides holding a role now (scaling rules leave that role alone until they end)."""
        return list(ScaleOverrideSerializer(active_overrides(deployment, timezone.now()), many=True).data)

    def prepare_candidate(self, candidate: Any, attrs: dict[str, Any]) -> None:
        """An update changing only a role's bounds clamps its replicas instead of failing.

        inference.actions.deployments.save_deployment applies the same clamp (and records it in the ScaleEvent)
        to the current count, which an autoscaler may have moved since the client read it.
        """
        if self.instance is None:
            return
        for role in WorkerRole.values:
            field = f"{role}_replicas"
            if field not in attrs:
                low, high = candidate.bounds(role)
                if low <= high:
                    setattr(candidate, field, min(max(candidate.replicas(role), low), high))


class WorkerSerializer(serializers.ModelSerializer):
    """A prefill or decode process of a deployment on a node, as its agent last reported it."""

    url = serializers.CharField(read_only=True)
    node_name = serializers.CharField(source="node.name", read_only=True)
    deployment_name = serializers.CharField(source="deployment.name", read_only=True)

    class Meta:
        model = Worker
        fields = [
            "id", "deployment", "deployment_name", "node", "node_name", "role", "url", "port", "kv_port",
            "pid", "status", "restarts", "cpu_ids", "gpu_ids", "last_health", "last_metrics", "last_error",
            "last_seen", "created_at", "updated_at",
        ]  # fmt: skip
        read_only_fields = fields


class ScalingRuleSerializer(ModelCleanMixin):
    """A threshold, SLO or schedule rule changing one role's replicas of a deployment.

    SLO rules (kind ttft_slo / itl_slo) take their p90 target as threshold (seconds / milliseconds);
    ScalingRule.clean refuses one with another role than the one limiting it, a step below 1 or a
    missing target (400 naming the field).
    """

    class Meta:
        model = ScalingRule
        fields = [
            "id", "deployment", "name", "kind", "role", "enabled", "threshold", "comparison", "duration_s",
            "cooldown_s", "step", "start_time", "end_time", "target_replicas", "breach_started_at",
            "last_triggered_at",
        ]  # fmt: skip
        read_only_fields = ["id", "breach_started_at", "last_triggered_at"]


class ScaleEventSerializer(serializers.ModelSerializer):
    """One recorded change of a deployment's replicas, with its source and reason, the workers placed
    for it and how long they took to run (time_to_run_s, null while they start). `refused`: workers the
    controller could not place (the reason names each node and why), not a change of the desired count."""

    class Meta:
        model = ScaleEvent
        fields = [
            "id", "deployment", "role", "from_replicas", "to_replicas", "source", "refused", "rule", "reason",
            "created_at", "placed_workers", "time_to_run_s",
        ]  # fmt: skip
        read_only_fields = fields


class ScaleRequestSerializer(serializers.Serializer):
    """Body of `POST /api/deployments/{id}/scale/`; a count outside the role's [min, max] is refused (400).

    Inside an active schedule rule's window a count the rule would revert is refused (409) unless an
    override end is given, as `override_until` (a time) or `override_minutes` (from now).
    """

    role = serializers.ChoiceField(choices=WorkerRole.choices)
    replicas = serializers.IntegerField(min_value=0, max_value=10_000)
    reason = serializers.CharField(required=False, allow_blank=True, max_length=1000, default="")
    override_until = serializers.DateTimeField(
        required=False, allow_null=True, default=None,
        help_text="hold this count against scaling rules until this time (at most 7 days ahead)",
    )  # fmt: skip
    override_minutes = serializers.IntegerField(
        required=False, allow_null=True, default=None, min_value=1,
        max_value=int(scale_actions.MAX_OVERRIDE.total_seconds() // 60),
        help_text="hold this count against scaling rules for this many minutes",
    )  # fmt: skip

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """One way of giving the override's end at most; resolved into `override_until`."""
        until, minutes = attrs.get("override_until"), attrs.pop("override_minutes", None)
        if until is not None and minutes is not None:
            message = "give override_until or override_minutes, not both"
            raise serializers.ValidationError({"override_minutes": [message]})
        now = timezone.now()
        if minutes is not None:
            until = now + timedelta(minutes=minutes)
        if until is not None and not now < until <= now + scale_actions.MAX_OVERRIDE:
            raise serializers.ValidationError(
                {"override_until": [f"must be in the future and at most {scale_actions.MAX_OVERRIDE.days} days ahead"]}
            )
        attrs["override_until"] = until
        return attrs


class ScaleQueuedSerializer(serializers.Serializer):
    """Answer of the scale endpoint: the Celery task that will apply the change (its state at `task_url`),
    the role's count now and the one asked for, and the override in force."""

    queued = serializers.BooleanField()
    task_id = serializers.CharField()
    task_url = serializers.CharField(help_text="GET it for the task's state (`GET /api/tasks/{task_id}/`)")
    role = serializers.CharField()
    from_replicas = serializers.IntegerField(help_text="the role's desired replicas when the scale was queued")
    to_replicas = serializers.IntegerField(help_text="the count the controller will set")
    override = ScaleOverrideSerializer(allow_null=True)


class TaskStatusSerializer(serializers.Serializer):
    """State of a queued control-plane task (Celery's AsyncResult), e.g. the scale endpoint's."""

    task_id = serializers.CharField()
    state = serializers.ChoiceField(
        choices=["PENDING", "RECEIVED", "STARTED", "RETRY", "SUCCESS", "FAILURE", "REVOKED"],
        help_text="Celery's state; PENDING also for an id Celery has no record of (unknown or expired)",
    )
    ready = serializers.BooleanField(help_text="whether the task has finished (SUCCESS, FAILURE or REVOKED)")
    scale_event = serializers.IntegerField(
        allow_null=True, help_text="the ScaleEvent a finished scale task recorded (null: nothing changed)",
    )
    error = serializers.CharField(allow_null=True, help_text="why a FAILURE failed")


class RuleRefSerializer(serializers.Serializer):
    """A scaling rule named in an answer."""

    id = serializers.IntegerField()
    name = serializers.CharField()
    start_time = serializers.TimeField()
    end_time = serializers.TimeField()
    target_replicas = serializers.IntegerField()


class ScheduleConflictSerializer(serializers.Serializer):
    """409 of the scale endpoint: the schedule rule that would revert the requested count."""

    detail = serializers.CharField()
    rule = RuleRefSerializer()
    held_replicas = serializers.IntegerField()


class WorkerRestartSerializer(serializers.Serializer):
    """Answer of the worker restart action."""

    restarting = serializers.BooleanField()
    worker = WorkerSerializer()


class ErrorSerializer(serializers.Serializer):
    """A refusal with its reason (e.g. 409 when a deleted object is still in use)."""

    detail = serializers.CharField()
