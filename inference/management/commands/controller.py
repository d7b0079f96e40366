"""`python manage.py controller`: a Celery worker on the queue "control", with beat embedded.

For single-host setups (and the systemd unit disagg-controller.service): one process runs the
controller's tasks (reconcile, scaling, metrics, heartbeats) and Celery beat with the database
scheduler, after creating the periodic tasks (`setup_schedules`, idempotent). On several controller
hosts run beat once: `--no-beat` on all but one.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import socket
from argparse import ArgumentParser
from typing import Any

from celery.signals import beat_embedded_init
from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import connections

from config.celery import app
from inference.management.commands.setup_schedules import setup_schedules

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@beat_embedded_init.connect
def _beat_dies_with_controller(**_: Any) -> None:
    """In the embedded beat process: SIGTERM when the controller dies, however it dies.

    A controller killed outright (SIGKILL, OOM) otherwise leaves its beat running, and the next
    controller's beat then sends every periodic task twice.
    """
    parent = multiprocessing.parent_process()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the service manager stops the process group instead
        return
    if parent is not None and os.getppid() != parent.pid:  # the controller died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


class Command(BaseCommand):
    """Run the controller's Celery worker (queue CELERY_TASK_DEFAULT_QUEUE) with embedded beat."""

    help = "Run the controller: a Celery worker on the queue 'control' plus Celery beat (-B)."

    def add_arguments(self, parser: ArgumentParser) -> None:
        """Flags of the controller."""
        parser.add_argument("--concurrency", type=int, default=4, help="Celery threads")
        parser.add_argument("--no-beat", action="store_true", help="do not embed Celery beat")
        parser.add_argument("--no-setup-schedules", action="store_true",
                            help="do not create/update the periodic tasks first")
        parser.add_argument("--loglevel", default="INFO", help="log level of the Celery worker")

    def handle(self, *args: Any, **options: Any) -> None:
        """Create the schedules, then run the worker until SIGTERM/SIGINT."""
        # One line per scrape request would drown the controller's own log.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        if not options["no_setup_schedules"]:
            for name, created in setup_schedules():
                self.stdout.write(f"schedule {'created' if created else 'ok'}: {name}")
        queue = settings.CELERY_TASK_DEFAULT_QUEUE
        # Beat runs in a forked process: it must not inherit this process's database connections.
        connections.close_all()
        worker = app.Worker(
            hostname=f"controller@{socket.gethostname()}",
            queues=[queue],
            pool="threads",
            concurrency=max(1, int(options["concurrency"])),
            loglevel=options["loglevel"],
            beat=not options["no_beat"],
            scheduler=settings.CELERY_BEAT_SCHEDULER,
            without_mingle=True,
            without_gossip=True,
        )
        worker.start()
