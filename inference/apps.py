"""Django app configuration for inference."""
from django.apps import AppConfig


class InferenceConfig(AppConfig):
    """The inference app: models, deployments, scaling rules, REST API and router views."""

    name = "inference"
    default_auto_field = "django.db.models.BigAutoField"
