"""`python manage.py prepare_model`: put a servable model folder on disk (see inference.tools.model_prep)."""
from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from inference.tools.model_prep import ModelPrepError, add_arguments, prepare_from_options


class Command(BaseCommand):
    """Thin wrapper over `inference.tools.model_prep`: its flags and its download; prints the prepared folder."""

    help = (
        "Prepare a model checkpoint folder for the prefill/decode workers: the bundled SmolLM2-135M "
        "(default, offline), a tiny random Llama, a local HF folder or a hub repo. Prints its path."
    )
    # Preparing files needs neither the database nor the URL conf: skip the system checks, so the command
    # also works before migrations ran (e.g. in a container's first start-up step).
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: ArgumentParser) -> None:
        """The flags of `python -m inference.tools.model_prep`, from the one definition there."""
        add_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        """Prepare the model; a ModelPrepError becomes a CommandError (message only, no traceback)."""
        try:
            path = prepare_from_options(options)
        except ModelPrepError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(str(path))
