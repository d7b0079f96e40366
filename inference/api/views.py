"""REST API views: thin ViewSets whose state changes go through inference.actions and nodes.actions, and
whose reads of metric series go through inference.selectors."""
from __future__ import annotations

import logging
from typing import Any

from django.db.models import Count, Prefetch, ProtectedError, Q
from django.urls import reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer

from inference import jobs
from inference.actions import deployments as deployment_actions
from inference.actions import nodes as node_workers
from inference.actions import rules as rule_actions
from inference.actions import scale as scale_actions
from inference.actions import workers as worker_actions
from inference.api.params import (
    ChoiceParam,
    IdParam,
    QueryParam,
    QueryParamFilterBackend,
    StrictLimitOffsetPagination,
)
from inference.api.schema import PlatformAutoSchema
from inference.api.serializers import (
    DeploymentSerializer,
    ErrorSerializer,
    NodeSerializer,
    ScaleEventSerializer,
    ScaleOverrideSerializer,
    ScaleQueuedSerializer,
    ScaleRequestSerializer,
    ScalingRuleSerializer,
    ScheduleConflictSerializer,
    ServedModelSerializer,
    WorkerRestartSerializer,
    WorkerSerializer,
)
from inference.models import (
    ACTIVE_WORKER_STATUSES,
    Deployment,
    DeploymentStatus,
    ScaleEvent,
    ScaleOverride,
    ScaleSource,
    ScalingRule,
    Worker,
    WorkerRole,
    WorkerStatus,
)
from inference.models import Model as ServedModel
from inference.selectors import metrics as metric_selectors
from nodes import actions as node_actions
from nodes.models import Node

logger = logging.getLogger(__name__)


class Conflict(APIException):
    """409: the request is valid but the object's current state refuses it."""

    status_code = status.HTTP_409_CONFLICT
    default_detail = "The object's current state does not allow this."
    default_code = "conflict"


class ServiceUnavailable(APIException):
    """503: a component the request needs (task queue, controller code) is not available."""

    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_detail = "A required service is unavailable."
    default_code = "service_unavailable"


def _actor(request: Request) -> str:
    """Who made the request, for ScaleEvent reasons."""
    return str(getattr(request.user, "username", "") or "anonymous")


class PlatformViewSetMixin:
    """What every viewset of the API shares: query parameters validated and documented in one place.

    `filter_params` (inference.api.params.QueryParam) declare a list's filters; the backend parses
    them (bad values are 400s naming the parameter) and documents them, the paginator does the same
    for `limit`/`offset`, and the schema class adds the error answers to every operation.
    """

    schema = PlatformAutoSchema()
    filter_backends = [QueryParamFilterBackend]
    pagination_class = StrictLimitOffsetPagination
    filter_params: tuple[QueryParam, ...] = ()


def _deployment_param() -> IdParam:
    return IdParam("deployment", "deployment_id", "only objects of this deployment id")


def _role_filter() -> ChoiceParam:
    return ChoiceParam("role", "role", "only this role", choices=tuple(WorkerRole.values))


def _role_param() -> OpenApiParameter:
    return OpenApiParameter("role", OpenApiTypes.STR, enum=WorkerRole.values, description="only this role")


@extend_schema_view(
    list=extend_schema(summary="List nodes with their resources, heartbeat age and live worker count"),
    retrieve=extend_schema(summary="One node"),
    partial_update=extend_schema(
        summary="Allow or forbid CPU oversubscription on a node (its only field an operator sets)"
    ),
)
class NodeViewSet(PlatformViewSetMixin, mixins.UpdateModelMixin, viewsets.ReadOnlyModelViewSet):
    """Hosts registered by their agents (agents own these rows), the drain action and the placement setting."""

    serializer_class = NodeSerializer
    # PATCH only: a PUT would have to restate fields the agent owns.
    http_method_names = ["get", "post", "patch", "head", "options"]
    queryset = Node.objects.annotate(
        live_workers=Count("workers", filter=Q(workers__status__in=ACTIVE_WORKER_STATUSES))
    ).order_by("name")

    @extend_schema(
        summary="Drain a node: it takes no new workers and its workers are moved off it",
        request=None,
        responses={202: NodeSerializer},
    )
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, pk: str | None = None) -> Response:
        """Drain the node through inference.actions.nodes.drain_node (the agent/controller carry it out)."""
        node = self.get_object()
        node_workers.drain_node(node)
        return Response(self.get_serializer(self.get_queryset().get(pk=node.pk)).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(
        summary="Put a draining node back into service (new workers may be placed on it)",
        request=None,
        responses={200: NodeSerializer},
    )
    @action(detail=True, methods=["post"])
    def activate(self, request: Request, pk: str | None = None) -> Response:
        """Undo a drain through nodes.actions.activate_node."""
        node = self.get_object()
        node_actions.activate_node(node)
        return Response(self.get_serializer(self.get_queryset().get(pk=node.pk)).data)


@extend_schema_view(destroy=extend_schema(responses={204: None, 409: ErrorSerializer}))
class ServedModelViewSet(PlatformViewSetMixin, viewsets.ModelViewSet):
    """Model checkpoints the platform serves (a model used by a deployment cannot be deleted)."""

    serializer_class = ServedModelSerializer
    queryset = ServedModel.objects.order_by("name")

    def perform_destroy(self, instance: ServedModel) -> None:
        """Delete the model, answering 409 while deployments use it."""
        try:
            instance.delete()
        except ProtectedError as exc:
            names = ", ".join(sorted(d.name for d in exc.protected_objects))
            raise Conflict(f"model {instance.name} is used by deployment(s): {names}") from exc


def _conflict_response(exc: scale_actions.ScheduleConflict) -> Response:
    """409 naming the schedule rule that would revert a manual replica change."""
    rule = exc.rule
    conflict = {
        "detail": str(exc),
        "rule": {"id": rule.pk, "name": rule.name, "start_time": rule.start_time, "end_time": rule.end_time,
                 "target_replicas": rule.target_replicas},
        "held_replicas": exc.held,
    }  # fmt: skip
    return Response(ScheduleConflictSerializer(conflict).data, status=status.HTTP_409_CONFLICT)


@extend_schema_view(destroy=extend_schema(responses={204: None, 409: ErrorSerializer}))
class DeploymentViewSet(PlatformViewSetMixin, viewsets.ModelViewSet):
    """Deployments: CRUD (replica changes are recorded as ScaleEvents), scale and metrics."""

    serializer_class = DeploymentSerializer
    queryset = Deployment.objects.select_related("model").order_by("name")
    filter_params = (ChoiceParam("status", "status", "only this status", choices=tuple(DeploymentStatus.values)),)

    def perform_create(self, serializer: BaseSerializer) -> None:
        """Create through inference.actions.deployments.save_deployment (records the initial ScaleEvents)."""
        deployment = Deployment(**serializer.validated_data)
        deployment_actions.save_deployment(
            deployment, source="api", reason=f"deployment created through the API by {_actor(self.request)}"
        )
        serializer.instance = deployment

    @extend_schema(responses={200: DeploymentSerializer, 409: ScheduleConflictSerializer})
    def update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """PUT/PATCH; 409 (nothing saved) when an active schedule rule would revert a replica change."""
        try:
            return super().update(request, *args, **kwargs)
        except scale_actions.ScheduleConflict as exc:
            return _conflict_response(exc)

    @extend_schema(responses={200: DeploymentSerializer, 409: ScheduleConflictSerializer})
    def partial_update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """PATCH: as `update`, with only the fields sent."""
        return super().partial_update(request, *args, **kwargs)

    def perform_update(self, serializer: BaseSerializer) -> None:
        """Update through inference.actions.deployments.save_deployment; unchanged replica counts are not reverted."""
        deployment = serializer.instance
        data = serializer.validated_data
        for field, value in data.items():
            setattr(deployment, field, value)
        deployment_actions.save_deployment(
            deployment,
            changed_fields=data.keys(),
            source="api",
            reason=f"deployment edited through the API by {_actor(self.request)}",
        )

    def perform_destroy(self, instance: Deployment) -> None:
        """Delete a deployment without live workers; 409 otherwise."""
        try:
            deployment_actions.delete_deployment(instance)
        except deployment_actions.DeploymentInUse as exc:
            raise Conflict(str(exc)) from exc

    @extend_schema(
        summary="Queue a scale operation for one role; 400 when the count is outside the role's min/max, "
        "409 if an active schedule rule would revert it, unless an override end is given; the task's state "
        "at task_url",
        request=ScaleRequestSerializer,
        responses={202: ScaleQueuedSerializer, 409: ScheduleConflictSerializer, 503: ErrorSerializer},
    )
    @action(detail=True, methods=["post"])
    def scale(self, request: Request, pk: str | None = None) -> Response:
        """Queue the scale through inference.actions.scale.request_manual_scale (the admin's scale actions
        too): checked against schedule rules, an override recorded if asked; answer 202 with the task id."""
        deployment = self.get_object()
        body = ScaleRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        actor = _actor(request)
        reason = data["reason"].strip() or f"scale requested through the API by {actor}"
        try:
            queued = scale_actions.request_manual_scale(
                deployment, data["role"], replicas=data["replicas"], source="api", actor=actor, reason=reason,
                override_until=data["override_until"],
            )  # fmt: skip
        except scale_actions.ScheduleConflict as exc:
            return _conflict_response(exc)
        except scale_actions.ReplicasOutOfBounds as exc:
            raise ValidationError({"replicas": [str(exc)]}) from exc
        except jobs.JobNotQueued as exc:  # the broker is down: nothing was changed, no override kept
            logger.exception("could not enqueue the scale of %s", deployment.name)
            raise ServiceUnavailable(f"could not queue the scale operation: {exc}") from exc
        payload = ScaleQueuedSerializer({
            "queued": True, "task_id": queued.task_id,
            "task_url": request.build_absolute_uri(reverse("task-status", args=[queued.task_id])),
            "role": queued.role, "from_replicas": queued.current, "to_replicas": queued.target,
            "override": queued.override,
        }).data  # fmt: skip
        return Response(payload, status=status.HTTP_202_ACCEPTED)

    @extend_schema(
        summary="Time series of the deployment's metrics: per role and per worker (load, TTFT, ITL, throughput, "
        "queue, KV usage, CPU/GPU, memory, KV transfer, prefix cache, request share) and the router's "
        "(dispatch overhead, error rate, 429s, client TTFT/ITL)",
        parameters=[
            OpenApiParameter("minutes", OpenApiTypes.INT, description="window back from now (default 60)"),
            _role_param(),
            OpenApiParameter("max_points", OpenApiTypes.INT, description="points per series (default 600; a "
                             "worker's series at most 200)"),
            OpenApiParameter("max_workers", OpenApiTypes.INT, description="per-worker series of the N most "
                             "loaded workers (default 20, at most 200, 0: none); workers_total counts them all"),
        ],
        responses={200: OpenApiResponse(OpenApiTypes.OBJECT, description="see deployment_metric_series")},
    )
    @action(detail=True, methods=["get"])
    def metrics(self, request: Request, pk: str | None = None) -> Response:
        """Return inference.selectors.metrics.deployment_metric_series for `?minutes=` back from now."""
        deployment = self.get_object()
        try:
            return Response(metric_selectors.metric_series_query(deployment, request.query_params))
        except metric_selectors.InvalidQuery as exc:
            raise ValidationError(exc.errors) from exc


class WorkerViewSet(PlatformViewSetMixin, viewsets.ReadOnlyModelViewSet):
    """Worker processes (read-only: the controller and agents own them) and the restart action."""

    serializer_class = WorkerSerializer
    queryset = Worker.objects.select_related("node", "deployment").order_by("deployment_id", "role", "id")
    filter_params = (
        _deployment_param(),
        _role_filter(),
        ChoiceParam("status", "status", "only this status", choices=tuple(WorkerStatus.values)),
        IdParam("node", "node_id", "only workers on this node id"),
    )

    @extend_schema(
        summary="Restart a worker process",
        request=None,
        responses={202: WorkerRestartSerializer, 409: ErrorSerializer},
    )
    @action(detail=True, methods=["post"])
    def restart(self, request: Request, pk: str | None = None) -> Response:
        """Restart the worker through inference.actions.workers.restart_worker (its agent carries it out)."""
        worker = self.get_object()
        try:
            worker_actions.restart_worker(worker)
        except ValueError as exc:  # not live any more, or its node is offline
            raise Conflict(str(exc)) from exc
        worker.refresh_from_db()
        payload = WorkerRestartSerializer({"restarting": True, "worker": worker}).data
        return Response(payload, status=status.HTTP_202_ACCEPTED)


class ScalingRuleViewSet(PlatformViewSetMixin, viewsets.ModelViewSet):
    """Threshold and schedule scaling rules; model validation failures answer 400 per field."""

    serializer_class = ScalingRuleSerializer
    queryset = ScalingRule.objects.select_related("deployment").order_by("deployment_id", "name")
    filter_params = (_deployment_param(), _role_filter())

    def perform_create(self, serializer: BaseSerializer) -> None:
        """Create through inference.actions.rules.save_rule."""
        serializer.instance = rule_actions.save_rule(ScalingRule(**serializer.validated_data))

    def perform_update(self, serializer: BaseSerializer) -> None:
        """Update through inference.actions.rules.save_rule (a changed condition restarts the breach timer)."""
        rule = serializer.instance
        for field, value in serializer.validated_data.items():
            setattr(rule, field, value)
        rule_actions.save_rule(rule, changed_fields=serializer.validated_data.keys())


class ScaleEventViewSet(PlatformViewSetMixin, viewsets.ReadOnlyModelViewSet):
    """Recorded replica changes, newest first (read-only: actions.py writes them)."""

    serializer_class = ScaleEventSerializer
    # Each event lists its placed workers' ids: read for the whole page in one query (ids only), not one
    # query per event (82 ms of CPU for 32 events at 1,000 workers; bench/sim/control_plane.py).
    queryset = ScaleEvent.objects.prefetch_related(
        Prefetch("placed_workers", queryset=Worker.objects.only("id"))
    ).order_by("-created_at", "-id")
    filter_params = (
        _deployment_param(),
        _role_filter(),
        ChoiceParam("source", "source", "only this source", choices=tuple(ScaleSource.values)),
    )


class ScaleOverrideViewSet(PlatformViewSetMixin, viewsets.ReadOnlyModelViewSet):
    """Overrides of scaling rules made by manual scales, newest first (made through the scale action)."""

    serializer_class = ScaleOverrideSerializer
    queryset = ScaleOverride.objects.select_related("rule").order_by("-created_at", "-id")
    filter_params = (_deployment_param(), _role_filter())
