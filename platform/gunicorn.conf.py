"""Gunicorn settings of the router (the Django/Channels ASGI app under uvicorn workers).

This is the deployment file, also used by the systemd units: `python -m inference.launch_router`
(what platform/systemd/disagg-router.service runs) loads it and puts its flags on top. Plain
`gunicorn -c platform/gunicorn.conf.py` works too, with the endpoints in ROUTER_PREFILL_ENDPOINTS /
ROUTER_DECODE_ENDPOINTS / ROUTER_POLICY. Every value comes from the environment so that one file
serves every host.
"""
import os


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"{name}={value!r} is not an integer") from None


def _bind() -> str:
    if os.environ.get("ROUTER_BIND"):
        return os.environ["ROUTER_BIND"]
    host = os.environ.get("ROUTER_HOST", "0.0.0.0") or "0.0.0.0"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    return f"{host}:{_env_int('ROUTER_PORT', 8000)}"


wsgi_app = "config.asgi:application"
# uvicorn with the router's HTTP protocol: GET /health answered in one pass of the event loop, not
# behind the generation traffic's tasks (inference/gateway/http_protocol.py).
worker_class = "inference.gateway.http_protocol.RouterUvicornWorker"
bind = [_bind()]
workers = _env_int("ROUTER_WORKERS", 1)
# Uvicorn workers heartbeat from their event loop, so long streams do not trip this timeout; it
# only catches a worker whose loop is stuck.
timeout = _env_int("ROUTER_WORKER_TIMEOUT_S", 120)
# On SIGTERM the listening socket closes at once (new connections are refused, never half served)
# and requests in flight, streams included, get this long to finish before the workers are killed.
# SIGHUP (graceful reload) starts new workers on the same socket first; the old ones finish what
# they accepted, bounded by `timeout` above. Signal the master only: SIGHUP kills a worker outright.
# Under `launch_router` (its acceptor owns the public port, inference/gateway/acceptor_process.py),
# signal the launch_router process: it forwards these to the master, and ROUTER_BIND is then the
# acceptor's private Unix socket.
graceful_timeout = _env_int("ROUTER_GRACEFUL_TIMEOUT_S", 30)
# Idle keep-alive connections are closed after this long: longer than clients' own idle expiry
# (httpx 5 s, aiohttp 15 s, load balancers 60 s), so that a client never sends its next request on
# a connection the router is closing at that moment.
keepalive = _env_int("ROUTER_KEEPALIVE_S", 75)
loglevel = os.environ.get("ROUTER_LOG_LEVEL", "info")
errorlog = "-"
accesslog = "-" if os.environ.get("ROUTER_ACCESS_LOG", "") in ("1", "true", "yes", "on") else None
proc_name = "disagg-router"
# Gunicorn >= 25 opens a control socket at one fixed per-user path, which two routers on one host
# (or a router and a test run) would fight over: off unless ROUTER_CONTROL_SOCKET names a path.
if os.environ.get("ROUTER_CONTROL_SOCKET"):
    control_socket = os.environ["ROUTER_CONTROL_SOCKET"]
else:
    control_socket_disable = True
