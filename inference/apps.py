"""Django app configuration for inference."""
from django.apps import AppConfig


class InferenceConfig(AppConfig):
    """The inference app (the control plane): models, actions, selectors, controller, scaling, metrics, agent,
    admin, REST API and the gateway hosting the router."""

    name = "inference"
    default_auto_field = "django.db.models.BigAutoField"
