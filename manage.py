#!/usr/bin/env python
"""Django's command-line utility for the disaggregated inference platform."""
import os
import sys


def main() -> None:
    """Run a management command with the platform's settings."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    if sys.argv[1:2] == ["agent"]:
        # Before Django's set-up: a SIGTERM while the agent starts must still stop its workers.
        from inference.agent import stop_signals

        stop_signals.install()
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
