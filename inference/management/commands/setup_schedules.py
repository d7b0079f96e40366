"""`python manage.py setup_schedules`: create or update the controller's periodic tasks (idempotent)."""
from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand
from django.db import transaction
from django_celery_beat.models import IntervalSchedule, PeriodicTask

# (PeriodicTask name, task, every, period). Each run expires after its interval (at least 5 s), so a
# controller that was down does not work through a backlog of stale ticks when it comes back.
SCHEDULES: list[tuple[str, str, int, str]] = [
    ("platform: collect metrics", "inference.tasks.collect_metrics", 5, IntervalSchedule.SECONDS),
    ("platform: evaluate scaling rules", "inference.tasks.evaluate_scaling_rules", 10, IntervalSchedule.SECONDS),
    ("platform: check node heartbeats", "inference.tasks.check_node_heartbeats", 5, IntervalSchedule.SECONDS),
    ("platform: reconcile all", "inference.tasks.reconcile_all", 30, IntervalSchedule.SECONDS),
    ("platform: prune metrics", "inference.tasks.prune_metrics", 1, IntervalSchedule.HOURS),
    ("platform: prune stopped workers", "inference.tasks.prune_workers", 1, IntervalSchedule.HOURS),
]
_PERIOD_SECONDS = {IntervalSchedule.SECONDS: 1, IntervalSchedule.MINUTES: 60, IntervalSchedule.HOURS: 3600}


def setup_schedules() -> list[tuple[str, bool]]:
    """Create or update the PeriodicTasks; returns (name, created) pairs. Running it twice changes nothing."""
    results = []
    with transaction.atomic():
        for name, task, every, period in SCHEDULES:
            interval, _ = IntervalSchedule.objects.get_or_create(every=every, period=period)
            _, created = PeriodicTask.objects.update_or_create(
                name=name,
                defaults={
                    "task": task,
                    "interval": interval,
                    "crontab": None,
                    "solar": None,
                    "clocked": None,
                    "enabled": True,
                    "one_off": False,
                    "args": "[]",
                    "kwargs": "{}",
                    "expire_seconds": max(5, every * _PERIOD_SECONDS[period]),
                },
            )
            results.append((name, created))
    return results


class Command(BaseCommand):
    """Thin wrapper over `setup_schedules()`."""

    help = (
        "Create the django-celery-beat periodic tasks of the controller: collect_metrics every 5 s, "
        "evaluate_scaling_rules every 10 s, check_node_heartbeats every 5 s, reconcile_all every 30 s, "
        "prune_metrics hourly. Idempotent."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        """No options."""

    def handle(self, *args: Any, **options: Any) -> None:
        """Create or update the schedules and say what was done."""
        for name, created in setup_schedules():
            self.stdout.write(f"{'created' if created else 'updated'}: {name}")
