"""`python manage.py prepare_model`: put a servable model folder on disk (see inference.model_prep)."""
from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from inference.model_prep import SERVICE_TYPES, SOURCES, ModelPrepError, download_model


class Command(BaseCommand):
    """Thin wrapper over `inference.model_prep.download_model`; prints the prepared folder."""

    help = (
        "Prepare a model checkpoint folder for the prefill/decode workers: the bundled SmolLM2-135M "
        "(default, offline), a tiny random Llama, a local HF folder or a hub repo. Prints its path."
    )
    # Preparing files needs neither the database nor the URL conf: skip the system checks, so the command
    # also works before migrations ran (e.g. in a container's first start-up step).
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: ArgumentParser) -> None:
        """Same flags as `python -m inference.model_prep`."""
        parser.add_argument("--model-name", default="smollm2",
                            help="smollm2 (bundled, default), tiny, a local checkpoint folder or a hub repo id")
        parser.add_argument("--service-type", default="both", choices=SERVICE_TYPES,
                            help="worker role the model is for; prefill and decode share the same files")
        parser.add_argument("--save-path", default=None,
                            help="where the model should appear (a symlink to the cache entry); "
                                 "default: the cache entry itself")
        parser.add_argument("--cache-dir", default="./model_cache", help="where prepared models are kept")
        parser.add_argument("--source", default="auto", choices=SOURCES, help="force where the model comes from")
        parser.add_argument("--force", action="store_true", help="rebuild even if already prepared")
        parser.add_argument("--copy", action="store_true", help="copy into --save-path instead of symlinking")

    def handle(self, *args: Any, **options: Any) -> None:
        """Prepare the model; a ModelPrepError becomes a CommandError (message only, no traceback)."""
        try:
            path = download_model(
                model_name=options["model_name"],
                service_type=options["service_type"],
                save_path=options["save_path"],
                cache_dir=options["cache_dir"],
                source=options["source"],
                force=options["force"],
                copy=options["copy"],
            )
        except ModelPrepError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(str(path))
