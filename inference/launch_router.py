"""`python -m inference.launch_router`: run the router with static prefill and decode endpoints.

    python -m inference.launch_router \
        --prefill-endpoint http://prefill-node:30000 \
        --decode-endpoint http://decode-node:30001 \
        --listen-port 8000 --load-balance-strategy round-robin

The flags are validated here, turned into the environment variables that config/settings.py and
platform/gunicorn.conf.py read, and gunicorn is started with uvicorn workers serving
`config.asgi:application`. Django is imported only inside gunicorn's app loading (in each worker).
"""
from __future__ import annotations

import argparse
import logging
import os
import runpy
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gunicorn.app.base import BaseApplication

from inference.gateway import acceptor_process
from inference.router.endpoint import normalize_url
from inference.router.policies import canonical_policy_name, policy_names

REPO_ROOT = Path(__file__).resolve().parent.parent
GUNICORN_CONF = REPO_ROOT / "platform" / "gunicorn.conf.py"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _endpoint_url(text: str) -> str:
    try:
        return normalize_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _strategy(text: str) -> str:
    try:
        return canonical_policy_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bounded_int(low: int, high: int) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in [{low}, {high}]")
        return value

    return convert


def build_parser() -> argparse.ArgumentParser:
    """The router's argument parser (flags as in the deployment guide)."""
    parser = argparse.ArgumentParser(
        prog="python -m inference.launch_router",
        description="Run the router of a disaggregated (prefill/decode) deployment.",
    )
    parser.add_argument(
        "--prefill-endpoint", action="append", default=[], type=_endpoint_url, metavar="URL",
        help="base URL of a prefill worker, e.g. http://prefill-node:30000 (repeatable)",
    )
    parser.add_argument(
        "--decode-endpoint", action="append", default=[], type=_endpoint_url, metavar="URL",
        help="base URL of a decode worker, e.g. http://decode-node:30001 (repeatable)",
    )
    parser.add_argument(
        "--deployment", default=None, metavar="NAME",
        help="managed mode: follow the RUNNING workers of this control-plane deployment instead of "
        "static endpoints (changes apply without a restart)",
    )
    parser.add_argument(
        "--listen-port", type=_bounded_int(1, 65535), default=8000, help="port to serve on (default 8000)"
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    parser.add_argument(
        "--load-balance-strategy", type=_strategy, default="kv-aware", metavar="STRATEGY",
        help=f"how workers are chosen: {', '.join(policy_names())} (default kv-aware: the worker with the least "
        "work ahead, its cached prefix of the prompt credited, plus its load; ahead of round-robin on TTFT and "
        "tok/s in the multi-turn chat benchmark; with one worker of a role every policy picks it)",
    )
    parser.add_argument(
        "--workers", type=_bounded_int(1, 256), default=1,
        help="gunicorn worker processes (default 1; each has its own pool and health checks)",
    )
    parser.add_argument(
        "--max-inflight", type=_bounded_int(1, 1_000_000), default=None, metavar="N",
        help="optional hard cap on the requests each router worker process holds, queued ones included; "
        "more are answered 429 (default: ROUTER_MAX_INFLIGHT, or none: the decode workers' batch slots "
        "and the queue bound it)",
    )
    parser.add_argument(
        "--queue-timeout", type=float, default=None, metavar="SECONDS",
        help="how long a request may wait for a decode slot before a 429 (default: ROUTER_QUEUE_TIMEOUT_S or 30)",
    )
    parser.add_argument(
        "--max-queue", type=_bounded_int(0, 1_000_000), default=None, metavar="N",
        help="requests that may wait for a decode slot; more are answered 429 at once "
        "(default: ROUTER_MAX_QUEUE or 1024)",
    )
    parser.add_argument(
        "--kv-token-weight", type=float, default=None, metavar="W",
        help="kv-aware policy: cost per prompt token a worker would still compute "
        "(default: ROUTER_KV_TOKEN_WEIGHT or 1)",
    )
    parser.add_argument(
        "--kv-load-weight", type=float, default=None, metavar="W",
        help="kv-aware policy: cost per request in flight on a worker, in prompt tokens "
        "(default: ROUTER_KV_LOAD_WEIGHT or 64)",
    )
    parser.add_argument(
        "--local-prefill-tokens", type=_bounded_int(0, 1_000_000), default=None, metavar="N",
        help="a decode worker with at most N prompt tokens left to compute prefills the prompt itself "
        "(default: ROUTER_LOCAL_PREFILL_TOKENS or 0: always a prefill worker)",
    )
    parser.add_argument(
        "--acceptor", action=argparse.BooleanOptionalAction, default=None,
        help="a separate acceptor process owns the port, answers GET /health from the router processes' "
        "snapshots (whatever the generation load) and hands every other connection to them "
        "(default: ROUTER_ACCEPTOR, or on); --no-acceptor: gunicorn's processes accept themselves",
    )
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log level (default info)")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parsed and validated flags; a bad one exits with status 2 and a message naming it."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.host.strip():
        parser.error("argument --host: must not be empty")
    if args.deployment is not None:
        if not args.deployment.strip():
            parser.error("argument --deployment: must not be empty")
        if args.prefill_endpoint or args.decode_endpoint:
            parser.error("--deployment follows the control plane: do not combine it with --prefill-endpoint/"
                         "--decode-endpoint")
    if args.queue_timeout is not None and not 0 < args.queue_timeout <= 3600:
        parser.error("argument --queue-timeout: must be > 0 and <= 3600 seconds")
    for flag in ("kv_token_weight", "kv_load_weight"):
        value = getattr(args, flag)
        if value is not None and not 0 <= value <= 1e9:
            parser.error(f"argument --{flag.replace('_', '-')}: must be >= 0")
    if args.deployment is None and not args.decode_endpoint:
        parser.error("--decode-endpoint is required (or --deployment NAME); without --prefill-endpoint the "
                     "decode workers prefill every prompt themselves (--service-type both workers)")
    return args


def router_environment(args: argparse.Namespace) -> dict[str, str]:
    """The environment variables that carry the flags to settings.py and gunicorn.conf.py."""
    env = {
        "ROUTER_PREFILL_ENDPOINTS": ",".join(args.prefill_endpoint),
        "ROUTER_DECODE_ENDPOINTS": ",".join(args.decode_endpoint),
        "ROUTER_POLICY": args.load_balance_strategy,
        "ROUTER_DEPLOYMENT": args.deployment or "",
        "ROUTER_HOST": args.host,
        "ROUTER_PORT": str(args.listen_port),
        "ROUTER_WORKERS": str(args.workers),
        "ROUTER_LOG_LEVEL": args.log_level,
        "PLATFORM_LOG_LEVEL": args.log_level.upper(),
    }
    # Only an explicit flag overrides the ROUTER_* variables from the environment (platform.env).
    if getattr(args, "max_inflight", None) is not None:
        env["ROUTER_MAX_INFLIGHT"] = str(args.max_inflight)
    if getattr(args, "queue_timeout", None) is not None:
        env["ROUTER_QUEUE_TIMEOUT_S"] = repr(args.queue_timeout)
    if getattr(args, "max_queue", None) is not None:
        env["ROUTER_MAX_QUEUE"] = str(args.max_queue)
    if getattr(args, "local_prefill_tokens", None) is not None:
        env["ROUTER_LOCAL_PREFILL_TOKENS"] = str(args.local_prefill_tokens)
    if getattr(args, "kv_token_weight", None) is not None:
        env["ROUTER_KV_TOKEN_WEIGHT"] = repr(args.kv_token_weight)
    if getattr(args, "kv_load_weight", None) is not None:
        env["ROUTER_KV_LOAD_WEIGHT"] = repr(args.kv_load_weight)
    return env


class RouterApplication(BaseApplication):  # type: ignore[misc]
    """Gunicorn serving the ASGI app with uvicorn workers, configured from platform/gunicorn.conf.py."""

    def __init__(self, options: dict[str, Any], config_path: Path = GUNICORN_CONF) -> None:
        self.options = options
        self.config_path = config_path
        super().__init__()

    def load_config(self) -> None:
        """The deployment file's settings first, then the command line's on top."""
        if self.config_path.is_file():
            for key, value in runpy.run_path(str(self.config_path)).items():
                if key in self.cfg.settings and value is not None:
                    self.cfg.set(key, value)
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        """Import the ASGI app (runs in each worker: Django is set up there, not in the arbiter)."""
        if str(REPO_ROOT) not in sys.path:
            sys.path.insert(0, str(REPO_ROOT))
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
        from config.asgi import application

        return application


def acceptor_enabled(args: argparse.Namespace) -> bool:
    """--acceptor/--no-acceptor, else ROUTER_ACCEPTOR (on unless 0/false/no/off)."""
    if args.acceptor is not None:
        return bool(args.acceptor)
    return os.environ.get("ROUTER_ACCEPTOR", "1").strip().lower() not in ("0", "false", "no", "off")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the flags, export them to the environment and run gunicorn until it stops (behind the
    acceptor process unless --no-acceptor: inference/gateway/acceptor_process.py)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    os.environ.update(router_environment(args))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host = f"[{args.host}]" if ":" in args.host and not args.host.startswith("[") else args.host
    if acceptor_process.is_child():
        bind = os.environ["ROUTER_BIND"]  # the acceptor's private socket: only it accepts from the network
    elif acceptor_enabled(args):
        logging.getLogger(__name__).info("router acceptor on %s:%s", host, args.listen_port)
        return acceptor_process.serve(host, args.listen_port, [sys.executable, "-m", "inference.launch_router", *argv])
    else:
        bind = f"{host}:{args.listen_port}"
    options = {
        "bind": [bind],
        "workers": args.workers,
        "worker_class": "inference.gateway.http_protocol.RouterUvicornWorker",
        "loglevel": args.log_level,
    }
    logging.getLogger(__name__).info(
        "router on %s: prefill %s, decode %s, policy %s",
        options["bind"][0], args.prefill_endpoint, args.decode_endpoint, args.load_balance_strategy,
    )
    RouterApplication(options).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
