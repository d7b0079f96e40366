"""The ``load_test`` console script: flags, prompts, Ctrl-C handling and the files it writes.

Example::

    load_test --endpoint http://localhost:8000/generate --concurrency 100 --duration 60s \\
        --metrics-file benchmark.csv
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from inference.tools.load_test.config import (
    LoadTestConfig,
    parse_duration,
    parse_header,
    parse_positive_int,
)
from inference.tools.load_test.endpoints import endpoint_kind
from inference.tools.load_test.payloads import DEFAULT_PROMPTS
from inference.tools.load_test.plot import plot_metrics
from inference.tools.load_test.records import RequestRecord
from inference.tools.load_test.report import format_summary, summarize, write_metrics_csv
from inference.tools.load_test.runner import run_load


def _argparse_type(func: Any, name: str) -> Any:
    """Wrap a ``ValueError``-raising parser so argparse reports it against the flag."""

    def convert(text: str) -> Any:
        try:
            return func(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name  # argparse uses the name in its fallback message
    return convert


def _endpoint_value(text: str) -> str:
    """An endpoint flag value, validated by its path."""
    endpoint_kind(text)  # validation only
    return text


def build_parser() -> argparse.ArgumentParser:
    """The ``load_test`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="load_test",
        description=(
            "Closed-loop load test of a streaming generation endpoint: --concurrency clients each "
            "send one request at a time until --duration (or --requests) is spent."
        ),
    )
    parser.add_argument(
        "--endpoint",
        required=True,
        type=_argparse_type(_endpoint_value, "endpoint"),
        help="URL ending in /generate or /api/generate (our SSE API) or /v1/completions or "
        "/v1/chat/completions (OpenAI streaming)",
    )
    parser.add_argument(
        "--concurrency",
        type=_argparse_type(parse_positive_int, "concurrency"),
        default=1,
        help="number of concurrent clients (default: 1)",
    )
    parser.add_argument(
        "--duration",
        type=_argparse_type(parse_duration, "duration"),
        default=60.0,
        help="how long to start new requests: 60s, 2m, 90 (seconds), 500ms (default: 60s)",
    )
    parser.add_argument(
        "--requests",
        type=_argparse_type(parse_positive_int, "requests"),
        default=None,
        help="stop after this many requests in total (whichever of this and --duration comes first)",
    )
    parser.add_argument(
        "--max-tokens",
        type=_argparse_type(parse_positive_int, "max-tokens"),
        default=64,
        help="max_tokens of each request (default: 64)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature to send (default: the server's)",
    )
    prompts = parser.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", default=None, help="send this prompt in every request")
    prompts.add_argument(
        "--prompts-file",
        default=None,
        help="file with one prompt a line, used round-robin (default: a built-in list)",
    )
    parser.add_argument(
        "--model", default=None, help="model name for /v1 endpoints (default: first of /v1/models)"
    )
    parser.add_argument("--metrics-file", default=None, help="per-request CSV output")
    parser.add_argument(
        "--plot",
        default=None,
        help="PNG plot output (default: the metrics file with .png; none without --metrics-file)",
    )
    parser.add_argument("--no-plot", action="store_true", help="do not write the plot")
    parser.add_argument("--summary-json", default=None, help="write the summary as JSON here")
    parser.add_argument(
        "--timeout",
        type=_argparse_type(parse_duration, "timeout"),  # same spellings as --duration
        default=120.0,
        help="per-request time limit, e.g. 120s (default: 120s)",
    )
    parser.add_argument(
        "--header",
        action="append",
        default=[],
        type=_argparse_type(parse_header, "header"),
        help='extra HTTP header "Name: value" (repeatable)',
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def _load_prompts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The prompts the flags ask for (--prompt, --prompts-file or the built-in list); exits on bad ones."""
    if args.prompt is not None:
        if not args.prompt:
            parser.error("argument --prompt: must not be empty")
        return [args.prompt]
    if args.prompts_file is not None:
        try:
            text = Path(args.prompts_file).read_text(encoding="utf-8")
        except OSError as exc:
            parser.error(f"argument --prompts-file: cannot read {args.prompts_file!r}: {exc.strerror}")
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if not lines:
            parser.error(f"argument --prompts-file: no prompts in {args.prompts_file!r}")
        return lines
    return list(DEFAULT_PROMPTS)


async def _run_with_signals(config: LoadTestConfig) -> tuple[list[RequestRecord], float]:
    """:func:`run_load` where Ctrl-C stops starting requests (a second one aborts)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:
        print(
            "\nload_test: stopping, waiting for requests in flight (Ctrl-C again to abort)", file=sys.stderr
        )
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)  # the next Ctrl-C is a plain KeyboardInterrupt

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        installed = True
    except (NotImplementedError, RuntimeError, ValueError):
        installed = False  # not the main thread / not supported: Ctrl-C just interrupts
    started = time.perf_counter()
    try:
        records = await run_load(config, stop)
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)
    return records, time.perf_counter() - started


def _write_outputs(
    args: argparse.Namespace, records: list[RequestRecord], summary: dict[str, Any], title: str
) -> None:
    """Write the files the flags ask for: per-request CSV, PNG plot (beside the CSV by default), JSON summary."""
    if args.metrics_file:
        write_metrics_csv(records, args.metrics_file)
        print(f"Per-request metrics: {args.metrics_file}")
    plot_path = args.plot
    if plot_path is None and args.metrics_file:
        plot_path = str(Path(args.metrics_file).with_suffix(".png"))
    if plot_path and not args.no_plot:
        plot_metrics(records, plot_path, summary, title)
        print(f"Plot: {plot_path}")
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        print(f"Summary JSON: {args.summary_json}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``load_test`` console script; returns the process exit code.

    0 when at least one request succeeded, 1 when every request failed (or none was sent),
    2 on bad command-line arguments (via argparse).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    config = LoadTestConfig(
        endpoint=args.endpoint,
        concurrency=args.concurrency,
        duration_s=args.duration,
        max_requests=args.requests,
        max_tokens=args.max_tokens,
        prompts=_load_prompts(parser, args),
        model=args.model,
        temperature=args.temperature,
        timeout_s=args.timeout,
        headers=dict(args.header),
        progress=not args.no_progress,
    )
    started_at = datetime.now(UTC)
    records, elapsed = asyncio.run(_run_with_signals(config))
    summary = summarize(records, elapsed)
    summary.update(
        {
            "endpoint": config.endpoint,
            "concurrency": config.concurrency,
            "max_tokens": config.max_tokens,
            "started_at": started_at.isoformat(),
        }
    )

    title = (
        f"load_test {config.endpoint}: concurrency {config.concurrency}, "
        f"duration {config.duration_s:g} s"
        + (f", max {config.max_requests} requests" if config.max_requests else "")
    )
    print(format_summary(summary, title))
    if records and summary["ok"] == 0:
        kinds = summary["error_kinds"]
        if set(kinds) == {"connect"}:
            print(f"\nAll requests failed: could not connect to {config.endpoint} (is the router running?)")
        else:
            print("\nAll requests failed.")
    elif not records:
        print("\nNo request was sent.")

    _write_outputs(args, records, summary, title)
    return 0 if summary["ok"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
