"""URLs of the REST API, mounted at /api/ by config/urls.py (before the router's api/generate)."""
from django.urls import URLPattern, URLResolver, path
from rest_framework.routers import DefaultRouter

from inference.api import views
from inference.api.api_keys import ApiKeyViewSet
from inference.api.task_status import TaskStatusView

router = DefaultRouter()
router.register("nodes", views.NodeViewSet, basename="node")
router.register("models", views.ServedModelViewSet, basename="model")
router.register("deployments", views.DeploymentViewSet, basename="deployment")
router.register("workers", views.WorkerViewSet, basename="worker")
router.register("rules", views.ScalingRuleViewSet, basename="scalingrule")
router.register("events", views.ScaleEventViewSet, basename="scaleevent")
router.register("overrides", views.ScaleOverrideViewSet, basename="scaleoverride")
router.register("keys", ApiKeyViewSet, basename="apikey")

urlpatterns: list[URLPattern | URLResolver] = [
    *router.urls,
    path("tasks/<str:task_id>/", TaskStatusView.as_view(), name="task-status"),
]
