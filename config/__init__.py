"""The Django project of the platform (named `config`, not `platform`, which would shadow the stdlib)."""
# Loading the Celery app with Django makes @shared_task and .delay() use the platform's broker settings.
from config.celery import app as celery_app

__all__ = ["celery_app"]
