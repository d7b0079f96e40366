"""`GET /api/tasks/{task_id}/`: the state of a control-plane task the API queued (the scale endpoint
answers 202 with its task id), read from Celery's result backend."""
from __future__ import annotations

import logging
import uuid
from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from config.celery import app
from inference.api.schema import PlatformAutoSchema
from inference.api.serializers import ErrorSerializer, TaskStatusSerializer

logger = logging.getLogger(__name__)


def task_status(task_id: str) -> dict[str, Any]:
    """The task's state, the ScaleEvent id a finished scale task returned, and a failure's error."""
    result = app.AsyncResult(task_id)
    state = str(result.state)
    value = result.result if state in ("SUCCESS", "FAILURE") else None
    return {
        "task_id": task_id,
        "state": state,
        "ready": state in ("SUCCESS", "FAILURE", "REVOKED"),
        "scale_event": value if state == "SUCCESS" and isinstance(value, int) else None,
        "error": f"{type(value).__name__}: {value}" if state == "FAILURE" and value is not None else None,
    }


class TaskStatusView(APIView):
    """The state of a queued task, by the id an earlier answer gave (202 of the scale endpoint)."""

    schema = PlatformAutoSchema()

    @extend_schema(
        summary="State of a queued control-plane task (e.g. a scale): PENDING, STARTED, SUCCESS, FAILURE, ...",
        responses={200: TaskStatusSerializer, 503: ErrorSerializer},
    )
    def get(self, request: Request, task_id: str) -> Response:
        """Look the task up in Celery's result backend; 404 for an id that is no task id (not a UUID)."""
        try:
            canonical = str(uuid.UUID(task_id))
        except ValueError as exc:
            raise NotFound(f"no task {task_id[:80]!r}: task ids are UUIDs, as the scale endpoint returns") from exc
        try:
            payload = task_status(canonical)
        except Exception as exc:  # noqa: BLE001  any backend error (Redis down, unreadable file) is a 503
            logger.exception("task %s: result backend unavailable", canonical)
            return Response(
                {"detail": f"the task result backend is unavailable: {exc}"}, status=status.HTTP_503_SERVICE_UNAVAILABLE
            )
        return Response(TaskStatusSerializer(payload).data)
