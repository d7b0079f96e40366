"""Closed-loop HTTP load generator for the router (the ``load_test`` console script).

``concurrency`` client tasks each loop "send one streaming request, wait for its end" until the
duration or the request budget is spent, so the offered load is exactly ``concurrency`` requests
in flight. Every request is timed from the client side (TTFT, inter-token latency, end-to-end) by
reading the Server-Sent Events stream of either our JSON API (``/generate``, ``/api/generate``) or
the OpenAI API (``/v1/completions``, ``/v1/chat/completions``).

Modules: ``config`` (the run's settings and value parsers), ``endpoints`` (API kind of a URL),
``payloads`` (prompts and request bodies), ``streams`` and ``sse`` (reading each kind's stream),
``client`` (one timed request), ``runner`` (the closed loop), ``report`` (summary, table, CSV),
``plot`` (PNG) and ``cli`` (the console script). It is a plain client of the public HTTP API and
never imports Django.
"""

from inference.tools.load_test.cli import build_parser, main
from inference.tools.load_test.config import LoadTestConfig, parse_duration, parse_header
from inference.tools.load_test.endpoints import ApiKind, endpoint_kind
from inference.tools.load_test.payloads import DEFAULT_PROMPTS
from inference.tools.load_test.plot import plot_metrics
from inference.tools.load_test.records import RequestRecord
from inference.tools.load_test.report import CSV_COLUMNS, format_summary, summarize, write_metrics_csv
from inference.tools.load_test.runner import run_load

__all__ = [
    "CSV_COLUMNS",
    "DEFAULT_PROMPTS",
    "ApiKind",
    "LoadTestConfig",
    "RequestRecord",
    "build_parser",
    "endpoint_kind",
    "format_summary",
    "main",
    "parse_duration",
    "parse_header",
    "plot_metrics",
    "run_load",
    "summarize",
    "write_metrics_csv",
]
