"""The Celery application shared by agents (queue node.<name>), the controller (queue control) and beat."""
from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("config")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
# The agent's tasks (inference.agent.tasks.*, and their legacy names nodes.tasks.*) live in
# inference.agent.tasks, which is no app's `tasks` module.
app.autodiscover_tasks(["inference.agent"])
