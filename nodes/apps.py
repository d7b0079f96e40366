"""Django app configuration for nodes."""
from django.apps import AppConfig


class NodesConfig(AppConfig):
    """The nodes app: Node, Worker and the per-host agent."""

    name = "nodes"
    default_auto_field = "django.db.models.BigAutoField"
