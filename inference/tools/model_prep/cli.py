"""The model preparation command line, defined once: ``python -m inference.tools.model_prep`` builds
its parser with :func:`add_arguments`, and so does ``python manage.py prepare_model``."""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from inference.tools.model_prep.core import ModelPrepError
from inference.tools.model_prep.download import SERVICE_TYPES, SOURCES, download_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the preparation flags to `parser` (ours, or the one Django builds for the management command)."""
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


def build_parser(prog: str = "python -m inference.tools.model_prep") -> argparse.ArgumentParser:
    """The standalone CLI's parser: :func:`add_arguments` on a fresh ArgumentParser."""
    parser = argparse.ArgumentParser(prog=prog, description="Prepare a model checkpoint folder for the workers.")
    add_arguments(parser)
    return parser


def prepare_from_options(options: Mapping[str, Any]) -> Path:
    """Run `download_model` with parsed flags (``vars(namespace)`` or Django's options dict)."""
    return download_model(
        model_name=options["model_name"],
        service_type=options["service_type"],
        save_path=options["save_path"],
        cache_dir=options["cache_dir"],
        source=options["source"],
        force=options["force"],
        copy=options["copy"],
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI: prints the prepared folder on success; prints `error: ...` and returns 1 on failure."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = prepare_from_options(vars(args))
    except ModelPrepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; nothing half-written was left behind", file=sys.stderr)
        return 130
    print(path)
    return 0
