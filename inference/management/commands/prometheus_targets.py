"""`python manage.py prometheus_targets`: write the Prometheus file_sd targets (workers, routers)."""
from __future__ import annotations

import json
from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from inference.metrics.prometheus import file_sd_targets, write_file_sd
from inference.models import Deployment

DEFAULT_OUT = "platform/prometheus/targets/targets.json"


class Command(BaseCommand):
    """Write every scraped worker's and router's /metrics target, with deployment/role/node/worker
    labels, as Prometheus file_sd JSON (rerun it after scaling, e.g. from cron: Prometheus picks the
    change up by itself)."""

    help = "Write Prometheus file_sd targets (workers and routers from the database)."

    def add_arguments(self, parser: ArgumentParser) -> None:
        """--out, --deployment (repeat)."""
        parser.add_argument("--out", default=DEFAULT_OUT,
                            help=f"file to write, '-' for standard output (default {DEFAULT_OUT})")
        parser.add_argument("--deployment", action="append", default=[],
                            help="only this deployment (by name; repeat for several)")

    def handle(self, *args: Any, **options: Any) -> None:
        """Build the target groups and write them."""
        names: list[str] = options["deployment"]
        deployments = None
        if names:
            deployments = Deployment.objects.filter(name__in=names)
            missing = sorted(set(names) - set(deployments.values_list("name", flat=True)))
            if missing:
                raise CommandError(f"--deployment: no deployment named {', '.join(missing)}")
        groups = file_sd_targets(deployments)
        out = options["out"]
        if out == "-":
            self.stdout.write(json.dumps(groups, indent=2))
            return
        try:
            write_file_sd(Path(out), groups)
        except OSError as exc:
            raise CommandError(f"--out {out}: {exc}") from exc
        routers = sum(1 for g in groups if g["labels"]["component"] == "router")
        self.stdout.write(f"wrote {len(groups) - routers} worker and {routers} router target(s) to {out}")

