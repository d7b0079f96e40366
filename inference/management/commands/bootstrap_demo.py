"""`python manage.py bootstrap_demo`: the quick start's control-plane rows, created idempotently.

An admin user (password from PLATFORM_ADMIN_PASSWORD, else generated once and kept in
var/run/admin-password), an API token, the demo Model and a Deployment with one prefill and one
decode worker, and the guide's scaling rules (prefill load > 0.8 and decode load > 0.7 add a worker;
decode load < 0.2 for 5 minutes removes one, so a scale-out comes down again after the load; 22:00-07:00
decode = 1). `make up` runs it before starting the controller, agent and router, registering the router
(`--router-url`) so that the metrics collector scrapes it.
"""
from __future__ import annotations

import datetime as dt
import os
import secrets
from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from rest_framework.authtoken.models import Token

from inference.actions.deployments import create_deployment
from inference.models import Deployment, Model, RouterEndpoint, RuleKind, ScaleSource, ScalingRule


def _admin_password(path: Path) -> str:
    """The admin password: from the environment, else the one generated on an earlier run, else new."""
    given = os.environ.get("PLATFORM_ADMIN_PASSWORD", "")
    if given:
        return given
    if path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    password = secrets.token_urlsafe(12)
    path.write_text(password + "\n")
    path.chmod(0o600)
    return password


class Command(BaseCommand):
    """Create (or keep) the demo admin user, model, deployment and scaling rules."""

    help = "Create the quick start's admin user, demo model, deployment and scaling rules (idempotent)."

    def add_arguments(self, parser: ArgumentParser) -> None:
        """Flags naming the demo's model folder and deployment."""
        parser.add_argument("--model-name", default="smollm2", help="Model row name (default smollm2)")
        parser.add_argument("--model-path", required=True, help="prepared checkpoint folder")
        parser.add_argument("--deployment", default="demo", help="deployment name (default demo)")
        parser.add_argument("--context-length", type=int, default=2048)
        parser.add_argument("--max-replicas", type=int, default=2, help="scaling ceiling per role (default 2)")
        parser.add_argument("--admin-user", default="admin")
        parser.add_argument(
            "--router-url", default="",
            help="the router's base URL, registered for the metrics collector to scrape (e.g. http://127.0.0.1:8000)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        """Create what is missing and print how to log in."""
        model_path = Path(options["model_path"])
        if not (model_path / "config.json").is_file():
            raise CommandError(f"--model-path {model_path}: no prepared model there (run prepare_model first)")
        if options["max_replicas"] < 1 or options["context_length"] < 16:
            raise CommandError("--max-replicas must be >= 1 and --context-length >= 16")
        password = _admin_password(Path(settings.VAR_DIR) / "run" / "admin-password")
        try:
            with transaction.atomic():
                user = self._admin(options["admin_user"], password)
                token, _ = Token.objects.get_or_create(user=user)
                deployment = self._deployment(options, model_path)
                if options["router_url"]:
                    self._router(deployment, options["router_url"])
                self._rules(deployment)
        except ValidationError as exc:
            raise CommandError(f"invalid demo settings: {exc}") from exc
        self.stdout.write(f"admin user: {user.get_username()}  password: {password}")
        self.stdout.write(f"api token: {token.key}")
        self.stdout.write(f"deployment: {deployment.name} (model {deployment.model.name})")

    def _admin(self, username: str, password: str) -> Any:
        user_model = get_user_model()
        user = user_model.objects.filter(username=username).first()
        if user is None:
            return user_model.objects.create_superuser(username=username, email="", password=password)
        if not user.check_password(password):
            user.set_password(password)
            user.save(update_fields=["password"])
        return user

    def _deployment(self, options: dict[str, Any], model_path: Path) -> Deployment:
        model, _ = Model.objects.update_or_create(
            name=options["model_name"], defaults={"source": "smollm2", "path": str(model_path)}
        )
        existing = Deployment.objects.filter(name=options["deployment"]).first()
        if existing is not None:
            return existing
        high = options["max_replicas"]
        return create_deployment(
            name=options["deployment"], model=model, prefill_replicas=1, prefill_min=1, prefill_max=high,
            decode_replicas=1, decode_min=1, decode_max=high, context_length=options["context_length"],
            router_policy="least-connections", batch_size=16, source=str(ScaleSource.BOOTSTRAP),
        )

    def _router(self, deployment: Deployment, url: str) -> None:
        """Register the router (its /metrics feeds the metrics page: overhead, errors, 429s, client latency)."""
        router = RouterEndpoint(deployment=deployment, url=url.rstrip("/"))
        router.clean_fields()  # a valid URL (the row may exist already: updated below)
        RouterEndpoint.objects.update_or_create(deployment=deployment, url=router.url, defaults={"enabled": True})

    def _rules(self, deployment: Deployment) -> None:
        """The guide's rules: add prefill above 0.8 load, decode above 0.7, remove an idle decode, one at night."""
        rules = [
            dict(name="prefill load > 0.8", kind=RuleKind.THRESHOLD, role="prefill", threshold=0.8, step=1,
                 duration_s=60, cooldown_s=300),
            dict(name="decode load > 0.7", kind=RuleKind.THRESHOLD, role="decode", threshold=0.7, step=1,
                 duration_s=60, cooldown_s=300),
            # Scale-in: without it a scale-out only came down through the night rule.
            dict(name="decode load < 0.2", kind=RuleKind.THRESHOLD, role="decode", threshold=0.2,
                 comparison="below", step=-1, duration_s=300, cooldown_s=300),
            dict(name="night: decode = 1", kind=RuleKind.SCHEDULE, role="decode", start_time=dt.time(22, 0),
                 end_time=dt.time(7, 0), target_replicas=1),
        ]
        for fields in rules:
            if not ScalingRule.objects.filter(deployment=deployment, name=fields["name"]).exists():
                rule = ScalingRule(deployment=deployment, **fields)
                rule.full_clean()
                rule.save()
